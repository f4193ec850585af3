"""Several devices in a process, peer copies, where a rank's device comes from, origins, and merged reports."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from metrale_core import (
    BackendUnavailableError,
    ConfigError,
    DriverError,
    GpuBackend,
    InvalidArgumentError,
    InvalidBufferError,
    LedgerReport,
    MetraleSettings,
    Origin,
    available_backends,
    device_count,
    merge_reports,
    open_backend,
    open_for_rank,
    placement,
)
from metrale_core._reports.merge import merge_snapshots
from metrale_core._reports.timeline import load_snapshot
from tests._support import SETTINGS, read_bytes

#: Under pytest-xdist (``dev.py test``, ``--dist loadgroup``) the tests that start clusters of processes (torchrun,
#: Dask, Ray) run on one worker, one after another: never two clusters at once on a 2-core machine.
pytestmark = pytest.mark.xdist_group("clusters")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "distributed" / "ranks.py"
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests set the launcher's variables themselves (a CI runner might have some)."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def two() -> Iterator[tuple[GpuBackend, GpuBackend]]:
    settings = SETTINGS.updated(fake_device_count=2)
    with open_backend("fake", settings=settings) as a, open_backend("fake", ordinal=1, settings=settings) as b:
        yield a, b


# -- several devices ---------------------------------------------------------------------------------


def test_the_fake_has_as_many_devices_as_its_setting_says() -> None:
    assert device_count("fake", settings=SETTINGS) == 1
    with pytest.raises(BackendUnavailableError, match=r"fake device 1 does not exist.*ordinals 0\.\.0") as raised:
        open_backend("fake", ordinal=1, settings=SETTINGS)
    assert raised.value.name == "CUDA_ERROR_INVALID_DEVICE"
    three = SETTINGS.updated(fake_device_count=3)
    assert device_count("fake", settings=three) == 3
    with open_backend("fake", ordinal=2, settings=three) as gpu:
        assert gpu.ordinal == 2 and "device 2" in gpu.device_name


def test_each_device_has_its_own_addresses_ledger_and_origin(two: tuple[GpuBackend, GpuBackend]) -> None:
    a, b = two
    x, y = a.alloc(256), b.alloc(256)
    assert x.ptr != y.ptr
    assert a.origin.ordinal == 0 and b.origin.ordinal == 1
    assert a.origin.device_uuid != b.origin.device_uuid and a.origin.device_uuid.startswith("FAKE-")
    assert [r.index for r in a.ledger_report().live] == [x.index]
    with pytest.raises(InvalidBufferError, match="belongs to another backend"):
        b.memset(x, 1)  # a buffer of one device used on another
    with pytest.raises(InvalidBufferError):
        b.free(x)
    a.free(x)
    b.free(y)


def test_metrale_info_lists_every_device() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    env.update(METRALE_BACKEND="fake", METRALE_FAKE_DEVICE_COUNT="2")
    out = subprocess.run([sys.executable, "-m", "metrale_core", "info", "--json"], capture_output=True, text=True,
                         env=env, check=False, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [d["ordinal"] for d in doc["devices"]] == [0, 1]
    assert doc["devices"][1]["device"].startswith("metrale fake device 1")
    assert doc["origin"]["ordinal"] == 0


# -- peer copies ---------------------------------------------------------------------------------


def test_copy_peer_copies_between_two_fake_devices(two: tuple[GpuBackend, GpuBackend]) -> None:
    a, b = two
    src, dst = a.alloc(64), b.alloc(64)
    a.copy_to_device(src, bytes(range(64)))
    a.synchronize()
    b.memset(dst, 0xEE)
    b.copy_peer(dst, src)
    b.synchronize()
    assert read_bytes(b, dst, 64) == bytes(range(64))
    b.copy_peer(dst, src, 8, dst_offset=56, src_offset=4)
    b.synchronize()
    assert read_bytes(b, dst, 64)[56:] == bytes(range(4, 12))
    b.enable_peer_access(a)
    b.enable_peer_access(a)  # twice: nothing more
    a.free(src)
    b.free(dst)


def test_a_refused_copy_peer_changes_nothing(two: tuple[GpuBackend, GpuBackend]) -> None:
    a, b = two
    src, dst = a.alloc(64), b.alloc(32)
    a.memset(src, 7)
    b.memset(dst, 1)
    a.synchronize()
    b.synchronize()
    records = (a.ledger_report().live, b.ledger_report().live)
    for call, error in (
        (lambda: b.copy_peer(dst, src), InvalidBufferError),  # 64 bytes into 32
        (lambda: b.copy_peer(dst, src, 8, dst_offset=30), InvalidBufferError),
        (lambda: b.copy_peer(src, dst), InvalidBufferError),  # the destination is not b's
        (lambda: b.copy_peer(dst, src.ptr), InvalidArgumentError),  # a bare pointer names no owner
        (lambda: b.copy_peer(dst, src, -1), InvalidArgumentError),
        (lambda: b.copy_peer(dst, src, 8, stream=a.default_stream), InvalidArgumentError),
        (lambda: b.enable_peer_access("a"), InvalidArgumentError),  # type: ignore[arg-type]
    ):
        with pytest.raises(error):
            call()
    b.synchronize()
    assert read_bytes(b, dst, 32) == b"\x01" * 32
    assert (a.ledger_report().live, b.ledger_report().live) == records
    a.free(src)
    with pytest.raises(InvalidBufferError, match="not live"):
        b.copy_peer(dst, src, 8)  # a freed source
    b.free(dst)


def test_copy_peer_from_a_closed_backend_is_refused() -> None:
    settings = SETTINGS.updated(fake_device_count=2)
    with open_backend("fake", ordinal=1, settings=settings) as b:
        dst = b.alloc(16)
        a = open_backend("fake", settings=settings)
        src = a.alloc(16)
        a.close()
        with pytest.raises(InvalidBufferError, match="closed"):
            b.copy_peer(dst, src)
        with pytest.raises(Exception, match="closed"):
            b.enable_peer_access(a)
        b.free(dst)


def test_copy_peer_between_plugins_is_refused(fake: GpuBackend) -> None:
    pytest.importorskip("metrale_tracing")
    with open_backend("tracing", settings=SETTINGS) as other:
        src, dst = other.alloc(16), fake.alloc(16)
        with pytest.raises(InvalidArgumentError, match="copy through the host"):
            fake.copy_peer(dst, src)
        other.free(src)
        fake.free(dst)


def test_devices_that_cannot_reach_each_other_refuse_peer_access() -> None:
    settings = SETTINGS.updated(fake_device_count=2, fake_peer_access=False)
    with open_backend("fake", settings=settings) as a, open_backend("fake", ordinal=1, settings=settings) as b:
        with pytest.raises(DriverError, match="cannot access") as raised:
            b.enable_peer_access(a)
        assert raised.value.name == "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"
        src, dst = a.alloc(16), b.alloc(16)  # a copy still works: CUDA copies through the host
        a.memset(src, 3)
        a.synchronize()
        b.copy_peer(dst, src)
        b.synchronize()
        assert read_bytes(b, dst, 16) == b"\x03" * 16
        a.free(src)
        b.free(dst)


def test_a_captured_peer_copy_replays_and_is_refused_once_its_source_is_freed(
    two: tuple[GpuBackend, GpuBackend],
) -> None:
    a, b = two
    src, dst = a.alloc(64), b.alloc(64)
    a.memset(src, 9)
    a.synchronize()
    b.memset(dst, 0)
    b.synchronize()
    stream = b.create_stream()
    b.begin_capture(stream)
    b.copy_peer(dst, src, stream=stream)
    graph = b.end_capture(stream)
    assert read_bytes(b, dst, 64) == bytes(64), "work issued to a capturing stream ran"
    exe = graph.instantiate()
    exe.launch(stream)
    stream.synchronize()
    assert read_bytes(b, dst, 64) == b"\x09" * 64
    a.free(src)
    with pytest.raises(InvalidBufferError, match="another backend"):
        exe.launch(stream)
    exe.close()
    graph.close()
    stream.close()
    b.free(dst)


# -- where a rank's device comes from ------------------------------------------------------------------


def test_placement_without_a_launcher_is_the_first_device() -> None:
    where = placement("fake", settings=MetraleSettings(fake_device_count=2))
    assert (where.ordinal, where.device_count, where.rank, where.shared) == (0, 2, None, False)
    assert "no launcher" in where.source


@pytest.mark.parametrize(("local", "count", "ordinal", "shared"), [(0, 2, 0, False), (1, 2, 1, False),
                                                                   (1, 1, 0, True), (3, 2, 1, True)])
def test_placement_follows_local_rank(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, local: int, count: int, ordinal: int,
    shared: bool,
) -> None:
    monkeypatch.setenv("RANK", str(10 + local))
    monkeypatch.setenv("LOCAL_RANK", str(local))
    monkeypatch.setenv("WORLD_SIZE", "16")
    with caplog.at_level(logging.WARNING, logger="metrale"):
        where = placement("fake", settings=MetraleSettings(fake_device_count=count))
    assert (where.ordinal, where.rank, where.local_rank, where.world_size, where.shared) == (
        ordinal, 10 + local, local, 16, shared
    )
    assert f"LOCAL_RANK={local}" in where.source
    assert bool([r for r in caplog.records if "share" in r.getMessage()]) == shared
    with open_for_rank("fake", settings=MetraleSettings(fake_device_count=count)) as gpu:
        assert gpu.ordinal == ordinal
        assert (gpu.origin.rank, gpu.origin.world_size) == (10 + local, 16)
        assert gpu.origin.describe().startswith(f"rank {10 + local} of 16 (")


def test_a_malformed_launcher_variable_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(ConfigError, match="LOCAL_RANK='first'"):
        placement("fake", settings=MetraleSettings())


def test_placement_asks_ray_only_where_the_program_imported_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: True  # type: ignore[attr-defined]
    ray.get_gpu_ids = lambda: [3]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # as Ray sets it for the GPU it assigned
    where = placement("fake", settings=MetraleSettings(fake_device_count=4))
    assert where.ordinal == 0 and "Ray assigned GPU 3, entry 0 of CUDA_VISIBLE_DEVICES=3" in where.source


# -- origins and merged reports ------------------------------------------------------------------------


def test_records_violations_and_snapshots_name_their_origin(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    settings = MetraleSettings(redzone=64, memory_history=100)
    with open_backend("fake", settings=settings) as gpu:
        buf = gpu.alloc(64)
        assert gpu.ledger_probe().records()[0].origin == gpu.origin
        gpu.memset(buf.ptr + 64, 0, nbytes=1)  # past the end: into the red zone
        violations = gpu.scan_redzones()
        assert violations and violations[0].origin == gpu.origin
        assert "on rank 1 of 2" in violations[0].describe()
        path = gpu.save_snapshot(tmp_path / "s.json")
        snapshot = load_snapshot(path)
        assert snapshot.origin == gpu.origin
        assert all(a.origin == gpu.origin for a in snapshot.live)
        gpu.free(buf)


def _report(rank: int, live: list[tuple[str, int]], swept: list[tuple[str, int]], peak: int) -> LedgerReport:
    from metrale_core import AllocRecord

    origin = Origin("node", 100 + rank, rank, 2, "fake", rank, f"FAKE-{rank}")
    records = [AllocRecord(0x1000 * i, n, "device", i, site, origin) for i, (site, n) in enumerate(live)]
    leaks = [AllocRecord(0x9000 * i, n, "device", 50 + i, site, origin) for i, (site, n) in enumerate(swept)]
    return LedgerReport(origin, tuple(records), tuple(leaks), {"peak_total_bytes": peak})


def test_merge_reports_sums_sites_across_ranks_and_keeps_each_ranks_line() -> None:
    one = _report(1, [("a.py:1", 100), ("b.py:2", 10)], [("leak.py:9", 4096)], 500)
    zero = _report(0, [("a.py:1", 50)], [("leak.py:9", 8192), ("other.py:3", 1)], 300)
    merged = merge_reports([one, zero])
    assert [r.origin.rank for r in merged.ranks] == [0, 1]
    assert [(r.live_bytes, r.leaked_bytes, r.peak_total_bytes) for r in merged.ranks] == [(50, 8193, 300),
                                                                                         (110, 4096, 500)]
    top = merged.largest_live[0]
    assert (top.site, top.nbytes, top.count, top.ranks) == ("a.py:1", 150, 2, ("rank 0", "rank 1"))
    assert (merged.largest_leaks[0].site, merged.largest_leaks[0].nbytes) == ("leak.py:9", 12288)
    assert merged.leaked_bytes == 12289 and merged.live_bytes == 160
    text = merged.render()
    assert "2 process(es)" in text and "rank 0" in text and "rank 1" in text and "leak.py:9" in text
    assert json.loads(json.dumps(merged.to_json()))["ranks"][1]["origin"]["rank"] == 1
    assert merge_reports([one], top=1).largest_live == (merged.largest_live[0].__class__("a.py:1", 100, 1,
                                                                                        ("rank 1",)),)


def test_ledger_reports_survive_pickling(fake: GpuBackend) -> None:
    """What torch.distributed.gather_object and Ray's object store do to them."""
    buf = fake.alloc(32)
    report = fake.ledger_report()
    again = pickle.loads(pickle.dumps(report))
    assert again == report and again.origin == fake.origin and again.live[0].origin == fake.origin
    fake.free(buf)


