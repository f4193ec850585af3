"""Where a zoned alloc/free pair spends its time (a profile for developers, not a test).

    python tools/profile_pairs.py [--backend NAME] [--pairs N]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

from metrale_core import MetraleSettings, open_backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--pairs", type=int, default=5000)
    parser.add_argument("--zone-bytes", type=int, default=4096)
    args = parser.parse_args()
    with open_backend(args.backend, settings=MetraleSettings(redzone=args.zone_bytes)) as gpu:
        keep = gpu.alloc(1 << 20)  # keeps the driver's 2 MiB page mapped, as in a running application
        for _ in range(100):
            gpu.free(gpu.alloc(1 << 16))
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.pairs):
            gpu.free(gpu.alloc(1 << 16))
        profile.disable()
        gpu.free(keep)
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
