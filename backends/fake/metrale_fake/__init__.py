"""metrale's fake backend: a whole device in host memory, for development and tests without a GPU.

Its public names load on first use (PEP 562): loading the plugin for its settings imports no numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._backend import FakeBackend
    from ._device import FAULT_OPS, FakeDevice
    from ._launch import FakeLaunch, MisalignedAddressError
    from ._settings import FakeSettings

__version__ = "0.2.0"

__all__ = ["FAULT_OPS", "FakeBackend", "FakeDevice", "FakeLaunch", "FakeSettings", "MisalignedAddressError"]

_WHERE = {
    "FAULT_OPS": "._device",
    "FakeBackend": "._backend",
    "FakeDevice": "._device",
    "FakeLaunch": "._launch",
    "FakeSettings": "._settings",
    "MisalignedAddressError": "._launch",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
