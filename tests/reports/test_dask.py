"""metrale on a real Dask cluster: `MetraleSetup` on every worker, `worker_backend`, `gather_reports`.

The cluster is built as Dask-CUDA's ``LocalCUDACluster`` builds one: a worker process (a ``Nanny``) per device,
one thread each, each worker's ``CUDA_VISIBLE_DEVICES`` rotated to put its own device first ("0,1" and "1,0"),
here on the fake with two devices. It is shared by the module's tests; each registers the plugin afresh (a new
registration tears the old one down on every worker).

The task functions below run on the workers, which import this module (they share the test run's ``sys.path``):
so they travel by name, and the call sites in the reports are this file's lines.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import logging.handlers
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("distributed", reason="metrale_core.dask needs Dask's distributed (pip install 'metrale[dask]')")

import dask
from distributed import Client, Nanny, Scheduler, SpecCluster

from metrale_core import (
    BackendNotFoundError,
    ConfigError,
    DoorError,
    InvalidArgumentError,
    MetraleError,
    MissingPackageError,
    load_snapshot,
)
from metrale_core.dask import PLUGIN_NAME, MetraleSetup, gather_reports, worker_backend
from metrale_fake._visible import fake_uuid

#: Under pytest-xdist (``dev.py test``, ``--dist loadgroup``) the tests that start clusters of processes (torchrun,
#: Dask, Ray) run on one worker, one after another: never two clusters at once on a 2-core machine.
pytestmark = pytest.mark.xdist_group("clusters")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "dask" / "report.py"
#: What LocalCUDACluster gives two workers on a host of two GPUs: each sees both, its own first.
VISIBLE = ("0,1", "1,0")
#: The variables a launcher or a CI run may have set; the workers get none of them (they inherit this process's),
#: nor any METRALE_* setting but METRALE_PURE (the suite's run with the pure twins runs them on the workers too).
INHERITED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "SLURM_LOCALID")


def _inherited(name: str) -> bool:
    return name in INHERITED or (name.startswith("METRALE_") and name != "METRALE_PURE")


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    """Two worker processes on the fake with two devices, worker 0 shown "0,1" and worker 1 "1,0"."""
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if _inherited(n)]:
            patch.delenv(name)  # (while the cluster lives: the nanny restarts a dead worker with this environment)
        env = {"METRALE_BACKEND": "fake", "METRALE_FAKE_DEVICE_COUNT": "2"}
        workers = {
            i: {"cls": Nanny, "options": {"nthreads": 1, "silence_logs": logging.ERROR,
                                          "env": {**env, "CUDA_VISIBLE_DEVICES": visible}}}
            for i, visible in enumerate(VISIBLE)
        }
        scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
        cluster = SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR)  # type: ignore[no-untyped-call]
        with cluster, Client(cluster) as dask_client:  # type: ignore[no-untyped-call]
            dask_client.wait_for_workers(len(VISIBLE), timeout=120)
            yield dask_client


@pytest.fixture
def setup(client: Client) -> Client:
    """The cluster with a fresh `MetraleSetup` (red zones of 64 bytes) on every worker."""
    client.register_plugin(MetraleSetup(redzone=64))
    return client


def _workers(client: Client) -> list[str]:
    """The workers' addresses, worker 0's first (their names are their places in `VISIBLE`)."""
    info = client.scheduler_info()["workers"]
    return [address for address, _ in sorted(info.items(), key=lambda item: item[1]["name"])]


def _site(function: Callable[..., Any], text: str) -> str:
    """``file:line`` of the one line of ``function`` that holds ``text``: the call site metrale records."""
    lines, first = inspect.getsourcelines(function)
    (line,) = [first + i for i, source in enumerate(lines) if text in source]
    return f"{inspect.getsourcefile(function)}:{line}"


# -- what the workers run --------------------------------------------------------------------------------


def _origin(dask_worker: Any) -> Any:
    return dask_worker.plugins[PLUGIN_NAME].backend.origin


def _set_up(dask_worker: Any) -> bool:
    """Whether the worker's plugin has its backend (a worker joining is listed before its plugins are set up)."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    try:
        return plugin is not None and plugin.backend is not None
    except ConfigError:
        return False


def _task_origin() -> Any:
    return worker_backend().origin


