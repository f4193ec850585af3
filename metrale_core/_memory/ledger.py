"""The allocation ledger: every live device allocation, its size and its call site.

Written once, here, and shared by every backend; compiled as well as run as Python (``_ledger``, with
``_ledger.pxd`` beside it: docs/building.md). Its invariants:

- an allocation is on the ledger from the moment ``alloc`` returns it until
  ``free`` or ``sweep_unreleased`` takes it off;
- ``free`` takes the record off *before* the memory is released, whatever the
  release returns, so nothing is ever freed twice by a later sweep;
- arena memory is never on it;
- a record holds strings and integers only: never a frame object, which would
  keep every local of the allocating function alive.

What must be one per process (the creation indexes) or one class for both builds (`LedgerEvent`) lives in
``records.py``; the call site in ``sites.py``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal, TypeVar

from .._device.buffer import DeviceBuffer
from .._errors import BackendClosedError
from .._types import AllocRecord, Origin
from .records import LedgerEvent, record_of

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

if not cython.compiled:  # (compiled: the C lock of _lock.pxd, cimported by _ledger.pxd)
    from .._device._lock import acquire_lock, new_lock, release_lock

if TYPE_CHECKING:  # (as a module: compiled, ``Gate`` is the one _ledger.pxd cimports)
    from .._device import gate as gates


__all__ = ["Ledger", "LedgerProbe"]

_T = TypeVar("_T")


class Ledger:
    """The live allocations of one backend, keyed by creation index (an allocation's identity:
    never an address, which the driver hands out again). Thread-safe.

    It keeps the buffer each allocation handed out (the same fields as its record, and immutable)
    and makes [`AllocRecord`][metrale_core.AllocRecord] objects only when asked for them, so an ``alloc``
    and a ``free`` each cost one dictionary operation under the lock.

    With ``history`` above zero it also keeps the last ``history`` events, oldest
    dropped first (`events`, `dropped`).
    """

    __slots__ = ("_events", "_lock", "_records", "_stack", "_start", "dropped", "history", "origin", "taken")

    def __init__(self, history: int = 0, stack: Callable[[], tuple[str, ...]] | None = None) -> None:
        self._lock = new_lock()
        self._records: dict[int, DeviceBuffer] = {}
        self.history = history
        self._events: collections.deque[LedgerEvent] | None = (
            collections.deque(maxlen=history) if history else None
        )
        self._start = time.monotonic()
        self._stack = stack  # an allocation's stack for its history event (memory_history_frames), or None
        #: Events that fell off the front of the bounded history.
        self.dropped = 0
        #: How many times records came off (frees and sweeps): while it stays the same, every buffer found
        #: on the ledger is still on it (what lets a graph's launch skip the check of its buffers).
        self.taken = 0
        #: The origin its records name (the backend sets it once it knows its device's UUID).
        self.origin: Origin | None = None

    def _log(
        self, op: Literal["alloc", "free", "sweep"], record: AllocRecord, stack: tuple[str, ...] = ()
    ) -> None:
        events = self._events
        assert events is not None
        if len(events) == events.maxlen:
            self.dropped += 1
        events.append(LedgerEvent(time.monotonic() - self._start, op, record, stack))

    def add(self, buf: DeviceBuffer) -> None:
        """Put the allocation ``buf`` handed out on the ledger."""
        self.commit(buf.index, buf, None)

    def commit(self, index: int, buf: DeviceBuffer, gate: gates.Gate | None) -> bool:
        """Put ``buf`` (allocation ``index``) on the ledger while ``gate`` is open (``None``: always); whether it
        did. Judged under the ledger's lock, which `drain` takes: a record is added before the sweep drains the
        ledger, or not at all (an allocation's commit: the backend is open now, or nothing of it remains)."""
        # (the stack walked before the lock: it makes objects, and a collection's finalizer may free a buffer)
        stack = () if self._stack is None or self._events is None else self._stack()
        acquire_lock(self._lock)
        try:
            if gate is not None and gate.closed:
                return False
            if self._events is not None:  # (first: an event that cannot be made leaves nothing on the ledger)
                self._log("alloc", record_of(buf, self.origin), stack)
            self._records[index] = buf
        finally:
            release_lock(self._lock)
        return True

    def take(self, index: int, ptr: int, nbytes: int) -> DeviceBuffer | None:
        """Take allocation ``index`` off, if it is on the ledger at ``ptr`` with ``nbytes``; the buffer
        it handed out (its record's fields)."""
        acquire_lock(self._lock)
        try:
            rec = self._records.get(index)
            if rec is None or rec.ptr != ptr or rec.nbytes != nbytes:
                return None
            del self._records[index]
            self.taken += 1
            if self._events is not None:
                self._log("free", record_of(rec, self.origin))
            return rec
        finally:
            release_lock(self._lock)

    def holds(self, index: int, ptr: int, nbytes: int) -> bool:
        """Whether allocation ``index`` is on the ledger, at ``ptr`` with the ``nbytes`` recorded."""
        rec = self._records.get(index)
        return rec is not None and rec.ptr == ptr and rec.nbytes == nbytes

    def has(self, buf: DeviceBuffer) -> bool:
        """Whether ``buf`` is the very buffer the ledger handed out for its allocation, still on it (a copy
        of it is not: `holds` says whether one matches)."""
        return self._records.get(buf.index) is buf

    def has_index(self, index: int, buf: DeviceBuffer) -> bool:
        """`has`, for a caller that read ``buf``'s ``index`` already."""
        return self._records.get(index) is buf

    def holds_all(self, bufs: Iterable[DeviceBuffer], owner: object) -> bool | None:
        """Whether every one of ``bufs`` is ``owner``'s and on the ledger (`holds`); ``None`` where some
        are not of a kind the ledger holds (arena, external memory), which it cannot say."""
        records = self._records
        for buf in bufs:
            if buf._owner is not owner:
                return False
            rec = records.get(buf.index)
            if rec is buf:  # the very buffer the ledger handed out (the common case)
                continue
            if buf.kind not in ("device", "managed", "pool"):
                return None
            if rec is None or rec.ptr != buf.ptr or rec.nbytes != buf.nbytes:
                return False
        return True

    def drain(self) -> list[AllocRecord]:
        """Take every record off (a sweep)."""
        acquire_lock(self._lock)
        try:
            origin = self.origin
            records = [record_of(buf, origin) for buf in self._records.values()]
            self._records.clear()
            self.taken += 1
            if self._events is not None:
                for rec in records:
                    self._log("sweep", rec)
            return records
        finally:
            release_lock(self._lock)

    def snapshot(self) -> list[AllocRecord]:
        acquire_lock(self._lock)
        try:
            bufs = sorted(self._records.values(), key=_by_index)
        finally:
            release_lock(self._lock)
        origin = self.origin
        return [record_of(buf, origin) for buf in bufs]

    def events(self) -> list[LedgerEvent]:
        """The kept history, oldest first (empty when history is off)."""
        acquire_lock(self._lock)
        try:
            return list(self._events or ())
        finally:
            release_lock(self._lock)

    def elapsed(self) -> float:
        """Seconds since the ledger was created, on the clock of [`LedgerEvent.t`][metrale_core.LedgerEvent.t]."""
        return time.monotonic() - self._start

    def __len__(self) -> int:
        return len(self._records)

    def live_bytes(self) -> int:
        acquire_lock(self._lock)
        try:
            return sum([r.nbytes for r in self._records.values()])
        finally:
            release_lock(self._lock)


def _by_index(buf: DeviceBuffer) -> int:
    return buf.index


class LedgerProbe:
    """A reader of one backend's ledger that stays usable after the backend closes.

    Closing the backend sweeps the ledger, so a probe then reads an empty one. While the backend is open, each read
    is counted in its gate: a finalizer that a collection runs during the read, and that frees a buffer of this
    backend, has its free deferred (the ledger's lock is not re-entrant: that free would wait for the read forever).
    """

    __slots__ = ("_gate", "_ledger")

    def __init__(self, ledger: Ledger, gate: gates.Gate | None = None) -> None:
        self._ledger = ledger
        self._gate = gate

    def _read(self, read: Callable[[], _T]) -> _T:
        """``read()``, inside the backend's gate while it is open (closed, nothing frees onto the ledger)."""
        gate = self._gate
        if gate is None:
            return read()
        try:
            gate.enter(True)
        except BackendClosedError:  # closed: no free of this backend can come meanwhile
            return read()  # (a finalizer's read during an interrupted call is refused: that call may hold the lock)
        try:
            return read()
        finally:
            gate.leave()

    def live_count(self) -> int:
        """How many allocations are on the ledger."""
        return len(self._ledger)

    def live_bytes(self) -> int:
        """The bytes asked for by the allocations on the ledger."""
        return self._read(self._ledger.live_bytes)

    def records(self) -> list[AllocRecord]:
        """The records on the ledger, in creation order."""
        return self._read(self._ledger.snapshot)
