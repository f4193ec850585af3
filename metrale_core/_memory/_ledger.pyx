# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`Ledger`][metrale_core._memory.ledger.Ledger]: the same interface and behaviour, its
records under a C-level lock (``_device/_lock.pxd``: a waiter lets go of the GIL) and its counters
as C integers.

- The pure class in ``ledger.py`` is the reference: `_twins.pick` picks this one where it was built
  and ``pure`` is off. A differential test runs both through the same programs.
- Records are kept by creation index in a dict, the buffer handed out as the value: an ``alloc`` and a
  ``free`` each cost one dict operation under the lock, as in the pure class.
"""

cimport cython

from metrale_core._device._gate cimport Gate
from metrale_core._device._handle cimport FIELD_NBYTES, FIELD_PTR, buffer_field
from metrale_core._device._lock cimport acquire, lock_t, release

import collections
import time

from .._device.buffer import DeviceBuffer as _DeviceBuffer
from .ledger import LedgerEvent, _record


@cython.final
cdef class Ledger:
    """The live allocations of one backend, keyed by creation index; thread-safe (compiled twin)."""

    def __init__(self, Py_ssize_t history=0, stack=None):
        self._records = {}
        self._stack = stack  # an allocation's stack for its history event (memory_history_frames), or None
        self.history = history
        self._events = collections.deque(maxlen=history) if history else None
        self._start = time.monotonic()
        self.dropped = 0
        self.taken = 0
        self.origin = None

    cdef void _log(self, str op, object record, tuple stack=()) except *:
        events = self._events
        if len(events) == events.maxlen:
            self.dropped += 1
        events.append(LedgerEvent(time.monotonic() - self._start, op, record, stack))

    def add(self, buf):
        """Put the allocation ``buf`` handed out on the ledger."""
        self.add_c(buf.index, buf, None)

    cdef int add_c(self, object index, object buf, Gate gate) except -1:
        """`add` while ``gate`` is open (``None``: always): ``1``, or ``0`` with nothing added once it is shut.
        Judged under the ledger's lock, which `drain` takes: a record is added before the sweep drains the ledger,
        or not at all."""
        # (the stack walked before the lock: it makes objects, and a collection's finalizer may free a buffer)
        stack = () if self._stack is None or self._events is None else self._stack()
        acquire(&self._lock)
        try:
            if gate is not None and gate.closed_c():
                return 0
            self._records[index] = buf
            if self._events is not None:
                self._log("alloc", _record(buf, self.origin), stack)
        finally:
            release(&self._lock)
        return 1

    def take(self, index, ptr, nbytes):
        """Take allocation ``index`` off, if it is on the ledger at ``ptr`` with ``nbytes``; the buffer it
        handed out (its record's fields)."""
        return self.take_c(index, ptr, nbytes)

    cdef object take_c(self, object index, object ptr, object nbytes):
        acquire(&self._lock)
        try:
            rec = self._records.get(index)
            if rec is None:
                return None
            if type(rec) is _DeviceBuffer:  # (its fields read from its slots)
                if buffer_field(rec, FIELD_PTR) != ptr or buffer_field(rec, FIELD_NBYTES) != nbytes:
                    return None
            elif rec.ptr != ptr or rec.nbytes != nbytes:
                return None
            del self._records[index]
            self.taken += 1
            if self._events is not None:
                self._log("free", _record(rec, self.origin))
            return rec
        finally:
            release(&self._lock)

    def holds(self, index, ptr, nbytes):
        """Whether allocation ``index`` is on the ledger, at ``ptr`` with the ``nbytes`` recorded."""
        rec = self._records.get(index)
        return rec is not None and rec.ptr == ptr and rec.nbytes == nbytes

    def has(self, buf):
        """Whether ``buf`` is the very buffer the ledger handed out for its allocation, still on it."""
        return self._records.get(buf.index) is buf

    cdef bint has_c(self, object index, object buf):
        return self._records.get(index) is buf

    def holds_all(self, bufs, owner):
        """Whether every one of ``bufs`` is ``owner``'s and on the ledger; ``None`` where some are not of a
        kind the ledger holds (arena, external memory), which it cannot say."""
        records = self._records
        for buf in bufs:
            if buf._owner is not owner:
                return False
            rec = records.get(buf.index)
            if rec is buf:
                continue
            if buf.kind not in ("device", "managed", "pool"):
                return None
            if rec is None or rec.ptr != buf.ptr or rec.nbytes != buf.nbytes:
                return False
        return True

    def drain(self):
        """Take every record off (a sweep)."""
        acquire(&self._lock)
        try:
            origin = self.origin
            records = [_record(buf, origin) for buf in self._records.values()]
            self._records.clear()
            self.taken += 1
            if self._events is not None:
                for rec in records:
                    self._log("sweep", rec)
            return records
        finally:
            release(&self._lock)

    def snapshot(self):
        acquire(&self._lock)
        try:
            bufs = sorted(self._records.values(), key=_by_index)
        finally:
            release(&self._lock)
        origin = self.origin
        return [_record(buf, origin) for buf in bufs]

    def events(self):
        """The kept history, oldest first (empty when history is off)."""
        acquire(&self._lock)
        try:
            return list(self._events or ())
        finally:
            release(&self._lock)

    def elapsed(self):
        """Seconds since the ledger was created, on the clock of `LedgerEvent.t`."""
        return time.monotonic() - self._start

    def __len__(self):
        return len(self._records)

    def live_bytes(self):
        acquire(&self._lock)
        try:
            return sum([r.nbytes for r in self._records.values()])
        finally:
            release(&self._lock)


def _by_index(buf):
    return buf.index
