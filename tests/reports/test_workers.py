"""What the engines' glue adds to origins and reports: a worker's name, a shared device, red-zone violations that
travel in a report, Slurm's local rank, and `MetraleSettings.with_launch`."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from pathlib import Path

import pytest

from metrale_core import (
    ConfigError,
    InvalidArgumentError,
    LaunchEnvironment,
    LedgerReport,
    MetraleSettings,
    OutOfMemoryError,
    RedZoneViolation,
    SnapshotError,
    assigned_ordinal,
    load_snapshot,
    merge_reports,
    open_backend,
    placement,
)
from metrale_core._types import Origin
from metrale_fake._visible import fake_uuid

WORKER = "tcp://10.0.0.2:4242"
U0, U1 = fake_uuid(0), fake_uuid(1)


def test_with_launch_overrides_the_engines_variables_and_stacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    base = MetraleSettings()
    named = base.with_launch(metrale_worker=WORKER)
    shared = named.with_launch(metrale_device_share=0.25)
    assert (shared.launch.rank, shared.launch.metrale_worker, shared.launch.metrale_device_share) == (3, WORKER, 0.25)
    assert base.launch.metrale_worker is None and named.launch.metrale_device_share is None  # each unchanged
    with pytest.raises(ConfigError, match=r"metrale_device_share=1\.5"):
        base.with_launch(metrale_device_share=1.5)
    with pytest.raises(ConfigError, match="nodes"):
        base.with_launch(nodes=2)


def test_with_launch_reads_a_bad_variable_it_leaves_to_the_environment_as_unset(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "-1")  # stops a placement, not a worker's open
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    settings = MetraleSettings(fake_device_count=2).with_launch(metrale_worker=WORKER)
    launch = settings.launch
    assert (launch.metrale_worker, launch.local_rank, launch.rank, launch.cuda_visible_devices) == (WORKER, None, 2,
                                                                                                   "1,0")
    assert "LOCAL_RANK='-1'" in caplog.text
    with open_backend("fake", settings=settings) as gpu, open_backend("fake", settings=MetraleSettings(
            fake_device_count=2)) as plain:
        assert gpu.origin.worker == WORKER
        assert gpu.origin.device_uuid == plain.origin.device_uuid, "the device a plain open shows"


def test_old_pickles_of_reports_load_without_violations() -> None:
    origin = Origin("h", 1, None, None, "fake", 0)
    old = LedgerReport.__new__(LedgerReport)
    old.__setstate__((origin, (), (), {}))  # a LedgerReport pickled before it carried violations
    assert old.violations == () and merge_reports([old]).violations == ()


def test_an_empty_variable_is_unset_but_for_the_devices_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    launch = LaunchEnvironment()
    assert launch.local_rank is None and launch.cuda_visible_devices == ""


def test_a_launcher_may_name_the_worker_and_its_share(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("METRALE_WORKER", "node7-gpu1")
    monkeypatch.setenv("METRALE_DEVICE_SHARE", "0.5")
    with open_backend("fake", settings=MetraleSettings()) as gpu:
        assert (gpu.origin.worker, gpu.origin.device_share, gpu.origin.shared) == ("node7-gpu1", 0.5, True)
    assert "is not a metrale setting" not in caplog.text


def test_slurm_localid_places_a_task_where_no_local_rank_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "3")
    where = placement("fake", settings=MetraleSettings(fake_device_count=2))
    assert (where.ordinal, where.local_rank) == (1, 3) and where.source.startswith("SLURM_LOCALID=3 modulo 2")
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun's variable wins
    assert placement("fake", settings=MetraleSettings(fake_device_count=2)).ordinal == 0


def test_an_origin_names_its_worker_and_a_shared_device() -> None:
    origin = Origin("vm", 42, None, None, "fake", 0, "FAKE-1", 1, WORKER, 0.5)
    assert origin.describe() == (f"worker {WORKER} (vm pid 42), fake:0 FAKE-1, 0.5 of the device (shared with other "
                                 "processes)")
    assert origin.in_job and origin.shared
    ranked = Origin("vm", 42, 1, 2, "fake", 0, worker=WORKER)
    assert ranked.describe().startswith("rank 1 of 2 (vm pid 42)")  # a rank first, where there is one


@pytest.mark.parametrize("state", [
    ["h", 1, None, None, "fake", 0, "FAKE-1"],  # before instance
    ["h", 1, None, None, "fake", 0, "FAKE-1", 2],  # before worker and device_share
])
def test_an_origin_pickled_before_workers_loads_with_the_defaults(state: list[object]) -> None:
    old = Origin.__new__(Origin)
    old.__setstate__(state)
    assert (old.worker, old.device_share, old.shared) == ("", 1.0, False)
    assert pickle.loads(pickle.dumps(old)) == old


def _leak_and_overrun(worker: str, share: float | None = None) -> LedgerReport:
    launch: dict[str, object] = {"metrale_worker": worker}
    if share is not None:
        launch["metrale_device_share"] = share
    settings = MetraleSettings(redzone=64).with_launch(**launch)
    with open_backend("fake", settings=settings) as gpu:
        leaked = gpu.alloc(4096)
        overrun = gpu.alloc(256)
        gpu.memset(overrun.ptr + overrun.nbytes + 3, 7, nbytes=2)
        gpu.scan_redzones()
        gpu.scan_redzones()  # found twice, kept once
        gpu.free(overrun)  # found a third time (its free checks its zones)
        del leaked
        gpu.sweep_unreleased()  # the end of the job: what is left is leaked
        report = gpu.ledger_report()
    return pickle.loads(pickle.dumps(report))  # as an engine carries it


def test_a_report_carries_each_violated_zone_once_named_by_its_backend() -> None:
    report = _leak_and_overrun("w1")
    assert [(v.nbytes, v.side, v.offset) for v in report.violations] == [(256, "trail", 3)]
    assert report.violations[0].origin == report.origin
    assert "on worker w1 (" in report.violations[0].describe()


def test_merged_reports_name_each_worker_its_leaks_and_its_violations() -> None:
    merged = merge_reports([_leak_and_overrun("w1"), _leak_and_overrun("w2", share=0.5)])
    text = merged.render()
    assert "2 red-zone violation(s)" in text.splitlines()[0]
    header = text.splitlines()[1].split()
    assert header[:2] == ["process", "worker"] and header[-1] == "violations"
    assert "(0.5 shared)" in text
    assert "red-zone violations across the job:" in text
    assert "  worker w2: red zone trail: a write past the end of allocation" in text
    assert [r.violation_count for r in merged.ranks] == [1, 1]
    site = f"{Path(__file__).name}:"
    assert any(site in s.site for s in merged.largest_leaks)
    as_json = json.loads(json.dumps(merged.to_json()))
    assert as_json["violations"][1]["origin"]["worker"] == "w2" and as_json["ranks"][0]["violation_count"] == 1


def test_merge_refuses_a_report_whose_violations_or_worker_are_not_what_they_claim() -> None:
    report = _leak_and_overrun("w1")
    with pytest.raises(InvalidArgumentError, match=r"its violations\[0\]"):
        merge_reports([LedgerReport(report.origin, report.live, report.swept, report.stats, ("x",))])  # type: ignore[arg-type]
    (found,) = report.violations
    elsewhere = dataclasses.replace(found, origin=dataclasses.replace(report.origin, pid=report.origin.pid + 1))
    with pytest.raises(InvalidArgumentError, match="origin None or the report's"):
        merge_reports([dataclasses.replace(report, violations=(elsewhere,))])
    with pytest.raises(InvalidArgumentError, match="ptr, nbytes"):
        merge_reports([dataclasses.replace(report, violations=(dataclasses.replace(found, ptr="0x10"),))])
    bad = dataclasses.replace(report, origin=dataclasses.replace(report.origin, device_share=2.0))
    with pytest.raises(InvalidArgumentError, match="device_share"):
        merge_reports([bad])


def test_a_violation_without_an_origin_is_named_by_its_report() -> None:
    report = _leak_and_overrun("w1")
    bare = RedZoneViolation(1, 2, 3, "x.py:1", "trail", 0)
    merged = merge_reports([LedgerReport(report.origin, (), (), {}, (bare,))])
    assert merged.violations[0].origin == report.origin


def test_a_snapshot_keeps_the_worker_and_the_share(tmp_path: Path) -> None:
    settings = MetraleSettings().with_launch(metrale_worker=WORKER, metrale_device_share=0.5)
    with open_backend("fake", settings=settings) as gpu:
        path = gpu.save_snapshot(tmp_path / "s.json")
        assert load_snapshot(path).origin == gpu.origin
    data = json.loads(path.read_text())
    data["origin"]["device_share"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(SnapshotError, match="device_share"):
        load_snapshot(path)


def test_out_of_memory_on_a_shared_device_says_what_others_hold() -> None:
    settings = MetraleSettings(fake_memory_bytes="1 MiB").with_launch(metrale_device_share=0.5)
    with open_backend("fake", settings=settings) as gpu, pytest.raises(OutOfMemoryError) as info:
        gpu.alloc(2 << 20)
    assert ("0 B in use outside this backend's allocations, most of it held by other processes on this device (it is "
            "shared: this process has 0.5 of it") in str(info.value)
    with open_backend("fake", settings=MetraleSettings(fake_memory_bytes="1 MiB")) as gpu, \
            pytest.raises(OutOfMemoryError) as whole:
        gpu.alloc(2 << 20)
    assert "other processes" not in str(whole.value)


# -- which ordinal Ray's assignment is, without Ray --------------------------------------------------------------


@pytest.mark.parametrize(("ids", "visible", "ordinal"), [
    (["0"], None, 0),  # the variable unset: an integer id is the ordinal
    (["1"], None, 1),
    (["1"], "1", 0),  # Ray set the variable to the assigned GPU: it is shown first
    (["1"], "1,0", 0),  # Ray left the node's variable alone (NOSET, ray#26493): its place in the list
    (["0"], "1,0", 1),
    ([" 1 "], " 0 , 1 ", 1),  # whitespace on either side
    (["1", "0"], "0,1", 1),  # several GPUs: the first
    ([U1], f"{U0},{U1}", 1),  # UUIDs (ray#43314), whole on both sides
    ([U1], f"{U0[:13]},{U1[:13]}", 1),  # a prefix in the variable
    ([U1[:13]], f"{U0},{U1}", 1),  # a prefix as the id
    ([U1], U1, 0),
], ids=["unset-0", "unset-1", "set-by-ray", "noset-1", "noset-0", "whitespace", "several", "uuid", "uuid-prefix-listed",
        "uuid-prefix-assigned", "uuid-set-by-ray"])
def test_assigned_ordinal(ids: list[str], visible: str | None, ordinal: int) -> None:
    got, why = assigned_ordinal(ids, visible)
    assert got == ordinal
    assert ids[0].strip() in why and (visible is None or visible in why)


def test_an_integer_id_and_its_string_are_one_gpu() -> None:
    """Ray gives ints where the node's variable is unset and strings where it is set (ray#28659): both name one
    device, handed over as Ray gives them."""
    for visible in (None, "1", "1,0", "0,1"):
        assert assigned_ordinal([1], visible) == assigned_ordinal(["1"], visible)
    assert assigned_ordinal([1, 0], "0,1")[0] == 1


@pytest.mark.parametrize(("ids", "visible"), [("1", "1"), ([1.0], "1"), ([None], None), ([1], 1)])
def test_assigned_ordinal_refuses_what_is_no_list_of_ids(ids: object, visible: object) -> None:
    with pytest.raises(InvalidArgumentError, match="assigned_ordinal"):
        assigned_ordinal(ids, visible)  # type: ignore[arg-type]


@pytest.mark.parametrize(("ids", "visible", "message"), [
    ([], "0", "no GPU is assigned"),
    (["2"], "0,1", "GPU '2' is assigned, but CUDA_VISIBLE_DEVICES='0,1' does not list it"),
    ([U1], f"{U0}", f"GPU '{U1}' is assigned, but CUDA_VISIBLE_DEVICES='{U0}' does not list it"),
    (["1"], "1,1", "CUDA_VISIBLE_DEVICES='1,1' lists it twice"),
    (["1"], "", "CUDA_VISIBLE_DEVICES='' does not list it"),
    ([U1], None, f"GPU '{U1}' is assigned, but CUDA_VISIBLE_DEVICES is unset"),
], ids=["none", "not-listed", "uuid-not-listed", "listed-twice", "empty", "uuid-unset"])
def test_an_assignment_no_device_shows_is_a_config_error_naming_both(ids: list[str], visible: str | None,
                                                                      message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        assigned_ordinal(ids, visible)