def _visible() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def _plant_leak(nbytes: int) -> int:
    worker_backend().alloc(nbytes)  # the handle dropped: a leak
    return os.getpid()


def _overrun() -> int:
    gpu = worker_backend()
    buf = gpu.alloc(256)
    gpu.memset(buf.ptr + buf.nbytes + 3, 7, nbytes=2)  # past the end, into the red zone
    gpu.free(buf)
    return os.getpid()


#: What a worker's tasks keep between them (as a service keeps its weights): on the worker, by task.
HELD: dict[str, Any] = {}


def _hold(nbytes: int) -> None:
    HELD["weights"] = worker_backend().alloc(nbytes)


def _use_held() -> bool:
    gpu, weights = worker_backend(), HELD.pop("weights")
    gpu.memset(weights, 1)  # still this backend's, and on its ledger
    gpu.free(weights)
    return True


def _overrun_and_leak() -> int:
    gpu = worker_backend()
    buf = gpu.alloc(256)  # left on the ledger: the end-of-job sweep checks its zones again
    gpu.memset(buf.ptr + buf.nbytes + 3, 7, nbytes=2)
    return os.getpid()


def _capture_log(dask_worker: Any) -> None:
    logging.getLogger("metrale").addHandler(logging.handlers.BufferingHandler(10_000))


def _captured_log(dask_worker: Any) -> list[tuple[str, str]]:
    logger = logging.getLogger("metrale")
    handlers = [h for h in logger.handlers if isinstance(h, logging.handlers.BufferingHandler)]
    for handler in handlers:
        logger.removeHandler(handler)
    return [(r.levelname, r.getMessage()) for h in handlers for r in h.buffer]


LEAK_SITE = _site(_plant_leak, ".alloc(nbytes)")
OVERRUN_SITE = _site(_overrun, ".alloc(256)")


# -- the tests -------------------------------------------------------------------------------------------


def test_each_worker_opens_the_device_its_cuda_visible_devices_puts_first(setup: Client) -> None:
    addresses = _workers(setup)
    assert setup.run(_visible) == dict(zip(addresses, VISIBLE, strict=True))
    origins = setup.run(_origin)
    pids = setup.run(os.getpid)
    for index, address in enumerate(addresses):
        origin = origins[address]
        assert (origin.backend, origin.ordinal, origin.worker, origin.pid) == ("fake", 0, address, pids[address])
        assert origin.device_uuid == fake_uuid(index), "ordinal 0: the device CUDA_VISIBLE_DEVICES names first"
        assert setup.submit(_task_origin, workers=[address], pure=False).result() == origin, "a task gets the same"
        assert origin.describe().startswith(f"worker {address} (")
    assert fake_uuid(0) != fake_uuid(1)


def test_a_leak_on_one_worker_and_an_overrun_on_the_other_are_in_the_merged_report(setup: Client) -> None:
    leaky, overrunning = _workers(setup)
    pids = {leaky: setup.submit(_plant_leak, 4096, workers=[leaky], pure=False).result(),
            overrunning: setup.submit(_overrun, workers=[overrunning], pure=False).result()}
    merged = gather_reports(setup, sweep=True)
    assert [r.origin.worker for r in merged.ranks] == sorted(pids)
    assert merged.leaked_bytes == 4096 and merged.live_bytes == 0
    (violation,) = merged.violations
    assert violation.origin is not None and violation.origin.worker == overrunning and violation.site == OVERRUN_SITE
    text = merged.render()
    lines = text.splitlines()
    assert lines[0] == ("merged ledger report: 2 process(es), 0 B live, 4.0 KiB leaked, 1 red-zone violation(s)"), text
    assert lines[1].split() == ["process", "worker", "host", "pid", "device", "live", "leaked", "peak",
                                "violations"], text
    host = merged.ranks[0].origin.host
    for index, (address, leaked, violations) in enumerate(((leaky, "4.0 KiB (1)", "0"), (overrunning, "0 B (0)", "1"))):
        (row,) = [line for line in lines if line.startswith("-  ") and f" {address} " in line]
        assert f" {host} " in row and f" {pids[address]} " in row, row
        assert f" fake:0 {fake_uuid(index)[:13]} " in row, row
        assert f" {leaked} " in row and row.endswith(f"  {violations}"), row
    leaks = lines[lines.index("largest leaks across the job:") + 1]
    assert leaks.split() == ["4.0", "KiB", "x1", LEAK_SITE, "(worker", f"{leaky})"], text
    zones = lines[lines.index("red-zone violations across the job:") + 1:]
    assert len(zones) == 1, text
    assert zones[0].startswith(f"  worker {overrunning}: red zone trail: a write past the end"), text
    assert f"allocated at {OVERRUN_SITE}" in zones[0], text
    once = gather_reports(setup, sweep=True, workers=[leaky])  # one worker asked: its report alone
    assert [r.origin.worker for r in once.ranks] == [leaky] and once.leaked_bytes == 4096


