#!/usr/bin/env python3
"""What driver calls cost on this machine, from Python (a measurement, not a test).

Standalone: needs only ``cuda.bindings.driver``. Prints the median of many
repetitions of each call sequence that metrale's red zones are built from, so a
design can be judged against the floor. Run on a GPU machine::

    python3 backends/cuda/tools/probe_costs.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from cuda.bindings import driver as drv


def ok(result: Any) -> Any:
    """The value of a driver call's result tuple; stops on an error code."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise SystemExit(f"driver error {err}")
    return rest[0] if len(rest) == 1 else rest


def median_us(fn: Callable[[], object], n: int = 2000) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ok(drv.cuInit(0))
    dev = ok(drv.cuDeviceGet(0))
    ctx = ok(drv.cuDevicePrimaryCtxRetain(dev))
    ok(drv.cuCtxSetCurrent(ctx))
    stream = ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))
    zone = ok(drv.cuMemAlloc(1 << 20))
    pinned = ok(drv.cuMemHostAlloc(4096, 0))
    rows = {
        "cuCtxGetCurrent (the cost of a binding call)": drv.cuCtxGetCurrent,
        "cuCtxSynchronize, device idle": drv.cuCtxSynchronize,
        "cuStreamSynchronize, stream idle": lambda: drv.cuStreamSynchronize(stream),
        "cuMemAlloc + cuMemFree, 1 MiB": lambda: drv.cuMemFree(ok(drv.cuMemAlloc(1 << 20))),
        "cuMemsetD8Async 4 KiB + cuStreamSynchronize": lambda: (
            drv.cuMemsetD8Async(zone, 0xA5, 4096, stream), drv.cuStreamSynchronize(stream)),
        "cuMemsetD8Async 4 KiB, no wait (queue drained every 64)": None,
        "cuMemcpyHtoD 4 KiB from pinned (returns when done)": lambda: drv.cuMemcpyHtoD(zone, pinned, 4096),
        "cuMemcpyDtoHAsync 4 KiB to pinned + cuStreamSynchronize": lambda: (
            drv.cuMemcpyDtoHAsync(pinned, zone, 4096, stream), drv.cuStreamSynchronize(stream)),
        "cuMemcpyDtoH 4 KiB to pinned": lambda: drv.cuMemcpyDtoH(pinned, zone, 4096),
        "cuCtxSynchronize + cuMemcpyDtoH 4 KiB to pinned": lambda: (
            drv.cuCtxSynchronize(), drv.cuMemcpyDtoH(pinned, zone, 4096)),
        "cuMemAllocAsync + cuMemFreeAsync 1 MiB + cuStreamSynchronize": lambda: (
            drv.cuMemFreeAsync(ok(drv.cuMemAllocAsync(1 << 20, stream)), stream), drv.cuStreamSynchronize(stream)),
    }
    count = [0]

    def memset_no_wait() -> None:
        drv.cuMemsetD8Async(zone, 0xA5, 4096, stream)
        count[0] += 1
        if count[0] % 64 == 0:
            drv.cuStreamSynchronize(stream)

    rows["cuMemsetD8Async 4 KiB, no wait (queue drained every 64)"] = memset_no_wait
    name = ok(drv.cuDeviceGetName(64, dev)).split(b"\0")[0].decode()
    print(f"probe_costs on {name}: median of 2000 repetitions each")
    for label, fn in rows.items():
        assert fn is not None
        print(f"  {median_us(fn):8.2f} us  {label}")
    ok(drv.cuStreamSynchronize(stream))
    ok(drv.cuMemFreeHost(pinned))
    ok(drv.cuMemFree(zone))
    ok(drv.cuStreamDestroy(stream))
    ok(drv.cuDevicePrimaryCtxRelease(dev))


if __name__ == "__main__":
    main()
