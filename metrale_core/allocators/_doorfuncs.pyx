# cython: language_level=3, binding=True, embedsignature=True
# distutils: language = c++
"""The compiled twin of [`c_functions`][metrale_core.allocators.doorfuncs.c_functions]: one set of C functions
(alloc, free, record_stream, and torch's three pool hooks) that call a door with the GIL, no ctypes in the way.

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
- C++ too, torch's pool hooks, declared as torch calls them: the beginning of a pool (device, pool id, and which
  streams allocate to it: a ``std::function``, copied and kept, as a callable, while the capture is underway:
  `Door.begin_pool`), its end (`Door.end_pool`) and its release (`Door.release_pool`).
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
    /* torch's pool hooks, as torch declares them: (device, MempoolId_t[, which streams allocate to the pool]) */
    #include <cstdint>
    #include <functional>
    #include <new>
    #include <utility>
    struct CUstream_st;
    typedef std::pair<unsigned long long, unsigned long long> metrale_door_pool_id;
    typedef std::function<bool(CUstream_st *)> metrale_door_test;
    /* a copy of the framework's test, kept while its capture is underway (NULL where none could be made) */
    static metrale_door_test *metrale_door_keep(const metrale_door_test &test) {
        try { return new metrale_door_test(test); } catch (...) { return nullptr; }
    }
    static void metrale_door_drop(metrale_door_test *test) { delete test; }
    /* 1 where the test says the stream allocates to the pool, 0 where not, -1 where it threw or none was kept */
    static int metrale_door_tests(const metrale_door_test *test, void *stream) {
        if (!test || !*test) return -1;
        try { return (*test)(static_cast<CUstream_st *>(stream)) ? 1 : 0; } catch (...) { return -1; }
    }
    typedef void (*metrale_door_begin_fn)(int, unsigned long long, unsigned long long, metrale_door_test *);
    typedef void (*metrale_door_pool_fn)(int, unsigned long long, unsigned long long, int);
    static metrale_door_begin_fn metrale_door_begin_to = nullptr;
    static metrale_door_pool_fn metrale_door_pool_to = nullptr;
    static void metrale_door_begin(int device, metrale_door_pool_id id, metrale_door_test test) {
        if (metrale_door_begin_to) metrale_door_begin_to(device, id.first, id.second, metrale_door_keep(test));
    }
    static void metrale_door_end(int device, metrale_door_pool_id id) {
        if (metrale_door_pool_to) metrale_door_pool_to(device, id.first, id.second, 0);
    }
    static void metrale_door_release(int device, metrale_door_pool_id id) {
        if (metrale_door_pool_to) metrale_door_pool_to(device, id.first, id.second, 1);
    }
    static uintptr_t metrale_door_begin_address(void) { return reinterpret_cast<uintptr_t>(&metrale_door_begin); }
    static uintptr_t metrale_door_end_address(void) { return reinterpret_cast<uintptr_t>(&metrale_door_end); }
    static uintptr_t metrale_door_release_address(void) { return reinterpret_cast<uintptr_t>(&metrale_door_release); }
    """
    ctypedef void* (*_alloc_fn "metrale_door_alloc_fn")(size_t, int, void*) noexcept nogil
    ctypedef void (*_free_fn "metrale_door_free_fn")(void*, size_t, int, void*) noexcept nogil
    _alloc_fn _alloc_to "metrale_door_alloc_to"
    _free_fn _free_to "metrale_door_free_to"
    void _say "metrale_door_say"(const char *why) noexcept nogil
    ctypedef struct _test_t "metrale_door_test"
    void _drop "metrale_door_drop"(_test_t *test) noexcept nogil
    int _tests "metrale_door_tests"(const _test_t *test, void *stream) noexcept nogil
    ctypedef void (*_begin_fn "metrale_door_begin_fn")(int, unsigned long long, unsigned long long,
                                                        _test_t*) noexcept nogil
    ctypedef void (*_pool_fn "metrale_door_pool_fn")(int, unsigned long long, unsigned long long, int) noexcept nogil
    _begin_fn _begin_to "metrale_door_begin_to"
    _pool_fn _pool_to "metrale_door_pool_to"
    uintptr_t _begin_address "metrale_door_begin_address"() noexcept nogil
    uintptr_t _end_address "metrale_door_end_address"() noexcept nogil
    uintptr_t _release_address "metrale_door_release_address"() noexcept nogil

from .doorfuncs import DoorFunctions as _DoorFunctions
from .doorfuncs import address as _address
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


cdef class _StreamTest:
    """The framework's test of which streams allocate to a pool of its own (torch's ``std::function<bool
    (cudaStream_t)>``, copied), called with a stream's handle while its capture is underway; let go with it."""

    cdef _test_t* _test

    def __call__(self, stream):
        cdef int said = _tests(self._test, <void*><uintptr_t>stream)
        if said < 0:
            raise RuntimeError("the framework's test of a stream for its pool failed (or none was kept)")
        return said == 1

    def __dealloc__(self):
        _drop(self._test)


cdef void _begin_c(int device, unsigned long long id_0, unsigned long long id_1, _test_t* test) noexcept with gil:
    cdef _StreamTest kept
    try:
        kept = _StreamTest.__new__(_StreamTest)
        kept._test = test
        if device == _device:
            _door.begin_pool((id_0, id_1), kept)
        else:  # (another device's allocations are not this door's: they are refused)
            _log.debug("allocator door: a pool begun on device %d, not this door's (%d): ignored", device, _device)
    except BaseException:
        try:
            _log_failure("allocator door: the beginning of a pool on device %d failed", device)
        except BaseException:
            pass


cdef void _pool_c(int device, unsigned long long id_0, unsigned long long id_1, int released) noexcept with gil:
    try:
        if device == _device:
            (_door.release_pool if released else _door.end_pool)((id_0, id_1))
    except BaseException:
        try:
            _log_failure("allocator door: the end or release of a pool on device %d failed", device)
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
    return _DoorFunctions(<uintptr_t>&_alloc_c, <uintptr_t>&_free_c, <uintptr_t>&_record_c, _end_address(),
                          _begin_address(), _release_address())


_begin_to, _pool_to = _begin_c, _pool_c
_alloc_to, _free_to = _alloc_by_name, _free_by_name  # (last: the module's Python objects are made)
