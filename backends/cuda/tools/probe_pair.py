#!/usr/bin/env python3
"""Where a ledgered 1 MiB alloc + free goes on the CUDA backend, layer by layer (a measurement, not a test).

Each row times one more layer of the pair than the row before, in turns, best of many rounds: the raw
cuda.bindings pair, the compiled driver calls (``_cdriver``) called from Python, the CUDA plugin's methods,
the lane (the gate, the capture rule, the ledger, the stats, the observers), the facade. The difference
between two rows is what that layer costs. Run on a GPU machine, compiled::

    python3 backends/cuda/tools/probe_pair.py
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from cuda.bindings import driver as drv

from metrale_core import open_backend

NBYTES = 1 << 20
ROUNDS = 15
PER_ROUND = 2000


def best_us(fn: Callable[[], object]) -> float:
    """The best round's time per call, µs."""
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(PER_ROUND):
            fn()
        best = min(best, (time.perf_counter() - t0) / PER_ROUND)
    return best * 1e6


def main() -> None:
    gpu = open_backend("cuda")
    try:
        plugin = gpu._ctx.plugin
        c = getattr(plugin, "_c", None)
        lane = gpu._lane
        keep = gpu.alloc(NBYTES)  # the pool of the driver stays warm

        def raw_pair() -> None:
            _, ptr = drv.cuMemAlloc(NBYTES)
            drv.cuMemFree(ptr)

        def cdriver_pair() -> None:
            c.mem_free(c.mem_alloc(NBYTES))

        def plugin_pair() -> None:
            plugin.free(plugin.alloc(NBYTES, "device"), "device")

        def lane_pair() -> None:
            lane.free(lane.alloc(NBYTES))

        def facade_pair() -> None:
            gpu.free(gpu.alloc(NBYTES))

        rows: list[tuple[str, Callable[[], None] | None]] = [
            ("raw cuda.bindings pair", raw_pair),
            ("compiled driver calls from Python (_cdriver)", cdriver_pair if c is not None else None),
            ("the plugin's alloc + free", plugin_pair),
            ("the lane (gate, capture rule, site, handle, ledger, stats, switched-on observers)", lane_pair),
            ("the facade (GpuBackend.alloc + free)", facade_pair),
        ]
        print(f"{type(plugin).__name__}, lane {type(lane).__module__}; {NBYTES} bytes; best of {ROUNDS} rounds")
        for turn in range(2):
            for gc_on in (True, False):
                if not gc_on:
                    gc.disable()
                for name, fn in rows:
                    figure = "-" if fn is None else f"{best_us(fn):.2f} us"
                    print(f"  turn {turn + 1}, gc {'on ' if gc_on else 'off'}  {name:<72} {figure}")
                gc.enable()
        gpu.free(keep)
    finally:
        gpu.close()


if __name__ == "__main__":
    main()
