# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`c_functions`][metrale_core.allocators.doorfuncs.c_functions]: one pair of C functions
that call a door's callables with the GIL, no ctypes in the way.

- C functions carry no context: the pair serves one door, the first of the process (torch has one current allocator
  at a time); `c_functions` answers ``None`` after that, and the caller makes ctypes callbacks instead.
- Nothing may cross into the framework's C++: a callable that raises is logged, and the framework gets no memory.
"""

from libc.stdint cimport uintptr_t

import logging

_log = logging.getLogger("metrale")

cdef object _alloc = None
cdef object _free = None


cdef void* _alloc_c(size_t size, int device, void* stream) noexcept with gil:
    try:
        got = _alloc(size, device, <uintptr_t>stream)
        return NULL if not got else <void*><uintptr_t>got
    except BaseException:
        _log.exception("allocator door: alloc of %d bytes failed", size)
        return NULL


cdef void _free_c(void* ptr, size_t size, int device, void* stream) noexcept with gil:
    try:
        _free(<uintptr_t>ptr, size, device, <uintptr_t>stream)
    except BaseException:
        _log.exception("allocator door: free of %#x failed", <uintptr_t>ptr)


def c_functions(alloc, free):
    """The addresses of C functions calling ``alloc`` and ``free`` (``None``: this pair serves another door)."""
    global _alloc, _free
    if _alloc is not None:
        return None
    _alloc, _free = alloc, free
    return <uintptr_t>&_alloc_c, <uintptr_t>&_free_c
