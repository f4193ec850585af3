#!/usr/bin/env python3
"""Where the torch door's cost goes on a real model (a measurement, not a test): ``metrale bench --only
frameworks``'s Llama ``generate`` (``_commands/bench/generate.py``), one process per mode, in turns:

- ``torch``: torch's own caching allocator.
- ``metrale``: every tensor from a metrale pool (`metrale_core.allocators.torch.install`), red zones off.
- ``metrale-nogc``: the same, Python's cyclic garbage collector off while timing (what collections cost).
- ``freelist``: the floor of any door with Python in it: the same C functions (`doorfuncs`) calling a pure-Python
  size-binned free list over ``cuMemAlloc`` (no metrale pool, no ledger).
- ``zones``, ``zones64``: 4 KiB red zones (both ends) on every tensor, and on one in 64 (issue 39's goals: 1.15x
  and 1.03x of ``torch``).
- ``profile``, ``profile-zones64``, ``profile-zones``: ``metrale`` (and ``zones64``, ``zones``) under cProfile, one
  generate: the Python functions with the most time of their own, and how many device-wide waits the zones made (the
  quarantine's checks). ``PROBE_PROFILES`` picks them (default ``profile,profile-zones64``).

Run on a GPU machine with torch and transformers (``PROBE_MODES=torch,zones64`` picks modes; ``PROBE_PROFILE=0``
skips the profiles)::

    python3 tools/probe_frameworks.py
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

MODES = tuple(os.environ.get("PROBE_MODES", "torch,metrale,metrale-nogc,freelist,zones,zones64").split(","))
#: The red-zone settings of each metrale mode (bytes, the sampling rate).
ZONES = {"metrale": (0, 1), "metrale-nogc": (0, 1), "profile": (0, 1), "zones": (4096, 1), "zones64": (4096, 64),
         "profile-zones64": (4096, 64), "profile-zones": (4096, 1)}
TURNS = int(os.environ.get("PROBE_TURNS", "2"))
STEPS = 5


def _freelist() -> Any:
    """A pure-Python caching allocator behind the doorfuncs' C functions (the issue's "size-binned free list")."""
    import torch
    from cuda.bindings import driver as drv

    from metrale_core._twins import pick
    from metrale_core.allocators.doorfuncs import c_functions

    free_lists: dict[int, list[int]] = {}
    sizes: dict[int, int] = {}

    def alloc_(size: int, device: int, stream: int) -> int:
        size = (size + 511) & ~511
        cached = free_lists.get(size)
        if cached:
            ptr = cached.pop()
        else:
            _, ptr = drv.cuMemAlloc(size)
            ptr = int(ptr)
        sizes[ptr] = size
        return ptr

    def free_(ptr: int, size: int, device: int, stream: int) -> None:
        free_lists.setdefault(sizes.pop(ptr), []).append(ptr)

    class FreeList:  # what the C functions call: a door's three calls
        framework = "free list"
        alloc = staticmethod(lambda size, stream: alloc_(size, 0, stream))
        free = staticmethod(lambda ptr: free_(ptr, 0, 0, 0))
        refuse = staticmethod(lambda what, why: None)

    door = FreeList()
    addresses = pick("doorfuncs", c_functions, False)(door, 0) or c_functions(door, 0)
    pluggable = torch.cuda.memory.CUDAPluggableAllocator
    made = pluggable.__new__(pluggable)
    torch.cuda.memory._CUDAAllocator.__init__(made, torch._C._cuda_customAllocator(*addresses))
    torch.cuda.memory.change_current_allocator(made)
    return made


def child(mode: str) -> None:
    keep: list[object] = []
    gpu = None
    if mode in ZONES:
        from metrale_core import MetraleSettings, open_backend
        from metrale_core.allocators import torch as torch_door

        zone, sample = ZONES[mode]
        gpu = open_backend("cuda", settings=MetraleSettings(redzone=zone, redzone_lead=bool(zone),
                                                            redzone_sample=sample))
        keep += [gpu, torch_door.install(gpu)]
    elif mode == "freelist":
        import torch
        from cuda.bindings import driver as drv

        torch.cuda.init()
        drv.cuInit(0)
        _, dev = drv.cuDeviceGet(0)
        _, ctx = drv.cuDevicePrimaryCtxRetain(dev)
        drv.cuCtxSetCurrent(ctx)
        keep.append(_freelist())
    import torch

    from metrale_core._commands.bench.generate import _workload

    generate = _workload(torch)
    generate()
    torch.cuda.synchronize()
    if mode.startswith("profile"):
        import cProfile
        import pstats

        scans = gpu.stats().redzone_scans if gpu is not None else 0  # type: ignore[attr-defined]
        profile = cProfile.Profile()
        profile.enable()
        generate()
        torch.cuda.synchronize()
        profile.disable()
        print(f"== {mode}: red-zone scans during one generate: "
              f"{(gpu.stats().redzone_scans if gpu is not None else 0) - scans}")  # type: ignore[attr-defined]
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        return
    if mode == "metrale-nogc":
        gc.collect()
        gc.disable()
    times = []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(json.dumps({"mode": mode, "median_ms": statistics.median(times) * 1e3, "gc": gc.get_count()}), flush=True)


def main() -> None:
    if len(sys.argv) > 1:
        child(sys.argv[1])
        return
    got: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(TURNS):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True, timeout=300,
                                 check=False)
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode or not lines:
                print(f"{mode}: rc {out.returncode}\n{out.stderr[-2000:]}")
                continue
            got[mode].append(json.loads(lines[-1])["median_ms"])
    base = statistics.median(got["torch"]) if got["torch"] else float("nan")
    for mode, values in got.items():
        if values:
            ms = statistics.median(values)
            turns = " ".join(f"{v:.1f}" for v in values)
            print(f"{mode:<14} {ms:8.1f} ms per generate  {ms / base:6.3f}x  (turns: {turns})")
    if os.environ.get("PROBE_PROFILE", "1") == "0":
        return
    for mode in os.environ.get("PROBE_PROFILES", "profile,profile-zones64").split(","):
        out = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True, timeout=300,
                             check=False)
        print(out.stdout[-6000:], out.stderr[-1500:])


if __name__ == "__main__":
    main()
