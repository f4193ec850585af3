# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`DeviceLane`][metrale_core._memory.lane.DeviceLane]: ``GpuBackend.alloc`` and ``free``,
the common case done here at C level.

- The common case: a plain device allocation (an ``int`` size, no red zones, not the traced index) and the
  free of a device buffer of this backend on its ledger, while no capture is in progress. The gate
  (``_gate.pxd``) and the capture rule (``_capture.pxd``) are passed at C level, the handle made by the
  handle twin's ``make_buffer``, the call site by its twin (``_site.pyx``); the ledger, the stats and the
  plugin are called as the allocator calls them, in the same order, under the same lock.
- Everything else goes to the allocator, as the pure lane sends every call: a bad size, red zones, a
  capture in progress, an out-of-memory error (reclaim-and-retry), a buffer not on the ledger (its error).
"""

cimport cython

from .._device._capture cimport forbid_c
from .._device._gate cimport Gate, _Cell
from .._device._handle cimport make_buffer

from .._device.buffer import DeviceBuffer as _DeviceBuffer
from .._device.guarded import raise_raw as _raise_raw
from .._errors import OutOfMemoryError as _OutOfMemoryError
from .._types import WORD_LIMIT as _WORD_LIMIT
from ._site import call_site as _call_site
from .ledger import next_index as _next_index


@cython.final
cdef class DeviceLane:
    """``GpuBackend.alloc`` and ``free``: inside the gate, the common case here (compiled twin)."""

    cdef object _allocator
    cdef object _ctx
    cdef Gate _gate
    cdef object _ledger
    cdef object _stats
    cdef list _observers
    cdef bint _zoned
    cdef object _trace_idx
    cdef object _internal
    cdef object _acquire
    cdef object _release
    cdef object _ref

    def __init__(self, allocator, parts):
        ctx = parts.ctx
        if not isinstance(ctx.gate, Gate):
            raise TypeError(
                f"the compiled lane needs the compiled gate, got {type(ctx.gate)!r}: one `pure` setting picks both"
            )
        self._allocator = allocator
        self._ctx = ctx
        self._gate = ctx.gate
        self._ledger = parts.ledger
        self._stats = parts.stats
        self._observers = parts.observers
        self._zoned = parts.zoned
        self._trace_idx = parts.trace_idx
        self._internal = ctx.internal
        self._acquire = ctx.lock.acquire  # the context's lock, taken as `with` takes it (a call less each way)
        self._release = ctx.lock.release
        self._ref = ctx.ref

    def alloc(self, nbytes):
        """``GpuBackend.alloc``."""
        cdef _Cell cell = self._gate.enter_c(False)
        try:
            forbid_c(cell.flag, "alloc")  # first, as the allocator checks it (which, handed the call, checks again)
            if self._zoned or type(nbytes) is not int or not (0 < nbytes < _WORD_LIMIT):
                return self._allocator.alloc(nbytes, "device", "alloc")
            return self._alloc(nbytes)
        finally:
            self._gate.leave_c(cell)

    cdef object _alloc(self, object n):
        ctx = self._ctx
        index = _next_index()
        site = _call_site(self._internal)
        try:
            raw_ptr = ctx.plugin.alloc(n, "device")
        except _OutOfMemoryError as exc:
            raw_ptr = self._allocator.retry_alloc(n, "device", "alloc", exc)
        except Exception as exc:
            _raise_raw(ctx, ctx.name, "alloc", exc)
        buf = make_buffer(raw_ptr, n, "device", index, site, self._ref)
        self._acquire()  # the commit: the backend is open now, or nothing of this allocation remains
        try:
            committed = not self._gate.closed_c()
            if committed:
                self._ledger.add(buf)
                self._stats.allocated("device", n)
        finally:
            self._release()
        if not committed:
            self._allocator.release_quietly(raw_ptr, "device")
            raise ctx.closed_error()
        if self._trace_idx is not None and self._trace_idx == index:
            self._allocator.trace(index, "alloc", n, site)
        return buf

    def free(self, buf):
        """``GpuBackend.free``."""
        cdef _Cell cell = self._gate.enter_c(False)
        try:
            forbid_c(cell.flag, "free")  # first, as the allocator checks it: before anything of ``buf`` is read
            if self._zoned or type(buf) is not _DeviceBuffer or buf.kind != "device" or buf._owner is not self._ref:
                self._allocator.free(buf)
            else:
                self._free(buf)
        finally:
            self._gate.leave_c(cell)

    cdef int _free(self, object buf) except -1:
        record = self._ledger.take(buf.index, buf.ptr, buf.nbytes)
        if record is None:  # not on the ledger: the allocator's error
            self._allocator.free(buf)
            return 0
        self._stats.released(record.kind, record.nbytes)
        for observer in self._observers:
            observer(buf)
        ctx = self._ctx
        try:
            ctx.plugin.free(buf.ptr, "device")
        except Exception as exc:
            _raise_raw(ctx, ctx.name, "free", exc)
        return 0
