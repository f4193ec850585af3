"""``memory_history_frames``: each allocation's history event keeps its stack (the call site first, then its
callers; metrale's frames passed over), snapshots carry it, and the torch-snapshot export writes it as frames; in
both builds."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from metrale_core import ConfigError, MetraleSettings, open_backend
from metrale_core._commands.cli import main
from metrale_core._memory.snapshot import load_snapshot

BUILDS = pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure"])
HERE = Path(__file__).name


def _leaf(gpu: object) -> object:
    return gpu.alloc(256)  # type: ignore[attr-defined]


def _middle(gpu: object) -> object:
    return _leaf(gpu)


@BUILDS
def test_snapshots_carry_the_stacks_and_the_torch_export_writes_them(pure: bool, tmp_path: Path) -> None:
    settings = MetraleSettings(pure=pure, memory_history=100, memory_history_frames=3)
    path = tmp_path / "s.json"
    with open_backend("fake", settings=settings) as gpu:
        kept = _middle(gpu)
        gpu.free(_middle(gpu))  # type: ignore[arg-type]
        gpu.save_snapshot(path)
        gpu.free(kept)  # type: ignore[arg-type]
    snapshot = load_snapshot(path)
    allocs = [e for e in snapshot.events if e.op == "alloc"]
    assert len(allocs) == 2 and all(len(e.stack) == 3 for e in allocs)
    stack = allocs[0].stack
    assert stack[0] == allocs[0].allocation.site and stack[0].endswith(f"{HERE}:21")  # _leaf's line, the site
    assert stack[1].endswith(f"{HERE}:25")  # _middle's
    assert HERE in stack[2]  # the test's own line
    assert all(not e.stack for e in snapshot.events if e.op != "alloc")
    out = tmp_path / "t.pickle"
    assert main(["report", str(path), "--torch-snapshot", str(out)]) == 0
    data = pickle.loads(out.read_bytes())
    (segment,) = data["segments"]  # the one still live when saved
    assert [f["line"] for f in segment["frames"]][:2] == [21, 25]
    assert [f["name"] for f in segment["frames"]][:2] == ["_leaf", "_middle"]
    alloc_entries = [t for t in data["device_traces"][0] if t["action"] == "alloc"]
    assert all(len(t["frames"]) == 3 for t in alloc_entries)


@BUILDS
def test_without_frames_the_events_keep_no_stack(pure: bool, tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    with open_backend("fake", settings=MetraleSettings(pure=pure, memory_history=100)) as gpu:
        gpu.free(_middle(gpu))  # type: ignore[arg-type]
        gpu.save_snapshot(path)
    assert all(e.stack == () for e in load_snapshot(path).events)
    assert '"stack"' not in path.read_text()


def test_the_setting_is_bounded() -> None:
    with pytest.raises(ConfigError, match="memory_history_frames"):
        MetraleSettings(memory_history_frames=65)
