#!/usr/bin/env python3
"""What an allocator door's pair costs (a measurement, not a test): ``Door.alloc`` + ``Door.free`` of 4 KiB for a
foreign stream, as PyTorch's and CuPy's hooks call them, compiled and pure, red zones off, on every piece and on one
in 64 (4 KiB), best and median of many rounds, in turns. Run on a GPU machine (``PROBE_BACKEND=fake`` to try it
without one)::

    python3 backends/cuda/tools/probe_door.py
"""

from __future__ import annotations

import os
import statistics
import time

from metrale_core import open_backend
from metrale_core.allocators.door import Door

BACKEND = os.environ.get("PROBE_BACKEND", "cuda")
PAIRS = 2000
ROUNDS = 15
STREAM = 0x1234  # a foreign stream's handle: the pool's cache key only (nothing is ordered on it unzoned)


def main() -> None:
    base = open_backend(BACKEND)
    configs = {}
    for pure in (False, True):
        for zone, sample in ((0, 1), (4096, 1), (4096, 64)):
            settings = base.settings.model_copy(update={"pure": pure, "redzone": zone, "redzone_lead": bool(zone),
                                                        "redzone_sample": sample})
            gpu = open_backend(BACKEND, settings=settings)
            label = f"{'pure' if pure else 'compiled'}, zones {zone}" + (f" (1 in {sample})" if sample > 1 else "")
            configs[label] = (gpu, Door(gpu, "probe"))
    times: dict[str, list[float]] = {label: [] for label in configs}
    stream = 0 if BACKEND == "cuda" else STREAM
    for _ in range(ROUNDS):
        for label, (gpu, door) in configs.items():
            alloc, free = door.alloc, door.free
            t0 = time.perf_counter()
            for _ in range(PAIRS):
                free(alloc(4096, stream))
            times[label].append((time.perf_counter() - t0) / PAIRS * 1e6)
            gpu.synchronize()
    print(f"Door.alloc + Door.free of 4 KiB on {base!r}: {ROUNDS} rounds of {PAIRS} pairs, in turns")
    for label, per in times.items():
        print(f"  {label:<32} best {min(per):7.2f} us  median {statistics.median(per):7.2f} us")
    for gpu, door in configs.values():
        door.close()
        gpu.close()
    base.close()


if __name__ == "__main__":
    main()
