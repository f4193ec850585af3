"""``metrale report --torch-snapshot``: the pickle of ``torch.cuda.memory._dump_snapshot``, for pytorch.org/memory_viz.

Where torch is installed, its own ``torch.cuda._memory_viz`` reads the file; everywhere, the checks below replay it
as the viewer's JavaScript does (``process_alloc_data`` and ``MemoryView.simulate_memory`` of
``torch/utils/viz``) and list its pickle opcodes against those the viewer's unpickler knows.
"""

from __future__ import annotations

import json
import pickle
import pickletools
from pathlib import Path
from typing import Any

import pytest

from metrale_core import GpuBackend, InvalidArgumentError, open_backend
from metrale_core._commands.cli import main
from metrale_core._reports import torch_snapshot as _torch
from metrale_core._reports.timeline import live_by_site, load_snapshot
from tests._support import KIB, MIB, SETTINGS

HERE = Path(__file__)
SOURCE = HERE.read_text()


def _line(marker: str) -> int:
    """The line of this file that ends with the comment ``# <marker>``."""
    lines = [i for i, text in enumerate(SOURCE.splitlines(), 1) if text.endswith(f"# <{marker}>")]
    assert len(lines) == 1, marker
    return lines[0]


def _load_weights(gpu: GpuBackend) -> object:
    return gpu.alloc(4 * MIB)  # <weights>


def _step(gpu: GpuBackend) -> None:
    scratch = [gpu.alloc(MIB) for _ in range(3)]  # <scratch>
    for buf in scratch:
        gpu.free(buf)


class _Cache:
    def grow(self, gpu: GpuBackend) -> object:
        return gpu.alloc(96 * KIB)  # <cache>


def _run(path: Path, history: int) -> Path:
    """A program on the fake: weights kept, scratch that comes and goes, a cache block kept; saved, then freed."""
    with open_backend("fake", settings=SETTINGS.updated(memory_history=history)) as gpu:
        weights = _load_weights(gpu)
        _step(gpu)
        block = _Cache().grow(gpu)
        gpu.save_snapshot(path)
        gpu.free(weights)
        gpu.free(block)
    return path


