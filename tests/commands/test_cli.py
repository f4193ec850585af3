"""The command line, run as a user runs it: a subprocess with its own environment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._support import metrale


def test_backends_table() -> None:
    out = metrale("backends")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["name", "available", "distribution", "reason"]
    fake = next(line for line in lines if line.startswith("fake "))
    assert "yes" in fake and "metrale-fake" in fake
    assert any(line.startswith("cuda ") and "metrale-cuda" in line for line in lines)


def test_selftest_on_fake_passes() -> None:
    out = metrale("selftest", METRALE_BACKEND="fake")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "selftest: 12 passed, 0 failed" in out.stdout
    assert "sweep on fake:0: 4 allocation(s)" in out.stdout
    # each planted fault's warnings are printed under the check that planted it, with short call sites
    lines = out.stdout.splitlines()
    assert "WARNING" not in out.stderr, out.stderr
    assert not any(line.startswith("WARNING") for line in lines), out.stdout
    under: dict[str, list[str]] = {}
    for line in lines:
        if line.startswith("["):
            check = line.split("] ", 1)[1].split(":", 1)[0]
        elif line.startswith("      WARNING metrale: "):
            under.setdefault(check, []).append(line)
    assert set(under) == {"red-zone overrun caught", "leak swept and reported"}, under
    overrun = under["red-zone overrun caught"]
    assert len(overrun) == 2 and "(found by scan_redzones())" in overrun[0], overrun
    assert "at sweep_unreleased())" in overrun[1] and "allocated at selftest.py:" in overrun[1], overrun
    assert "largest sites: selftest.py:" in under["leak swept and reported"][0]
    assert "/_commands/selftest.py" not in out.stdout


def test_info_on_fake() -> None:
    out = metrale("info", METRALE_BACKEND="fake", METRALE_FAKE_MEMORY_BYTES="2GiB")
    assert out.returncode == 0, out.stderr
    assert "memory total    2.0 GiB" in out.stdout


@pytest.mark.parametrize("command", ["backends", "info", "selftest"])
def test_bad_settings_exit_nonzero_with_one_line(command: str) -> None:
    out = metrale(command, METRALE_REDZONE="plenty")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "METRALE_REDZONE" in out.stderr


def test_unavailable_backend_is_one_line_error() -> None:
    out = metrale("info", METRALE_BACKEND="nonexistent")
    assert out.returncode == 1 and "BackendUnavailableError" in out.stderr and out.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("stats", "ok"),
    [({"alloc_count": 3}, True), ({}, True), ({"current_bytes": [1, 2]}, False), ({"alloc_count": "lots"}, False),
     ({"allocated_bytes": {"device": 1.5}}, False)],
    ids=["older", "empty", "list", "string", "float"],
)
def test_stats_of_a_snapshot_of_another_version_or_damaged(tmp_path: Path, stats: dict[str, object], ok: bool) -> None:
    """An older snapshot's missing counters read as zeros; counters of the wrong type are one line."""
    from metrale_core import open_backend

    with open_backend("fake") as gpu:
        path = gpu.save_snapshot(tmp_path / "s.json")
    doc = json.loads(path.read_text())
    doc["stats"] = stats
    path.write_text(json.dumps(doc))
    for args in (("stats", str(path)), ("stats", str(path), "--json")):
        out = metrale(*args)
        if ok:
            assert out.returncode == 0 and not out.stderr, out.stderr
        else:
            assert out.returncode == 1 and "SnapshotError" in out.stderr and out.stderr.count("\n") == 1, out.stderr
