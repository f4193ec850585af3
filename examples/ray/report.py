"""One metrale backend per Ray actor, and one merged ledger report for the job.

    python examples/ray/report.py                         # two actors on the fake (two fake devices)
    python examples/ray/report.py --backend cuda --gpus 4  # four actors on four of this host's GPUs

Each actor asks Ray for a GPU (``num_gpus=1``) and opens it with ``open_for_actor()``: the GPU Ray assigned,
whatever ``CUDA_VISIBLE_DEVICES`` Ray set or left alone, its origin naming the actor. It runs a few steps and
leaves one allocation of its own size unfreed; its sweep takes it as a leak. Each actor returns its ledger report
(plain values: Ray's object store carries it), and the driver merges what ``ray.get`` gathered and prints it.

On the fake (the default), Ray gets ``--gpus`` logical GPUs and each worker a fake device per GPU
(``METRALE_FAKE_DEVICE_COUNT``), so it runs on a machine without a GPU; with another backend Ray counts the
host's GPUs itself.
"""

from __future__ import annotations

import argparse
import sys

import ray

from metrale_core import LedgerReport, merge_reports
from metrale_core.ray import open_for_actor

STEP_BYTES = 1 << 16
#: Seconds the driver waits for the actors: an actor Ray cannot place (too few GPUs) fails instead of hanging.
TIMEOUT = 300


class Trainer:
    """One actor, one GPU, one backend on it (`TrainerActor`: the class Ray makes actors of)."""

    def __init__(self, index: int) -> None:
        self.index = index

    @ray.method(num_returns=1)
    def run(self, steps: int) -> LedgerReport:
        """A few steps on the actor's GPU, one planted leak, and the actor's ledger report."""
        with open_for_actor() as gpu:
            weights = gpu.alloc(1 << 20)
            gpu.memset(weights, 1)
            for _ in range(steps):
                activations = gpu.alloc(STEP_BYTES)
                gpu.copy_device(activations, weights, nbytes=STEP_BYTES)
                gpu.free(activations)
            out = bytearray(4)
            gpu.copy_to_host(out, weights)
            assert out == b"\x01" * 4, out
            gpu.alloc((self.index + 1) * 4096)  # the planted leak: never freed
            gpu.free(weights)
            gpu.sweep_unreleased()  # takes the leak, logs it with this actor's origin
            return gpu.ledger_report()


#: ``ray.remote`` called, not used as a decorator: mypy then knows the actor's methods and what they return.
TrainerActor = ray.remote(num_gpus=1)(Trainer)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2, help="actors, one GPU each (default: 2)")
    parser.add_argument("--backend", default="fake", help="the backend each actor opens (default: fake)")
    parser.add_argument("--steps", type=int, default=3, help="steps per actor (default: 3)")
    args = parser.parse_args()
    if args.gpus < 1:
        parser.error("--gpus must be at least 1")
    env = {"METRALE_BACKEND": args.backend}
    gpus = None  # Ray counts the host's GPUs
    if args.backend == "fake":
        env["METRALE_FAKE_DEVICE_COUNT"] = str(args.gpus)
        gpus = args.gpus  # logical GPUs, one fake device each
    ray.init(num_gpus=gpus, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        have = int(ray.cluster_resources().get("GPU", 0))  # type: ignore[no-untyped-call]  # Ray leaves it untyped
        if have < args.gpus:
            print(f"report.py: Ray sees {have} GPU(s) here; {args.gpus} actors need one each", file=sys.stderr)
            return 2
        trainers = [TrainerActor.remote(i) for i in range(args.gpus)]
        reports: list[LedgerReport] = ray.get([t.run.remote(args.steps) for t in trainers], timeout=TIMEOUT)
        print(merge_reports(reports).render(), flush=True)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