def test_a_worker_that_raises_on_violations_still_reports_them(client: Client) -> None:
    client.register_plugin(MetraleSetup(redzone=64, redzone_action="raise"))
    _, overrunning = _workers(client)
    client.submit(_overrun_and_leak, workers=[overrunning], pure=False).result()
    merged = gather_reports(client, sweep=True)  # the scan and the sweep raise on the worker: the report is whole
    assert [v.site for v in merged.violations] == [_site(_overrun_and_leak, ".alloc(256)")]
    assert merged.leaked_bytes == 256


def test_gathering_without_a_sweep_leaves_the_workers_memory_alone(setup: Client) -> None:
    first, _ = _workers(setup)
    setup.submit(_hold, 8192, workers=[first], pure=False).result()
    merged = gather_reports(setup)  # mid-job: nothing freed, the held buffer is live
    assert (merged.live_bytes, merged.leaked_bytes) == (8192, 0)
    assert merged.largest_live[0].ranks == (f"worker {first}",)
    assert setup.submit(_use_held, workers=[first], pure=False).result()
    assert gather_reports(setup).live_bytes == 0


def test_a_worker_that_dies_leaves_the_others_report_whole(setup: Client, caplog: pytest.LogCaptureFixture) -> None:
    alive, dying = _workers(setup)
    setup.submit(_plant_leak, 8192, workers=[alive], pure=False).result()
    answer = setup.run(os._exit, 1, workers=[dying], on_error="return")[dying]
    assert isinstance(answer, OSError), answer  # (distributed's CommClosedError: the worker died answering)
    # The scheduler may not know yet: ask the dead one by name (a short connect timeout, not the default 30 s).
    with dask.config.set({"distributed.comm.timeouts.connect": "2s"}), caplog.at_level(logging.WARNING, "metrale"):
        merged = gather_reports(setup, sweep=True, workers=[alive, dying])
    assert [r.origin.worker for r in merged.ranks] == [alive]
    assert merged.leaked_bytes == 8192 and merged.largest_leaks[0].site == LEAK_SITE
    (warning,) = [r.getMessage() for r in caplog.records if "gather_reports" in r.getMessage()]
    assert f"Dask worker {dying} gave no report" in warning and "merged the others'" in warning
    # The nanny starts a new worker, at a new address, and the scheduler sets the plugin up on it: a fresh ledger.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = _workers(setup)
        ready = setup.run(_set_up, on_error="return")  # (an error answers an exception: not True)
        if dying not in now and len(now) == len(VISIBLE) and all(ready.get(a) is True for a in now):
            break
        time.sleep(0.1)
    assert dying not in now and len(now) == len(VISIBLE), now
    merged = gather_reports(setup, sweep=True)
    assert sorted(r.origin.worker for r in merged.ranks) == sorted(now)
    assert {r.origin.worker: r.leaked_bytes for r in merged.ranks} == {alive: 8192, now[1]: 0}
    assert merged.ranks[[r.origin.worker for r in merged.ranks].index(now[1])].origin.device_uuid == fake_uuid(1)


def test_metrale_setup_refuses_a_bad_allocator_or_setting_on_the_client() -> None:
    with pytest.raises(ConfigError, match=r"unknown allocator\(s\) \['numba'\]"):
        MetraleSetup(allocators=("torch", "numba"))
    with pytest.raises(ConfigError, match="redzone=-1"):
        MetraleSetup(redzone=-1)
    with pytest.raises(ConfigError, match="bogus=1: no such setting"):
        MetraleSetup(bogus=1)
    with pytest.raises(ConfigError, match="allocators must be names"):
        MetraleSetup(allocators=5)  # type: ignore[arg-type]


