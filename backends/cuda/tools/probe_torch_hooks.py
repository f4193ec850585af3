#!/usr/bin/env python3
"""What this machine's torch offers an allocator door (a measurement, not a test; issue 54): its version, the
allocator hooks and pool classes it has, and how its own caching allocator meets a captured graph and an
out-of-memory, the behaviour metrale's door must match; whether ``cuMemAlloc`` is allowed during a capture in
global mode when the calling thread's capture mode is relaxed (as torch's allocator makes it for a graph's private
pool); and, in a process of its own, the same out-of-memory and capture under metrale's door (``PROBE_DOOR=0`` skips
it). One line per finding::

    python3 backends/cuda/tools/probe_torch_hooks.py
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import torch

_DOOR = """
import logging, torch
logging.basicConfig(level=logging.CRITICAL)
from metrale_core import open_backend
from metrale_core.allocators.torch import install
door = install(open_backend("cuda"))
x = torch.ones(1024, device="cuda")
print("door: first tensor on the ledger:", door.piece(x.data_ptr()) is not None)
try:
    torch.empty(400 << 30, dtype=torch.uint8, device="cuda")
    print("door: out of memory: no error raised")
except Exception as exc:
    print("door: out of memory:", type(exc).__module__, type(exc).__name__, str(exc).splitlines()[0][:160])
print("door: next allocation works:", float(torch.ones(4, device="cuda").sum()))
graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
with torch.cuda.stream(side):
    y = x * 2
torch.cuda.synchronize()
try:
    with torch.cuda.graph(graph):
        y = x * 2 + 1
    graph.replay()
    torch.cuda.synchronize()
    print("door: graph replayed,", float(y[0]), "failures", door.failures, repr(door.last_error)[:200])
except Exception as exc:
    print("door: graph:", type(exc).__name__, str(exc).splitlines()[0][:200])
"""


def relaxed_alloc() -> str:
    """cuMemAlloc during a global-mode capture of this thread, its capture mode made relaxed around the call."""
    from cuda.bindings import driver as drv

    torch.cuda.init()
    err, stream = drv.cuStreamCreate(1)
    said = []
    drv.cuStreamBeginCapture(stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    err, before = drv.cuThreadExchangeStreamCaptureMode(drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    err, ptr = drv.cuMemAlloc(1 << 20)
    said.append(f"cuMemAlloc {err.name}")
    drv.cuThreadExchangeStreamCaptureMode(before)
    err2 = drv.cuMemsetD8Async(ptr, 0, 1 << 20, stream)[0]
    said.append(f"memset on the capture {err2.name}")
    drv.cuThreadExchangeStreamCaptureMode(drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    err, other = drv.cuMemAlloc(1 << 20)
    said.append(f"a second relaxed cuMemAlloc {err.name}, its relaxed cuMemFree {drv.cuMemFree(other)[0].name}")
    drv.cuThreadExchangeStreamCaptureMode(before)
    err3, graph = drv.cuStreamEndCapture(stream)
    said.append(f"end {err3.name}")
    if err3 == drv.CUresult.CUDA_SUCCESS:
        _err, exe = drv.cuGraphInstantiate(graph, 0)
        said.append(f"replay {drv.cuGraphLaunch(exe, stream)[0].name} {drv.cuStreamSynchronize(stream)[0].name}")
    said.append(f"free {drv.cuMemFree(ptr)[0].name}")
    return "; ".join(said)


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
    print("cuMemAlloc in a global capture, relaxed for the call:", relaxed_alloc())
    if os.environ.get("PROBE_DOOR", "1") != "0":
        done = subprocess.run([sys.executable, "-c", _DOOR], capture_output=True, text=True, timeout=120, check=False)
        print(done.stdout.strip() or "door: no output", f"(exit {done.returncode})", done.stderr.strip()[-600:])


if __name__ == "__main__":
    main()
