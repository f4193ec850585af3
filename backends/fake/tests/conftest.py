"""The fake backend's own tests: a ``fake`` backend opened with the run's settings (``tests/_support.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from metrale_core import GpuBackend, open_backend
from tests._support import SETTINGS


@pytest.fixture
def fake() -> Iterator[GpuBackend]:
    with open_backend("fake", settings=SETTINGS) as backend:
        yield backend
