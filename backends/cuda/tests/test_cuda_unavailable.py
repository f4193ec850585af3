"""The CUDA backend on a machine without a GPU: it says why it cannot run, and raises only metrale's errors.

These run in CI, where cuda-bindings is installed but no NVIDIA driver is.
Where a GPU answers (the probe returns ``None``) they are skipped: the GPU
tests cover that machine.
"""

from __future__ import annotations

import importlib.util

import pytest

from metrale_core import (
    BackendUnavailableError,
    MetraleSettings,
    OutOfMemoryError,
    available_backends,
    open_backend,
)
from metrale_cuda._driver import check
from metrale_cuda._plugin import metrale_backend, probe

SETTINGS = MetraleSettings()
_REASON = probe(SETTINGS)


def _have_bindings() -> bool:
    try:
        return importlib.util.find_spec("cuda.bindings.driver") is not None
    except ImportError:
        return False


pytestmark = [
    pytest.mark.skipif(not _have_bindings(), reason="cuda-bindings is not installed"),
    pytest.mark.skipif(
        _REASON is None, reason="a CUDA driver and device answer here: the GPU tests cover this machine"
    ),
]


def test_probe_names_the_missing_driver() -> None:
    reason = probe(SETTINGS)
    assert isinstance(reason, str)
    assert "driver" in reason.lower()


def test_registration_probe_agrees() -> None:
    registration = metrale_backend(SETTINGS)
    assert registration.probe(SETTINGS) == _REASON
    assert registration.description


def test_open_raises_backend_unavailable_naming_the_ordinal() -> None:
    registration = metrale_backend(SETTINGS)
    with pytest.raises(BackendUnavailableError) as info:
        registration.open(SETTINGS, 0)
    assert "device 0" in str(info.value)
    assert "driver" in str(info.value).lower()


def test_discovery_lists_cuda_as_unavailable_with_the_reason() -> None:
    infos = available_backends(SETTINGS)
    if "cuda" not in infos:
        pytest.skip("metrale-cuda is not installed as a distribution (no entry point)")
    info = infos["cuda"]
    assert not info.available
    assert info.reason is not None
    assert "driver" in info.reason.lower()
    with pytest.raises(BackendUnavailableError):
        open_backend("cuda", settings=SETTINGS)


def test_checker_passes_success_and_raises_the_tables_class() -> None:
    check(0, "cuMemAlloc")
    with pytest.raises(OutOfMemoryError) as info:
        check(2, "cuMemAlloc of 64 bytes", requested=64)
    assert info.value.code == 2
    assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert info.value.requested == 64


def test_a_primary_context_poisoned_by_an_earlier_fault_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen on the H100: after a kernel faulted, every later open in the process got a bare
    ``cuDevicePrimaryCtxRetain failed [CUDA_ERROR_ILLEGAL_ADDRESS (700)]`` while a backend still held the
    context. The refusal now says why and what to do (the driver calls are stood in for here)."""
    import types

    from metrale_cuda import _device

    stand_in = types.SimpleNamespace(cuDeviceGet=lambda ordinal: (0, ordinal),
                                     cuDevicePrimaryCtxRetain=lambda device: (700, None))
    monkeypatch.setattr(_device, "drv", stand_in)
    monkeypatch.setattr(_device._d, "init_driver", lambda: 1)
    monkeypatch.setattr(_device._d, "warn_if_driver_older_than_bindings", lambda: None)
    with pytest.raises(BackendUnavailableError, match="earlier fault in this process") as info:
        _device.CudaDevice.open(0)
    assert info.value.code == 700
    assert "open the backend in a new process" in str(info.value)
