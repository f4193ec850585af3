"""The CUDA driver calls of the hot path at C speed, through ``cuda.bindings.cydriver`` (issue 38).

The compiled twin of the calls ``CudaDevice`` makes through ``cuda.bindings.driver``: ``_compiled.py`` calls these
where its device was opened compiled; the pure calls stay the reference. Built as C++ (``cydriver.pxd`` needs
``<type_traits>``) against ``cuda.h``; ``setup.py`` says how it finds them.

The return convention: plain ints in, plain ints out, and no Python object made on success beyond the value asked
for.

- A call that gives nothing back returns its ``CUresult`` as an ``int``: ``0`` on success.
- A call that gives a value back (``mem_alloc``, ``mem_alloc_managed``, ``ctx_current``) returns the value
  (``>= 0``: a device address or a context handle) on success and ``-CUresult`` (``< 0``) on a failure.
- ``launch`` returns ``-1`` (``REPACK``), having launched nothing, where the arguments' sizes are not its slots'.
- An exception is what ``cydriver`` raises where it cannot load the driver library (``DynamicLibNotFoundError``), or
  what an argument's conversion raises (``OverflowError``, ``TypeError``, ``BufferError``): the caller maps it with
  ``foreign_error``, as it maps the pure calls' exceptions.

The calls that may wait, or take the driver's locks, run without the GIL (as ``cuda.bindings.driver`` runs them).
"""

cimport cython
from cpython.buffer cimport PyBUF_ANY_CONTIGUOUS, PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_GET_SIZE
from cpython.pycapsule cimport PyCapsule_Destructor, PyCapsule_GetContext, PyCapsule_New, PyCapsule_SetContext
from cpython.object cimport PyObject
from cpython.pystate cimport PyThreadState, PyThreadState_Get
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy
from libcpp.vector cimport vector

from cuda.bindings cimport cydriver

import sys
import threading

#: What ``launch`` returns where the arguments' sizes differ from its slots' (nothing launched): build new slots.
REPACK = -1

#: The alignment of the slots' start, and of a tensor map's slot (CUDA 13's ``CUtensorMap`` is 128-byte aligned).
cdef enum:
    _SLOT_BASE_ALIGN = 128
    _LARGE_SLOT = 64  # a slot this large or larger starts 128-byte aligned, a smaller one 8-byte


@cython.final
cdef class ArgSlots:
    """Where a kernel's arguments go for ``cuLaunchKernel``: the twin of ``_launch.ArgSlots``, the same layout (a
    slot per argument, 8-byte aligned, a tensor map's 128-byte aligned; the slots start 128-byte aligned) in a C
    buffer, filled by ``memcpy`` from each argument's bytes."""

    cdef readonly tuple sizes
    cdef readonly tuple offsets
    cdef readonly object address
    cdef char* _storage
    cdef Py_ssize_t _start  # the offset of the first slot (the slots' start, 128-byte aligned)
    cdef Py_ssize_t _end  # the offset just past the last slot's storage
    cdef vector[Py_ssize_t] _sizes
    cdef vector[Py_ssize_t] _offsets
    cdef vector[void*] _pointers

    def __init__(self, tuple sizes):
        cdef Py_ssize_t end = 0, align, size, skip
        cdef list offsets = []
        free(self._storage)  # (a second __init__ lays the slots anew)
        self._storage = NULL
        self._sizes.clear()
        self._offsets.clear()
        self._pointers.clear()
        for item in sizes:
            size = item
            if size < 0:
                raise ValueError(f"ArgSlots: a negative argument size ({size})")
            align = _SLOT_BASE_ALIGN if size >= _LARGE_SLOT else 8
            end = (end + align - 1) // align * align
            offsets.append(end)
            self._sizes.push_back(size)
            end += (size + 7) // 8 * 8
        self._storage = <char*>calloc(max(end, 8) + _SLOT_BASE_ALIGN, 1)
        if self._storage == NULL:
            raise MemoryError(f"ArgSlots: {max(end, 8) + _SLOT_BASE_ALIGN} bytes of argument slots")
        skip = (_SLOT_BASE_ALIGN - <uintptr_t>self._storage % _SLOT_BASE_ALIGN) % _SLOT_BASE_ALIGN
        self._start, self._end = skip, skip + end
        self.sizes = sizes
        self.offsets = tuple([skip + offset for offset in offsets])
        for offset in self.offsets:
            self._offsets.push_back(offset)
            self._pointers.push_back(self._storage + <Py_ssize_t>offset)
        self.address = <uintptr_t>self._pointers.data() if self._pointers.size() else None

    def __dealloc__(self):
        free(self._storage)

    def fill(self, args):
        """Write ``args`` (each a ``LaunchArg``: its ``data``) into their slots; ``False`` (nothing to trust) where
        their sizes differ."""
        return self._fill(args) == 1

    def image(self):
        """The slots' bytes, from the first slot's start to the last one's end (padding included)."""
        return self._storage[self._start : self._end]

    cdef int _fill(self, object args) except -1:
        """1 where ``args`` were written into their slots, 0 where their count or a size differs."""
        cdef Py_ssize_t i, n = len(args), size
        cdef Py_buffer view
        if n != <Py_ssize_t>self._sizes.size():
            return 0
        for i in range(n):
            data = args[i].data
            if PyBytes_CheckExact(data):
                size = PyBytes_GET_SIZE(data)
                if size != self._sizes[i]:
                    return 0
                memcpy(self._storage + self._offsets[i], PyBytes_AS_STRING(data), size)
            else:  # another buffer: what the pure slots' memoryview assignment takes
                PyObject_GetBuffer(data, &view, PyBUF_SIMPLE | PyBUF_ANY_CONTIGUOUS)
                try:
                    if view.len != self._sizes[i]:
                        return 0
                    memcpy(self._storage + self._offsets[i], view.buf, view.len)
                finally:
                    PyBuffer_Release(&view)
        return 1


