"""The CUDA backend's plugin: registered through ``metrale.backends`` like any other.

Importing it is cheap: ``cuda.bindings`` is imported only when the backend is
probed or opened.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Final

from metrale_core import MetraleError, MetraleSettings
from metrale_core.plugin import BackendRegistration, RawDevice, hookimpl

__all__ = ["PREFERENCE", "driver_calls", "metrale_backend", "open_device", "probe", "versions"]

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
    """Open CUDA device ``ordinal`` in its primary context: with the compiled driver calls where they were built and
    the setting ``pure`` is off (``_compiled.device_class``), else with the pure ones.

    Raises [`BackendUnavailableError`][metrale_core.BackendUnavailableError] naming the ordinal
    and the reason when it cannot.
    """
    from ._compiled import device_class

    return device_class(settings.pure).open(ordinal)


def device_count(settings: MetraleSettings) -> int:
    """The devices the driver reports (``cuDeviceGetCount``, after ``CUDA_VISIBLE_DEVICES``)."""
    from ._driver import init_driver

    return init_driver()


def driver_calls(settings: MetraleSettings | None = None) -> str:
    """Which driver calls a device opened with ``settings`` makes, in words: ``compiled: cuda.bindings.cydriver``, or
    the pure calls and why. Never raises."""
    try:
        from ._compiled import describe

        return describe(settings.pure if settings is not None else False)
    except Exception as exc:  # cuda-bindings not importable, say
        return f"pure Python: cuda.bindings.driver ({type(exc).__name__}: {exc})"


def versions(settings: MetraleSettings | None = None) -> Mapping[str, str]:
    """cuda-bindings' version, the CUDA version the driver supports and the driver calls a device makes (compiled or
    pure, `driver_calls`), for ``metrale --version``.

    Needs no device and no ``cuInit`` (``cuDriverGetVersion`` answers before
    it); never raises: ``"not found"`` where no driver library answers.
    """
    try:
        from ._driver import IMPORT_ERROR, bindings_version, drv
    except Exception as exc:  # never raises
        return {"cuda-bindings": f"not importable ({type(exc).__name__})", "driver": "not found",
                "driver calls": "none: cuda-bindings is not importable"}
    if drv is None:
        return {"cuda-bindings": f"not importable ({IMPORT_ERROR})", "driver": "not found",
                "driver calls": "none: cuda-bindings is not importable"}
    try:
        err, version = drv.cuDriverGetVersion()
        driver = "not found" if int(err) else f"CUDA {int(version) // 1000}.{int(version) % 1000 // 10}"
    except Exception:  # no libcuda: the bindings raise where they would load it
        driver = "not found"
    return {"cuda-bindings": bindings_version(), "driver": driver, "driver calls": driver_calls(settings)}


@hookimpl
def metrale_backend(settings: MetraleSettings) -> BackendRegistration:
    """The CUDA backend: available where an NVIDIA driver and a device answer."""
    return BackendRegistration(
        open=open_device,
        probe=probe,
        description="NVIDIA GPUs through the CUDA driver API (cuda-bindings)",
        preference=PREFERENCE,
        versions=functools.partial(versions, settings),  # (the setting pure: which driver calls run)
        device_count=device_count,
    )