@pytest.mark.parametrize("bad", [[object()], ["report"]])
def test_merge_reports_refuses_what_is_no_report(bad: list[object]) -> None:
    with pytest.raises(InvalidArgumentError, match="LedgerReport"):
        merge_reports(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="top"):
        merge_reports([], top=0)


def _bad_reports() -> list[object]:
    from metrale_core import AllocRecord, MemorySnapshot

    good = _report(0, [("a.py:1", 100)], [], 1)
    rec = good.live[0]
    return [
        None, 5,
        [LedgerReport(good.origin, None, ())],  # type: ignore[arg-type]
        [LedgerReport(good.origin, (1,), ())],  # type: ignore[arg-type]
        [LedgerReport(good.origin, (), ("leak",))],  # type: ignore[arg-type]
        [LedgerReport(good.origin, (AllocRecord(rec.ptr, "4", "device", 1, "a.py:1"),), ())],  # type: ignore[arg-type]
        [LedgerReport(good.origin, (AllocRecord(rec.ptr, 4, "device", 1, ["a.py:1"]),), ())],  # type: ignore[arg-type]
        [LedgerReport(good.origin, (rec,), (), None)],  # type: ignore[arg-type]
        [LedgerReport(good.origin, (rec,), (), [("peak_total_bytes", 1)])],  # type: ignore[arg-type]
        [good, MemorySnapshot("fake", "d", 0, 0, "now", 0, 0, (1,), ())],  # type: ignore[arg-type]
        [good, MemorySnapshot("fake", "d", 0, 0, "now", 0, 0, (), None)],  # type: ignore[arg-type]
        [good, MemorySnapshot("fake", "d", 0, 0, "now", 0, 0, (), (), stats=None)],  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize("bad", _bad_reports(), ids=[
    "none", "int", "live-none", "live-int", "swept-str", "nbytes-str", "site-list", "stats-none", "stats-list",
    "snapshot-events", "snapshot-live", "snapshot-stats",
])
def test_merge_reports_refuses_a_report_that_is_not_what_it_claims(bad: object) -> None:
    """The docstring: InvalidArgumentError, never a raw TypeError or AttributeError."""
    with pytest.raises(InvalidArgumentError, match="merge_reports: "):
        merge_reports(bad)  # type: ignore[arg-type]


def test_one_report_merged_twice_counts_once(tmp_path: Path) -> None:
    """distributed.md: a line per process. One report given twice (the same object, or one snapshot file named
    twice) counts once; equal reports of two objects both count (two backends on one device have equal origins)."""
    one = _report(1, [("a.py:1", 100)], [("leak.py:9", 4096)], 500)
    zero = _report(0, [("a.py:1", 50)], [], 300)
    once = merge_reports([one, zero])
    twice = merge_reports([one, zero, one])
    assert twice == once and (twice.live_bytes, twice.leaked_bytes, len(twice.ranks)) == (150, 4096, 2)
    later = LedgerReport(one.origin, one.live[:0], one.swept, one.stats)  # one backend, another moment
    assert len(merge_reports([one, later]).ranks) == 2
    assert len(merge_reports(_report(1, [], [], 0) for _ in range(3)).ranks) == 3  # no id reused
    with open_backend("fake", settings=SETTINGS.updated(memory_history=10)) as gpu:
        buf = gpu.alloc(1024)
        path = gpu.save_snapshot(tmp_path / "rank0.json")
        gpu.free(buf)
    snap = load_snapshot(path)
    for snapshots in ([snap, snap], [snap, load_snapshot(path)], [snap, load_snapshot(tmp_path / "." / "rank0.json")]):
        merged = merge_reports(snapshots)
        assert (len(merged.ranks), merged.live_bytes) == (1, 1024)
        assert [a.nbytes for a in merge_snapshots(snapshots).live] == [1024]


def test_two_backends_on_one_device_are_two_lines_told_apart_by_their_instance() -> None:
    """Issue 37, item 8: two backends on one device of one process had equal origins, so their equal reports
    could not be told from one report given twice. Their origins now differ in ``instance``, and the merged
    report names each."""
    with open_backend("fake", settings=SETTINGS) as a, open_backend("fake", settings=SETTINGS) as b:
        for gpu in (a, b):
            gpu.free(gpu.alloc(1 << 20))
        first, second = a.ledger_report(), b.ledger_report()
        early = a.ledger_report()
        a.free(a.alloc(64))
        late = a.ledger_report()
    assert first.origin != second.origin and second.origin.instance == first.origin.instance + 1 > 1
    assert dataclasses.replace(first.origin, instance=0) == dataclasses.replace(second.origin, instance=0)
    assert "#" not in second.origin.describe(), "describe() knows nothing of the process's other backends"
    merged = merge_reports([first, second])
    assert [r.origin.instance for r in merged.ranks] == [first.origin.instance, second.origin.instance]
    text = merged.render()
    assert f"fake:0 #{first.origin.instance} " in text and f"fake:0 #{second.origin.instance} " in text, text
    with pytest.raises(InvalidArgumentError, match=r"item 0 and item 1 are two reports of one backend .*merge one"):
        merge_reports([early, late])
    assert len(merge_reports([early, early]).ranks) == 1, "one report given twice still counts once"


def test_two_snapshots_of_one_backend_are_refused_by_both_merges(tmp_path: Path) -> None:
    """merge_reports and merge_snapshots (metrale report, with or without --trace) agree: two moments of one
    backend are refused, naming both files (a fresh review found merge_snapshots counting a record twice)."""
    with open_backend("fake", settings=SETTINGS.updated(memory_history=10)) as gpu:
        a = gpu.alloc(1024)
        first = gpu.save_snapshot(tmp_path / "t1.json")
        b = gpu.alloc(2048)
        second = gpu.save_snapshot(tmp_path / "t2.json")
        gpu.free(a)
        gpu.free(b)
    snaps = [load_snapshot(first), load_snapshot(second)]
    for merge in (merge_reports, merge_snapshots):
        with pytest.raises(InvalidArgumentError, match=r"item 0 \(.*t1\.json\) and item 1 \(.*t2\.json\) are two"):
            merge(snaps)


def test_an_unknown_instance_is_no_label_and_an_old_pickle_loads() -> None:
    one = _report(1, [], [], 0)
    zero = LedgerReport(dataclasses.replace(one.origin, instance=0), (), (), {})
    other = LedgerReport(dataclasses.replace(one.origin, instance=0, ordinal=1), (), (), {})
    assert "#" not in merge_reports([zero, other]).render()
    old = Origin.__new__(Origin)
    old.__setstate__(["h", 1, None, None, "fake", 0, "FAKE-1"])  # what a pickle of an Origin before it held
    assert old.instance == 0 and pickle.loads(pickle.dumps(old)) == old
    assert len(merge_reports([LedgerReport(old, (), (), {})]).ranks) == 1


def test_an_origin_s_instance_survives_a_snapshot(tmp_path: Path) -> None:
    with open_backend("fake", settings=SETTINGS.updated(memory_history=10)) as gpu:
        path = gpu.save_snapshot(tmp_path / "one.json")
        instance = gpu.ledger_report().origin.instance
    loaded = load_snapshot(path).origin
    assert loaded is not None and loaded.instance == instance > 0
    data = json.loads(path.read_text())
    del data["origin"]["instance"]  # a snapshot written before origins had it
    path.write_text(json.dumps(data))
    loaded = load_snapshot(path).origin
    assert loaded is not None and loaded.instance == 0


def test_an_origin_s_world_size_that_is_no_integer_is_refused() -> None:
    report = _report(1, [], [], 0)
    bad = LedgerReport(dataclasses.replace(report.origin, world_size=[2]), (), (), {})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="world_size"):
        merge_reports([bad])


