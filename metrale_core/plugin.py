"""Everything a backend plugin needs from metrale, in one public module.

A backend imports from here (or from :mod:`metrale_core`), never from a
private ``metrale_core._*`` module::

    from metrale_core.plugin import BackendRegistration, RawDevice, error_for_code, hookimpl

- the contract: :class:`RawDevice` (the raw layer a backend implements),
  :class:`BackendRegistration` (what its ``metrale_backend`` hook returns),
  :data:`hookimpl` (the marker of its hooks), :class:`PluginSettings` and
  :data:`Size` (its own settings, through the ``metrale_settings`` hook);
- the records a raw layer takes and returns: :class:`Baseline`,
  :class:`ForeignMemory`, :class:`LaunchArg`, :class:`KernelImplementation`,
  :class:`TensorMapEncoding` (and :class:`TensorMap`, what a tensor-map
  argument's :attr:`LaunchArg.tensor_map` holds), :func:`check_tensor_map`
  (the driver's rules, for a backend that refuses as the driver does);
- the error table: :func:`error_for_code` (the typed error for a CUDA result
  name or code), :func:`cuda_code` (a name's code) and :func:`is_sticky`
  (whether a result poisons the context, as a device fault does);
- helpers: :func:`as_index` (an ``int``-like argument as an ``int``, or
  ``None``) and :func:`format_bytes` (a byte count as people read it).
"""

from __future__ import annotations

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

from ._errors import is_sticky
from ._settings import PluginSettings, Size
from ._types import as_index, format_bytes

__all__ = [
    "BackendRegistration",
    "Baseline",
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
    "hookimpl",
    "is_sticky",
]