def launch(ArgSlots slots not None, args, uintptr_t function, grid, block, unsigned int shared_mem,
           uintptr_t stream):
    """``cuLaunchKernel`` of ``function`` (a ``CUfunction`` as an int) with ``args`` packed into ``slots``: the
    ``CUresult``, or ``REPACK`` (nothing launched) where their sizes are not the slots'."""
    cdef unsigned int gx, gy, gz, bx, by, bz
    cdef cydriver.CUresult err
    cdef void** params
    if not slots._fill(args):
        return REPACK
    gx, gy, gz = grid[0], grid[1], grid[2]
    bx, by, bz = block[0], block[1], block[2]
    params = slots._pointers.data() if slots._pointers.size() else NULL
    with nogil:
        err = cydriver.cuLaunchKernel(<cydriver.CUfunction><void*>function, gx, gy, gz, bx, by, bz, shared_mem,
                                      <cydriver.CUstream><void*>stream, params, NULL)
    return <int>err


def graph_launch(uintptr_t graph_exec, uintptr_t stream):
    """``cuGraphLaunch``: the ``CUresult``."""
    cdef cydriver.CUresult err
    with nogil:
        err = cydriver.cuGraphLaunch(<cydriver.CUgraphExec><void*>graph_exec, <cydriver.CUstream><void*>stream)
    return <int>err


def mem_alloc(size_t nbytes):
    """``cuMemAlloc``: the device address, or ``-CUresult``."""
    cdef cydriver.CUdeviceptr ptr = 0
    cdef cydriver.CUresult err
    with nogil:
        err = cydriver.cuMemAlloc(&ptr, nbytes)
    if err:
        return -<int>err
    return ptr


def mem_alloc_managed(size_t nbytes, unsigned int flags):
    """``cuMemAllocManaged``: the address, or ``-CUresult``."""
    cdef cydriver.CUdeviceptr ptr = 0
    cdef cydriver.CUresult err
    with nogil:
        err = cydriver.cuMemAllocManaged(&ptr, nbytes, flags)
    if err:
        return -<int>err
    return ptr


def mem_free(cydriver.CUdeviceptr ptr):
    """``cuMemFree``: the ``CUresult``."""
    cdef cydriver.CUresult err
    with nogil:
        err = cydriver.cuMemFree(ptr)
    return <int>err


def memset_d8(cydriver.CUdeviceptr ptr, unsigned char value, size_t nbytes, uintptr_t stream):
    """``cuMemsetD8Async``: the ``CUresult``."""
    cdef cydriver.CUresult err
    with nogil:
        err = cydriver.cuMemsetD8Async(ptr, value, nbytes, <cydriver.CUstream><void*>stream)
    return <int>err


