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
- `PoolLane` is the compiled twin of [`PoolLane`][metrale_core._memory.lane.PoolLane], the front of the backend's
  pools. Its common case is an allocator door's: a piece of a compiled pool (``_pool.pyx``) for another library's
  stream (``MemoryPool.alloc_on``) and the free of such a piece without a stream, red zones off, no capture in
  progress. It is the allocator's ``pool_alloc`` and ``free_piece`` written out, in their order, under their locks;
  a new segment is the allocator's (`new_piece`: reclaim-and-retry), and every other call goes to the allocator.
"""

cimport cython
from cpython.object cimport PyObject
from libc.stdint cimport uintptr_t

from .._device._capture cimport forbid_c
from .._device._calls cimport ask_device_calls, device_calls_have_memset, device_calls_of, metrale_device_calls_v1
from .._device._gate cimport Gate, _Cell
from .._device._handle cimport (
    FIELD_INDEX, FIELD_KIND, FIELD_NBYTES, FIELD_OWNER, FIELD_PTR, buffer_field, make_buffer,
)
from .._device._stats cimport KIND_DEVICE, KIND_POOL, StatsCounter
from .._redzones._layout cimport RedZones
from ._ledger cimport Ledger
from ._pool cimport MemoryPool, _Segment
from ._quarantine cimport Quarantine
from ._sites cimport call_site

import functools
import logging

from .._device.buffer import DeviceBuffer as _DeviceBuffer
from .._device.guarded import raise_raw as _raise_raw
from .._errors import InvalidArgumentError as _InvalidArgumentError
from .._errors import MetraleError as _MetraleError
from .._errors import OutOfMemoryError as _OutOfMemoryError
from .._types import WORD_LIMIT as _WORD_LIMIT
from .._device.raw import DEVICE_CALLS as _DEVICE_CALLS
from .records import INDEXES as _INDEXES
from .records import INDEXES_LOCK_FREE as _INDEXES_LOCK_FREE
from .records import next_index as _next_index
from .pool import HUGE as _HUGE

_log = logging.getLogger("metrale")

cdef bytes _CAPSULE_NAME = _DEVICE_CALLS.encode()
#: The pool lane's sizes are below `pool.HUGE` (a piece's rounded size fits a C ``long long``); larger ones, which
#: no driver serves, go to the allocator (its out-of-memory error).
cdef object _FAST_LIMIT = _HUGE


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
        capsule = ask_device_calls(plugin, _log)
        self._door = device_calls_of(plugin, capsule, _CAPSULE_NAME, _log)
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
        self._door_memset = self._door is not NULL and device_calls_have_memset(self._door)
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


@cython.final
cdef class PoolLane:
    """The front of a backend's memory pools: an allocator door's common case here (compiled twin)."""

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
    cdef RedZones _zones  # (None where red zones are off)
    cdef dict _raw_base
    cdef dict _pool_of

    def __init__(self, allocator, parts):
        ctx = parts.ctx
        _compiled_parts("pool lane", parts)
        if type(parts.pool_of) is not dict:
            raise TypeError("the compiled pool lane needs the holdings' pool_of (LaneParts)")
        self._allocator = allocator
        self._ctx = ctx
        self._gate = ctx.gate
        self._ledger = parts.ledger
        self._stats = parts.stats
        self._releases = parts.releases
        self._trace_idx = parts.trace_idx
        self._internal = ctx.internal
        self._indexes = _INDEXES if _INDEXES_LOCK_FREE else None
        self._caller_frames = parts.caller_frames
        self._ref = ctx.ref
        zoning = parts.zoning
        if zoning is not None:
            if not isinstance(zoning.zones, RedZones):
                raise TypeError(f"the compiled pool lane needs the compiled zone table, got {type(zoning.zones)!r}: "
                                f"one `pure` setting picks them all")
            self._zones = zoning.zones
            self._raw_base = zoning.raw_base
        self._pool_of = parts.pool_of

    def pool_alloc(self, pool, nbytes, stream, foreign=None, stacklevel=1):
        """`MemoryPool.alloc` and `MemoryPool.alloc_on`."""
        cdef _Cell cell
        if foreign is None:  # (MemoryPool.alloc: the allocator's whole work)
            return self._allocator.pool_alloc(pool, nbytes, stream, None, stacklevel)
        if (type(pool) is not MemoryPool or type(nbytes) is not int
                or type(foreign) is not int or not (0 < nbytes < _FAST_LIMIT) or not (0 <= foreign < _WORD_LIMIT)):
            return self._allocator.pool_alloc(pool, nbytes, stream, foreign)
        cell = self._gate.enter_c(False)
        try:
            forbid_c(cell.flag, "MemoryPool.alloc_on")  # first, as the allocator's `_open_pool`
            if (<MemoryPool>pool)._closed:  # the allocator's error
                return self._allocator.pool_alloc(pool, nbytes, stream, foreign)
            index = _next_index() if self._indexes is None else next(self._indexes)
            zones = self._zones
            if zones is not None and not (index < zones.min_idx or index % zones.sample):  # zoned: the allocator's
                return self._allocator.pool_piece(pool, nbytes, ("foreign", foreign), True, index,
                                                  "MemoryPool.alloc_on")
            return self._alloc_on(<MemoryPool>pool, nbytes, ("foreign", foreign), index)
        finally:
            self._gate.leave_c(cell)

    cdef object _alloc_on(self, MemoryPool pool, object n, tuple target, object index):
        cdef long long size = ((<long long>n) + 511) & ~(<long long>511)  # (`pool.size_class`)
        cdef _Segment segment
        site = call_site(self._internal, self._caller_frames)
        taken = pool.take_c(size, target, False)
        if taken is None:  # a new segment: the allocator's (reclaim-and-retry)
            taken = self._allocator.new_piece(pool, size, n, "MemoryPool.alloc_on", target, False)
        ptr, segment = <tuple>taken
        buf = make_buffer(ptr, n, "pool", index, site, self._ref)
        # the commit, without the context's lock (the allocator's takes it): the ledger first, judged under its lock
        # against the backend's close (as the device lane's), then the pool's hand-out, judged under the pool's lock
        # against its close. A close that comes between finds the record on the ledger but not out of the pool:
        # it leaves it, and the hand-out, refused, takes it back off. A sweep that comes between takes the record:
        # the hand-out, seeing it gone, makes of the piece what the sweep would have (cached, or stranded), and the
        # buffer is handed back as the allocator's would be. Each pool_of item is one dict operation (atomic): no
        # piece touches two of the holdings' tables at once here, so their lock is not needed.
        self._pool_of[index] = pool
        self._stats.allocated_c(KIND_POOL, n)  # (before the record is out: a sweep's release never comes first)
        if not self._ledger.commit(index, buf, self._gate):
            self._stats.released_c(KIND_POOL, n)
            self._pool_of.pop(index, None)
            pool.give_untaken(ptr, size, segment)
            raise self._ctx.closed_error()
        if not pool.handed_out_c(index, ptr, size, segment, target, False, self._ledger, buf):  # (2: swept already)
            if self._ledger.take(index, ptr, n) is not None:  # (None where the backend's sweep took it)
                self._stats.released_c(KIND_POOL, n)
            self._pool_of.pop(index, None)
            pool.give_untaken(ptr, size, segment)
            raise _InvalidArgumentError(f"MemoryPool.alloc_on: {pool!r} was closed meanwhile")
        if self._trace_idx is not None and self._trace_idx == index:
            self._allocator.trace(index, "MemoryPool.alloc_on", n, site)
        return buf

    def pool_free(self, pool, buf, stream, what):
        """`MemoryPool.free` (and a door's); from a finalizer that a collection runs in a call of this backend,
        later."""
        cdef _Cell cell
        if self._gate.interrupted_c():
            self._gate.defer(functools.partial(self.pool_free, pool, stream=stream, what=what), buf)
            return
        cell = self._gate.enter_c(False)
        try:
            forbid_c(cell.flag, what)  # first, as the allocator's `pool_free`
            if (stream is not None or type(buf) is not _DeviceBuffer
                    or buffer_field(buf, FIELD_KIND) != "pool" or buffer_field(buf, FIELD_OWNER) is not self._ref):
                self._allocator.free_piece(pool, buf, stream, what)
            else:
                self._free(pool, buf, what)
        finally:
            self._gate.leave_c(cell)

    cdef int _free(self, object pool, object buf, str what) except -1:
        index = buffer_field(buf, FIELD_INDEX)
        owner = self._pool_of.get(index)
        if (owner is None or (pool is not None and owner is not pool) or type(owner) is not MemoryPool
                or (self._raw_base is not None and index in self._raw_base)):  # (a zoned piece: the allocator's)
            self._allocator.free_piece(pool, buf, None, what)  # its error (or a pure pool's work)
            return 0
        n = buffer_field(buf, FIELD_NBYTES)
        record = self._ledger.take(index, buffer_field(buf, FIELD_PTR), n)
        if record is None:  # not live: the allocator's error
            self._allocator.free_piece(pool, buf, None, what)
            return 0
        owner = self._pool_of.pop(index)  # (the allocator's `piece_taken`, unzoned; this free took the record)
        self._stats.released_c(KIND_POOL, n)
        observers = self._releases.active
        if observers:
            for observer in <tuple>observers:
                observer(buf)
        (<MemoryPool>owner).give_c(index, None)
        return 0

    def pool_record(self, pool, buf, foreign_stream):
        self._allocator.pool_record(pool, buf, foreign_stream)

    def pool_trim(self, pool, keep_bytes):
        return self._allocator.pool_trim(pool, keep_bytes)

    def pool_stats(self, pool):
        return self._allocator.pool_stats(pool)

    def pool_close(self, pool):
        self._allocator.pool_close(pool)
