"""The pipeline example on every available backend: results against numpy, an empty ledger, fake_defer, the CLI.

Runs against each backend ``available_backends()`` finds; ``cuda`` is skipped,
with the reason, where no GPU answers. ``METRALE_*`` variables apply (for
example ``METRALE_REDZONE=256``), as in metrale's own suite.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from metrale_core import MetraleError, MetraleSettings, open_backend
from metrale_core.testing import backend_params
from metrale_fake import FakeBackend
from metrale_pipeline import Pipeline, run_pipeline

SETTINGS = MetraleSettings()
SIZE = 3000  # not a multiple of the block: the last block has idle threads


@pytest.fixture(params=backend_params(SETTINGS, expected=("cuda",), needs=("kernels",)))  # the pipeline launches
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_run_matches_numpy_and_leaves_the_ledger_empty(backend_name: str) -> None:
    with open_backend(backend_name, settings=SETTINGS) as gpu:
        result = run_pipeline(gpu, batches=5, size=SIZE, seed=1)
        assert result.bad_batches == ()
        assert result.acc_max_error == 0.0
        assert result.live_after_close == 0
        assert gpu.live_alloc_len() == 0
        assert len(result.batch_ms) == 5
        assert all(ms >= 0.0 for ms in result.batch_ms)
        assert gpu.run_metrics().launches[("vector", "vector_add")] == 2, "two launches, recorded once"
        assert "vector.vector_add" in result.metrics_table
        assert result.ok


def test_steps_checked_here_against_numpy(backend_name: str, caplog: pytest.LogCaptureFixture) -> None:
    """Each step and the sum, checked independently of run_pipeline's own checks; teardown warns of nothing."""
    rng = np.random.default_rng(2)
    b = rng.standard_normal(SIZE, dtype=np.float32)
    total = np.zeros(SIZE, dtype=np.float32)
    caplog.set_level(logging.WARNING)
    with open_backend(backend_name, settings=SETTINGS) as gpu:
        probe = gpu.ledger_probe()
        with Pipeline(gpu, b) as pipeline:
            assert probe.live_count() == 4
            for _ in range(4):
                a = rng.standard_normal(SIZE, dtype=np.float32)
                out, _ms = pipeline.step(a)
                np.testing.assert_array_equal(out, a + b)
                total += a + b
            np.testing.assert_array_equal(pipeline.accumulated(), total)
        assert probe.live_count() == 0
        pipeline.close()  # idempotent
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_fake_defer_runs_work_only_when_it_must_and_the_pipeline_is_still_right() -> None:
    with open_backend("fake", settings=SETTINGS.updated(fake_defer=True)) as gpu:
        result = run_pipeline(gpu, batches=6, size=SIZE, seed=3)
        assert result.ok, result
        assert gpu.live_alloc_len() == 0


@pytest.mark.parametrize(
    ("op", "nth"),
    [("alloc", 3), ("alloc", 5), ("memcpy", 2), ("launch", 1), ("graph_instantiate", 1)],
    ids=["device-alloc", "host-alloc", "captured-copy", "captured-launch", "instantiate"],
)
def test_a_failure_half_way_releases_everything(op: str, nth: int) -> None:
    """A failure while building the pipeline (also inside the capture) leaves nothing behind, and no capture."""
    with open_backend("fake", settings=SETTINGS) as gpu:
        assert isinstance(gpu, FakeBackend)
        b = np.ones(SIZE, dtype=np.float32)
        gpu.inject_fault(op, nth=nth)
        with pytest.raises(MetraleError):
            Pipeline(gpu, b)
        assert gpu.live_alloc_len() == 0
        assert run_pipeline(gpu, batches=2, size=SIZE).ok, "the backend is still usable: no capture was left open"


def test_a_pipeline_outlived_by_nothing() -> None:
    """Closing the backend first releases the pipeline's resources; the pipeline's close() is then a no-op."""
    with open_backend("fake", settings=SETTINGS) as gpu:
        pipeline = Pipeline(gpu, np.ones(16, dtype=np.float32))
    pipeline.close()


def test_bad_arguments() -> None:
    with open_backend("fake", settings=SETTINGS) as gpu:
        with pytest.raises(ValueError, match="float32"):
            Pipeline(gpu, np.ones(16, dtype=np.float64))
        with pytest.raises(ValueError, match="batches"):
            run_pipeline(gpu, batches=0, size=16)
        with Pipeline(gpu, np.ones(16, dtype=np.float32)) as pipeline, pytest.raises(ValueError, match="shape"):
            pipeline.step(np.ones(17, dtype=np.float32))
        assert gpu.live_alloc_len() == 0


def _script() -> str:
    found = shutil.which("metrale-pipeline", path=sysconfig.get_path("scripts"))
    assert found, "the metrale-pipeline script is not installed here: pip install -e examples/pipeline"
    return found


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")} | env
    return subprocess.run(args, capture_output=True, text=True, env=environ, timeout=120, check=False)


@pytest.mark.parametrize("defer", ["0", "1"], ids=["eager", "defer"])
def test_console_script(backend_name: str, defer: str) -> None:
    proc = _run([_script(), "--batches", "3", "--size", "1000"], METRALE_BACKEND=backend_name, METRALE_FAKE_DEFER=defer)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == "", "nothing logged at WARNING: no mismatch, no sweep"
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"metrale-pipeline: 3 batches of 1000 float32 on {backend_name}:0, ")
    assert [line.split(":")[0] for line in lines[1:4]] == ["batch   0", "batch   1", "batch   2"]
    assert "checked against numpy: 3 of 3 batches match, acc max abs error 0" in lines
    assert "ledger after the pipeline closed: 0 live allocation(s)" in lines
    assert lines[-1] == "OK"


def test_module_entry_and_errors() -> None:
    ok = _run([sys.executable, "-m", "metrale_pipeline", "--backend", "fake", "--batches", "1", "--size", "7"])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    missing = _run([_script(), "--backend", "nonexistent"])
    assert missing.returncode == 2
    assert "BackendNotFoundError: no backend named 'nonexistent'" in missing.stderr
    usage = _run([_script(), "--size", "0"])
    assert usage.returncode == 2
    assert "--size: must be 1 to 4294967295, got 0" in usage.stderr

