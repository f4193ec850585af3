"""Stub of the compiled twin of `metrale_core._memory.lane.DeviceLane` (``_lane.pyx``): the same interface."""

from typing import final

from .._device.buffer import DeviceBuffer
from .lane import LaneParts, LaneWork

@final
class DeviceLane:
    def __init__(self, allocator: LaneWork, parts: LaneParts) -> None: ...
    def alloc(self, nbytes: object) -> DeviceBuffer: ...
    def free(self, buf: object) -> None: ...