def test_gather_reports_refuses_a_bad_top_before_asking_a_worker(client: Client) -> None:
    with pytest.raises(InvalidArgumentError, match="top must be a positive integer"):
        gather_reports(client, sweep=True, top=0)


def test_a_setup_that_fails_on_the_workers_reaches_the_client_typed(client: Client) -> None:
    # Without torch (the workers share this environment): MissingPackageError. With it, the fake is no CUDA
    # device: DoorError. Either is the worker's own exception, raised again on the client by register_plugin.
    torch = importlib.util.find_spec("torch")
    expected: type[MetraleError] = MissingPackageError if torch is None else DoorError
    with pytest.raises(expected, match="torch"):
        client.register_plugin(MetraleSetup(allocators=("torch",)))
    # Dask keeps a plugin whose setup failed (on the scheduler and the workers): it has no backend to give.
    with pytest.raises(ConfigError, match="not set up"):
        client.submit(worker_backend, pure=False).result()
    with pytest.raises(ConfigError, match=r"no Dask worker gave a report \(2 asked\)"):
        gather_reports(client)
    with pytest.raises(BackendNotFoundError, match="no backend named 'nope'"):
        client.register_plugin(MetraleSetup("nope"))  # a backend's name is known only where it is opened


def test_teardown_saves_a_snapshot_per_worker_and_logs_the_leak(client: Client, tmp_path: Path) -> None:
    client.register_plugin(MetraleSetup(redzone=64, snapshot_dir=tmp_path / "snapshots"))
    clean, leaky = _workers(client)
    client.run(_capture_log)
    pids = client.run(os.getpid)
    client.submit(_plant_leak, 2048, workers=[leaky], pure=False).result()
    client.unregister_worker_plugin(PLUGIN_NAME)  # type: ignore[no-untyped-call]  # teardown on every worker
    logs = client.run(_captured_log)
    paths = sorted((tmp_path / "snapshots").glob("*.json"))
    assert len(paths) == 2, paths
    snapshots = {s.origin.worker: s for s in map(load_snapshot, paths) if s.origin is not None}
    assert sorted(snapshots) == sorted(pids)
    for index, address in enumerate((clean, leaky)):
        origin = snapshots[address].origin
        assert origin is not None and (origin.pid, origin.device_uuid) == (pids[address], fake_uuid(index))
    (warning,) = [m for level, m in logs[leaky] if level == "WARNING" and "at teardown" in m]
    assert warning.startswith(f"metrale on Dask worker {leaky} at teardown:\n"), warning
    assert "2.0 KiB leaked" in warning and LEAK_SITE in warning, warning
    assert not [m for level, m in logs[clean] if level == "WARNING"], logs[clean]
    with pytest.raises(ConfigError, match="has no metrale plugin"):
        client.submit(worker_backend, workers=[clean], pure=False).result()


def test_worker_backend_outside_a_task_is_a_config_error(setup: Client) -> None:
    with pytest.raises(ConfigError, match="not inside a Dask task"):
        worker_backend()  # on the client
    answers = setup.run(worker_backend, on_error="return")  # on a worker, but out of band: no task
    assert len(answers) == 2 and all(isinstance(a, ConfigError) for a in answers.values()), answers


def test_the_example_reports_both_workers_and_the_leak() -> None:
    env = {k: v for k, v in os.environ.items() if not _inherited(k)}
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, env=env, check=False,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    lines = text.splitlines()
    assert "merged ledger report: 2 process(es), 0 B live, 4.0 KiB leaked" in lines, text
    addresses = []
    for index, visible in enumerate(VISIBLE):
        (line,) = [line for line in lines if line.startswith(f"worker {index}: CUDA_VISIBLE_DEVICES={visible}, ")]
        assert line.endswith(f"fake:0 {fake_uuid(index)}"), line
        addresses.append(line.split(", worker ")[1].split()[0])
    rows = {a: [line for line in lines if line.startswith("-  ") and f" {a} " in line] for a in addresses}
    assert all(len(r) == 1 for r in rows.values()), text
    assert "4.0 KiB (1)" in rows[addresses[1]][0] and "0 B (0)" in rows[addresses[0]][0], text
    leaks = lines[lines.index("largest leaks across the job:") + 1]
    assert f"{EXAMPLE}:" in leaks and leaks.endswith(f"(worker {addresses[1]})"), text
