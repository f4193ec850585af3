"""The batch scorer's tests, on metrale's ``metrale_backend`` fixture.

Each test gets a backend of its own (``METRALE_BACKEND``, or ``--metrale-backend``); at its teardown the fixture
fails the test if a buffer of it is still on the ledger, or a red zone was overrun, naming the site. Red zones are
on for every test here (the module's marker), so a launch that writes past a row is caught.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_scorer import Scorer, score_batches

from metrale_core import DriverError, GpuBackend
from metrale_fake import FakeBackend

pytestmark = pytest.mark.metrale_settings(redzone=64)

WIDTH = 300  # not a multiple of the block: the last block of each row has idle threads


def _batches(count: int, rows: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((rows, WIDTH), dtype=np.float32) for _ in range(count)]


def _bias() -> np.ndarray:
    return np.linspace(-1.0, 1.0, WIDTH, dtype=np.float32)


def test_scores_match_numpy(metrale_backend: GpuBackend) -> None:
    batches = _batches(4, rows=5)
    scores = score_batches(metrale_backend, _bias(), batches)
    for batch, got in zip(batches, scores, strict=True):
        np.testing.assert_array_equal(got, batch + _bias())


@pytest.mark.metrale_settings(fake_defer=True)
def test_scores_are_read_after_the_stream_is_synchronized(metrale_backend: GpuBackend) -> None:
    """With ``fake_defer`` the fake runs stream work only when it must: a missing synchronize reads stale zeros."""
    (batch,) = _batches(1, rows=3, seed=1)
    with Scorer(metrale_backend, _bias()) as scorer:
        np.testing.assert_array_equal(scorer.score(batch), batch + _bias())


@pytest.mark.metrale_settings(backend="fake")  # inject_fault is the fake's
def test_a_failed_launch_frees_the_batch_s_buffers(metrale_backend: GpuBackend) -> None:
    assert isinstance(metrale_backend, FakeBackend)
    first, second = _batches(2, rows=4, seed=2)
    with Scorer(metrale_backend, _bias()) as scorer:
        metrale_backend.inject_fault("launch", nth=3)  # the third launch fails, once
        with pytest.raises(DriverError, match="launch"):
            scorer.score(first)
        assert metrale_backend.live_alloc_len() == 1, "the bias only: the batch's buffers were freed"
        np.testing.assert_array_equal(scorer.score(second), second + _bias())


@pytest.mark.metrale_allow_leaks(reason="checks what the ledger says of a scorer a service forgot to close")
def test_a_scorer_left_open_names_its_bias_on_the_ledger(metrale_backend: GpuBackend) -> None:
    Scorer(metrale_backend, _bias())  # never closed: the backend's close() sweeps the bias
    (record,) = metrale_backend.ledger_probe().records()
    assert record.nbytes == 4 * WIDTH
    assert "batch_scorer.py:" in record.site, "the allocation is named where the application made it"