def test_metrale_report_merges_the_snapshots_of_several_ranks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    paths = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        with open_backend("fake", settings=MetraleSettings(memory_history=100)) as gpu:
            keep = gpu.alloc(1024 * (rank + 1))
            gone = gpu.alloc(64)
            gpu.free(gone)
            paths.append(gpu.save_snapshot(tmp_path / f"rank{rank}.json"))
            gpu.free(keep)
    snapshots = [load_snapshot(p) for p in paths]
    merged = merge_snapshots(snapshots)
    sites = {a.site.split(":")[0] for a in merged.live}
    assert sites == {"rank 0", "rank 1"}
    assert len({a.index for a in merged.live}) == 2
    assert len(merged.events) == sum(len(s.events) for s in snapshots)
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    out = subprocess.run([sys.executable, "-m", "metrale_core", "report", *map(str, paths)], capture_output=True,
                         text=True, env=env, check=False, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "merged ledger report: 2 process(es)" in out.stdout
    assert "rank 0: " in out.stdout and "rank 1: " in out.stdout
    trace = tmp_path / "t.json"
    out = subprocess.run([sys.executable, "-m", "metrale_core", "report", *map(str, paths), "--trace", str(trace)],
                         capture_output=True, text=True, env=env, check=False, timeout=120)
    assert out.returncode == 0 and trace.exists(), out.stderr


# -- torchrun ------------------------------------------------------------------------------------


def _torchrun(env_extra: dict[str, str], nproc: int = 2) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("torch.distributed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_") and k not in LAUNCH_VARIABLES}
    env.update(env_extra)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(EXAMPLE)]
    return subprocess.run(command, capture_output=True, text=True, env=env, check=False, timeout=300, cwd=ROOT)


