# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`DeviceLane`][metrale_core._memory.lane.DeviceLane]: ``GpuBackend.alloc`` and ``free``,
the common case done here at C level.

- The common case: a device allocation (an ``int`` size) and the free of a device buffer of this backend on its
  ledger, while no capture is in progress. The gate
  (``_gate.pxd``) and the capture rule (``_capture.pxd``) are passed at C level, the handle made by the
  handle twin's ``make_buffer``, the call site by its twin (``sites.py`` compiled); the ledger, the stats and the
  plugin are called as the allocator calls them, in the same order, under the same lock.
- Red zones (``LaneParts.zoning``): a zoned allocation takes a kept block from the quarantine's twin or asks the
  allocator for raw memory, fills its zones through the plugin's C ``memset`` (else through the guarded layer, as
  the zone guard does), puts them in the zone table's twin and commits; a zoned free hands the buffer to the
  quarantine's twin. Both in the zone guard's and the allocator's order.
- Everything else goes to the allocator, as the pure lane sends every call: a bad size, a capture in progress,
  an out-of-memory error (reclaim-and-retry), a buffer not on the ledger (its error).
- The ledger, the stats and the call site are called through their twins' C-level doors (``.pxd``); the plugin
  through its C functions where it offers them (``RawDevice.device_calls``), else through its methods. A C call
  that declined (``1``) is made through the method, which does it or raises; one that failed raised its error.
