"""``metrale-pipeline``: run the batched vector pipeline and report timing, checks, run metrics and the ledger.

Exit status: 0 when every check passed, 1 when a result differed from numpy
or an allocation was left on the ledger, 2 on a usage error or a metrale
error (no such backend, out of memory, ...).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from collections.abc import Sequence

from metrale_core import MetraleError, open_backend

from ._pipeline import MAX_SIZE, PipelineResult, run_pipeline

__all__ = ["main"]


def _count(text: str, *, most: int) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= value <= most:
        raise argparse.ArgumentTypeError(f"must be 1 to {most}, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="metrale-pipeline",
        description="A batched vector pipeline on metrale: one captured graph, replayed per batch, checked "
        "against numpy; the backend's ledger is empty at the end.",
    )
    parser.add_argument("--batches", type=lambda s: _count(s, most=1 << 20), default=8, help="batches (default 8)")
    parser.add_argument(
        "--size", type=lambda s: _count(s, most=MAX_SIZE), default=1 << 16, help="float32 per batch (default 65536)"
    )
    parser.add_argument(
        "--backend", default=None, help="fake, cuda, or auto (default: METRALE_BACKEND, else auto: cuda with a GPU)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the pipeline's steps (INFO)")
    return parser


def _report(result: PipelineResult) -> None:
    batches = len(result.batch_ms)
    print(f"metrale-pipeline: {batches} batches of {result.size} float32 on {result.backend}, {result.device}")
    for index, ms in enumerate(result.batch_ms):
        print(f"batch {index:3d}: {ms:8.3f} ms")
    times = result.batch_ms
    print(
        f"device time per batch: mean {statistics.fmean(times):.3f} ms, "
        f"min {min(times):.3f} ms, max {max(times):.3f} ms"
    )
    print(
        f"checked against numpy: {batches - len(result.bad_batches)} of {batches} batches match, "
        f"acc max abs error {result.acc_max_error:g}"
    )
    print(result.metrics_table)
    print(f"(launches are those issued: the ones recorded at capture; the graph replayed them {batches} times)")
    print(f"ledger after the pipeline closed: {result.live_after_close} live allocation(s)")
    print("OK" if result.ok else "FAILED")


def main(argv: Sequence[str] | None = None) -> int:
    """The console script's entry point."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        with open_backend(args.backend) as gpu:
            result = run_pipeline(gpu, batches=args.batches, size=args.size, seed=args.seed)
    except MetraleError as exc:
        print(f"metrale-pipeline: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    _report(result)
    return 0 if result.ok else 1
