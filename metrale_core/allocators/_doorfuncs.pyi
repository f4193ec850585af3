"""Stub of the compiled twin of `metrale_core.allocators.doorfuncs.c_functions` (``_doorfuncs.pyx``)."""

from .doorfuncs import DoorFunctions, DoorLike

def c_functions(door: DoorLike, device: int) -> DoorFunctions | None: ...
