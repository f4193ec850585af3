"""Stub of the compiled twin of `metrale_core._device.buffer.DeviceBuffer._make` (``_handle.pyx``; its C-level
``make_buffer`` is in ``_handle.pxd``)."""

from typing import Any

from .buffer import DeviceBuffer

#: Whether ``make`` stores into ``DeviceBuffer``'s slots directly (else it calls ``DeviceBuffer._make``).
DIRECT: bool

def make(ptr: int, nbytes: int, kind: str, index: int, site: str, owner: Any = None) -> DeviceBuffer: ...