def _check_merged(out: subprocess.CompletedProcess[str], ordinals: tuple[int, int]) -> None:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "merged ledger report: 2 process(es)" in text, text
    for rank, ordinal in enumerate(ordinals):
        assert f"rank {rank}: ordinal {ordinal}" in text, text
    lines = text.splitlines()
    for rank in (0, 1):  # each rank's line: its planted leak, 4 KiB for rank 0 and 8 KiB for rank 1
        assert any(line.startswith(f"rank {rank} ") and f"{4 * (rank + 1)}.0 KiB (1)" in line for line in lines), text
    assert "ranks.py" in text and "(rank 0, rank 1)" in text, text


def test_the_torchrun_example_merges_both_ranks_on_the_fake() -> None:
    out = _torchrun({"METRALE_BACKEND": "fake", "METRALE_FAKE_DEVICE_COUNT": "2"})
    _check_merged(out, (0, 1))


def _cuda_here() -> bool:
    info = available_backends(SETTINGS).get("cuda")
    return info is not None and info.available


def test_two_ranks_share_the_one_gpu_under_torchrun() -> None:
    if not _cuda_here():
        pytest.skip("no CUDA device answers here")
    if device_count("cuda", settings=SETTINGS) != 1:
        pytest.skip("the machine has more than one GPU: this test is for ranks sharing one")
    out = _torchrun({"METRALE_BACKEND": "cuda"})
    _check_merged(out, (0, 0))
    assert "GPU-" in out.stdout