def copy_htod(cydriver.CUdeviceptr dst, src, uintptr_t stream):
    """``cuMemcpyHtoDAsync`` of all of ``src`` (a C-contiguous buffer, as the bindings take it): the ``CUresult``.
    The caller keeps ``src`` alive until the stream is idle."""
    cdef Py_buffer view
    cdef cydriver.CUresult err
    PyObject_GetBuffer(src, &view, PyBUF_SIMPLE | PyBUF_ANY_CONTIGUOUS)
    try:
        with nogil:
            err = cydriver.cuMemcpyHtoDAsync(dst, view.buf, <size_t>view.len, <cydriver.CUstream><void*>stream)
    finally:
        PyBuffer_Release(&view)
    return <int>err


def copy_dtoh(dst, cydriver.CUdeviceptr src, uintptr_t stream):
    """``cuMemcpyDtoHAsync`` filling all of ``dst`` (a C-contiguous buffer, as the bindings take it): the
    ``CUresult``. The caller keeps ``dst`` alive until the stream is idle."""
    cdef Py_buffer view
    cdef cydriver.CUresult err
    PyObject_GetBuffer(dst, &view, PyBUF_SIMPLE | PyBUF_ANY_CONTIGUOUS)
    try:
        with nogil:
            err = cydriver.cuMemcpyDtoHAsync(view.buf, src, <size_t>view.len, <cydriver.CUstream><void*>stream)
    finally:
        PyBuffer_Release(&view)
    return <int>err


def copy_dtod(cydriver.CUdeviceptr dst, cydriver.CUdeviceptr src, size_t nbytes, uintptr_t stream):
    """``cuMemcpyDtoDAsync``: the ``CUresult``."""
    cdef cydriver.CUresult err
    with nogil:
        err = cydriver.cuMemcpyDtoDAsync(dst, src, nbytes, <cydriver.CUstream><void*>stream)
    return <int>err


def ctx_current():
    """``cuCtxGetCurrent``: the current context's handle (``0``: none), or ``-CUresult``."""
    cdef cydriver.CUcontext ctx = NULL
    cdef cydriver.CUresult err = cydriver.cuCtxGetCurrent(&ctx)
    if err:
        return -<int>err
    return <uintptr_t>ctx


def ctx_set(uintptr_t ctx):
    """``cuCtxSetCurrent``: the ``CUresult``."""
    return <int>cydriver.cuCtxSetCurrent(<cydriver.CUcontext><void*>ctx)


# -- the device calls (``RawDevice.device_calls``) -------------------------------------------------------------------


# The one definition, shipped in metrale-core with Cython's view of it beside (``metrale_core.plugin.get_include()``;
# setup.py finds it): the C++ compiler checks each use against the header.
from metrale.device_calls cimport METRALE_DEVICE_CALLS_CAPSULE, metrale_device_calls_v1
# declined, nothing done: the core calls the method, which binds the context, does the work or raises
from metrale.device_calls cimport METRALE_DEVICE_CALLS_DECLINED as _DECLINED

#: The capsule's name, as ``metrale_core.plugin.DEVICE_CALLS`` has it (the struct's version is in it).
DEVICE_CALLS = METRALE_DEVICE_CALLS_CAPSULE.decode("ascii")


cdef struct _CallsState:
    cydriver.CUcontext ctx
    bint closed
    void* owner  # the DeviceCalls (borrowed: it owns this struct): its Python callables map a driver error


cdef bint _current(_CallsState* calls) noexcept:
    """Whether the device calls are open and the context current on this thread (a driver that cannot answer: no)."""
    cdef cydriver.CUcontext current = NULL
    if calls.closed:
        return False
    try:
        return cydriver.cuCtxGetCurrent(&current) == cydriver.CUDA_SUCCESS and current == calls.ctx
    except BaseException:  # (the driver library could not be loaded: the method says so)
        return False


cdef int _calls_alloc(void* state, size_t nbytes, uintptr_t* ptr) except -1:
    """``cuMemAlloc`` where the device's context is current on this thread; a driver error raised as the method
    raises it (``check``), once."""
    cdef _CallsState* calls = <_CallsState*>state
    cdef cydriver.CUdeviceptr out = 0
    cdef cydriver.CUresult err
    if not _current(calls):
        return _DECLINED
    try:
        with nogil:
            err = cydriver.cuMemAlloc(&out, nbytes)
    except BaseException:
        return _DECLINED
    if err != cydriver.CUDA_SUCCESS:
        (<DeviceCalls>calls.owner).alloc_failed(<int>err, nbytes)  # raises
        return _DECLINED  # (a mapping that did not raise: the method asks again)
    ptr[0] = <uintptr_t>out
    return 0


