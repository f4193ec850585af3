"""One metrale backend per Dask worker, and one merged ledger report for the whole cluster.

    python examples/dask/report.py                            # 2 workers on the fake, 2 fake devices
    python examples/dask/report.py --backend cuda --workers 1  # a GPU host: one worker per GPU

The script starts a local cluster the way Dask-CUDA's ``LocalCUDACluster`` does: one worker process (a
``Nanny``) per device, with one thread each, every worker's ``CUDA_VISIBLE_DEVICES`` rotated so that its own
device comes first. It registers ``MetraleSetup`` (red zones on), which opens ordinal 0 on each worker (its
device) and names every record with the worker's address. Each worker runs a few steps (allocate, fill, read
back, free); the last worker also leaves one allocation unfreed, a planted leak.
``gather_reports(client, sweep=True)`` asks every worker for its report (red zones judged, each ledger drained:
the job is done) and the merged
report is printed: a line per worker with its address, host, pid and device, then the leak and its call site.

On the fake (the default) ``--workers N`` gives the fake N devices; on CUDA the workers take the first N of
``CUDA_VISIBLE_DEVICES`` (``0..N-1`` where it is unset).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from distributed import Client, Nanny, Scheduler, SpecCluster

from metrale_core import ConfigError, MetraleError
from metrale_core.dask import MetraleSetup, gather_reports, worker_backend

STEP_BYTES = 1 << 16
LEAK_BYTES = 4096


def step(seed: int) -> str:
    """A task: a few allocations on this worker's device, filled, read back and freed; its device, described."""
    gpu = worker_backend()
    weights = gpu.alloc(4 * STEP_BYTES)
    activations = gpu.alloc(STEP_BYTES)
    gpu.memset(weights, seed & 0xFF)
    gpu.copy_device(activations, weights, nbytes=STEP_BYTES)
    out = bytearray(4)
    gpu.copy_to_host(out, activations)
    gpu.synchronize()
    assert out == bytes([seed & 0xFF]) * 4, out
    gpu.free(activations)
    gpu.free(weights)
    return gpu.origin.describe()


def plant_leak(nbytes: int) -> int:
    """A task that allocates and drops the handle: the end-of-job sweep (``gather_reports(client, sweep=True)``)
    takes it as a leak."""
    worker_backend().alloc(nbytes)  # the planted leak: never freed
    return nbytes


def rotated(devices: list[str], i: int) -> str:
    """Worker ``i``'s ``CUDA_VISIBLE_DEVICES``: every device, its own first (as ``LocalCUDACluster`` sets it)."""
    return ",".join(devices[i:] + devices[:i])


def devices_for(backend: str, workers: int) -> list[str]:
    """The devices the workers take, one each: the fake's ``0..N-1``; on a GPU the first N shown."""
    shown = "" if backend == "fake" else os.environ.get("CUDA_VISIBLE_DEVICES", "")
    listed = [d.strip() for d in shown.split(",") if d.strip()] or [str(i) for i in range(workers)]
    if len(listed) < workers:
        raise SystemExit(f"--workers {workers}: CUDA_VISIBLE_DEVICES={shown!r} shows only {len(listed)} device(s)")
    return listed[:workers]


def local_cluster(devices: list[str]) -> SpecCluster:
    """A worker process (a ``Nanny``) per device, one thread each, each worker's ``CUDA_VISIBLE_DEVICES`` rotated
    to put its device first: what ``LocalCUDACluster`` starts. No dashboard, and only the workers' errors logged."""
    spec = {  # (a worker inherits this environment, METRALE_* included: the plugin's keywords win over those)
        i: {"cls": Nanny, "options": {"nthreads": 1, "silence_logs": logging.ERROR,
                                      "env": {"CUDA_VISIBLE_DEVICES": rotated(devices, i)}}}
        for i in range(len(devices))
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    return SpecCluster(workers=spec, scheduler=scheduler, silence_logs=logging.ERROR)  # type: ignore[no-untyped-call]


def tasks() -> ModuleType:
    """This file as a module the workers import. Functions of ``__main__`` travel to the workers by value, and
    cloudpickle names their code ``<dynamic-code>``, so the call sites of the report would lose their file;
    taken from a module (a local cluster's workers share this ``sys.path``), they travel by name and keep it."""
    if __name__ != "__main__":
        return sys.modules[__name__]
    folder = str(Path(__file__).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(Path(__file__).stem)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="worker processes, one per device (default 2)")
    parser.add_argument("--backend", default="fake", help="the metrale backend each worker opens (default fake)")
    parser.add_argument("--redzone", type=int, default=64, help="red-zone bytes around each allocation (default 64)")
    args = parser.parse_args()
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    devices = devices_for(args.backend, args.workers)
    settings: dict[str, Any] = {"redzone": args.redzone}
    if args.backend == "fake":
        settings["fake_device_count"] = args.workers
    try:
        setup = MetraleSetup(args.backend, **settings)  # a bad setting is refused here, before a worker starts
    except ConfigError as exc:
        parser.error(str(exc))

    mod = tasks()
    with local_cluster(devices) as cluster, Client(cluster) as client:  # type: ignore[no-untyped-call]
        client.wait_for_workers(args.workers, timeout=120)
        try:
            client.register_plugin(setup)  # a worker's failure to set up comes back here, as it was raised
        except MetraleError as exc:
            print(f"metrale could not set up on the workers: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        workers = {info["name"]: address for address, info in client.scheduler_info()["workers"].items()}
        steps = {i: [client.submit(mod.step, i * 16 + s, workers=[workers[i]], pure=False) for s in range(3)]
                 for i in sorted(workers)}
        for i, futures in steps.items():
            described = [f.result() for f in futures]
            print(f"worker {i}: CUDA_VISIBLE_DEVICES={rotated(devices, i)}, {described[-1]}", flush=True)
        last = workers[max(workers)]
        client.submit(mod.plant_leak, LEAK_BYTES, workers=[last], pure=False).result()
        print(gather_reports(client, sweep=True).render(), flush=True)  # the job is done: drain every ledger
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