def _torchrun_nccl(extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("torch.distributed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_") and k not in LAUNCH_VARIABLES}
    env.update(extra)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(EXAMPLE),
               "--nccl"]
    return subprocess.run(command, capture_output=True, text=True, env=env, check=False, timeout=300, cwd=ROOT)


def test_two_ranks_on_two_gpus_all_reduce_a_metrale_buffer_with_nccl() -> None:
    if not _cuda_here() or device_count("cuda", settings=SETTINGS) < 2:
        pytest.skip("needs two GPUs: NCCL refuses two ranks on one device")
    out = _torchrun_nccl({"METRALE_BACKEND": "cuda"})
    _check_merged(out, (0, 1))
    assert out.stdout.count("NCCL all-reduce of a metrale buffer through DLPack: 3 (want 3)") == 2, out.stdout


def test_two_backends_on_two_gpus_copy_both_ways() -> None:
    if not _cuda_here() or device_count("cuda", settings=SETTINGS) < 2:
        pytest.skip("needs two GPUs")
    with open_backend("cuda", settings=SETTINGS) as a, open_backend("cuda", ordinal=1, settings=SETTINGS) as b:
        assert a.origin.device_uuid != b.origin.device_uuid
        x, y = a.alloc(1 << 20), b.alloc(1 << 20)
        with pytest.raises(InvalidBufferError):
            b.memset(x, 0)
        for access in (False, True):
            if access:
                try:
                    a.enable_peer_access(b)
                    b.enable_peer_access(a)
                except DriverError as exc:
                    assert exc.name == "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"
            a.copy_to_device(x, bytes(range(256)) * 4096)
            a.synchronize()
            b.copy_peer(y, x)
            b.synchronize()
            assert read_bytes(b, y, 1 << 20) == bytes(range(256)) * 4096
            b.memset(y, 7)
            b.synchronize()
            stream = a.create_stream()
            a.begin_capture(stream)
            a.copy_peer(x, y, stream=stream)
            graph = a.end_capture(stream)
            exe = graph.instantiate()
            exe.launch(stream)
            stream.synchronize()
            assert read_bytes(a, x, 1 << 20) == b"\x07" * (1 << 20)
            exe.close()
            graph.close()
            stream.close()
        a.free(x)
        b.free(y)


