"""The two C functions a framework's allocator hook calls, made for two Python callables.

- `c_functions(alloc, free)` returns the addresses of ``void* alloc(size_t size, int device, void* stream)`` and
  ``void free(void* ptr, size_t size, int device, void* stream)`` (torch's ``CUDAPluggableAllocator`` calls these),
  which call ``alloc(size, device, stream)`` and ``free(ptr, size, device, stream)``.
- Nothing may cross into the framework's C++. ``alloc`` answers an address (an integer from 1 to 2**64 - 1), or 0 /
  ``None`` for none; anything else it answers, and anything it raises, gives the framework no memory, logged (a log
  that fails is dropped).
- Here they are ctypes callbacks, kept for the life of the process: the framework may call them until it exits.
- Its compiled twin (``_doorfuncs.pyx``) has one pair of C functions that call the callables with the GIL, without
  ctypes in the way: it serves the first door of the process, and answers ``None`` after that (the caller then
  makes ctypes callbacks here).
"""

from __future__ import annotations

import ctypes
import logging
import operator
from collections.abc import Callable
from typing import Final

__all__ = ["address", "c_functions", "log_failure"]

_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_ADDRESS_END: Final = 1 << 64

_log = logging.getLogger("metrale")

#: Every callback made here, never let go.
_KEPT: list[tuple[object, object]] = []


def address(got: object) -> int:
    """What ``alloc`` answered, as the address the framework gets: 0 for none (``None``, 0); an integer from 1 to
    2**64 - 1 as it is; anything else raises."""
    if got is None:
        return 0
    value = operator.index(got)  # type: ignore[arg-type]  # (a float, a string: TypeError)
    if not 0 <= value < _ADDRESS_END:
        raise OverflowError(f"allocator door: {value:#x} is no address")
    return value


def log_failure(message: str, value: object) -> None:
    try:  # noqa: SIM105 - no contextlib: at shutdown the module's names may be gone already
        _log.exception(message, value)
    except BaseException:  # (at shutdown the logger is gone; a handler may raise): nothing may cross into C
        pass


def c_functions(
    alloc: Callable[[int, int, int], int | None], free: Callable[[int, int, int, int], None]
) -> tuple[int, int] | None:
    """The addresses of C functions calling ``alloc`` and ``free`` (``None``: none can be made here; never here)."""
    if not (callable(alloc) and callable(free)):
        raise TypeError(f"c_functions: alloc and free must be callables, got {alloc!r} and {free!r}")

    def alloc_c(size: int, device: int, stream: int | None) -> int | None:
        try:  # (a ctypes callback that raises, or answers what is no pointer, gives an undefined one: never let it)
            return address(alloc(size, device, stream or 0)) or None
        except BaseException:
            log_failure("allocator door: alloc of %d bytes failed", size)
            return None

    def free_c(ptr: int | None, size: int, device: int, stream: int | None) -> None:
        try:
            free(ptr or 0, size, device, stream or 0)
        except BaseException:
            log_failure("allocator door: free of %#x failed", ptr or 0)

    alloc_fn, free_fn = _ALLOC(alloc_c), _FREE(free_c)
    _KEPT.append((alloc_fn, free_fn))
    alloc_at = ctypes.cast(alloc_fn, ctypes.c_void_p).value
    free_at = ctypes.cast(free_fn, ctypes.c_void_p).value
    assert alloc_at is not None and free_at is not None
    return alloc_at, free_at
