"""``metrale bench``: a quick run on every backend (a smoke run: no timing is asserted), its JSON, its
table, ``--only`` and ``--list``; the baselines the backends provide."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pytest

from metrale_core import InvalidArgumentError, MetraleSettings, open_backend
from metrale_core._commands.bench import MEASUREMENTS, run_bench
from tests._support import SETTINGS, metrale

#: The measurements that launch the shipped kernels (skipped on a backend that runs none).
LAUNCHING = {"eager", "graph", "safety", "eager_breakdown"}


@pytest.mark.parametrize("measurement", [
    pytest.param(m.name, marks=[pytest.mark.needs("kernels")] if m.name in LAUNCHING else []) for m in MEASUREMENTS
])
def test_each_measurement_runs_quick_and_leaves_nothing_behind(
    backend_name: str, measurement: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = SETTINGS.model_copy(update={"backend": backend_name})
    lines: list[str] = []
    with caplog.at_level(logging.WARNING, logger="metrale"):
        report = run_bench(settings, only=measurement, quick=True, progress=lines.append)
    # every allocation a measurement made was freed (the sweep at close would warn), nothing else warned
    assert [r.getMessage() for r in caplog.records] == []
    assert lines[0].startswith(f"[1/1] {measurement}:") and lines[-1].strip().startswith(f"{measurement} done in")
    (result,) = report.results
    assert result.name == measurement and report.backend == backend_name and report.quick
    labels = [f.label for f in result.figures]
    assert len(labels) == len(set(labels))
    for figure in result.figures:
        if figure.source == "metrale":  # metrale's own figures are always measured
            assert figure.value is not None and math.isfinite(figure.value)
            assert figure.value > 0 or figure.note.startswith("within noise"), figure  # a difference may be 0
        if figure.value is None:
            assert figure.note.startswith("skipped: ")
        if figure.vs is not None:
            assert figure.vs in labels
    if backend_name == "fake":
        assert result.goals == ()  # the goals are the GPU's


def test_the_fake_is_compared_with_numpy() -> None:
    report = run_bench(MetraleSettings(backend="fake"), only="alloc,copy", quick=True)
    alloc, copy = report.results
    raw, ledger = alloc.figures[0], alloc.figures[1]
    assert raw.source.startswith("numpy ") and raw.value is not None
    assert ledger.vs == raw.label and ledger.ratio == pytest.approx(ledger.value / raw.value)  # type: ignore[operator]
    assert re.fullmatch(r"[\d,]+ pairs/s, \+[\d.]+ us", ledger.note)
    assert [f.label for f in alloc.figures] == [
        "raw alloc + free 64 KiB", "metrale 64 KiB (ledger)", "metrale 64 KiB, red zone",
        "raw alloc + free 1 MiB", "metrale 1 MiB (ledger)", "metrale 1 MiB, red zone",
        "raw alloc + free 64 MiB", "metrale 64 MiB (ledger)", "metrale 64 MiB, red zone",
    ]
    assert [f.label for f in copy.figures] == [
        "raw D2D 1 MiB", "metrale D2D 1 MiB", "raw pinned H2D 1 MiB", "metrale pinned H2D 1 MiB",
        "raw pinned D2H 1 MiB", "metrale pinned D2H 1 MiB",
        "raw peer copy 1 MiB from ordinal 0", "metrale peer copy 1 MiB from ordinal 0",
    ]
    assert all(f.unit == "GB/s" and f.value is not None for f in copy.figures)


def test_peers_without_a_gpu_are_skipped_and_said_so() -> None:
    report = run_bench(MetraleSettings(backend="fake"), only="pools,graph", quick=True)
    skipped = {f.label: f.note for r in report.results for f in r.figures if f.value is None}
    assert skipped == {
        "CuPy MemoryPool.malloc + release": "skipped: CuPy needs the cuda backend (this run is on fake)",
        "torch.empty + release (caching allocator)":
            "skipped: PyTorch's CUDA needs the cuda backend (this run is on fake)",
        "torch.cuda.CUDAGraph replay": "skipped: PyTorch's CUDA needs the cuda backend (this run is on fake)",
    }
    assert "skipped: CuPy needs the cuda backend" in report.text()


def test_unknown_measurements_are_refused_before_anything_runs() -> None:
    with pytest.raises(InvalidArgumentError, match=r"no measurement named nope; choose from alloc, breakdown, pools"):
        run_bench(MetraleSettings(backend="fake"), only="alloc,nope")
    with pytest.raises(InvalidArgumentError, match="no measurement named at all"):
        run_bench(MetraleSettings(backend="fake"), only=" , ")


def test_cli_quick_run_writes_json(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    out = metrale("bench", "--quick", "--only", "alloc,safety", "--json", str(path), METRALE_BACKEND="fake")
    assert out.returncode == 0, out.stderr
    assert "[1/2] alloc:" in out.stderr and "[2/2] safety:" in out.stderr  # progress goes to stderr
    assert out.stdout.startswith("metrale bench on fake: metrale fake device 0")
    assert "\nalloc: ledgered allocation against the raw driver pair" in out.stdout
    assert "step, checks on, verdict judged later" in out.stdout and f"wrote {path}" in out.stdout
    data = json.loads(path.read_text())
    assert data["backend"] == "fake" and data["quick"] is True
    assert set(data["versions"]) >= {"metrale", "python", "numpy"}
    assert [r["name"] for r in data["results"]] == ["alloc", "safety"]
    assert [f["label"] for f in data["results"][1]["figures"]] == [
        "step, checks off", "step, checks on, verdict waited for", "step, checks on, verdict judged later",
    ]
    assert data["results"][1]["figures"][2]["vs"] == "step, checks off"


def test_cli_list_and_unknown_names() -> None:
    listed = metrale("bench", "--list")
    assert listed.returncode == 0
    assert [line.split()[0] for line in listed.stdout.splitlines()[2:]] == [m.name for m in MEASUREMENTS]
    bad = metrale("bench", "--only", "nope", METRALE_BACKEND="fake")
    assert bad.returncode == 1 and bad.stdout == ""
    assert "no measurement named nope; choose from alloc, breakdown, pools, copy, eager, graph, safety" in bad.stderr


@pytest.mark.needs("baseline")
def test_a_baseline_is_the_backend_s_own_and_closes(backend_name: str) -> None:
    with open_backend(backend_name, settings=SETTINGS) as gpu:
        baseline = gpu.raw.baseline()
        try:
            ops = [
                baseline.alloc_free(4096), baseline.memset(4096), baseline.copy("dtod", 4096),
                baseline.copy("htod", 4096), baseline.copy("dtoh", 4096), baseline.vector_add(1000),
            ]
            for op in ops:
                op()
            baseline.synchronize()
            assert baseline.label and baseline.versions
        finally:
            baseline.close()
        baseline.close()  # twice is harmless
        assert gpu.live_alloc_len() == 0  # a baseline's memory is never on the ledger