def test_copy_peer_within_one_gpu_and_a_missing_ordinal() -> None:
    if not _cuda_here():
        pytest.skip("no CUDA device answers here")
    count = device_count("cuda", settings=SETTINGS)
    with pytest.raises(BackendUnavailableError, match=f"CUDA device {count} does not exist") as raised:
        open_backend("cuda", ordinal=count, settings=SETTINGS)
    assert raised.value.name == "CUDA_ERROR_INVALID_DEVICE"
    with open_backend("cuda", settings=SETTINGS) as a, open_backend("cuda", settings=SETTINGS) as b:
        assert a.origin.device_uuid.startswith("GPU-") and a.origin.device_uuid == b.origin.device_uuid
        b.enable_peer_access(a)  # the same device: nothing to enable
        src, dst = a.alloc(1 << 20), b.alloc(1 << 20)
        a.copy_to_device(src, bytes(range(256)) * 4096)
        a.synchronize()
        b.copy_peer(dst, src)
        b.synchronize()
        assert read_bytes(b, dst, 1 << 20) == bytes(range(256)) * 4096
        stream = b.create_stream()
        b.memset(dst, 0)
        b.synchronize()
        b.begin_capture(stream)
        b.copy_peer(dst, src, 4096, src_offset=4096, stream=stream)
        graph = b.end_capture(stream)
        exe = graph.instantiate()
        exe.launch(stream)
        stream.synchronize()
        assert read_bytes(b, dst, 4096) == bytes(range(256)) * 16
        a.free(src)
        with pytest.raises(InvalidBufferError):
            exe.launch(stream)
        exe.close()
        graph.close()
        stream.close()
        b.free(dst)


