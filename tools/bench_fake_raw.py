"""The fake's raw alloc/free pair: nanoseconds a pair, called straight on the raw device (not a test).

    python tools/bench_fake_raw.py [--pairs N] [--repeats R]

Opens the fake through its plugin (``gpu.raw``), keeps one allocation live (as a running application
does) and times ``free(alloc(n, "device"), "device")`` with ``perf_counter_ns`` brackets over ``--pairs``
pairs, for 64 KiB, 1 MiB and 64 MiB; the best of ``--repeats`` runs is printed, with the median.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from metrale_core import MetraleSettings, open_backend
from metrale_core.plugin import RawDevice

SIZES = ((64 << 10, "64 KiB"), (1 << 20, "1 MiB"), (64 << 20, "64 MiB"))


def pairs_ns(raw: RawDevice, nbytes: int, pairs: int) -> float:
    """Nanoseconds a raw pair of ``nbytes``, over ``pairs`` pairs."""
    alloc, free = raw.alloc, raw.free
    for _ in range(1000):  # warm: the size class's range (and whatever the fake keeps) exists
        free(alloc(nbytes, "device"), "device")
    gc_was = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter_ns()
        for _ in range(pairs):
            free(alloc(nbytes, "device"), "device")
        stop = time.perf_counter_ns()
    finally:
        if gc_was:
            gc.enable()
    return (stop - start) / pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    settings = MetraleSettings(redzone_quarantine_bytes=0)
    with open_backend("fake", settings=settings) as gpu:
        raw = gpu.raw
        keep = raw.alloc(1 << 20, "device")
        for nbytes, label in SIZES:
            runs = [pairs_ns(raw, nbytes, args.pairs) for _ in range(args.repeats)]
            print(
                f"raw fake pair {label:>6}: best {min(runs):8.0f} ns  median {statistics.median(runs):8.0f} ns"
                f"  ({args.pairs} pairs x {args.repeats})"
            )
        raw.free(keep, "device")


if __name__ == "__main__":
    main()
