# cython: language_level=3, binding=True, embedsignature=True
# distutils: language = c++
"""The compiled twin of [`c_functions`][metrale_core.allocators.doorfuncs.c_functions]: one set of C functions
(alloc, free, record_stream, graph_captured) that call a door with the GIL, no ctypes in the way.

- C functions carry no context: the pair serves one door, the first of the process (torch has one current allocator
  at a time); `c_functions` answers ``None`` after that, and the caller makes ctypes callbacks instead.
- A compiled door (``door.py`` compiled as ``_door``) is called at C level (`Door.alloc_c`, `Door.free_c`): no Python
  frame between the framework's hook and the pool's compiled lane. Any other door is called through its methods.
- No Python exception crosses into the framework: what a door's ``alloc`` answers passes the pure module's `address`
  rule, and a call that raises (or answers what is no address) is logged, and the framework gets no memory.
- Compiled as C++, for the pair exported by name (``metrale_door_alloc``, ``metrale_door_free``), which only a C++
  caller finds (torch's ``CUDAPluggableAllocator``): where the door gives no memory for a non-empty request, it
  throws a ``std::runtime_error`` carrying the door's refusal (`doorfuncs.refusal`: "CUDA out of memory." and the
  sites holding memory, for an out-of-memory), thrown after the GIL is let go. torch turns it into a
  ``RuntimeError`` in the calling Python code, as it does RMM's ``rmm::out_of_memory``, instead of a tensor at
  address 0 whose first kernel ends the CUDA context. The functions given by address (`c_functions`) answer NULL:
  their caller may be C.
"""

import logging

from libc.stdint cimport uintptr_t

from ._door cimport Door

cdef extern from *:
    """
    #include <stdexcept>
    #include <string>
    #if defined(_WIN32)
    #define METRALE_DOOR_EXPORT __declspec(dllexport)
    #else
    #define METRALE_DOOR_EXPORT __attribute__((visibility("default")))
    #endif
    /* why the door gave this thread no memory last: what the exported alloc throws */
    static thread_local std::string metrale_door_why;
    static void metrale_door_say(const char *why) { metrale_door_why = why; }
    /* the module's functions the exported pair calls, set when Python imports the module (none before) */
    typedef void *(*metrale_door_alloc_fn)(size_t, int, void *);
    typedef void (*metrale_door_free_fn)(void *, size_t, int, void *);
    static metrale_door_alloc_fn metrale_door_alloc_to = nullptr;
    static metrale_door_free_fn metrale_door_free_to = nullptr;
    extern "C" {
    METRALE_DOOR_EXPORT void *metrale_door_alloc(size_t size, int device, void *stream) {
        if (!metrale_door_alloc_to)
            throw std::runtime_error("metrale: its allocator functions are loaded, but Python did not import "
                                     "metrale_core.allocators._doorfuncs: no door serves them");
        void *ptr = metrale_door_alloc_to(size, device, stream);
        if (!ptr && size) throw std::runtime_error(metrale_door_why);
        return ptr;
    }
    METRALE_DOOR_EXPORT void metrale_door_free(void *ptr, size_t size, int device, void *stream) {
        if (metrale_door_free_to) metrale_door_free_to(ptr, size, device, stream);
    }
    }
    """
    ctypedef void* (*_alloc_fn "metrale_door_alloc_fn")(size_t, int, void*) noexcept nogil
    ctypedef void (*_free_fn "metrale_door_free_fn")(void*, size_t, int, void*) noexcept nogil
    _alloc_fn _alloc_to "metrale_door_alloc_to"
    _free_fn _free_to "metrale_door_free_to"
    void _say "metrale_door_say"(const char *why) noexcept nogil

from .doorfuncs import DoorFunctions as _DoorFunctions
from .doorfuncs import address as _address
from .doorfuncs import graph_captured as _graph_captured
from .doorfuncs import log_failure as _log_failure
from .doorfuncs import refusal as _refusal
from .doorfuncs import wrong_device as _wrong_device

_log = logging.getLogger("metrale")

cdef object _door = None
cdef int _device = 0
cdef bint _compiled = False
cdef bint _taken = False


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


# The pair under fixed names (``metrale_door_alloc``, ``metrale_door_free``, written in C++ above), exported from this
# module's shared library for a framework that finds its allocator's functions by name (torch's
# ``CUDAPluggableAllocator(path, alloc_fn_name, free_fn_name)``, as RMM's are found), call these: the same functions,
# serving the same door (none until `c_functions` gave the pair to one). Where they give no memory for a non-empty
# request, the exported alloc throws why.
cdef void* _alloc_by_name(size_t size, int device, void* stream) noexcept with gil:
    cdef object failures
    cdef void* ptr
    if not _taken:
        _say(b"metrale: no door took metrale's allocator functions yet (metrale_core.allocators.torch.allocator "
             b"makes them serve one)")
        try:
            _log.error("allocator door: alloc of %d bytes by name before any door took the C functions "
                       "(c_functions)", size)
        except BaseException:
            pass
        return NULL
    failures = getattr(_door, "failures", None)
    ptr = _alloc_c(size, device, stream)
    if ptr == NULL and size != 0:
        try:
            _say(_refusal(_door, size, failures).encode("utf-8", "backslashreplace"))
        except BaseException:
            _say(b"metrale: the allocator door gave no memory (the metrale log says why)")
    return ptr


cdef void _free_by_name(void* ptr, size_t size, int device, void* stream) noexcept nogil:
    if _taken:
        _free_c(ptr, size, device, stream)


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


_alloc_to, _free_to = _alloc_by_name, _free_by_name  # (last: the module's Python objects are made)
