"""What the tests share: the run's settings, sizes, the capability probe, and small readers.

Import it as ``from tests._support import ...``; the fixtures built on it are in ``tests/conftest.py``.

- `SETTINGS`: the settings of this run, from ``METRALE_*`` (the GPU runs set ``METRALE_TARGET_HW`` and
  ``METRALE_REDZONE``).
- `backend_params`: every discovered backend, the unavailable ones skipped with their reason.
- `missing`: why a backend lacks a capability (a skip reason), for the ``needs`` marker.
- `KIB`, `MIB`, `GIB`; `step`: a step of memory that moves the needle on this backend.
- `checked_inside`: whether a backend checks red zones inside captured graphs.
- `read_bytes`: a buffer's bytes, copied to the host.
- `install_distribution`: an installed distribution laid out on a path, as pip would.
- `metrale`: the command line run as a user runs it, in a subprocess without ``METRALE_*``.
- `fake`: a fixture, the fake backend opened with `SETTINGS` (``tests/conftest.py`` and the fake's own tests use it).
- `compiled_twin`: a compiled twin by its name in `TWINS`, or a skip where it was not built here.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings as _hypothesis

from metrale_core import ConfigError, GpuBackend, MetraleSettings, open_backend, testing
from metrale_core._twins import TWINS, built
from metrale_core.plugin import DEVICE_CALLS, format_bytes

__all__ = [
    "GIB", "KIB", "LEAST_DEVICE", "MIB", "SETTINGS", "TEST_CAPACITY", "backend_params", "checked_inside",
    "compiled_twin", "fake", "install_distribution", "metrale", "missing", "read_bytes", "step",
]

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

#: The settings of this run, from METRALE_* (the GPU runs set METRALE_TARGET_HW and METRALE_REDZONE).
SETTINGS = MetraleSettings()

def backend_params() -> list[object]:
    """Every discovered backend; the unavailable ones are skipped with their reason."""
    return testing.backend_params(SETTINGS, expected=("cuda",))


#: The capacity the memory tests set on the fake (``fake_memory_bytes``), and the least a device must
#: have where no setting sets it (they fill it in steps of 2 GiB there).
TEST_CAPACITY = 64 << 20
LEAST_DEVICE = 8 << 30


def compiled_twin(name: str) -> object:
    """The compiled twin ``name`` (a class or a function, as `TWINS` names it); a skip where it was not built."""
    if not built()[name]:
        pytest.skip(f"the {name} twin was not compiled here (no C compiler at install): the pure code runs")
    module, attr = TWINS[name]
    return getattr(importlib.import_module(module), attr)


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


def step(gpu: GpuBackend) -> int:
    """A step of memory that moves the needle: 8 MiB on the fake, 2 GiB on a GPU."""
    return 8 * MIB if gpu.memory_info().total <= 64 * MIB else 2 * GIB


def checked_inside(gpu: GpuBackend) -> bool:
    """Whether graphs are checked inside (the verdict kernel as their last node), not by scans after launches."""
    return gpu.redzone_checks.mode == "inside"


def read_bytes(gpu: GpuBackend, buf: object, n: int) -> bytes:
    """The first ``n`` bytes of ``buf``, copied to the host."""
    out = bytearray(n)
    gpu.copy_to_host(out, buf)  # type: ignore[arg-type]
    return bytes(out)


def install_distribution(site: Path, dist: str, module: str, source: str, eps: dict[str, str]) -> None:
    """Lay out an installed distribution (dist-info and module), as pip would."""
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{name} = {value}" for name, value in eps.items())
    (info / "entry_points.txt").write_text(f"[metrale.backends]\n{lines}\n")


def metrale(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m metrale_core ARGS`` with ``env`` and no other ``METRALE_*`` variable."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "metrale_core", *args],
        capture_output=True, text=True, env=environ, timeout=300, check=False,
    )


@pytest.fixture
def fake() -> Iterator[GpuBackend]:
    """The fake backend, opened with this run's settings, closed after the test."""
    with open_backend("fake", settings=SETTINGS) as backend:
        yield backend


def in_threads(work: Callable[[int], None], count: int = 4) -> None:
    """Run ``work(t)`` on ``count`` threads at once (``t`` = 0, 1, ...); raise the first error any of them met."""
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            work(t)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


class DeviceCallsTable(ctypes.Structure):
    """A plugin's ``metrale_core.device_calls.v1`` struct (``RawDevice.device_calls``, ``metrale/device_calls.h``), its
    functions callable from Python as the core calls them: with the GIL held (``PYFUNCTYPE``)."""

    _fields_ = (
        ("size", ctypes.c_size_t),
        ("state", ctypes.c_void_p),
        ("alloc", ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64))),
        ("free", ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64)),
        ("memset", ctypes.PYFUNCTYPE(
            ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_size_t, ctypes.py_object
        )),
        ("graph_launch", ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.py_object, ctypes.py_object)),
        ("launch", ctypes.PYFUNCTYPE(
            ctypes.c_int, ctypes.c_void_p, ctypes.py_object, ctypes.POINTER(ctypes.c_uint), ctypes.c_uint,
            ctypes.py_object, ctypes.py_object,
        )),
    )


def device_calls_table(capsule: object) -> DeviceCallsTable:
    """The struct a ``device_calls()`` capsule points at (valid while the capsule lives)."""
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, (ctypes.py_object, ctypes.c_char_p)
    return DeviceCallsTable.from_address(get_pointer(capsule, DEVICE_CALLS.encode()))


def examples(count: int) -> int:
    """A test's own Hypothesis example count (or a count of its own making), scaled down to the loaded profile:
    ``count`` under "ci" (40 examples a test) and "thorough", a fifth under "fast" (8: ``dev.py test --fast``)."""
    ci = _hypothesis.get_profile("ci").max_examples
    return max(1, min(count, count * _hypothesis.default.max_examples // ci))

