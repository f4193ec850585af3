# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`c_functions`][metrale_core.allocators.doorfuncs.c_functions]: one set of C functions
(alloc, free, record_stream, graph_captured) that call a door with the GIL, no ctypes in the way.

- C functions carry no context: the pair serves one door, the first of the process (torch has one current allocator
  at a time); `c_functions` answers ``None`` after that, and the caller makes ctypes callbacks instead.
- A compiled door (``door.py`` compiled as ``_door``) is called at C level (`Door.alloc_c`, `Door.free_c`): no Python
  frame between the framework's hook and the pool's compiled lane. Any other door is called through its methods.
- Nothing may cross into the framework's C++: what a door's ``alloc`` answers passes the pure module's `address`
  rule, and a call that raises (or answers what is no address) is logged, and the framework gets no memory.
"""

import logging

from libc.stdint cimport uintptr_t

from ._door cimport Door

from .doorfuncs import DoorFunctions as _DoorFunctions
from .doorfuncs import address as _address
from .doorfuncs import graph_captured as _graph_captured
from .doorfuncs import log_failure as _log_failure
from .doorfuncs import wrong_device as _wrong_device

_log = logging.getLogger("metrale")

cdef object _door = None
cdef int _device = 0
cdef bint _compiled = False
cdef bint _taken = False
cdef bint _ready = False  # the module's Python objects are made (its import ran to the end)


cdef void* _alloc_c(size_t size, int device, void* stream) noexcept with gil:
    try:
        if device != _device:
            _wrong_device(_door, device, _device)
            return NULL
        if _compiled:
            return <void*>(<Door>_door).alloc_c(size, <uintptr_t>stream)
        got = _address(_door.alloc(size, <uintptr_t>stream))
        return NULL if got == 0 else <void*><uintptr_t>got
    except BaseException:
        try:
            _log_failure("allocator door: alloc of %d bytes failed", size)
        except BaseException:
            pass
        return NULL


cdef void _free_c(void* ptr, size_t size, int device, void* stream) noexcept with gil:
    if _compiled:
        (<Door>_door).free_c(<uintptr_t>ptr)
        return
    try:
        _door.free(<uintptr_t>ptr)
    except BaseException:
        try:
            _log_failure("allocator door: free of %#x failed", <uintptr_t>ptr)
        except BaseException:
            pass


cdef void _record_c(void* ptr, void* stream) noexcept with gil:
    try:
        _door.record(<uintptr_t>ptr, <uintptr_t>stream)
    except BaseException:
        try:
            _log_failure("allocator door: record_stream of %#x failed", <uintptr_t>ptr)
        except BaseException:
            pass


cdef void _captured_c(int device, unsigned long long id_0, unsigned long long id_1) noexcept with gil:
    try:
        _graph_captured(_door, device, (id_0, id_1))
    except BaseException:
        try:
            _log_failure("allocator door: a graph capture's end on device %d failed", device)
        except BaseException:
            pass


# The pair under fixed names, exported from this module's shared library, for a framework that finds its allocator's
# functions by name (torch's ``CUDAPluggableAllocator(path, alloc_fn_name, free_fn_name)``, as RMM's are found): the
# same functions, serving the same door (none until `c_functions` gave the pair to one: then they give no memory).
cdef public void* metrale_door_alloc(size_t size, int device, void* stream) noexcept nogil:
    if not _taken:  # (C statics: false too where the library was loaded by name before Python imported the module)
        if _ready:
            _untaken(size)
        return NULL
    return _alloc_c(size, device, stream)


cdef public void metrale_door_free(void* ptr, size_t size, int device, void* stream) noexcept nogil:
    if _taken:
        _free_c(ptr, size, device, stream)


cdef void _untaken(size_t size) noexcept with gil:
    try:
        _log.error("allocator door: alloc of %d bytes by name before any door took the C functions (c_functions)",
                   size)
    except BaseException:
        pass


def c_functions(door, device):
    """The addresses of C functions calling ``door`` for memory on ``device`` (``None``: this pair serves another
    door)."""
    global _door, _device, _compiled, _taken
    if not all(callable(getattr(door, name, None)) for name in ("alloc", "free", "record", "refuse")):
        raise TypeError(f"c_functions: {door!r} is no door (it needs alloc, free, record and refuse)")
    if type(device) is not int:
        raise TypeError(f"c_functions: device must be an int, got {device!r}")
    if _taken:
        return None
    _door, _device, _compiled, _taken = door, device, type(door) is Door, True
    return _DoorFunctions(<uintptr_t>&_alloc_c, <uintptr_t>&_free_c, <uintptr_t>&_record_c, <uintptr_t>&_captured_c)


_ready = True
