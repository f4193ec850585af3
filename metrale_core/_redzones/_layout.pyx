# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`RedZones`][metrale_core._redzones.layout.RedZones]: the same interface and behaviour, the
live zones under a C-level lock (``_device/_lock.pxd``) and the scan's table in a C array.

- The pure class in ``layout.py`` is the reference: `_twins.pick("zones", ...)` picks this one where it was built
  and ``pure`` is off. The slots move as the pure class moves them (a removed zone's slot takes the last one), so
  a scan reads the same table in the same order.
- Each allocation's zones are one `_Rec`: their addresses and lengths as C integers, their table slots, the
  buffer. Their `Zone` objects are made when asked for (a scan, a check, a free without quarantine), once.
- A snapshot's zones are a `_SlotZones`: the slots' records, whose `Zone` objects are made only when asked for (a
  scan that finds nothing asks for none), kept until the zones change (the pure class copies its list of zones).
- The C-level door (``_layout.pxd``) is for the compiled lane and quarantine: `add_c` adds the zones of a new
  allocation from its address and size, `remove_c` forgets them, `zone_bytes_c` says how many bytes they hold.
"""

cimport cython
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from libc.stdint cimport uint64_t, uintptr_t

from metrale_core._device._lock cimport acquire, release
from metrale_core._device._slots cimport slot_set, slots_to_build

from collections.abc import Sequence as _Sequence

from .._types import WORD_LIMIT as _WORD_LIMIT
from .._types import RedZoneViolation as _RedZoneViolation
from .layout import ALIGN as _ALIGN
from .layout import Layout as _Layout
from .layout import Zone as _Zone

# Zone's slots (buffer, side, start, length): a zone is made by storing them in place, as the packer twin makes a
# LaunchArg; where a Zone is not made so (`slots_to_build`), by its constructor.
_z = slots_to_build(_Zone, ("buffer", "side", "start", "length"))
cdef bint _Z_DIRECT = _z is not None
cdef Py_ssize_t _Z_BUFFER = _z[0] if _Z_DIRECT else -1
cdef Py_ssize_t _Z_SIDE = _z[1] if _Z_DIRECT else -1
cdef Py_ssize_t _Z_START = _z[2] if _Z_DIRECT else -1
cdef Py_ssize_t _Z_LENGTH = _z[3] if _Z_DIRECT else -1
del _z
cdef object _new = object.__new__


cdef object _zone(object buf, str side, uint64_t start, uint64_t length):
    """A `Zone`, the same as ``Zone(buf, side, start, length)``."""
    if not _Z_DIRECT:
        return _Zone(buf, side, start, length)
    zone = _new(_Zone)
    slot_set(zone, _Z_BUFFER, buf)
    slot_set(zone, _Z_SIDE, side)
    slot_set(zone, _Z_START, start)
    slot_set(zone, _Z_LENGTH, length)
    return zone


@cython.final
cdef class _Rec:
    """The zones of one allocation: where they lie and which table slots they hold (-1: no such zone); ``zones``:
    their tuple of `Zone` objects, ``None`` until asked for."""


@cython.final
cdef class RedZones:
    """The zones of one backend's live allocations, and the settings that shape them (compiled twin)."""

    def __init__(self, settings):
        self.size = settings.redzone
        self.min_idx = settings.redzone_min_idx
        self.fill = settings.redzone_fill
        self.lead = settings.redzone_lead
        self.sample = settings.redzone_sample
        lead_bytes = (self.size + _ALIGN - 1) // _ALIGN * _ALIGN if self.lead else 0
        self._lead_bytes = lead_bytes
        # (as C integers where they fit 64 bits: else no allocation can fit them, and add_c is never called)
        self._lead_c = lead_bytes if lead_bytes < _WORD_LIMIT else 0
        self._trail_c = self.size if self.size < _WORD_LIMIT else 0
        self._recs = {}
        self._slots = []
        self._table = NULL
        self._capacity = 0
        self._patterns = {}
        self.version = 0
        self.filled = 0
        self._seen = None  # (version, _SlotZones) of the last snapshot

    def __dealloc__(self):
        PyMem_Free(self._table)

    # -- the layout ------------------------------------------------------------------------------

    def layout(self, nbytes, index):
        """The raw size and the zones for an ``alloc`` of ``nbytes`` with ``index``; ``None`` for none."""
        if self.size == 0 or index < self.min_idx or index % self.sample:
            return None
        return _Layout(raw_bytes=self._lead_bytes + nbytes + self.size, lead=self._lead_bytes, trail=self.size)

    def zones_for(self, buf, layout):
        zones = []
        if layout.lead:
            zones.append(_Zone(buf, "lead", buf.ptr - layout.lead, layout.lead))
        if layout.trail:
            zones.append(_Zone(buf, "trail", buf.ptr + buf.nbytes, layout.trail))
        return tuple(zones)

    # -- adding and removing ---------------------------------------------------------------------

    cdef int _grow(self, Py_ssize_t slots) except -1:
        """Room in the table for ``slots`` slots (the caller holds the lock; no Python code runs here)."""
        cdef Py_ssize_t capacity = self._capacity
        cdef uint64_t* table
        if slots <= capacity:
            return 0
        capacity = max(slots, capacity * 2, 64)
        table = <uint64_t*>PyMem_Realloc(self._table, capacity * 2 * sizeof(uint64_t))
        if table is NULL:
            raise MemoryError()
        self._table = table
        self._capacity = capacity
        return 0

    cdef int _put(self, object index, _Rec rec) except -1:
        """Add ``rec``'s zones, lead first, to the table's end (the caller holds the lock)."""
        cdef Py_ssize_t slot = len(self._slots)
        self._grow(slot + 2)
        self._recs[index] = rec
        if rec.lead_len:
            rec.lead_slot = slot
            self._slots.append(rec)
            self._table[2 * slot] = rec.lead_start
            self._table[2 * slot + 1] = rec.lead_len
            slot += 1
        if rec.trail_len:
            rec.trail_slot = slot
            self._slots.append(rec)
            self._table[2 * slot] = rec.trail_start
            self._table[2 * slot + 1] = rec.trail_len
        self.version += 1
        self.filled += 1
        return 0

    def add(self, tuple zones):
        if not zones:
            return
        cdef _Rec rec = _Rec.__new__(_Rec)
        rec.lead_slot = rec.trail_slot = -1
        first = zones[0]
        rec.buf = first.buffer
        rec.zones = zones
        for zone in zones:
            if zone.side == "lead":
                rec.lead_start, rec.lead_len = zone.start, zone.length
            else:
                rec.trail_start, rec.trail_len = zone.start, zone.length
        index = first.buffer.index
        acquire(&self._lock)
        try:
            self._put(index, rec)
        finally:
            release(&self._lock)

    cdef int add_c(self, object buf, object index, uintptr_t ptr, size_t nbytes) except -1:
        """`add` of the zones of ``buf`` (allocation ``index`` of ``nbytes`` bytes at ``ptr``), as `layout` and
        `zones_for` lay them out."""
        cdef _Rec rec = _Rec.__new__(_Rec)  # (made before the lock: making an object may run a collection)
        rec.buf = buf
        rec.zones = None
        rec.lead_slot = rec.trail_slot = -1
        rec.lead_len = self._lead_c
        rec.lead_start = <uint64_t>ptr - rec.lead_len
        rec.trail_len = self._trail_c
        rec.trail_start = <uint64_t>ptr + <uint64_t>nbytes
        acquire(&self._lock)
        try:
            self._put(index, rec)
        finally:
            release(&self._lock)
        return 0

    cdef void _drop_slot(self, Py_ssize_t slot) noexcept:
        """Free table slot ``slot``: the last slot moves into it (the caller holds the lock)."""
        cdef Py_ssize_t last = len(self._slots) - 1
        cdef _Rec moved = <_Rec>self._slots[last]
        del self._slots[last]
        if slot < last:
            self._slots[slot] = moved
            self._table[2 * slot] = self._table[2 * last]
            self._table[2 * slot + 1] = self._table[2 * last + 1]
            if moved.lead_slot == last:
                moved.lead_slot = slot
            else:
                moved.trail_slot = slot

    cdef _Rec _take(self, object index):
        """Forget allocation ``index``'s zones: its `_Rec`, or ``None`` (the caller holds the lock; the caller drops
        the record after letting go of it: a buffer released may run Python code)."""
        rec = self._recs.pop(index, None)
        if rec is None:
            return None
        cdef _Rec r = <_Rec>rec
        if r.lead_slot >= 0:  # in the order the pure class frees them: the lead's slot, then the trail's
            self._drop_slot(r.lead_slot)
        if r.trail_slot >= 0:
            self._drop_slot(r.trail_slot)
        r.lead_slot = r.trail_slot = -1
        self.version += 1
        return r

    cdef bint remove_c(self, object index) except -1:
        """`remove` without making the zones: whether allocation ``index`` had any."""
        acquire(&self._lock)
        try:
            rec = self._take(index)
        finally:
            release(&self._lock)
        if rec is not None and self._seen is not None:
            self._seen = None  # (after the lock: it may hold the last reference to a buffer with a finalizer)
        return rec is not None

    def remove(self, index):
        """Forget the zones of allocation ``index``; returns them (empty if it had none)."""
        acquire(&self._lock)
        try:
            rec = self._take(index)
        finally:
            release(&self._lock)
        if rec is not None and self._seen is not None:
            self._seen = None  # (after the lock: it may hold the last reference to a buffer with a finalizer)
        return () if rec is None else _zones_of(rec)

    # -- reading ---------------------------------------------------------------------------------

    cdef Py_ssize_t zone_bytes_c(self, object index) except -2:
        """The bytes allocation ``index``'s zones hold (lead and trail), or -1 where it has none."""
        acquire(&self._lock)
        try:
            rec = self._recs.get(index)
            if rec is None:
                return -1
            return <Py_ssize_t>((<_Rec>rec).lead_len + (<_Rec>rec).trail_len)
        finally:
            release(&self._lock)

    cdef tuple batch_c(self, list indexes):
        """The zones of allocations ``indexes`` still watched, in that order (each one's lead first), and their scan
        table (`zone_table`'s bytes): what a batch check judges."""
        cdef _Rec rec
        cdef Py_ssize_t i, n = 0
        cdef uint64_t* at
        cdef Py_ssize_t k
        recs = [None] * len(indexes)  # (made before the lock, filled under it)
        acquire(&self._lock)
        try:
            for k in range(len(indexes)):
                recs[k] = self._recs.get(indexes[k])
        finally:
            release(&self._lock)
        zones = []
        for item in recs:
            if item is not None:
                zones.extend(_zones_of(<_Rec>item))
        table = PyBytes_FromStringAndSize(NULL, len(zones) * 16)
        at = <uint64_t*><char*>table
        for item in recs:
            if item is None:
                continue
            rec = <_Rec>item
            if rec.lead_len:
                at[2 * n], at[2 * n + 1] = rec.lead_start, rec.lead_len
                n += 1
            if rec.trail_len:
                at[2 * n], at[2 * n + 1] = rec.trail_start, rec.trail_len
                n += 1
        return zones, table

    def zones_of(self, index):
        """The zones of allocation ``index`` still watched (empty if none)."""
        acquire(&self._lock)
        try:
            rec = self._recs.get(index)
        finally:
            release(&self._lock)
        return () if rec is None else _zones_of(<_Rec>rec)

    def watched(self, index):
        """Whether allocation ``index`` still has zones here (live, or freed and waiting in quarantine)."""
        return index in self._recs

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef tuple _live(self):
        """The slots' records in order, which of them are leads, and the version they are; their `Zone` objects are
        made after, by `_SlotZones`. Takes the lock itself: the containers are made before it (making a container may run a
        collection, whose finalizers may free a zoned buffer, which takes this lock), filled under it."""
        cdef Py_ssize_t i, n
        cdef list recs, slots
        cdef unsigned char *lead_flags
        while True:
            n = len(self._slots)
            recs = [None] * n
            leads = bytearray(n)
            lead_flags = leads
            acquire(&self._lock)
            try:
                slots = self._slots
                if len(slots) == n:  # (else it changed meanwhile: made again at its new size)
                    for i in range(n):
                        rec = slots[i]
                        recs[i] = rec
                        lead_flags[i] = (<_Rec>rec).lead_slot == i
                    return recs, leads, self.version
            finally:
                release(&self._lock)

    def live(self):
        recs, leads, _ = self._live()
        return list(_SlotZones.of(recs, bytes(leads)))

    def table(self):
        """``(version, count, table bytes)``: what the device-side table holds for this version."""
        cdef long long version
        acquire(&self._lock)
        try:  # (bytes are no container: making them runs no collection)
            version = self.version
            count = len(self._slots)
            table = PyBytes_FromStringAndSize(<char*>self._table, count * 16)
        finally:
            release(&self._lock)
        return version, count, table

    def snapshot(self, known_version):
        """``(version, zones, table)``: the live zones in slot order and, unless the version is still
        ``known_version``, the table's bytes for the device."""
        cdef long long version
        while True:
            seen = self._seen
            if seen is None or (<tuple>seen)[0] != self.version:
                recs, leads, read = self._live()
                seen = self._seen = (read, _SlotZones.of(recs, bytes(leads)))
            acquire(&self._lock)
            try:  # the table of the same version as the slots read (else read again)
                version = self.version
                same = version == (<tuple>seen)[0]
                table = None if version == known_version or not same else PyBytes_FromStringAndSize(
                    <char*>self._table, len(self._slots) * 16)
            finally:
                release(&self._lock)
            if same:
                return version, (<tuple>seen)[1], table

    def judge(self, zone, data):
        """A violation if ``data`` (the zone read back) is not all fill bytes."""
        pattern = self._patterns.get(len(data))
        if pattern is None:
            pattern = self._patterns.setdefault(len(data), bytes((self.fill,)) * len(data))
        if data == pattern:
            return None
        rest = data.lstrip(bytes((self.fill,)))
        buf = zone.buffer
        return _RedZoneViolation(
            ptr=buf.ptr, nbytes=buf.nbytes, index=buf.index, site=buf.site, side=zone.side,
            offset=len(data) - len(rest),
        )


@cython.final
cdef class _SlotZones:
    """The zone in each slot of a snapshot, lead or trail as the slot held then: a read-only sequence whose `Zone`
    objects are made when asked for, once per allocation (`_zones_of`)."""

    cdef list _recs
    cdef bytes _leads

    @staticmethod
    cdef _SlotZones of(list recs, bytes leads):
        cdef _SlotZones made = _SlotZones.__new__(_SlotZones)
        made._recs = recs
        made._leads = leads
        return made

    def __len__(self):
        return len(self._recs)

    def __getitem__(self, at):
        cdef Py_ssize_t i
        if isinstance(at, slice):
            return [self[j] for j in range(*at.indices(len(self._recs)))]
        i = at
        if i < 0:
            i += len(self._recs)
        if not 0 <= i < len(self._recs):
            raise IndexError("zone index out of range")
        zones = _zones_of(<_Rec>self._recs[i])
        return zones[0] if self._leads[i] else zones[len(zones) - 1]

    def __iter__(self):
        cdef Py_ssize_t i
        for i in range(len(self._recs)):
            zones = _zones_of(<_Rec>self._recs[i])
            yield zones[0] if self._leads[i] else zones[len(zones) - 1]


_Sequence.register(_SlotZones)


cdef tuple _zones_of(_Rec rec):
    """The `Zone` objects of ``rec``, lead first: made once."""
    if rec.zones is None:
        if rec.lead_len and rec.trail_len:
            rec.zones = (_zone(rec.buf, "lead", rec.lead_start, rec.lead_len),
                         _zone(rec.buf, "trail", rec.trail_start, rec.trail_len))
        elif rec.lead_len:
            rec.zones = (_zone(rec.buf, "lead", rec.lead_start, rec.lead_len),)
        else:
            rec.zones = (_zone(rec.buf, "trail", rec.trail_start, rec.trail_len),)
    return <tuple>rec.zones
