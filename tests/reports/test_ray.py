"""metrale under a real Ray, on the fake: each actor opens the device Ray assigned it (`open_for_actor`), its
origin names the actor, and the reports gathered with ``ray.get`` merge into one.

One Ray instance serves the module (two logical GPUs, the workers on the fake with two fake devices); the cases
that need the node's own ``CUDA_VISIBLE_DEVICES`` (GPU UUIDs, ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``)
start a Ray of their own in a subprocess, and so does the example. Every ``ray.get`` has a timeout: a test whose
actors cannot be placed fails instead of waiting.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray", reason="metrale_core.ray needs Ray (pip install ray)")

import ray

from metrale_core import (
    ConfigError,
    LedgerReport,
    MetraleSettings,
    OutOfMemoryError,
    merge_reports,
)
from metrale_core.ray import open_for_actor
from metrale_fake._visible import fake_uuid

#: Under pytest-xdist (``dev.py test``, ``--dist loadgroup``) the tests that start clusters of processes (torchrun,
#: Dask, Ray) run on one worker, one after another: never two clusters at once on a 2-core machine.
pytestmark = pytest.mark.xdist_group("clusters")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ray" / "report.py"
#: What the workers of the module's Ray see: the fake, with two devices (Ray's two logical GPUs).
FAKE_ENV = {"METRALE_BACKEND": "fake", "METRALE_FAKE_DEVICE_COUNT": "2"}
NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
#: Seconds a ``ray.get`` waits: an actor that cannot be placed fails the test instead of hanging it.
TIMEOUT = 60
U0, U1 = fake_uuid(0), fake_uuid(1)


def _ray_env(**extra: str) -> dict[str, str]:
    """This process's environment for a Ray of its own: no ``METRALE_*``, no GPU variables, no token file asked
    for; then ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("METRALE_") and k not in ("CUDA_VISIBLE_DEVICES", NOSET, "RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A local Ray with two CPUs and two logical GPUs, the node's ``CUDA_VISIBLE_DEVICES`` unset; shut down at the
    end of the module."""
    if ray.is_initialized():
        pytest.fail("Ray is already initialized in this process: the module starts its own")
    with pytest.MonkeyPatch.context() as env:
        for name in ("CUDA_VISIBLE_DEVICES", NOSET, "RAY_ADDRESS"):
            env.delenv(name, raising=False)
        env.setenv("RAY_AUTH_MODE", "disabled")
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": FAKE_ENV})
        try:
            yield
        finally:
            ray.shutdown()


@ray.remote(num_gpus=1, num_cpus=0)
class Holder:
    """An actor with a backend on the GPU Ray assigned it (``settings``: changes to the worker's settings)."""

    def __init__(self, **settings: Any) -> None:
        self.gpu = open_for_actor(settings=MetraleSettings().updated(**settings) if settings else None)

    def where(self) -> dict[str, Any]:
        context = ray.get_runtime_context()
        return {"ids": ray.get_gpu_ids(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "actor": context.get_actor_id(), "origin": self.gpu.origin, "described": self.gpu.origin.describe()}

    def leak(self, nbytes: int) -> None:
        self.gpu.alloc(nbytes)  # never freed: the sweep takes it
        self.gpu.sweep_unreleased()

    def overrun(self) -> int:
        buf = self.gpu.alloc(256)
        self.gpu.memset(buf.ptr + buf.nbytes + 3, 7, nbytes=2)  # two bytes into the trailing red zone
        return len(self.gpu.scan_redzones())

    def overfill(self, nbytes: int) -> str:
        try:
            self.gpu.alloc(nbytes)
        except OutOfMemoryError as exc:
            return str(exc)
        return ""

    def report(self) -> LedgerReport:
        return self.gpu.ledger_report()


@contextlib.contextmanager
def holders(count: int, **options: Any) -> Iterator[list[Any]]:
    """``count`` `Holder` actors made with ``options`` (``settings``: the constructor's), killed on the way out so
    the next test finds the GPUs free."""
    settings = options.pop("settings", {})
    made = [Holder.options(**options).remote(**settings) for _ in range(count)]
    try:
        yield made
    finally:
        for actor in made:
            ray.kill(actor)


def _where(actors: list[Any]) -> list[dict[str, Any]]:
    return list(ray.get([a.where.remote() for a in actors], timeout=TIMEOUT))


# -- outside Ray, and without a GPU ------------------------------------------------------------------------------


def test_open_for_actor_outside_ray_is_a_config_error() -> None:
    code = textwrap.dedent("""
        from metrale_core import ConfigError
        from metrale_core.ray import open_for_actor
        try:
            open_for_actor("fake")
        except ConfigError as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_ray_env(), check=False,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "open_for_actor: Ray is not initialized here" in out.stdout


@ray.remote(num_gpus=0)
def _open_without_a_gpu() -> None:
    open_for_actor()


@ray.remote(num_gpus=1)
def _open_in_a_task() -> tuple[str, str, str]:
    with open_for_actor() as gpu:
        return gpu.origin.worker, ray.get_runtime_context().get_worker_id(), gpu.origin.device_uuid


@pytest.mark.usefixtures("cluster")
def test_open_for_actor_without_a_gpu_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no GPU is assigned to this process"):
        open_for_actor()  # the driver: Ray runs, but gave it no GPU
    with pytest.raises(ConfigError, match=r"open_for_actor: no GPU is assigned .*give the task or actor num_gpus"):
        ray.get(_open_without_a_gpu.remote(), timeout=TIMEOUT)  # Ray raises the task's error as itself


@pytest.mark.usefixtures("cluster")
def test_a_task_s_origin_names_its_worker() -> None:
    worker, worker_id, device_uuid = ray.get(_open_in_a_task.remote(), timeout=TIMEOUT)
    assert worker == f"ray worker {worker_id}"
    assert device_uuid in (U0, U1)


# -- actors on the module's Ray ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("cluster")
def test_two_actors_open_the_two_devices_ray_assigned() -> None:
    with holders(2) as actors:
        places = _where(actors)
    for place in places:
        (gpu_id,) = place["ids"]
        assert type(gpu_id) is int  # Ray 2.60, the node's CUDA_VISIBLE_DEVICES unset: integer ids
        assert place["visible"] == str(gpu_id)  # ...and each worker's variable set to its GPU: ordinal 0
        origin = place["origin"]
        assert (origin.ordinal, origin.device_uuid) == (0, fake_uuid(gpu_id))
        assert origin.worker == f"ray actor {place['actor']}" and origin.in_job
        assert origin.device_share == 1 and "shared" not in place["described"]
        assert place["described"].startswith(f"worker ray actor {place['actor']} (")
    assert sorted(p["ids"][0] for p in places) == [0, 1]
    assert len({p["origin"].worker for p in places}) == 2


@pytest.mark.usefixtures("cluster")
def test_string_ids_where_the_node_lists_its_gpus() -> None:
    """A worker whose ``CUDA_VISIBLE_DEVICES`` lists the node's GPUs (here through its ``runtime_env``, which Ray
    2.60 reads as the node's) gets string ids out of that list; Ray narrows the variable to the id."""
    env = {"env_vars": {**FAKE_ENV, "CUDA_VISIBLE_DEVICES": "1,0"}}
    with holders(2, runtime_env=env) as actors:
        places = _where(actors)
    assert sorted(p["ids"][0] for p in places) == ["0", "1"]
    for place in places:
        (gpu_id,) = place["ids"]
        assert place["visible"] == gpu_id
        assert (place["origin"].ordinal, place["origin"].device_uuid) == (0, fake_uuid(int(gpu_id)))


@pytest.mark.usefixtures("cluster")
def test_a_leak_and_an_overrun_on_two_actors_merge_into_one_report() -> None:
    with holders(2, settings={"redzone": 64}) as (leaky, overrunning):
        ray.get(leaky.leak.remote(12345), timeout=TIMEOUT)
        assert ray.get(overrunning.overrun.remote(), timeout=TIMEOUT) == 1
        reports = ray.get([a.report.remote() for a in (leaky, overrunning)], timeout=TIMEOUT)
    merged = merge_reports(reports)
    text = merged.render()
    leak_origin, overrun_origin = (r.origin for r in reports)
    assert text.startswith("merged ledger report: 2 process(es)") and "1 red-zone violation(s)" in text
    assert merged.leaked_bytes == 12345
    for origin in (leak_origin, overrun_origin):
        row = next(line for line in text.splitlines() if origin.worker in line)
        for part in (origin.host, str(origin.pid), f"fake:0 {origin.device_uuid[:13]}"):
            assert part in row, (part, row)
    assert leak_origin.device_uuid != overrun_origin.device_uuid
    (leak,) = merged.largest_leaks
    assert leak.nbytes == 12345 and leak.site.startswith(f"{__file__}:")
    leaks = text.split("largest leaks across the job:")[1].split("red-zone violations across the job:")[0]
    assert f"{leak.site}  (worker {leak_origin.worker})" in leaks
    (violation,) = merged.violations
    assert violation.origin == overrun_origin and violation.side == "trail" and violation.offset == 3
    assert violation.site.startswith(f"{__file__}:")
    (found,) = text.split("red-zone violations across the job:\n")[1].splitlines()
    assert found.startswith(f"  worker {overrun_origin.worker}: red zone trail: a write past the end")
    assert f"allocated at {violation.site}" in found


@pytest.mark.usefixtures("cluster")
def test_an_actor_that_dies_leaves_the_others_reports_whole() -> None:
    """Each report gathered on its own (``ray.wait``, then ``ray.get`` of each): one actor's death costs its report
    alone, as docs/distributed.md shows."""
    with holders(2) as (alive, dying):
        ray.get(alive.leak.remote(4321), timeout=TIMEOUT)
        ray.kill(dying, no_restart=True)
        refs = [a.report.remote() for a in (alive, dying)]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=TIMEOUT)
        reports, lost = [], []
        for ref in ready:
            try:
                reports.append(ray.get(ref, timeout=TIMEOUT))
            except ray.exceptions.RayActorError as exc:
                lost.append(exc)
    assert len(reports) == 1 and len(lost) == 1
    merged = merge_reports(reports)
    assert merged.leaked_bytes == 4321 and merged.ranks[0].origin == reports[0].origin


@pytest.mark.usefixtures("cluster")
def test_two_actors_with_half_a_gpu_share_one_device() -> None:
    """``num_gpus=0.5``: the origin says the share, the merged report and an out-of-memory error too. One GPU is
    held whole first, so the halves can only go to the other."""
    with holders(1) as (whole,):
        (held,) = _where([whole])  # placed before the halves ask
        with holders(2, num_gpus=0.5, settings={"fake_memory_bytes": 1 << 20}) as halves:
            places = _where(halves)
            oom = ray.get(halves[0].overfill.remote(2 << 20), timeout=TIMEOUT)
            reports = ray.get([a.report.remote() for a in halves], timeout=TIMEOUT)
    (device,) = {p["origin"].device_uuid for p in places}
    assert device != held["origin"].device_uuid
    for place in places:
        assert place["origin"].device_share == 0.5 and place["origin"].shared
        assert "0.5 of the device (shared with other processes)" in place["described"]
    assert "held by other processes on this device" in oom and "this process has 0.5 of it" in oom
    assert merge_reports(reports).render().count("(0.5 shared)") == 2


# -- a Ray of its own, the node's CUDA_VISIBLE_DEVICES set -------------------------------------------------------

#: Starts Ray in a process whose environment is the node's; two actors with a GPU each print where they are.
NODE = textwrap.dedent("""
    import json, os
    import ray
    from metrale_core.ray import open_for_actor

    @ray.remote(num_gpus=1, num_cpus=0)
    class Probe:
        def where(self):
            with open_for_actor() as gpu:
                return {"ids": ray.get_gpu_ids(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                        "ordinal": gpu.origin.ordinal, "uuid": gpu.origin.device_uuid}

    ray.init(num_cpus=1, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        probes = [Probe.remote() for _ in range(2)]
        print(json.dumps(ray.get([p.where.remote() for p in probes], timeout=60)))
    finally:
        ray.shutdown()
""")


def _node(**env: str) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-c", NODE], capture_output=True, text=True, check=False, timeout=180,
                         cwd=ROOT, env=_ray_env(**FAKE_ENV, **env))
    assert out.returncode == 0, out.stderr[-4000:]
    places: list[dict[str, Any]] = json.loads(out.stdout.strip().splitlines()[-1])
    return places


def test_gpu_uuids_in_the_node_s_cuda_visible_devices() -> None:
    """ray#43314: the node lists its GPUs by UUID. Ray 2.60 hands each worker the UUID string as its id and sets
    its ``CUDA_VISIBLE_DEVICES`` to it; the worker opens that device, as ordinal 0."""
    places = _node(CUDA_VISIBLE_DEVICES=f"{U1},{U0}")
    assert sorted(p["ids"][0] for p in places) == sorted([U0, U1])
    for place in places:
        (gpu_id,) = place["ids"]
        assert place["visible"] == gpu_id
        assert (place["ordinal"], place["uuid"]) == (0, gpu_id)


def test_ray_leaving_cuda_visible_devices_alone() -> None:
    """ray#26493: with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` Ray 2.60 leaves the node's variable
    (``1,0``) as it is and hands string ids out of it; the actor given ``"1"`` opens fake device 1, its ordinal 0."""
    places = _node(CUDA_VISIBLE_DEVICES="1,0", **{NOSET: "1"})
    assert sorted(p["ids"][0] for p in places) == ["0", "1"]
    for place in places:
        (gpu_id,) = place["ids"]
        assert place["visible"] == "1,0"
        assert (place["ordinal"], place["uuid"]) == (["1", "0"].index(gpu_id), fake_uuid(int(gpu_id)))


# -- the example ----------------------------------------------------------------------------------------------


def test_the_ray_example_merges_both_actors_reports() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE), "--gpus", "2"], capture_output=True, text=True, check=False,
                         timeout=300, cwd=ROOT, env=_ray_env())
    assert out.returncode == 0, out.stderr[-4000:]
    text = out.stdout
    assert "merged ledger report: 2 process(es)" in text
    actors = set(re.findall(r"ray actor [0-9a-f]+", text))
    assert len(actors) == 2, text
    assert f"fake:0 {U0[:13]}" in text and f"fake:0 {U1[:13]}" in text
    leaks = text.split("largest leaks across the job:")[1]
    assert f"{EXAMPLE}:" in leaks and "x2" in leaks, text
