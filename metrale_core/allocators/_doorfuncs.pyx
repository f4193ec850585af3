# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`c_functions`][metrale_core.allocators.doorfuncs.c_functions]: one pair of C functions
that call a door's callables with the GIL, no ctypes in the way.

- C functions carry no context: the pair serves one door, the first of the process (torch has one current allocator
  at a time); `c_functions` answers ``None`` after that, and the caller makes ctypes callbacks instead.
- Nothing may cross into the framework's C++: what ``alloc`` answers passes the pure module's `address` rule, and a
  callable that raises (or answers what is no address) is logged, and the framework gets no memory.
"""

from libc.stdint cimport uintptr_t

from .doorfuncs import address as _address, log_failure as _log_failure

cdef object _alloc = None
cdef object _free = None
cdef bint _taken = False


cdef void* _alloc_c(size_t size, int device, void* stream) noexcept with gil:
    try:
        got = _address(_alloc(size, device, <uintptr_t>stream))
        return NULL if got == 0 else <void*><uintptr_t>got
    except BaseException:
        try:
            _log_failure("allocator door: alloc of %d bytes failed", size)
        except BaseException:
            pass
        return NULL


cdef void _free_c(void* ptr, size_t size, int device, void* stream) noexcept with gil:
    try:
        _free(<uintptr_t>ptr, size, device, <uintptr_t>stream)
    except BaseException:
        try:
            _log_failure("allocator door: free of %#x failed", <uintptr_t>ptr)
        except BaseException:
            pass


def c_functions(alloc, free):
    """The addresses of C functions calling ``alloc`` and ``free`` (``None``: this pair serves another door)."""
    global _alloc, _free, _taken
    if not (callable(alloc) and callable(free)):
        raise TypeError(f"c_functions: alloc and free must be callables, got {alloc!r} and {free!r}")
    if _taken:
        return None
    _alloc, _free, _taken = alloc, free, True
    return <uintptr_t>&_alloc_c, <uintptr_t>&_free_c
