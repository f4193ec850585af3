"""The two C functions a framework's allocator hook calls, made for two Python callables.

- `c_functions(alloc, free)` returns the addresses of ``void* alloc(size_t size, int device, void* stream)`` and
  ``void free(void* ptr, size_t size, int device, void* stream)`` (torch's ``CUDAPluggableAllocator`` calls these),
  which call ``alloc(size, device, stream)`` (an address, or 0 / ``None`` for none) and
  ``free(ptr, size, device, stream)``. A callable that raises is logged, and the framework gets no memory: nothing
  may cross into its C++.
- Here they are ctypes callbacks, kept for the life of the process: the framework may call them until it exits.
- Its compiled twin (``_doorfuncs.pyx``) has one pair of C functions that call the callables with the GIL, without
  ctypes in the way: it serves the first door of the process, and answers ``None`` after that (the caller then
  makes ctypes callbacks here).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

__all__ = ["c_functions"]

_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)

_log = logging.getLogger("metrale")

#: Every callback made here, never let go.
_KEPT: list[tuple[object, object]] = []


def c_functions(
    alloc: Callable[[int, int, int], int | None], free: Callable[[int, int, int, int], None]
) -> tuple[int, int] | None:
    """The addresses of C functions calling ``alloc`` and ``free`` (``None``: none can be made here; never here)."""

    def alloc_c(size: int, device: int, stream: int | None) -> int | None:
        try:  # (a ctypes callback that raises answers an undefined pointer: never let it)
            return alloc(size, device, stream or 0) or None
        except BaseException:
            _log.exception("allocator door: alloc of %d bytes failed", size)
            return None

    def free_c(ptr: int | None, size: int, device: int, stream: int | None) -> None:
        try:
            free(ptr or 0, size, device, stream or 0)
        except BaseException:
            _log.exception("allocator door: free of %#x failed", ptr or 0)

    alloc_fn, free_fn = _ALLOC(alloc_c), _FREE(free_c)
    _KEPT.append((alloc_fn, free_fn))
    alloc_at = ctypes.cast(alloc_fn, ctypes.c_void_p).value
    free_at = ctypes.cast(free_fn, ctypes.c_void_p).value
    assert alloc_at is not None and free_at is not None
    return alloc_at, free_at
