#!/usr/bin/env python3
"""What this machine's torch offers an allocator door (a measurement, not a test; issue 54): its version, the
allocator hooks and pool classes it has, and how its own caching allocator meets a captured graph and an
out-of-memory, the behaviour metrale's door must match. One line per finding::

    python3 backends/cuda/tools/probe_torch_hooks.py
"""

from __future__ import annotations

import inspect

import torch


def main() -> None:
    memory = torch.cuda.memory
    print("torch", torch.__version__, "cuda", torch.version.cuda)
    for name in ("CUDAPluggableAllocator", "MemPool", "use_mem_pool", "change_current_allocator"):
        print(f"has {name}: {hasattr(memory, name) or hasattr(torch.cuda, name)}")
    for name, obj in (("CUDAPluggableAllocator", getattr(memory, "CUDAPluggableAllocator", None)),
                      ("MemPool", getattr(torch.cuda, "MemPool", None))):
        if obj is not None:
            print(f"{name}{inspect.signature(obj.__init__)}")
    hooks = [n for n in dir(torch._C) if "luggable" in n or "Pool" in n or "customAllocator" in n]
    print("torch._C:", ", ".join(sorted(hooks)))
    x = torch.zeros(1024, device="cuda")
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(side):  # (warm-up on a side stream, as torch.cuda.graph's docs ask)
        y = x * 2
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y = x * 2 + 1
    graph.replay()
    torch.cuda.synchronize()
    print("graph under torch's allocator: replayed,", float(y[0]))
    try:
        torch.empty(400 << 30, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as exc:
        print("out of memory under torch's allocator: torch.OutOfMemoryError:", str(exc).splitlines()[0][:100])
    print("next allocation works:", float(torch.ones(4, device="cuda").sum()))


if __name__ == "__main__":
    main()