cdef int _calls_free(void* state, uintptr_t ptr) except -1:
    """``cuMemFree`` where the device's context is current on this thread; a driver error handled as the method
    handles it (``teardown_failed``: raised, or logged where nothing was left to release), never retried."""
    cdef _CallsState* calls = <_CallsState*>state
    cdef cydriver.CUresult err
    if not _current(calls):
        return _DECLINED
    try:
        with nogil:
            err = cydriver.cuMemFree(<cydriver.CUdeviceptr>ptr)
    except BaseException:
        return _DECLINED
    if err != cydriver.CUDA_SUCCESS:
        (<DeviceCalls>calls.owner).free_failed(<int>err)  # raises, or returns (nothing left to release)
    return 0


cdef int _calls_memset(void* state, uintptr_t ptr, int value, size_t nbytes, PyObject* stream) except -1:
    """``cuMemsetD8Async`` on ``stream`` (a `CuStream`: its ``raw`` handle) where the device's context is current on
    this thread; a driver error raised as the method raises it (``check``), once."""
    cdef _CallsState* calls = <_CallsState*>state
    cdef cydriver.CUresult err
    cdef uintptr_t handle
    if not _current(calls):
        return _DECLINED
    try:
        handle = (<object>stream).raw
    except BaseException:  # (not a stream of this device: the method says what it is)
        return _DECLINED
    try:
        with nogil:
            err = cydriver.cuMemsetD8Async(<cydriver.CUdeviceptr>ptr, <unsigned char>value, nbytes,
                                           <cydriver.CUstream><void*>handle)
    except BaseException:
        return _DECLINED
    if err != cydriver.CUDA_SUCCESS:
        (<DeviceCalls>calls.owner).memset_failed(<int>err)  # raises
        return _DECLINED
    return 0


cdef int _calls_graph_launch(void* state, PyObject* graph_exec, PyObject* stream) except -1:
    """``cuGraphLaunch`` of ``graph_exec`` (a `CuGraphExec`) on ``stream`` (a `CuStream`) where the device's context is
    current on this thread and the graph holds no host objects (the method keeps those alive until the stream is
    idle: it is asked instead); a driver error raised as the method raises it (``check``), once."""
    cdef _CallsState* calls = <_CallsState*>state
    cdef cydriver.CUresult err
    cdef uintptr_t exec_handle, stream_handle
    if not _current(calls):
        return _DECLINED
    try:
        if (<object>graph_exec).keep:
            return _DECLINED
        exec_handle = (<object>graph_exec).raw
        stream_handle = (<object>stream).raw
    except BaseException:  # (not a graph or a stream of this device: the method says what it is)
        return _DECLINED
    try:
        with nogil:
            err = cydriver.cuGraphLaunch(<cydriver.CUgraphExec><void*>exec_handle, <cydriver.CUstream><void*>stream_handle)
    except BaseException:
        return _DECLINED
    if err != cydriver.CUDA_SUCCESS:
        (<DeviceCalls>calls.owner).graph_launch_failed(<int>err)  # raises
        return _DECLINED
    return 0


cdef int _calls_launch(void* state, PyObject* function, const unsigned int* shape, unsigned int shared_mem,
                       PyObject* stream, PyObject* args) except -1:
    """``cuLaunchKernel`` of ``function`` (a `CuFunction`) on ``stream`` (a `CuStream`), ``shape`` its grid and block
    (x, y, z each), ``args`` a list of ``LaunchArg`` copied into this thread's slots of the kernel (the device calls'
    own, as the method keeps its own), where the device's context is current on this thread; a driver error raised as the
    method raises it (``check``), once."""
    cdef _CallsState* calls = <_CallsState*>state
    cdef cydriver.CUresult err
    cdef uintptr_t handle, stream_handle
    cdef ArgSlots slots
    cdef void** params
    if not _current(calls):
        return _DECLINED
    try:
        handle = (<object>function).raw
        stream_handle = (<object>stream).raw
        slots = (<DeviceCalls>calls.owner)._slots_for(<object>function, <object>args)
    except BaseException:  # (not a kernel or a stream of this device, odd arguments: the method says what is wrong)
        return _DECLINED
    if slots is None:
        return _DECLINED
    params = slots._pointers.data() if slots._pointers.size() else NULL
    try:
        with nogil:
            err = cydriver.cuLaunchKernel(<cydriver.CUfunction><void*>handle, shape[0], shape[1], shape[2], shape[3],
                                          shape[4], shape[5], shared_mem, <cydriver.CUstream><void*>stream_handle,
                                          params, NULL)
    except BaseException:
        return _DECLINED
    if err != cydriver.CUDA_SUCCESS:
        (<DeviceCalls>calls.owner).launch_failed(<int>err)  # raises
        return _DECLINED
    return 0


