"""Stub of the compiled twin of `metrale_core._launch.lane.LaunchLane` (``_lane.pyx``): the same interface."""

from collections.abc import Sequence
from typing import final

from .._device.handles import Stream
from .lane import LaunchLaneParts, LaunchWork
from .registry import Kernel

@final
class LaunchLane:
    def __init__(self, kernels: LaunchWork, parts: LaunchLaneParts) -> None: ...
    def launch(
        self, kernel: Kernel, grid: object, block: object, args: Sequence[object], shared_mem: object,
        stream: Stream | None,
    ) -> None: ...
