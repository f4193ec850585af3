"""The fixtures of the suite: the backends every test runs against, and the ``needs`` marker.

What the tests share besides fixtures is in ``tests/_support.py``.

``@pytest.mark.needs("kernels", ...)`` on a test that takes ``backend_name`` (or ``gpu``) skips it, with
the reason, on a backend that lacks one of the capabilities named: the optional primitives of
``metrale_core.testing.CAPABILITIES`` (``kernels``, ``interop``, ``baseline``, ``tensor_maps``, ``peers``) and
``capacity``, the memory the memory tests fill (a capacity ``fake_memory_bytes`` sets, or a device of 8 GiB or more).
A backend is probed once per run, only when a test that needs something runs on it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from metrale_core import GpuBackend, open_backend

from ._support import SETTINGS, backend_params, fake, missing

__all__ = ["fake"]  # a fixture defined in _support, offered to every test here


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
def unzoned_gpu(backend_name: str) -> Iterator[GpuBackend]:
    """As `gpu`, red zones off: for tests that count bytes and reuse exactly (a zoned piece waits for its check)."""
    with open_backend(backend_name, settings=SETTINGS.updated(redzone=0)) as backend:
        yield backend


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("mtp_")]:
        del sys.modules[name]
