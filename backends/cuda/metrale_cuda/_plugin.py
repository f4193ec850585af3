"""The CUDA backend's plugin: registered through ``metrale.backends`` like any other.

Importing it is cheap: ``cuda.bindings`` is imported only when the backend is
probed or opened.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Final

from metrale_core import MetraleError, MetraleSettings
from metrale_core.plugin import BackendRegistration, RawDevice, hookimpl

__all__ = ["PREFERENCE", "metrale_backend", "open_device", "probe", "versions"]

_log = logging.getLogger("metrale.cuda")

#: How strongly ``auto`` prefers this backend: real GPUs outrank the fake (``0``).
PREFERENCE: Final = 100


def probe(settings: MetraleSettings) -> str | None:
    """``None`` when a CUDA driver answers ``cuInit`` and reports a device, else why not.

    Never raises: a reason in words a user can act on (no driver library,
    ``cuInit``'s failure with its code's name, no device, cuda-bindings
    missing).
    """
    try:
        from ._driver import init_driver

        init_driver()
    except MetraleError as exc:
        return str(exc)
    except Exception as exc:  # a probe never raises
        _log.debug("the CUDA probe failed unexpectedly", exc_info=True)
        return f"the CUDA backend could not be probed: {type(exc).__name__}: {exc}"
    return None


def open_device(settings: MetraleSettings, ordinal: int) -> RawDevice:
    """Open CUDA device ``ordinal`` in its primary context.

    Raises [`BackendUnavailableError`][metrale_core.BackendUnavailableError] naming the ordinal
    and the reason when it cannot.
    """
    from ._device import CudaDevice

    return CudaDevice.open(ordinal)


def device_count(settings: MetraleSettings) -> int:
    """The devices the driver reports (``cuDeviceGetCount``, after ``CUDA_VISIBLE_DEVICES``)."""
    from ._driver import init_driver

    return init_driver()


def versions() -> Mapping[str, str]:
    """cuda-bindings' version and the CUDA version the driver supports, for ``metrale --version``.

    Needs no device and no ``cuInit`` (``cuDriverGetVersion`` answers before
    it); never raises: ``"not found"`` where no driver library answers.
    """
    try:
        from ._driver import IMPORT_ERROR, bindings_version, drv
    except Exception as exc:  # never raises
        return {"cuda-bindings": f"not importable ({type(exc).__name__})", "driver": "not found"}
    if drv is None:
        return {"cuda-bindings": f"not importable ({IMPORT_ERROR})", "driver": "not found"}
    try:
        err, version = drv.cuDriverGetVersion()
        driver = "not found" if int(err) else f"CUDA {int(version) // 1000}.{int(version) % 1000 // 10}"
    except Exception:  # no libcuda: the bindings raise where they would load it
        driver = "not found"
    return {"cuda-bindings": bindings_version(), "driver": driver}


@hookimpl
def metrale_backend(settings: MetraleSettings) -> BackendRegistration:
    """The CUDA backend: available where an NVIDIA driver and a device answer."""
    return BackendRegistration(
        open=open_device,
        probe=probe,
        description="NVIDIA GPUs through the CUDA driver API (cuda-bindings)",
        preference=PREFERENCE,
        versions=versions,
        device_count=device_count,
    )