def test_torchrun_is_on_the_path_or_the_module_runs() -> None:
    """The example's docstring says `torchrun`; the tests run `python -m torch.distributed.run`, the same."""
    pytest.importorskip("torch.distributed")
    assert shutil.which("torchrun") is not None or (Path(sys.executable).parent / "torchrun").exists()


# -- from a review: nested graphs, close races, the fake's queue, launcher variables, labels --------------


def test_a_graph_launched_inside_a_capture_carries_its_peer_check(two: tuple[GpuBackend, GpuBackend]) -> None:
    a, b = two
    src, dst = a.alloc(64), b.alloc(64)
    a.memset(src, 0x11)
    a.synchronize()
    stream = b.create_stream()
    b.begin_capture(stream)
    b.copy_peer(dst, src, stream=stream)
    inner = b.end_capture(stream).instantiate()
    b.begin_capture(stream)
    inner.launch(stream)
    outer_graph = b.end_capture(stream)
    outer = outer_graph.instantiate()
    a.free(src)
    for exe in (inner, outer):
        with pytest.raises(InvalidBufferError, match="another backend"):
            exe.launch(stream)
    outer.close()
    outer_graph.close()
    inner.close()
    stream.close()
    b.free(dst)


def test_a_source_backend_closing_during_a_copy_waits_for_it(two: tuple[GpuBackend, GpuBackend]) -> None:
    """close() of the source waits for a copy that is being issued; a copy after it is an InvalidBufferError."""
    import threading

    a, b = two
    src, dst = a.alloc(1 << 16), b.alloc(1 << 16)
    a.memset(src, 0x22)
    a.synchronize()
    started, errors = threading.Event(), []

    def copies() -> None:
        started.set()
        for _ in range(2000):
            try:
                b.copy_peer(dst, src)
            except InvalidBufferError:
                return
            except Exception as exc:  # anything else is the bug
                errors.append(exc)
                return

    thread = threading.Thread(target=copies)
    thread.start()
    started.wait()
    a.close()
    thread.join()
    assert not errors, errors
    with pytest.raises(InvalidBufferError, match="closed"):
        b.copy_peer(dst, src)
    b.free(dst)


