"""Stub of the compiled twin of `metrale_core.allocators.doorfuncs.c_functions` (``_doorfuncs.pyx``)."""

from collections.abc import Callable

def c_functions(
    alloc: Callable[[int, int, int], int | None], free: Callable[[int, int, int, int], None]
) -> tuple[int, int] | None: ...