def _export(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert main(["report", *args]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out.splitlines()


def _read(path: Path) -> Any:
    with path.open("rb") as f:
        return pickle.load(f)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return _run(tmp_path / "run.json", 1000)


# -- what the file holds ------------------------------------------------------------------------------------


def test_the_pickle_of_a_run(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.pickle"
    lines = _export(capsys, str(run), "--torch-snapshot", str(out))
    assert lines == [f"wrote PyTorch memory snapshot: {out} (open it in https://pytorch.org/memory_viz)",
                     f"  device 0: fake:0 ({run}): 8 events"]
    doc = _read(out)
    assert set(doc) == {"segments", "device_traces", "metrale"}
    weights = {"filename": str(HERE), "line": _line("weights"), "name": "_load_weights"}
    cache = {"filename": str(HERE), "line": _line("cache"), "name": "grow"}
    scratch = {"filename": str(HERE), "line": _line("scratch"), "name": "_step"}
    # the live set when saved: a segment of one allocated block each, the keys torch's _snapshot() has
    segments = doc["segments"]
    assert [(s["total_size"], s["frames"]) for s in segments] == [(4 * MIB, [weights]), (96 * KIB, [cache])]
    snap = load_snapshot(run)
    for seg, rec in zip(segments, snap.live, strict=True):
        assert seg == {
            "device": 0, "address": rec.ptr, "total_size": rec.nbytes, "allocated_size": rec.nbytes,
            "active_size": rec.nbytes, "requested_size": rec.nbytes, "stream": 0,
            "segment_type": "large" if rec.nbytes > MIB else "small", "segment_pool_id": (0, 0),
            "is_expandable": False, "frames": seg["frames"],
            "blocks": [{"address": rec.ptr, "size": rec.nbytes, "requested_size": rec.nbytes,
                        "state": "active_allocated", "frames": seg["frames"],
                        "user_metadata": f"device allocation #{rec.index}"}],
        }
    # the history: each alloc a segment_alloc and an alloc; each free a free_requested, a free_completed and a
    # segment_free; times in microseconds since the backend opened
    (trace,) = doc["device_traces"]
    assert [(e["action"], e["size"], e["frames"]) for e in trace] == [
        ("segment_alloc", 4 * MIB, [weights]), ("alloc", 4 * MIB, [weights]),
        *[(action, MIB, [scratch]) for _ in range(3) for action in ("segment_alloc", "alloc")],
        *[(action, MIB, [scratch]) for _ in range(3) for action in ("free_requested", "free_completed",
                                                                     "segment_free")],
        ("segment_alloc", 96 * KIB, [cache]), ("alloc", 96 * KIB, [cache]),
    ]
    times = [e["time_us"] for e in trace]
    assert all(type(t) is int for t in times) and times == sorted(times)
    assert times[-1] == round(snap.events[-1].t * 1e6)
    assert {(e["addr"], e["size"]) for e in trace[:2]} == {(snap.live[0].ptr, 4 * MIB)}
    assert all(set(e) == {"action", "addr", "size", "stream", "time_us", "frames", "user_metadata"} for e in trace)
    assert doc["metrale"]["devices"] == [{
        "device": 0, "name": doc["metrale"]["devices"][0]["name"], "backend": "fake", "ordinal": 0,
        "source": str(run), "created": snap.created, "history_limit": 1000, "dropped": 0, "events": 8,
    }]


#: The opcodes pytorch.org/memory_viz's unpickler (``unpickleData`` of torch/utils/viz/MemoryViz.js) knows.
VIEWER_OPCODES = {
    "APPEND", "APPENDS", "BINFLOAT", "BINGET", "BININT", "BININT1", "BININT2", "BINPUT", "BINUNICODE", "DICT",
    "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "FRAME", "LIST", "LONG1", "LONG_BINGET", "LONG_BINPUT", "MARK",
    "MEMOIZE", "NEWFALSE", "NEWTRUE", "NONE", "PROTO", "SETITEM", "SETITEMS", "SHORT_BINUNICODE", "STOP", "TUPLE",
    "TUPLE1", "TUPLE2", "TUPLE3",
}


def test_the_viewer_can_unpickle_it(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The viewer's unpickler reads protocols 2 to 4 and the opcodes of plain values, and numbers of at most 8
    bytes (LONG1): what a metrale snapshot exports, long site names and addresses included."""
    out = tmp_path / "out.pickle"
    _export(capsys, str(run), "--torch-snapshot", str(out))
    ops = list(pickletools.genops(out.read_bytes()))
    assert ops[0][0].name == "PROTO" and ops[0][1] == 4
    assert {op.name for op, _, _ in ops} <= VIEWER_OPCODES
    assert all(len(pickle.encode_long(arg)) <= 8 for op, arg, _ in ops if op.name == "LONG1")
    doc = _read(out)
    assert doc["segments"][0]["frames"] is doc["device_traces"][0][0]["frames"]  # one list per call site


def _viewer_totals(doc: Any, device: int) -> list[int]:
    """The live bytes of the viewer's "Active Memory Timeline" at each step, as its ``process_alloc_data``
    counts them: an ``alloc`` adds an element, a ``free_completed`` takes off the one at its address or, with
    none, is an element allocated before the trace began; so are the live blocks that no alloc made."""
    elements: list[int] = []
    initially: list[int] = []
    actions: list[int] = []
    by_addr: dict[int, int] = {}
    for e in doc["device_traces"][device]:
        if e["action"] == "alloc":
            elements.append(e["size"])
            by_addr[e["addr"]] = len(elements) - 1
            actions.append(len(elements) - 1)
        elif e["action"] == "free_completed":
            if e["addr"] in by_addr:
                actions.append(by_addr.pop(e["addr"]))
            else:
                elements.append(e["size"])
                initially.append(len(elements) - 1)
                actions.append(len(elements) - 1)
    for seg in doc["segments"]:
        for b in seg["blocks"]:
            if seg["device"] == device and b["state"] == "active_allocated" and b["address"] not in by_addr:
                elements.append(b["requested_size"])
                initially.append(len(elements) - 1)
    current = set(initially)
    totals = [sum(elements[i] for i in current)]
    for i in actions:
        if i in current:
            current.remove(i)
            totals.append(totals[-1] - elements[i])
        else:
            current.add(i)
            totals.append(totals[-1] + elements[i])
    return totals


def _viewer_state_history(doc: Any, device: int) -> int:
    """The viewer's "Allocator State History" (``MemoryView.simulate_memory``): from the segments and blocks
    when saved, walk the trace backwards; at every step each block must lie inside a segment (else the viewer
    fails: ``find_segment`` finds none), a ``segment_alloc`` must find its segment and a ``free_requested`` its
    block. Returns the steps walked."""
    segments = {s["address"]: s["total_size"] for s in doc["segments"] if s["device"] == device}
    blocks = {b["address"]: b["size"] for s in doc["segments"] if s["device"] == device for b in s["blocks"]
              if b["state"] == "active_allocated"}

    def inside() -> bool:
        return all(any(s <= a and a + n <= s + size for s, size in segments.items()) for a, n in blocks.items())

    assert inside()
    trace = doc["device_traces"][device]
    for e in reversed(trace):
        addr, size = e["addr"], e["size"]
        if e["action"] == "alloc":
            assert blocks.pop(addr) == size
        elif e["action"] == "free_completed":
            assert addr not in blocks
            blocks[addr] = size
        elif e["action"] == "free_requested":
            assert addr in blocks
        elif e["action"] == "segment_free":
            assert addr not in segments
            segments[addr] = size
        else:
            assert e["action"] == "segment_alloc" and segments.pop(addr) == size
        assert inside()
    return len(trace)


def test_the_viewer_replays_what_metrale_report_replays(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.pickle"
    _export(capsys, str(run), "--torch-snapshot", str(out))
    doc = _read(out)
    assert _viewer_totals(doc, 0) == list(live_by_site(load_snapshot(run)).totals)
    assert _viewer_state_history(doc, 0) == 19


# -- a hand-written snapshot: a dropped alloc, a sweep, sites of no file ---------------------------------------


def _alloc(index: int, nbytes: int, site: str) -> dict[str, Any]:
    return {"ptr": 0x7F00_0000_0000 + index * 0x100_0000, "nbytes": nbytes, "kind": "device", "index": index,
            "site": site}


def _document(events: list[dict[str, Any]], live: list[dict[str, Any]], **header: Any) -> dict[str, Any]:
    doc = {"format": "metrale-memory-snapshot", "version": 1, "backend": "fake", "device": "fake device 0",
           "ordinal": 0, "total": 16 << 30, "created": "2026-12-02T15:10:00+00:00", "history_limit": 100,
           "dropped": 0, "events": events, "live": live, "stats": {}}
    return doc | header


KEPT = _alloc(1, 2 * MIB, "/srv/app/model.py:10")  # allocated before the log, still live
DROPPED = _alloc(2, MIB, "/srv/app/cache.py:20")  # allocated before the log (dropped), freed in it
LEAK = _alloc(3, 3 * MIB, "<string>:7")  # allocated and swept in the log
ODD = _alloc(4, 512, "<unknown>:0")  # no file:line at all


def test_a_dropped_alloc_a_sweep_and_sites_of_no_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = [{"t": 0.010, "op": "free", **DROPPED}, {"t": 0.020, "op": "alloc", **LEAK},
              {"t": 0.025, "op": "alloc", **ODD}, {"t": 0.030, "op": "sweep", **LEAK}]
    path = tmp_path / "hand.json"
    path.write_text(json.dumps(_document(events, [KEPT, ODD], dropped=7)))
    out = tmp_path / "out.pickle"
    lines = _export(capsys, str(path), "--torch-snapshot", str(out))
    assert lines[1] == (f"  device 0: fake:0 ({path}): 4 events (7 older ones were dropped: what they left live "
                        f"shows from the start)")
    doc = _read(out)
    (trace,) = doc["device_traces"]
    assert [(e["action"], e["addr"], e["time_us"]) for e in trace[:3]] == [
        (a, DROPPED["ptr"], 10_000) for a in ("free_requested", "free_completed", "segment_free")]
    assert trace[0]["frames"] == [{"filename": "/srv/app/cache.py", "line": 20, "name": "??"}]  # no such file here
    assert trace[3]["frames"] == [{"filename": "<string>", "line": 7, "name": "??"}]
    assert trace[5]["frames"] == [{"filename": "<unknown>", "line": 0, "name": "??"}]
    swept = [e for e in trace if e["addr"] == LEAK["ptr"] and "free" in e["action"]]
    assert [e["user_metadata"] for e in swept] == ["device allocation #3, taken by the teardown sweep: a leak"] * 3
    assert [s["address"] for s in doc["segments"]] == [KEPT["ptr"], ODD["ptr"]]
    snap = load_snapshot(path)
    assert _viewer_totals(doc, 0) == list(live_by_site(snap).totals)
    assert _viewer_state_history(doc, 0) == 10


def test_with_history_off_it_says_the_viewer_shows_the_live_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "off.json", 0)
    out = tmp_path / "out.pickle"
    lines = _export(capsys, str(run), "--torch-snapshot", str(out))
    assert lines[1] == (f"  device 0: fake:0 ({run}): history recording was off (set METRALE_MEMORY_HISTORY): the "
                        f"viewer shows only the live set when it was saved")
    doc = _read(out)
    assert doc["device_traces"] == [[]] and [s["total_size"] for s in doc["segments"]] == [4 * MIB, 96 * KIB]
    assert _viewer_totals(doc, 0) == [4 * MIB + 96 * KIB]
    path = tmp_path / "quiet.json"
    path.write_text(json.dumps(_document([], [KEPT])))  # recording on, nothing recorded
    lines = _export(capsys, str(path), "--torch-snapshot", str(out))
    assert lines[1].endswith(": no events were recorded: the viewer shows only the live set when it was saved")


# -- several ranks ------------------------------------------------------------------------------------------


def _rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int, ordinal: int, nbytes: int) -> Path:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    settings = SETTINGS.updated(memory_history=100, fake_device_count=2)
    with open_backend("fake", ordinal=ordinal, settings=settings) as gpu:
        keep = gpu.alloc(nbytes)
        gpu.free(gpu.alloc(64))
        path = gpu.save_snapshot(tmp_path / f"rank{rank}.json")
        gpu.free(keep)
    return path


@pytest.mark.parametrize(("ordinals", "devices"), [((1, 0), (1, 0)), ((0, 0), (0, 1))],
                         ids=["ordinals-differ", "one-ordinal"])
def test_each_rank_is_a_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    ordinals: tuple[int, int], devices: tuple[int, int],
) -> None:
    """A device per snapshot: its ordinal where the ordinals differ (torch numbers CUDA devices so), else in rank
    order; the notes say which rank each device is."""
    paths = [_rank(tmp_path, monkeypatch, rank, ordinal, (rank + 1) * KIB) for rank, ordinal in enumerate(ordinals)]
    out = tmp_path / "job.pickle"
    lines = _export(capsys, str(paths[1]), str(paths[0]), "--torch-snapshot", str(out))
    assert lines[1:] == [f"  device {devices[rank]}: rank {rank}, fake:{ordinals[rank]} ({paths[rank]}): 3 events"
                         for rank in (0, 1)]
    doc = _read(out)
    assert len(doc["device_traces"]) == 2
    for rank in (0, 1):
        device = devices[rank]
        assert [(s["device"], s["total_size"]) for s in doc["segments"] if s["device"] == device] == [
            (device, (rank + 1) * KIB)]
        assert [e["action"] for e in doc["device_traces"][device]] == [
            "segment_alloc", "alloc", "segment_alloc", "alloc", "free_requested", "free_completed", "segment_free"]
        assert _viewer_totals(doc, device) == list(live_by_site(load_snapshot(paths[rank])).totals)
        assert _viewer_state_history(doc, device) == 7


def test_no_snapshot_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="torch_snapshot: no snapshot"):
        _torch.torch_snapshot([])


# -- function names -----------------------------------------------------------------------------------------


def test_a_frame_names_the_function_around_its_line(tmp_path: Path) -> None:
    source = tmp_path / "app.py"
    source.write_text("x = 1\n\nclass Model:\n    size = 2\n\n    def forward(self):\n        def inner():\n"
                      "            return 3\n        return inner()\n\nasync def main():\n    pass\n")
    names = _torch._Names()
    at = [names.at(str(source), line) for line in (1, 4, 6, 8, 9, 10, 12, 99)]
    assert at == ["<module>", "Model", "forward", "inner", "forward", "<module>", "main", "<module>"]
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    assert names.at(str(broken), 1) == "??" and names.at(str(tmp_path / "gone.py"), 1) == "??"
    assert names.at(str(tmp_path), 1) == "??"  # a folder


# -- the command's errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["missing-dir/out.pickle", "."], ids=["no-folder", "a-folder"])
def test_a_file_that_cannot_be_written_is_one_line_and_exit_1(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    out = tmp_path / where
    assert main(["report", str(run), "--torch-snapshot", str(out)]) == 1
    captured = capsys.readouterr()
    reason = "No such file or directory" if where != "." else "Is a directory"
    assert captured.out == "" and captured.err == f"metrale report: cannot write {out}: {reason}\n"


# -- torch's own reader -------------------------------------------------------------------------------------


def test_torch_reads_it_and_names_the_call_sites(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``torch.cuda._memory_viz``, what ``python -m torch.cuda._memory_viz`` runs on a ``_dump_snapshot`` file:
    its statistics, trace, flame graphs (the lines handed to flamegraph.pl) and the HTML of both plots."""
    viz = pytest.importorskip("torch.cuda._memory_viz", reason="torch is not installed (python3 dev.py torchrun)")
    out = tmp_path / "out.pickle"
    _export(capsys, str(run), "--torch-snapshot", str(out))
    doc = _read(out)
    stats = viz.segsum(doc)
    assert "segments: 2\n" in stats and "total_allocated: 4.1MiB\n" in stats and "total_free: 0.0B\n" in stats
    trace = viz.trace(doc)
    assert trace.startswith("Device 0 ----------------\n19 entries\n") and "cudaFree(" in trace
    memory = viz.memory(doc, format_flamegraph=lambda lines: lines)
    assert memory.splitlines() == [
        f"stream_0;active_allocated;{HERE.name}:{_line('weights')}:_load_weights {4 * MIB}",
        f"stream_0;active_allocated;{HERE.name}:{_line('cache')}:grow {96 * KIB}",
    ]
    per_segment = viz.segments(doc, format_flamegraph=lambda lines: lines)
    assert f"{HERE.name}:{_line('cache')}:grow" in per_segment and ";seg_" in per_segment
    for html in (viz.trace_plot(doc), viz.segment_plot(doc), viz.trace_plot(doc, plot_segments=True)):
        assert "MemoryViz.js" in html and "snapshot.pickle" in html
