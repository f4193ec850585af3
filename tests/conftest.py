"""Shared fixtures: Hypothesis profiles, and the backends every test runs against."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from metrale_core import GpuBackend, MetraleSettings, open_backend, testing

#: The settings of this run, from METRALE_* (the GPU runs set METRALE_TARGET_HW and METRALE_REDZONE).
SETTINGS = MetraleSettings()


def backend_params() -> list[object]:
    """Every discovered backend; the unavailable ones are skipped with their reason."""
    return testing.backend_params(SETTINGS, expected=("cuda",))


@pytest.fixture(params=backend_params())
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def gpu(backend_name: str) -> Iterator[GpuBackend]:
    with open_backend(backend_name, settings=SETTINGS) as backend:
        yield backend


@pytest.fixture
def fake() -> Iterator[GpuBackend]:
    with open_backend("fake", settings=SETTINGS) as backend:
        yield backend


def install_distribution(site: Path, dist: str, module: str, source: str, eps: dict[str, str]) -> None:
    """Lay out an installed distribution (dist-info and module), as pip would."""
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{name} = {value}" for name, value in eps.items())
    (info / "entry_points.txt").write_text(f"[metrale.backends]\n{lines}\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("mtp_")]:
        del sys.modules[name]