def test_the_fakes_queued_peer_copy_never_reads_a_freed_source() -> None:
    settings = SETTINGS.updated(fake_device_count=2, fake_defer=True)
    with open_backend("fake", settings=settings) as a, open_backend("fake", ordinal=1, settings=settings) as b:
        src, dst = a.alloc(64), b.alloc(64)
        a.memset(src, 0x33)
        a.synchronize()
        b.copy_peer(dst, src)  # queued on b's stream
        a.free(src)
        again = a.alloc(64)  # the same address comes back
        a.memset(again, 0x99)
        a.synchronize()
        b.synchronize()
        assert read_bytes(b, dst, 64) == b"\x33" * 64, "the copy took the bytes it was issued with"
        a.free(again)
        b.free(dst)


def test_a_closed_source_device_holds_no_memory_through_a_graph() -> None:
    import gc
    import weakref

    settings = SETTINGS.updated(fake_device_count=2)
    with open_backend("fake", ordinal=1, settings=settings) as b:
        a = open_backend("fake", settings=settings)
        src, dst = a.alloc(1 << 20), b.alloc(1 << 20)
        view = a.raw.export_memory(src.ptr, src.nbytes).keepalive  # a numpy view of the fake's memory
        memory = weakref.ref(view.base if view.base is not None else view)
        del view
        stream = b.create_stream()
        b.begin_capture(stream)
        b.copy_peer(dst, src, stream=stream)
        graph = b.end_capture(stream)
        exe = graph.instantiate()
        a.close()
        gc.collect()
        assert memory() is None, "the graph keeps the closed source device's memory"
        with pytest.raises(InvalidBufferError):
            exe.launch(stream)
        exe.close()
        graph.close()
        stream.close()
        b.free(dst)


def test_a_bad_launcher_variable_does_not_stop_a_plain_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "-1")
    with open_backend("fake", settings=MetraleSettings()) as gpu:
        assert gpu.origin.rank is None
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        placement("fake", settings=MetraleSettings())


def test_two_backends_on_one_fake_ordinal_report_one_uuid() -> None:
    with open_backend("fake", settings=SETTINGS) as a, open_backend("fake", settings=SETTINGS) as b:
        assert a.origin.device_uuid == b.origin.device_uuid
    with open_backend("fake", ordinal=1, settings=SETTINGS.updated(fake_device_count=2)) as c:
        assert c.origin.device_uuid != a.origin.device_uuid


def test_several_devices_of_one_process_merge_as_distinct_lines(two: tuple[GpuBackend, GpuBackend]) -> None:
    a, b = two
    x, y = a.alloc(2048), b.alloc(2048)
    merged = merge_reports([a.ledger_report(), b.ledger_report()])
    assert len(merged.ranks) == 2
    (site,) = merged.largest_live
    assert site.count == 2 and len(set(site.ranks)) == 2 and all(":" in r for r in site.ranks), site.ranks
    with pytest.raises(InvalidArgumentError, match="LedgerReport"):
        merge_reports([LedgerReport(None, (), ())])  # type: ignore[arg-type]
    a.free(x)
    b.free(y)
