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

With ``--nccl`` (one GPU per rank: NCCL refuses two ranks on one device), each rank also hands a metrale
buffer to PyTorch through DLPack, with no copy, and the ranks sum it with an NCCL all-reduce; the reports
still travel over gloo.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from metrale_core import GpuBackend, LedgerReport, MetraleSettings, merge_reports, open_for_rank, placement

STEP_BYTES = 1 << 16


def all_reduce_through_dlpack(gpu: GpuBackend, rank: int, size: int) -> None:
    """A metrale buffer summed across the ranks by NCCL, handed to PyTorch through DLPack (no copy)."""
    buf = gpu.alloc(4 << 20)
    gpu.memset(buf, 0)
    tensor = torch.from_dlpack(buf.view("float32"))  # ordered after metrale's work on torch's stream
    tensor.fill_(float(rank + 1))
    dist.all_reduce(tensor)  # NCCL, on torch's current stream
    torch.cuda.current_stream().synchronize()
    want = size * (size + 1) / 2
    out = bytearray(8)
    gpu.copy_to_host(out, buf)
    got = torch.frombuffer(out, dtype=torch.float32).tolist()
    assert got == [want, want], (got, want)
    print(f"rank {rank}: NCCL all-reduce of a metrale buffer through DLPack: {got[0]:g} (want {want:g})", flush=True)
    del tensor
    gpu.free(buf)


def run_rank(settings: MetraleSettings, nccl: bool = False) -> LedgerReport:
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
        if nccl:
            all_reduce_through_dlpack(gpu, dist.get_rank(), dist.get_world_size())
        gpu.alloc((gpu.origin.rank or 0) * 4096 + 4096)  # the planted leak: never freed
        gpu.free(activations)
        gpu.free(weights)
        gpu.sweep_unreleased()  # takes the leak, logs it with this rank's origin
        report = gpu.ledger_report()
    print(f"rank {where.rank}: ordinal {where.ordinal} of {where.device_count} ({where.source}), "
          f"{report.origin.describe()}", flush=True)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nccl", action="store_true", help="also all-reduce a metrale buffer with NCCL (GPUs only)")
    args = parser.parse_args()
    settings = MetraleSettings()
    objects = None
    if args.nccl:
        torch.cuda.set_device(placement(settings=settings).ordinal)  # NCCL's device: the one metrale opens
        dist.init_process_group("nccl")
        objects = dist.new_group(backend="gloo")  # the reports travel over gloo, on the CPU
    else:
        dist.init_process_group("gloo")
    try:
        report = run_rank(settings, nccl=args.nccl)
        rank, size = dist.get_rank(), dist.get_world_size()
        gathered: list[LedgerReport | None] | None = [None] * size if rank == 0 else None
        dist.gather_object(report, gathered, dst=0, group=objects)
        if rank == 0:
            assert gathered is not None
            merged = merge_reports(r for r in gathered if r is not None)
            print(merged.render(), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
