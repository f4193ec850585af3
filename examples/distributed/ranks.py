"""One metrale backend per rank under torchrun, and one merged ledger report for the whole job.

    torchrun --standalone --nproc-per-node 2 examples/distributed/ranks.py

torchrun starts the processes and sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; metrale opens each
rank's device (``open_for_rank``: ``LOCAL_RANK`` modulo the devices, so two ranks on one GPU share it) and
names every record with its origin. Each rank runs a few captured steps and leaves one allocation of its own
size unfreed; its sweep takes it as a leak. Rank 0 gathers every rank's ledger report with
``torch.distributed.gather_object`` (gloo: CPU only, no NCCL needed) and prints the merged report.

On a machine without a GPU, run it on the fake with two fake devices:

    METRALE_BACKEND=fake METRALE_FAKE_DEVICE_COUNT=2 torchrun --standalone --nproc-per-node 2 \\
        examples/distributed/ranks.py
"""

from __future__ import annotations

import torch.distributed as dist

from metrale_core import LedgerReport, MetraleSettings, merge_reports, open_for_rank, placement

STEP_BYTES = 1 << 16


def run_rank(settings: MetraleSettings) -> LedgerReport:
    """A few captured steps on this rank's device, one planted leak, and the rank's ledger report."""
    where = placement(settings=settings)
    with open_for_rank(settings=settings) as gpu:
        weights = gpu.alloc(1 << 20)
        gpu.memset(weights, 1)
        activations = gpu.alloc(STEP_BYTES)
        stream = gpu.create_stream()
        gpu.synchronize()
        gpu.begin_capture(stream)
        gpu.memset(activations, 0, stream=stream)
        gpu.copy_device(activations, weights, nbytes=STEP_BYTES, stream=stream)
        graph = gpu.end_capture(stream)
        step = graph.instantiate()
        for _ in range(3):
            step.launch(stream)
        stream.synchronize()
        out = bytearray(4)
        gpu.copy_to_host(out, activations)
        assert out == b"\x01" * 4, out
        step.close()
        graph.close()
        stream.close()
        gpu.alloc((gpu.origin.rank or 0) * 4096 + 4096)  # the planted leak: never freed
        gpu.free(activations)
        gpu.free(weights)
        gpu.sweep_unreleased()  # takes the leak, logs it with this rank's origin
        report = gpu.ledger_report()
    print(f"rank {where.rank}: ordinal {where.ordinal} of {where.device_count} ({where.source}), "
          f"{report.origin.describe()}", flush=True)
    return report


def main() -> int:
    dist.init_process_group("gloo")
    try:
        report = run_rank(MetraleSettings())
        rank, size = dist.get_rank(), dist.get_world_size()
        gathered: list[LedgerReport | None] | None = [None] * size if rank == 0 else None
        dist.gather_object(report, gathered, dst=0)
        if rank == 0:
            assert gathered is not None
            merged = merge_reports(r for r in gathered if r is not None)
            print(merged.render(), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
