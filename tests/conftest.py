"""Shared fixtures: Hypothesis profiles, the backends every test runs against, and the ``needs`` marker.

``@pytest.mark.needs("kernels", ...)`` on a test that takes ``backend_name`` (or ``gpu``) skips it, with
the reason, on a backend that lacks one of the capabilities named: the optional primitives of
``metrale_core.testing.CAPABILITIES`` (``kernels``, ``interop``, ``baseline``, ``tensor_maps``, ``peers``) and
``capacity``, the memory the memory tests fill (a capacity ``fake_memory_bytes`` sets, or a device of 8 GiB or more).
A backend is probed once per run, only when a test that needs something runs on it.
"""

from __future__ import annotations

import functools
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from metrale_core import ConfigError, GpuBackend, MetraleSettings, open_backend, testing
from metrale_core.plugin import format_bytes

#: The settings of this run, from METRALE_* (the GPU runs set METRALE_TARGET_HW and METRALE_REDZONE).
SETTINGS = MetraleSettings()


def backend_params() -> list[object]:
    """Every discovered backend; the unavailable ones are skipped with their reason."""
    return testing.backend_params(SETTINGS, expected=("cuda",))


#: The capacity the memory tests set on the fake (``fake_memory_bytes``), and the least a device must
#: have where no setting sets it (they fill it in steps of 2 GiB there).
TEST_CAPACITY = 64 << 20
LEAST_DEVICE = 8 << 30


@functools.cache
def _missing_capacity(name: str) -> str | None:
    try:
        settings = SETTINGS.updated(fake_memory_bytes=TEST_CAPACITY)
    except ConfigError:  # the fake is not installed: no such setting
        settings = SETTINGS
    with open_backend(name, settings=settings) as gpu:
        total = gpu.memory_info().total
    if total == TEST_CAPACITY or total >= LEAST_DEVICE:
        return None
    return (
        f"needs capacity: backend {name} has {format_bytes(total)} of memory and fake_memory_bytes does not set "
        f"it; the memory tests need a capacity they can set ({format_bytes(TEST_CAPACITY)}) or a device of "
        f"{format_bytes(LEAST_DEVICE)} or more"
    )


def missing(name: str, capability: str) -> str | None:
    """Why backend ``name`` lacks ``capability`` (a skip reason), or ``None``."""
    if capability == "capacity":
        return _missing_capacity(name)
    return testing.backend_capabilities(name, SETTINGS).why_not(capability)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "needs(*capabilities): skip on a backend that lacks one of them "
        "(kernels, interop, baseline, tensor_maps, peers, capacity)",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked ``needs(...)`` on a backend (its ``backend_name`` param) that lacks a capability."""
    callspec = getattr(item, "callspec", None)
    name = callspec.params.get("backend_name") if callspec is not None else None
    if not isinstance(name, str):
        return
    for marker in item.iter_markers("needs"):
        for capability in marker.args:
            why = missing(name, capability)
            if why is not None:
                pytest.skip(why)


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
