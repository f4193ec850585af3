"""``metrale report``: reading memory snapshots, replaying them, the trace, the plot and the command."""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from metrale_core import (
    AllocRecord,
    ConfigError,
    InvalidArgumentError,
    MetraleError,
    MetraleSettings,
    SnapshotError,
    open_backend,
)
from metrale_core._commands.cli import main
from metrale_core._errors import MissingPackageError
from metrale_core._memory import snapshot as _snapshot
from metrale_core._reports import timeline as _report
from metrale_core._reports.timeline import (
    OTHER_SITES,
    MemorySnapshot,
    SnapshotEvent,
    chrome_trace,
    initial_live,
    live_by_site,
    load_snapshot,
    plot_png,
    site_labels,
)
from tests._support import MIB

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import report_example  # the snapshot header the docs' example writes


def alloc(index: int, nbytes: int, site: str, kind: str = "device") -> dict[str, Any]:
    return {"ptr": 0x7F00_0000_0000 + index * 0x100_0000, "nbytes": nbytes, "kind": kind, "index": index, "site": site}


def event(t: float, op: str, record: dict[str, Any]) -> dict[str, Any]:
    return {"t": t, "op": op, **record}


def document(events: list[dict[str, Any]], live: list[dict[str, Any]], **header: Any) -> dict[str, Any]:
    """A snapshot of the fake (the docs' example's header), ``header`` adding or replacing fields."""
    header.setdefault("stats", {"alloc_count": 3, "current_bytes": {"device": 0}})
    return report_example.snapshot(events, live, **header)


def write(tmp_path: Path, doc: Any, name: str = "snap.json") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


# A: allocated before the log begins and still live; B: allocated before the log begins (its alloc was
# dropped), freed in the log; C: allocated and freed in the log; D: allocated in the log, still live;
# E: allocated in the log, taken off by the teardown sweep.
A = alloc(1, 4 * MIB, "/srv/app/model.py:10")
B = alloc(2, 2 * MIB, "/srv/app/cache.py:20")
C = alloc(5, 1 * MIB, "/srv/app/step.py:30")
D = alloc(6, 8 * MIB, "/srv/app/cache.py:21")
E = alloc(7, 3 * MIB, "/srv/app/step.py:31")
EVENTS = [
    event(0.010, "alloc", C),
    event(0.020, "free", B),
    event(0.030, "alloc", D),
    event(0.040, "free", C),
    event(0.050, "alloc", E),
    event(0.060, "sweep", E),
]
LIVE = [A, D]


@pytest.fixture
def snapshot_path(tmp_path: Path) -> Path:
    return write(tmp_path, document(EVENTS, LIVE, dropped=5, elapsed=0.075))


# -- reading ------------------------------------------------------------------------------------------------


def test_load_reads_every_field(snapshot_path: Path) -> None:
    snap = load_snapshot(snapshot_path)
    assert (snap.backend, snap.ordinal, snap.total, snap.dropped, snap.history_limit) == ("fake", 0, 16 << 30, 5, 10000)
    assert snap.device == "metrale fake device 0 (16.0 GiB, discrete)"
    assert snap.created == "2026-12-02T15:10:00+00:00" and snap.elapsed == 0.075
    assert [(e.t, e.op, e.allocation.index) for e in snap.events] == [
        (0.010, "alloc", 5), (0.020, "free", 2), (0.030, "alloc", 6), (0.040, "free", 5), (0.050, "alloc", 7),
        (0.060, "sweep", 7),
    ]
    assert snap.live == (AllocRecord(**A), AllocRecord(**D))
    assert snap.stats["alloc_count"] == 3
    assert snap.source == snapshot_path


def test_elapsed_is_optional(tmp_path: Path) -> None:
    snap = load_snapshot(write(tmp_path, document(EVENTS, LIVE)))
    assert snap.elapsed is None
    assert live_by_site(snap).end is None


# -- the replay ---------------------------------------------------------------------------------------------


def test_initial_live_set_replays_backwards_from_the_end(snapshot_path: Path) -> None:
    # live (A, D) + freed without their alloc in the log (B) - allocated in the log (D)
    assert [a.index for a in initial_live(load_snapshot(snapshot_path))] == [1, 2]


