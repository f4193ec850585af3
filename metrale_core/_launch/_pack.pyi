"""Stub of the compiled twin of `metrale_core._launch.registry.pack_args` (``_pack.pyx``): the same interface."""

from collections.abc import Callable

from .._device.buffer import DeviceBuffer
from .._types import LaunchArg
from .registry import Kernel

def pack_args(kernel: Kernel, args: object, what: str, live: Callable[[DeviceBuffer], None]) -> list[LaunchArg]: ...
C_ARGS: bool