cdef void _drop_owner(object capsule) noexcept:
    """The capsule's destructor: it lets go of the `DeviceCalls` it kept alive."""
    cdef void* owner = PyCapsule_GetContext(capsule)
    if owner is not NULL:
        Py_DECREF(<object>owner)


cdef extern from "Python.h":
    unsigned long long PyThreadState_GetID(PyThreadState* tstate)

#: Whether the GIL makes the device calls' reads of their per-thread slots' cache atomic (else the ``threading.local``
#: each time).
cdef bint _GIL = getattr(sys, "_is_gil_enabled", lambda: True)()


@cython.final
cdef class DeviceCalls:
    """One device's calls for the core's compiled lanes (``RawDevice.device_calls``): ``alloc`` and ``free`` of device
    memory as C functions over its context, ``memset`` and ``graph_launch`` on a stream of it. Each answers ``0``
    (done), ``1`` (declined: another context or none current, or shut) or ``-1`` with the error raised:
    ``alloc_failed(code, nbytes)``, ``free_failed(code)``, ``memset_failed(code)`` and ``graph_launch_failed(code)``
    map a driver error as the device's methods do (``launch_failed(code)`` too, for ``launch``). `close` shuts it."""

    cdef _CallsState _state
    cdef metrale_device_calls_v1 _table
    cdef readonly object alloc_failed
    cdef readonly object free_failed
    cdef readonly object memset_failed
    cdef readonly object graph_launch_failed
    cdef readonly object launch_failed
    cdef object _local  # per thread: its ArgSlots per kernel (by the CuFunction's identity)
    cdef unsigned long long _last_thread  # the thread state whose slots `_last_slots` are (under the GIL)
    cdef dict _last_slots

    def __init__(self, uintptr_t ctx, alloc_failed, free_failed, memset_failed, graph_launch_failed, launch_failed):
        self.alloc_failed = alloc_failed
        self.free_failed = free_failed
        self.memset_failed = memset_failed
        self.graph_launch_failed = graph_launch_failed
        self.launch_failed = launch_failed
        self._local = threading.local()
        self._last_thread = 0
        self._last_slots = None
        self._state.ctx = <cydriver.CUcontext><void*>ctx
        self._state.closed = False
        self._state.owner = <void*>self
        self._table.size = sizeof(metrale_device_calls_v1)
        self._table.state = &self._state
        self._table.alloc = _calls_alloc
        self._table.free = _calls_free
        self._table.memset = _calls_memset
        self._table.graph_launch = _calls_graph_launch
        self._table.launch = _calls_launch

    cdef ArgSlots _slots_for(self, object function, object args):
        """This thread's slots of ``function``, ``args`` written into them (new slots where their sizes changed);
        ``None`` where they cannot hold them."""
        cdef unsigned long long thread
        cdef dict kept
        cdef ArgSlots slots
        if _GIL:
            thread = PyThreadState_GetID(PyThreadState_Get())
            if thread == self._last_thread and self._last_slots is not None:
                kept = self._last_slots
            else:
                kept = self._thread_slots()
                self._last_thread = thread
                self._last_slots = kept
        else:
            kept = self._thread_slots()
        key = id(function)
        found = kept.get(key)
        if found is not None:
            slots = <ArgSlots>found
            if slots._fill(args):
                return slots
        slots = ArgSlots(tuple([len(a.data) for a in args]))
        if not slots._fill(args):
            return None
        kept[key] = slots
        return slots

    cdef dict _thread_slots(self):
        kept = getattr(self._local, "slots", None)
        if kept is None:
            kept = self._local.slots = {}
        return <dict>kept

    def close(self):
        """No device call is made any more (the device closes)."""
        self._state.closed = True

    @property
    def closed(self):
        return bool(self._state.closed)

    def capsule(self):
        """The capsule of the table, named `DEVICE_CALLS`; it keeps this object alive."""
        cap = PyCapsule_New(&self._table, METRALE_DEVICE_CALLS_CAPSULE, <PyCapsule_Destructor>_drop_owner)
        PyCapsule_SetContext(cap, <void*>self)
        Py_INCREF(self)
        return cap
