"""Benchmark: the arena's alloc against CuPy's memory pool and PyTorch's caching allocator
(a benchmark, not a test; the GPU's figures mean something only on a GPU).

Prints, from one run, the host time of one 1 MiB allocation and its release with:
metrale's ``Arena`` (``alloc`` then ``reset``), metrale's ledgered ``alloc``/``free``, the raw
``cuMemAlloc``/``cuMemFree`` through ``cuda.bindings``, CuPy's ``MemoryPool.malloc`` (freed to the
pool when dropped) and ``torch.empty`` on the caching allocator; each peer is skipped, and said so,
where it is not installed or has no GPU. Every figure is the mean of a timed loop, best of 5.

    python tools/bench_arena.py [--backend NAME] [--n 20000]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from metrale_core import MetraleSettings, open_backend

MIB = 1 << 20


def _per_op_us(loop: Callable[[int], object], n: int) -> float:
    loop(min(n, 1000))  # warm-up
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        loop(n)
        best = min(best, time.perf_counter() - start)
    return best / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", default=None, help="backend name (default: METRALE_BACKEND, else auto)")
    parser.add_argument("--n", type=int, default=20_000, help="allocations per timed loop (default 20000)")
    args = parser.parse_args()
    n = args.n
    rows: list[tuple[str, float | None, str]] = []
    with open_backend(args.backend, settings=MetraleSettings(redzone=0)) as gpu:
        print(f"backend {gpu.name}: {gpu.device_name}")
        arena = gpu.create_arena(64 * MIB)

        def arena_loop(k: int) -> None:
            alloc, reset = arena.alloc, arena.reset
            for _ in range(k):
                alloc(MIB)
                reset()

        def arena_burst(k: int) -> None:  # 32 pieces, then one reset: scratch for one step
            alloc, reset = arena.alloc, arena.reset
            for _ in range(k // 32):
                for _ in range(32):
                    alloc(MIB)
                reset()

        def ledger_loop(k: int) -> None:
            alloc, free = gpu.alloc, gpu.free
            for _ in range(k):
                free(alloc(MIB))

        rows.append(("metrale Arena.alloc + reset", _per_op_us(arena_loop, n), ""))
        rows.append(("metrale Arena.alloc, 32 per reset", _per_op_us(arena_burst, n), ""))
        rows.append(("metrale alloc + free (ledger)", _per_op_us(ledger_loop, max(n // 10, 100)), ""))
        arena.close()
        on_gpu = gpu.name == "cuda"
    if on_gpu:
        from cuda.bindings import driver as drv

        def raw_loop(k: int) -> None:
            for _ in range(k):
                _, ptr = drv.cuMemAlloc(MIB)
                drv.cuMemFree(ptr)

        rows.append(("raw cuMemAlloc + cuMemFree", _per_op_us(raw_loop, max(n // 10, 100)), "cuda.bindings"))
    try:
        import cupy

        if not on_gpu:
            raise ImportError("no GPU")
        pool = cupy.cuda.MemoryPool()

        def cupy_loop(k: int) -> None:
            malloc = pool.malloc
            for _ in range(k):
                p = malloc(MIB)
                del p

        rows.append(("CuPy MemoryPool.malloc + release", _per_op_us(cupy_loop, n), f"cupy {cupy.__version__}"))
    except ImportError as exc:
        rows.append(("CuPy MemoryPool.malloc + release", None, f"skipped: {exc}"))
    try:
        import torch

        if not (on_gpu and torch.cuda.is_available()):
            raise ImportError("no GPU")

        def torch_loop(k: int) -> None:
            empty, u8 = torch.empty, torch.uint8
            for _ in range(k):
                t = empty(MIB, dtype=u8, device="cuda")
                del t

        label = "torch.empty + release (caching allocator)"
        rows.append((label, _per_op_us(torch_loop, n), f"torch {torch.__version__}"))
    except ImportError as exc:
        rows.append(("torch.empty + release (caching allocator)", None, f"skipped: {exc}"))
    base = rows[0][1]
    assert base is not None
    print(f"1 MiB allocation and release, host time per operation (mean of {n}, best of 5):")
    for label, us, note in rows:
        if us is None:
            print(f"  {label:<44} {'':>9}  {note}")
        else:
            print(f"  {label:<44} {us:8.2f} us  {us / base:6.2f}x the arena  {note}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