def test_timeline_is_a_step_after_each_event(snapshot_path: Path) -> None:
    timeline = live_by_site(load_snapshot(snapshot_path))
    assert timeline.times == (0.010, 0.010, 0.020, 0.030, 0.040, 0.050, 0.060)
    assert [t // MIB for t in timeline.totals] == [6, 7, 5, 13, 12, 15, 12]
    by_label = dict(zip(timeline.labels, timeline.series, strict=True))
    assert [v // MIB for v in by_label["cache.py:21"]] == [0, 0, 0, 8, 8, 8, 8]
    assert [v // MIB for v in by_label["model.py:10"]] == [4] * 7
    assert [v // MIB for v in by_label["cache.py:20"]] == [2, 2, 0, 0, 0, 0, 0]
    assert [v // MIB for v in by_label["step.py:30"]] == [0, 1, 1, 1, 0, 0, 0]
    assert [v // MIB for v in by_label["step.py:31"]] == [0, 0, 0, 0, 0, 3, 0]
    # the last step equals the "live" list, step by step the sum of the series is the total
    assert timeline.totals[-1] == A["nbytes"] + D["nbytes"]
    for step, total in enumerate(timeline.totals):
        assert sum(series[step] for series in timeline.series) == total
    assert timeline.peak_step == 5 and timeline.totals[5] == 15 * MIB
    assert timeline.end == 0.075


def test_series_are_the_largest_sites_by_peak_then_other_sites(snapshot_path: Path) -> None:
    timeline = live_by_site(load_snapshot(snapshot_path), top=2)
    # peaks: cache.py:21 8 MiB, model.py:10 4 MiB, step.py:31 3 MiB, cache.py:20 2 MiB, step.py:30 1 MiB
    assert timeline.labels == ("cache.py:21", "model.py:10", OTHER_SITES)
    assert timeline.sites[0] == ("/srv/app/cache.py:21",)
    assert set(timeline.sites[2]) == {"/srv/app/step.py:31", "/srv/app/cache.py:20", "/srv/app/step.py:30"}
    assert [v // MIB for v in timeline.series[2]] == [2, 3, 1, 1, 0, 3, 0]
    assert timeline.peaks == (8 * MIB, 4 * MIB, 3 * MIB)
    # a site whose peak is large but ends at zero still ranks by its peak
    assert live_by_site(load_snapshot(snapshot_path), top=3).labels[2] == "step.py:31"


def test_no_other_sites_series_when_top_covers_them_all(snapshot_path: Path) -> None:
    assert OTHER_SITES not in live_by_site(load_snapshot(snapshot_path), top=5).labels


def test_everything_freed_whose_alloc_was_dropped(tmp_path: Path) -> None:
    # the bounded log kept only frees: everything was live from the start, nothing at the end
    x, y = alloc(10, MIB, "a.py:1"), alloc(11, 2 * MIB, "a.py:2")
    snap = load_snapshot(write(tmp_path, document([event(1.0, "free", x), event(2.0, "free", y)], [], dropped=2)))
    assert [a.index for a in initial_live(snap)] == [10, 11]
    assert live_by_site(snap).totals == (3 * MIB, 2 * MIB, 0)


def test_history_off_is_one_step_of_the_live_set(tmp_path: Path) -> None:
    snap = load_snapshot(write(tmp_path, document([], [A, D], history_limit=0, elapsed=12.5)))
    timeline = live_by_site(snap)
    assert timeline.times == (12.5,) and timeline.totals == (12 * MIB,)
    assert timeline.labels == ("cache.py:21", "model.py:10")
    assert timeline.series == ((8 * MIB,), (4 * MIB,))
    snap = load_snapshot(write(tmp_path, document([], [A], history_limit=0)))
    assert live_by_site(snap).times == (0.0,)


def test_nothing_allocated(tmp_path: Path) -> None:
    timeline = live_by_site(load_snapshot(write(tmp_path, document([], []))))
    assert timeline.labels == () and timeline.series == () and timeline.totals == (0,)


def test_times_that_go_backwards_are_held(tmp_path: Path) -> None:
    x, y = alloc(1, MIB, "a.py:1"), alloc(2, MIB, "a.py:2")
    doc = document([event(0.5, "alloc", x), event(0.4, "alloc", y), event(0.6, "free", x)], [y])
    assert live_by_site(load_snapshot(write(tmp_path, doc))).times == (0.5, 0.5, 0.5, 0.6)


@pytest.mark.parametrize(
    ("events", "live", "words"),
    [
        ([event(1, "free", B), event(2, "free", B)], [], "still live right after it"),
        ([event(1, "free", B)], [B], "still live right after it"),
        ([event(1, "alloc", C)], [], "not live right after it"),
        ([event(1, "alloc", C), event(2, "free", C), event(3, "free", C)], [], "still live right after it"),
        ([event(1, "alloc", C)], [dict(C, nbytes=5)], "with 5 bytes"),
        ([], [A, A], "lists allocation #1 twice"),
    ],
)
def test_a_log_that_contradicts_itself_is_refused(
    tmp_path: Path, events: list[dict[str, Any]], live: list[dict[str, Any]], words: str
) -> None:
    path = write(tmp_path, document(events, live))
    with pytest.raises(SnapshotError, match=words) as info:
        load_snapshot(path)
    assert str(path) in str(info.value) and "backend.save_snapshot(path)" in str(info.value)
    assert info.value.path == str(path)


def test_a_snapshot_built_in_memory_that_contradicts_itself_names_no_file() -> None:
    record = AllocRecord(**C)
    snap = MemorySnapshot("fake", "dev", 0, 0, "now", 10, 0, (SnapshotEvent(1.0, "free", record),), (record,))
    with pytest.raises(SnapshotError, match="the snapshot is not a consistent metrale memory snapshot") as info:
        initial_live(snap)
    assert info.value.path is None


def test_top_must_be_positive(snapshot_path: Path) -> None:
    with pytest.raises(InvalidArgumentError):
        live_by_site(load_snapshot(snapshot_path), top=0)


# -- labels -------------------------------------------------------------------------------------------------


def test_labels_are_file_and_line() -> None:
    assert site_labels(["/srv/app/model.py:10", "/srv/app/cache.py:20"]) == {
        "/srv/app/model.py:10": "model.py:10", "/srv/app/cache.py:20": "cache.py:20",
    }


def test_colliding_labels_take_directories_until_they_differ() -> None:
    sites = ["/a/x/app.py:12", "/b/x/app.py:12", "/c/lib.py:3", "/a/y/app.py:13", "app.py:14", "/z/app.py:14"]
    assert site_labels(sites) == {
        "/a/x/app.py:12": "a/x/app.py:12",
        "/b/x/app.py:12": "b/x/app.py:12",
        "/c/lib.py:3": "lib.py:3",
        "/a/y/app.py:13": "app.py:13",
        "app.py:14": "app.py:14",
        "/z/app.py:14": "z/app.py:14",
    }
    labels = site_labels(["/m/app.py:1", "m/app.py:1", "<unknown>:0", "C:\\w\\app.py:1"])
    assert len(set(labels.values())) == 4
    assert labels["<unknown>:0"] == "<unknown>:0"
    assert labels["C:\\w\\app.py:1"] == "w\\app.py:1"


def test_colliding_sites_in_the_timeline(tmp_path: Path) -> None:
    x, y = alloc(1, MIB, "/srv/a/worker.py:5"), alloc(2, 2 * MIB, "/srv/b/worker.py:5")
    timeline = live_by_site(load_snapshot(write(tmp_path, document([], [x, y]))))
    assert timeline.labels == ("b/worker.py:5", "a/worker.py:5")


# -- the trace ----------------------------------------------------------------------------------------------


def test_chrome_trace_structure(snapshot_path: Path) -> None:
    snap = load_snapshot(snapshot_path)
    trace = json.loads(json.dumps(chrome_trace(snap, top=3)))  # plain JSON
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    process = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert len(process) == 1 and "fake" in process[0]["args"]["name"]
    assert "metrale fake device 0" in process[0]["args"]["name"]
    live = [e for e in events if e["ph"] == "C" and e["name"] == "live bytes"]
    totals = [e for e in events if e["ph"] == "C" and e["name"] == "total"]
    timeline = live_by_site(snap, top=3)
    # one sample per step, and a last one when the snapshot was saved
    assert len(live) == len(totals) == len(timeline.times) + 1
    assert live[-1]["ts"] == pytest.approx(75_000) and live[-1]["args"] == live[-2]["args"]
    stamps = [e["ts"] for e in live]
    assert stamps == sorted(stamps) and stamps[0] == pytest.approx(10_000)
    for sample, total in zip(live, totals, strict=True):
        assert sample["ts"] == total["ts"] and sample["pid"] == total["pid"]
        assert set(sample["args"]) == {"cache.py:21", "model.py:10", "step.py:31", OTHER_SITES}
        assert sum(sample["args"].values()) == total["args"]["live bytes"]
    assert [t["args"]["live bytes"] for t in totals[:-1]] == list(timeline.totals)
    meta = trace["metadata"]
    assert meta["backend"] == "fake" and meta["dropped"] == 5 and meta["events"] == 6
    assert meta["sites"]["cache.py:21"] == "/srv/app/cache.py:21"
    assert len(meta["sites"][OTHER_SITES]) == 2


def test_chrome_trace_with_history_off(tmp_path: Path) -> None:
    trace = chrome_trace(load_snapshot(write(tmp_path, document([], [A], history_limit=0))))
    live = [e for e in trace["traceEvents"] if e.get("name") == "live bytes"]
    assert len(live) == 1 and live[0]["args"] == {"model.py:10": 4 * MIB} and live[0]["ts"] == 0


# -- bad files ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{not json", "not JSON"),
        ("", "not JSON"),
        ("[1, 2]", 'no "format": "metrale-memory-snapshot"'),
        (json.dumps({"format": "chrome-trace"}), 'no "format": "metrale-memory-snapshot"'),
        (json.dumps(document([], [], version=2)), "newer metrale"),
        (json.dumps(document([], [], version="1")), 'version "1"'),
        (json.dumps({k: v for k, v in document([], []).items() if k != "device"}), 'has no "device" field'),
        (json.dumps({k: v for k, v in document([], []).items() if k != "events"}), 'has no "events" field'),
        (json.dumps(dict(document([], []), events={})), '"events" must be a list'),
        (json.dumps(document([], [], total=-1)), '"total" must be an integer of at least 0'),
        (json.dumps(document([], [], ordinal=True)), '"ordinal" must be an integer'),
        (json.dumps(document([], [], stats=[])), '"stats" must be a JSON object'),
        (json.dumps(document([event(1, "realloc", A)], [])), '"op" of events\\[0\\] must be one of'),
        (json.dumps(document([event(-1, "alloc", A)], [A])), '"t" of events\\[0\\] must be a number of seconds'),
        (json.dumps(document([event(1, "alloc", dict(A, nbytes="4"))], [])), '"nbytes" of events\\[0\\]'),
        (json.dumps(document([{"t": 1, "op": "alloc"}], [])), 'events\\[0\\] has no "ptr" field'),
        (json.dumps(document([], [dict(A, site=None)])), '"site" of live\\[0\\] must be a string'),
        (json.dumps(document([], ["x"])), "live\\[0\\] must be a JSON object"),  # type: ignore[list-item]
    ],
)
def test_bad_files_are_snapshot_errors_naming_the_file(tmp_path: Path, content: str, words: str) -> None:
    path = write(tmp_path, content)
    with pytest.raises(SnapshotError, match=words) as info:
        load_snapshot(path)
    assert str(path) in str(info.value) and info.value.path == str(path)
    assert isinstance(info.value, MetraleError) and not isinstance(info.value, ConfigError)
    assert "save_snapshot" in str(info.value) or "upgrade" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match=r"cannot read the memory snapshot .*nope\.json: No such file") as info:
        load_snapshot(tmp_path / "nope.json")
    assert info.value.path == str(tmp_path / "nope.json")


def test_a_directory_is_refused_as_unreadable(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="cannot read the memory snapshot"):
        load_snapshot(tmp_path)


def test_one_module_writes_and_reads_the_format(tmp_path: Path) -> None:
    # the report re-exports the reader; the writer and the reader share one FORMAT and VERSION
    assert _report.load_snapshot is _snapshot.load_snapshot and _report.MemorySnapshot is _snapshot.MemorySnapshot
    assert (_report.FORMAT, _report.VERSION) == (_snapshot.FORMAT, _snapshot.VERSION)
    with open_backend("fake", settings=MetraleSettings(memory_history=10)) as gpu:
        buf = gpu.alloc(MIB)
        path = gpu.save_snapshot(tmp_path / "round.json")
        gpu.free(buf)
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"]) == (_snapshot.FORMAT, _snapshot.VERSION)
    snap = _snapshot.load_snapshot(path)
    assert [e.op for e in snap.events] == ["alloc"] and [a.nbytes for a in snap.live] == [MIB]
    assert initial_live(snap) == ()


# -- the plot -----------------------------------------------------------------------------------------------


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.parametrize("history", ["on", "off", "empty"])
def test_plot_png(tmp_path: Path, history: str) -> None:
    pytest.importorskip("matplotlib")
    if history == "on":
        doc = document(EVENTS, LIVE, elapsed=0.075)
    elif history == "off":
        doc = document([], LIVE, history_limit=0)
    else:
        doc = document([], [])
    out = tmp_path / "plot.png"
    plot_png(load_snapshot(write(tmp_path, doc)), out, top=3)
    width, height = png_size(out)
    assert 1000 <= width <= 1400 and 550 <= height <= 800  # 10 x 5.5 inches at 120 dpi


def test_plot_without_matplotlib_says_what_to_install(snapshot_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(MissingPackageError, match=r'pip install "metrale(-core)?\[report\]"') as info:
        plot_png(load_snapshot(snapshot_path), snapshot_path.with_suffix(".png"))
    assert isinstance(info.value, MetraleError) and not isinstance(info.value, ConfigError)


@pytest.mark.parametrize(("option", "package"), [("--png", "matplotlib"), ("--html", "plotly")])
def test_cli_without_a_plotting_package_says_what_to_install(
    snapshot_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    option: str, package: str,
) -> None:
    for name in (package, f"{package}.figure", f"{package}.graph_objects"):
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["report", str(snapshot_path), option, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("metrale report: ") and f'needs {package}, which is not installed' in err
    assert re.search(r'pip install "metrale(-core)?\[report\]"', err) and "ConfigError" not in err
    assert not (tmp_path / "out").exists()


# -- the command --------------------------------------------------------------------------------------------


def test_cli_writes_the_trace_and_the_plot(
    snapshot_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    trace, png = tmp_path / "out.json", tmp_path / "out.png"
    assert main(["report", str(snapshot_path), "--trace", str(trace), "--png", str(png), "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"wrote timeline: {trace} (open it in https://ui.perfetto.dev)", f"wrote plot: {png}"]
    labels = {k for e in json.loads(trace.read_text())["traceEvents"] if e["name"] == "live bytes" for k in e["args"]}
    assert labels == {"cache.py:21", "model.py:10", OTHER_SITES}
    assert png_size(png)[0] > 0


def test_cli_summary(snapshot_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(snapshot_path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "events     6 (history limit 10000, 5 older dropped)" in out
    assert "peak live  15.0 MiB at 50.0 ms (after events[4], an alloc of 3.0 MiB at /srv/app/step.py:31)" in out
    assert "live       12.0 MiB in 2 allocation(s) when saved" in out
    rows = [line.split() for line in out.splitlines()]
    assert ["cache.py:21", "8.0", "MiB", "30.0", "ms", "8.0", "MiB"] in rows
    assert ["other", "sites", "3.0", "MiB", "10.0", "ms", "0", "B"] in rows


def test_cli_summary_with_history_off(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, document([], [A], history_limit=0))
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "events     0 (history recording was off: set METRALE_MEMORY_HISTORY)" in out
    assert "live       4.0 MiB in 1 allocation(s) when saved" in out and "peak" not in out
    assert ["model.py:10", "4.0", "MiB"] in [line.split() for line in out.splitlines()]


def test_cli_bad_file_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "[]")
    assert main(["report", str(path), "--trace", str(tmp_path / "t.json")]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("metrale report: SnapshotError: ") and str(path) in captured.err
    assert not (tmp_path / "t.json").exists()


DEEP = "[" * 100_000 + "]" * 100_000  # deeper than Python's JSON parser recurses


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "content",
    [
        DEEP,
        json.dumps(dict(document([], []), events="DEEP")).replace('"DEEP"', DEEP),
        json.dumps(document([], [], stats={"alloc_count": "DEEP"})).replace('"DEEP"', DEEP),
        json.dumps(document([event(1, "alloc", dict(A, ptr="DEEP"))], [])).replace('"DEEP"', DEEP),
        json.dumps(document([], [], stats={"unknown": _nested(100)})),  # parses; too deep to keep
    ],
    ids=["top-level", "events", "stats", "a-field", "stats-100-levels"],
)
@pytest.mark.parametrize(
    "args",
    [("report", "{}"), ("report", "{}", "--trace", "{out}"), ("report", "{}", "{}"), ("stats", "{}"),
     ("stats", "{}", "--json")],
    ids=["report", "report-trace", "report-merged", "stats", "stats-json"],
)
def test_cli_deeply_nested_file_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, args: tuple[str, ...]
) -> None:
    """cli.md: a file that cannot be read is one line naming it and exit status 1, never a RecursionError."""
    path = write(tmp_path, content)
    out = tmp_path / "t.json"
    assert main([a.format(str(path), out=out) for a in args]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err[-500:]
    assert captured.err.startswith(f"metrale {args[0]}: SnapshotError: {path} ") and "too deeply" in captured.err
    assert not out.exists()


def test_load_refuses_deep_nesting_with_a_snapshot_error(tmp_path: Path) -> None:
    for depth, content in ((100_000, DEEP), (65, json.dumps(document([], [], stats={"x": _nested(64)})))):
        path = write(tmp_path, content)
        with pytest.raises(SnapshotError, match="nests JSON arrays or objects too deeply") as info:
            load_snapshot(path)
        assert info.value.path == str(path), depth
    kept = load_snapshot(write(tmp_path, document([], [], stats={"x": _nested(63)})))  # 64 levels: kept
    assert kept.stats["x"] == _nested(63)


def test_cli_unwritable_output(snapshot_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "missing-dir" / "t.json"
    assert main(["report", str(snapshot_path), "--trace", str(out)]) == 1
    assert capsys.readouterr().err == f"metrale report: cannot write {out}: No such file or directory\n"


def test_cli_top_must_be_positive(snapshot_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["report", str(snapshot_path), "--top", "0"])
    assert info.value.code == 2


# -- a snapshot the fake backend wrote ----------------------------------------------------------------------


def test_report_of_a_real_snapshot(tmp_path: Path) -> None:
    settings = MetraleSettings(memory_history=3)
    with open_backend("fake", settings=settings) as gpu:
        weights = gpu.alloc(4 * MIB)
        weights_line = sys._getframe().f_lineno - 1
        scratch = [gpu.alloc(MIB) for _ in range(3)]  # the log keeps the last 3 events only
        for buf in scratch:
            gpu.free(buf)
        path = gpu.save_snapshot(tmp_path / "real.json")
        gpu.free(weights)
    snap = load_snapshot(path)
    # 7 events: 4 allocs, then 3 frees; the log kept the frees
    assert isinstance(snap, MemorySnapshot) and snap.dropped == 4
    assert [e.op for e in snap.events] == ["free"] * 3 and len(snap.live) == 1
    timeline = live_by_site(snap)
    assert timeline.totals == (7 * MIB, 6 * MIB, 5 * MIB, 4 * MIB)
    assert timeline.labels[0] == f"test_report.py:{weights_line}"
