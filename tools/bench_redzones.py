"""Benchmark: what red zones cost (a benchmark, not a test; the GPU's figures mean something only on a GPU).

Prints, from one run on one backend (``--backend``, default ``auto``):
- the time to scan N live 4 KiB zones with ``scan_redzones()`` (the device-side scan kernel where the
  backend runs kernels), against one synchronous read per zone through the public API, and the ratio;
- the time of an alloc/free pair with and without a zone, and what the zone adds.

    python tools/bench_redzones.py --zones 10000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

from metrale_core import MetraleSettings, open_backend


def _median_us(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="backend name (default: METRALE_BACKEND, else auto)")
    parser.add_argument("--zones", type=int, default=10_000, help="live zones to scan (default 10000)")
    parser.add_argument("--zone-bytes", type=int, default=4096, help="bytes per zone (default 4096)")
    parser.add_argument("--pair-bytes", type=int, default=1 << 16, help="alloc/free pair size (default 64 KiB)")
    parser.add_argument("--repeat", type=int, default=20, help="timed repetitions, median reported (default 20)")
    args = parser.parse_args()

    zoned = MetraleSettings(redzone=args.zone_bytes)
    with open_backend(args.backend, settings=zoned) as gpu:
        print(f"backend {gpu.name}: {gpu.device_name}")
        bufs = [gpu.alloc(256) for _ in range(args.zones)]
        gpu.scan_redzones()  # warm-up: loads the scan kernel, sizes the scan buffers
        scan_us = _median_us(gpu.scan_redzones, args.repeat)
        out = bytearray(args.zone_bytes)

        def per_zone_reads() -> None:
            gpu.synchronize()
            for buf in bufs:
                gpu.copy_to_host(out, buf.ptr + buf.nbytes)  # one synchronous read of the zone

        reads_us = _median_us(per_zone_reads, max(3, args.repeat // 5))
        print(f"scan of {args.zones} live {args.zone_bytes}-byte zones: scan_redzones() {scan_us / 1000:.3f} ms, "
              f"one synchronous read per zone {reads_us / 1000:.3f} ms, ratio {reads_us / scan_us:.1f}x")
        changed = []
        for _ in range(args.repeat):
            bufs.append(gpu.alloc(256))  # the zone set changed: this scan copies the table again
            start = time.perf_counter()
            gpu.scan_redzones()
            changed.append(time.perf_counter() - start)
        changed_us = statistics.median(changed) * 1e6
        print(f"  after an allocation changed the zone set (the table is copied again): {changed_us / 1000:.3f} ms")
        for buf in bufs:
            gpu.free(buf)

    # Both backends open at once and measured in turns, so drift (clocks, caches) falls on both. Each keeps
    # 1 MiB allocated, as a running application does, so the pairs measure metrale and not the driver mapping
    # and unmapping a fresh 2 MiB page for every 64 KiB allocation.
    with open_backend(args.backend, settings=zoned) as gpu, \
            open_backend(args.backend, settings=MetraleSettings(redzone=0)) as plain:
        keep = [gpu.alloc(1 << 20), plain.alloc(1 << 20)]
        timings: dict[str, list[float]] = {"plain alloc": [], "plain free": [], "zoned alloc": [], "zoned free": []}
        for _ in range(args.repeat * 100):
            for label, backend in (("plain", plain), ("zoned", gpu)):
                t0 = time.perf_counter()
                buf = backend.alloc(args.pair_bytes)
                t1 = time.perf_counter()
                backend.free(buf)
                t2 = time.perf_counter()
                timings[f"{label} alloc"].append(t1 - t0)
                timings[f"{label} free"].append(t2 - t1)
        gpu.free(keep[0])
        plain.free(keep[1])
        med = {k: statistics.median(v) * 1e6 for k, v in timings.items()}
        without = med["plain alloc"] + med["plain free"]
        with_zone = med["zoned alloc"] + med["zoned free"]
        alloc_added = med["zoned alloc"] - med["plain alloc"]
        free_added = med["zoned free"] - med["plain free"]
        print(f"alloc+free of {args.pair_bytes} bytes: {without:.1f} us without a zone, {with_zone:.1f} us with a "
              f"{args.zone_bytes}-byte zone, {with_zone - without:+.1f} us (alloc {alloc_added:+.1f} us, "
              f"free {free_added:+.1f} us; medians of {args.repeat * 100})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