"""

cimport cython
from cpython.object cimport PyObject
from libc.stdint cimport uintptr_t

from .._device._capture cimport forbid_c
from .._device._door cimport ask_door, door_has_memset, door_of, metrale_device_calls_v1
from .._device._gate cimport Gate, _Cell
from .._device._handle cimport (
    FIELD_INDEX, FIELD_KIND, FIELD_NBYTES, FIELD_OWNER, FIELD_PTR, buffer_field, make_buffer,
)
from .._device._stats cimport KIND_DEVICE, StatsCounter
from .._redzones._layout cimport RedZones
from ._ledger cimport Ledger
from ._quarantine cimport Quarantine
from ._sites cimport call_site

import logging

from .._device.buffer import DeviceBuffer as _DeviceBuffer
from .._device.guarded import raise_raw as _raise_raw
from .._errors import MetraleError as _MetraleError
from .._errors import OutOfMemoryError as _OutOfMemoryError
from .._types import WORD_LIMIT as _WORD_LIMIT
from .._device.raw import DEVICE_CALLS as _DEVICE_CALLS
from .records import INDEXES as _INDEXES
from .records import INDEXES_LOCK_FREE as _INDEXES_LOCK_FREE
from .records import next_index as _next_index

_log = logging.getLogger("metrale")

cdef bytes _CAPSULE_NAME = _DEVICE_CALLS.encode()


cdef int _compiled_parts(str lane, object parts) except -1:
    """Refuse pure parts: a compiled lane passes the gate and calls the ledger and the stats at C level."""
    gate = parts.ctx.gate
    if not isinstance(gate, Gate):
        raise TypeError(f"the compiled {lane} needs the compiled gate, got {type(gate)!r}: one `pure` setting picks both")
    if not isinstance(parts.ledger, Ledger) or not isinstance(parts.stats, StatsCounter):
        raise TypeError(
            f"the compiled {lane} needs the compiled ledger and stats, got {type(parts.ledger)!r} and "
            f"{type(parts.stats)!r}: one `pure` setting picks them all"
        )
    return 0


@cython.final
cdef class DeviceLane:
    """``GpuBackend.alloc`` and ``free``: inside the gate, the common case here (compiled twin)."""

    cdef object _allocator
    cdef object _ctx
    cdef Gate _gate
    cdef Ledger _ledger
    cdef StatsCounter _stats
    cdef object _releases
    cdef object _trace_idx
    cdef object _internal
    cdef object _indexes
    cdef Py_ssize_t _caller_frames
    cdef object _ref
    cdef object _capsule  # (keeps the plugin's struct alive)
    cdef metrale_device_calls_v1* _door
    cdef bint _door_memset
    # red zones (``LaneParts.zoning``; None where they are off)
    cdef object _guard
    cdef RedZones _zones
    cdef Quarantine _quarantine
    cdef dict _raw_base
    cdef object _fill_stream
    cdef bint _zeroes
    cdef object _raw

    def __init__(self, allocator, parts):
        ctx = parts.ctx
        _compiled_parts("lane", parts)
        plugin = ctx.plugin
        capsule = ask_door(plugin, _log)
        self._door = door_of(plugin, capsule, _CAPSULE_NAME, _log)
        self._capsule = capsule if self._door is not NULL else None
        self._allocator = allocator
        self._ctx = ctx
        self._gate = ctx.gate
        self._ledger = parts.ledger
        self._stats = parts.stats
        self._releases = parts.releases
        self._trace_idx = parts.trace_idx
        self._internal = ctx.internal
        self._indexes = _INDEXES if _INDEXES_LOCK_FREE else None  # (its next item taken at C level)
        self._caller_frames = parts.caller_frames
        self._ref = ctx.ref
        self._door_memset = self._door is not NULL and door_has_memset(self._door)
        self._raw = ctx.raw
        zoning = parts.zoning
        if zoning is not None:
            if not isinstance(zoning.zones, RedZones) or not isinstance(zoning.quarantine, Quarantine):
                raise TypeError(
                    f"the compiled lane needs the compiled zone table and quarantine, got {type(zoning.zones)!r} and "
                    f"{type(zoning.quarantine)!r}: one `pure` setting picks them all"
                )
            self._guard = zoning.guard
            self._zones = zoning.zones
            self._quarantine = zoning.quarantine
            self._raw_base = zoning.raw_base
            self._fill_stream = zoning.stream
            self._zeroes = zoning.zeroes

    def alloc(self, nbytes):
        """``GpuBackend.alloc``."""
        cdef _Cell cell = self._gate.enter_c(False)
        try:
            forbid_c(cell.flag, "alloc")  # first, as the allocator checks it (which, handed the call, checks again)
            if type(nbytes) is not int or not (0 < nbytes < _WORD_LIMIT):
                return self._allocator.alloc(nbytes, "device", "alloc")
            if self._zones is not None:
                return self._zoned_alloc(nbytes)
            return self._alloc(nbytes, _next_index() if self._indexes is None else next(self._indexes))
        finally:
            self._gate.leave_c(cell)

    cdef object _alloc(self, object n, object index):
        site = call_site(self._internal, self._caller_frames)  # (the facade's frame passed over where it has one)
        raw_ptr = None if self._door is NULL or self._gate.closed_c() else self._door_alloc(n)  # (closed: the method's error)
        if raw_ptr is None:  # no door, or it declined
            raw_ptr = self._plugin_alloc(n)
        return self._commit(make_buffer(raw_ptr, n, "device", index, site, self._ref), raw_ptr, site, False)

    cdef object _commit(self, object buf, object raw_ptr, object site, bint zoned):
        """The commit of ``buf`` (its raw memory at ``raw_ptr``): the backend is open now, or nothing of this
        allocation remains. Judged under the ledger's lock, which the sweep's drain takes: the record is drained at
        close, or never added. A zoned one's raw base goes first, so a sweep that drains its record finds it."""
        index = buffer_field(buf, FIELD_INDEX)
        n = buffer_field(buf, FIELD_NBYTES)
        if zoned:
            self._raw_base[index] = raw_ptr
        if self._ledger.commit(index, buf, self._gate):
            self._stats.allocated_c(KIND_DEVICE, n)
        else:
            if zoned:
                self._raw_base.pop(index, None)
                self._guard.forget(index)
            self._allocator.release_quietly(raw_ptr, "device")
            raise self._ctx.closed_error()
        if self._trace_idx is not None and self._trace_idx == index:
            self._allocator.trace(index, "alloc", n, site)
        return buf

    cdef object _zoned_alloc(self, object n):
        """An allocation where red zones are on: with zones where its index is sampled (the allocator's work,
        written out: the zone guard's fills, the quarantine's kept blocks), else plain."""
        cdef RedZones zones = self._zones
        cdef bint recycled = True
        raw_bytes = zones._lead_bytes + n + zones.size
        if raw_bytes >= _WORD_LIMIT:  # the allocator's error (the index taken there, as the pure lane's)
            return self._allocator.alloc(n, "device", "alloc")
        index = _next_index() if self._indexes is None else next(self._indexes)
        if index < zones.min_idx or index % zones.sample:
            return self._alloc(n, index)
        site = call_site(self._internal, self._caller_frames)
        raw_ptr = self._quarantine.reuse_c(raw_bytes)
        if raw_ptr is None:
            recycled = False
            raw_ptr = self._allocator.zoned_raw(raw_bytes, n)
        ptr = raw_ptr + zones._lead_bytes
        buf = make_buffer(ptr, n, "device", index, site, self._ref)
        try:  # the zone guard's fills, in its order: lead, trail, then the recycled block's bytes
            if zones._lead_c:
                self._memset(<uintptr_t>raw_ptr, zones.fill, zones._lead_c)
            self._memset(<uintptr_t>ptr + <uintptr_t>n, zones.fill, zones._trail_c)
            if recycled and self._zeroes:
                self._memset(<uintptr_t>ptr, 0, <size_t>n)
        except _MetraleError:
            self._allocator.release_quietly(raw_ptr, "device")
            raise
        zones.add_c(buf, index, <uintptr_t>ptr, <size_t>n)
        return self._commit(buf, raw_ptr, site, True)

    cdef int _memset(self, uintptr_t ptr, int value, size_t nbytes) except -1:
        """A fill on the default stream: through the plugin's C ``memset`` where it has one and takes it, else
        through the guarded layer (as the zone guard fills); a typed error either way."""
        cdef int rc = 1
        if self._door_memset and not self._gate.closed_c():
            ctx = self._ctx
            try:
                rc = self._door.memset(self._door.state, ptr, value, nbytes, <PyObject*>self._fill_stream)
            except Exception as exc:
                _raise_raw(ctx, ctx.name, "memset", exc)
        if rc != 0:
            self._raw.memset(ptr, value, nbytes, self._fill_stream)
        return 0

    cdef object _door_alloc(self, object n):
        """The plugin's C ``alloc``: the address, ``None`` where it declined, or the typed error it raised
        (reclaim-and-retry on out of memory)."""
        cdef uintptr_t ptr = 0
        try:
            if self._door.alloc(self._door.state, <size_t>n, &ptr) == 0:
                return ptr
            return None
        except _OutOfMemoryError as exc:
            return self._allocator.retry_alloc(n, "device", "alloc", exc)
        except Exception as exc:
            ctx = self._ctx
            _raise_raw(ctx, ctx.name, "alloc", exc)

    cdef object _plugin_alloc(self, object n):
        """The plugin's ``alloc`` method: the address, or the typed error (reclaim-and-retry on out of memory)."""
        ctx = self._ctx
        try:
            return ctx.plugin.alloc(n, "device")
        except _OutOfMemoryError as exc:
            return self._allocator.retry_alloc(n, "device", "alloc", exc)
        except Exception as exc:
            _raise_raw(ctx, ctx.name, "alloc", exc)

    def free(self, buf):
        """``GpuBackend.free``; from a finalizer that a collection runs in a call of this backend, later."""
        if self._gate.interrupted_c():
            self._gate.defer(self.free, buf)
            return
        cdef _Cell cell = self._gate.enter_c(False)
        try:
            forbid_c(cell.flag, "free")  # first, as the allocator checks it: before anything of ``buf`` is read
            if (type(buf) is not _DeviceBuffer or buffer_field(buf, FIELD_KIND) != "device"
                    or buffer_field(buf, FIELD_OWNER) is not self._ref):
                self._allocator.free(buf)
            else:
                self._free(buf)
        finally:
            self._gate.leave_c(cell)

    cdef int _free(self, object buf) except -1:
        ptr = buffer_field(buf, FIELD_PTR)
        index = buffer_field(buf, FIELD_INDEX)
        record = self._ledger.take(index, ptr, buffer_field(buf, FIELD_NBYTES))
        if record is None:  # not on the ledger: the allocator's error
            self._allocator.free(buf)
            return 0
        if record is buf:  # the handle handed out: a device allocation of its recorded size
            self._stats.released_c(KIND_DEVICE, buffer_field(buf, FIELD_NBYTES))
            kind = "device"
        elif record.kind == "pool":  # an equal handle of a pool's piece: back to its pool (as the allocator's)
            self._allocator.piece_taken(buf, record, None)
            return 0
        else:  # an equal handle: its record says what it was, and the method frees it so (as the allocator's)
            self._stats.released(record.kind, record.nbytes)
            kind = "managed" if record.kind == "managed" else "device"
        observers = self._releases.active
        if observers:
            for observer in <tuple>observers:
                observer(buf)
        if self._raw_base is not None:
            raw_ptr = self._raw_base.pop(index, None)
            if raw_ptr is not None:  # zoned: to the quarantine, as the allocator hands it
                self._quarantine.free_c(buf, index, buffer_field(buf, FIELD_NBYTES), raw_ptr, kind)
                return 0
        ctx = self._ctx
        try:
            if (record is not buf or self._door is NULL or self._gate.closed_c()
                    or self._door.free(self._door.state, <uintptr_t>ptr) != 0):  # not the door's, or declined
                ctx.plugin.free(ptr, kind)
        except Exception as exc:
            _raise_raw(ctx, ctx.name, "free", exc)
        return 0
