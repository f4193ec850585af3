"""metrale's fake backend: a whole device in host memory, for development and tests without a GPU."""

from __future__ import annotations

from ._backend import FakeBackend
from ._device import FAULT_OPS, FakeDevice
from ._launch import FakeLaunch, MisalignedAddressError
from ._settings import FakeSettings

__all__ = ["FAULT_OPS", "FakeBackend", "FakeDevice", "FakeLaunch", "FakeSettings", "MisalignedAddressError"]
