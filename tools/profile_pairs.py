"""Where metrale's host time goes on a hot path (a profile for developers, not a test).

    python tools/profile_pairs.py [--backend NAME] [--op pair|launch|memset] [--pairs N] [--zone-bytes B]

``pair`` is an alloc/free pair of 64 KiB (with a red zone of ``--zone-bytes``), ``launch`` a launch of
the shipped ``vector_add`` over 4096 elements, ``memset`` an asynchronous 4 KiB memset.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import pstats
from collections.abc import Callable

from metrale_core import MetraleSettings, open_backend
from metrale_core.kernels import shipped_modules


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--op", choices=("pair", "launch", "memset"), default="pair")
    parser.add_argument("--pairs", type=int, default=5000, help="operations profiled")
    parser.add_argument("--zone-bytes", type=int, default=4096)
    args = parser.parse_args()
    with open_backend(args.backend, settings=MetraleSettings(redzone=args.zone_bytes)) as gpu:
        keep = gpu.alloc(1 << 20)  # keeps the driver's 2 MiB page mapped, as in a running application
        n = 4096
        bufs = [gpu.alloc(4 * n) for _ in range(3)]
        op: Callable[[], object]
        if args.op == "pair":
            alloc, free = gpu.alloc, gpu.free
            op = lambda: free(alloc(1 << 16))
        elif args.op == "launch":
            kernel = gpu.load_modules(shipped_modules("vector")).kernel("vector", "vector_add")
            launch, launch_args = gpu.launch, (bufs[0], bufs[1], bufs[2], ctypes.c_uint32(n))
            op = lambda: launch(kernel, n // 256, 256, launch_args)
        else:
            memset = gpu.memset
            op = lambda: memset(bufs[0], 0, nbytes=4096)
        for _ in range(100):
            op()
        gpu.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        for i in range(args.pairs):
            op()
            if i % 256 == 255:
                gpu.synchronize()
        profile.disable()
        gpu.synchronize()
        for buf in [keep, *bufs]:
            gpu.free(buf)
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
