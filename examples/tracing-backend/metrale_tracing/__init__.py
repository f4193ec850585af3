"""metrale-tracing: a third-party backend written only against metrale's public plugin contract.

It wraps the fake device (``metrale_fake.FakeDevice``) and records every raw
call the core makes, so a host application can see exactly which driver
calls its metrale calls turn into:

    from metrale_core import open_backend

    with open_backend("tracing") as gpu:
        gpu.free(gpu.alloc(64))
        print(gpu.raw_calls())   # ['stream_create', 'alloc', 'free']

How many calls it keeps is a setting of its own, ``METRALE_TRACING_MAX_CALLS``
(``MetraleSettings(tracing_max_calls=100)``): see ``_settings.py``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._device import TracingBackend, TracingDevice
    from ._settings import TracingSettings

__version__ = "0.2.0"

__all__ = ["TracingBackend", "TracingDevice", "TracingSettings"]

# Public names load on first use (PEP 562): loading the plugin for its settings imports no fake device.
_WHERE = {"TracingBackend": "._device", "TracingDevice": "._device", "TracingSettings": "._settings"}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value
