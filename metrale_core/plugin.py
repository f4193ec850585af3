"""Everything a backend plugin needs from metrale, in one public module.

A backend imports from here (or from [`metrale_core`][metrale_core]), never from a
private ``metrale_core._*`` module:

    from metrale_core.plugin import BackendRegistration, RawDevice, error_for_code, hookimpl

- the contract: [`RawDevice`][metrale_core.RawDevice] (the raw layer a backend implements),
  [`BackendRegistration`][metrale_core.BackendRegistration] (what its ``metrale_backend`` hook returns),
  [`hookimpl`][metrale_core.hookimpl] (the marker of its hooks), [`PluginSettings`][metrale_core.plugin.PluginSettings]
  and [`Size`][metrale_core.plugin.Size] (its own settings, through the ``metrale_settings`` hook);
- the records a raw layer takes and returns: [`Baseline`][metrale_core.Baseline],
  [`ForeignMemory`][metrale_core.ForeignMemory], [`LaunchArg`][metrale_core.LaunchArg],
  [`KernelImplementation`][metrale_core.KernelImplementation], [`TensorMapEncoding`][metrale_core.TensorMapEncoding]
  (and [`TensorMap`][metrale_core.TensorMap], what a tensor-map argument's
  [`LaunchArg.tensor_map`][metrale_core.LaunchArg.tensor_map] holds),
  [`check_tensor_map`][metrale_core.check_tensor_map] (the driver's rules, for a backend that refuses as the driver
  does), and what the core asks of it: ``AllocKind`` (the kind of memory ``alloc`` and ``free`` are asked for) and
  ``CopyDirection`` (a baseline's copy: ``"dtod"``, ``"htod"`` or ``"dtoh"``) and ``CaptureMode`` (a thread's stream
  capture mode: ``"global"``, ``"thread_local"`` or ``"relaxed"``);
- the error table: [`error_for_code`][metrale_core.error_for_code] (the typed error for a CUDA result
  name or code), [`cuda_code`][metrale_core.cuda_code] (a name's code) and [`is_sticky`][metrale_core.plugin.is_sticky]
  (whether a result poisons the context, as a device fault does);
- helpers: [`as_index`][metrale_core.plugin.as_index] (an ``int``-like argument as an ``int``, or
  ``None``) and [`format_bytes`][metrale_core.plugin.format_bytes] (a byte count as people read it);
- the device calls in C: [`get_include`][metrale_core.plugin.get_include] (the folder of ``metrale/device_calls.h``,
  the struct a [`RawDevice.device_calls`][metrale_core.RawDevice.device_calls] capsule named ``DEVICE_CALLS`` holds).
"""

from __future__ import annotations

from pathlib import Path

from metrale_core import (
    BackendRegistration,
    Baseline,
    ForeignMemory,
    KernelImplementation,
    LaunchArg,
    RawDevice,
    TensorMap,
    TensorMapEncoding,
    check_tensor_map,
    cuda_code,
    error_for_code,
    hookimpl,
)

from ._device.raw import DEVICE_CALLS, CaptureMode, CopyDirection
from ._errors import is_sticky
from ._settings.parsing import Size
from ._settings.plugins import PluginSettings
from ._types import AllocKind, as_index, format_bytes

__all__ = [
    "DEVICE_CALLS",
    "AllocKind",
    "BackendRegistration",
    "Baseline",
    "CaptureMode",
    "CopyDirection",
    "ForeignMemory",
    "KernelImplementation",
    "LaunchArg",
    "PluginSettings",
    "RawDevice",
    "Size",
    "TensorMap",
    "TensorMapEncoding",
    "as_index",
    "check_tensor_map",
    "cuda_code",
    "error_for_code",
    "format_bytes",
    "get_include",
    "hookimpl",
    "is_sticky",
]


def get_include() -> str:
    """The folder to add to a C extension's include path for ``#include "metrale/device_calls.h"``: the one C
    definition of the device calls (the struct ``metrale_device_calls_v1``, its return codes and the capsule's name,
    ``DEVICE_CALLS``) that a backend may offer from
    [`RawDevice.device_calls`][metrale_core.RawDevice.device_calls]. NumPy's ``numpy.get_include()`` pattern:

        Extension("my_backend._calls", ["my_backend/_calls.c"], include_dirs=[metrale_core.plugin.get_include()])

    :returns: the absolute path of the ``include`` folder inside the installed ``metrale_core`` package.
    """
    return str(Path(__file__).resolve().parent / "include")
