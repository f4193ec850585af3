# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`Quarantine`][metrale_core._memory.quarantine.Quarantine]: the same interface and
behaviour, its bookkeeping at C level.

- The pure class in ``quarantine.py`` is the reference; `_twins.pick("quarantine", ...)` picks this one where it
  was built and ``pure`` is off, with the compiled zone table (``_redzones/_layout.pyx``: one setting picks both).
- A held buffer is a `_Held` of C fields; its zones stay in the zone table, whose C-level door (`zone_bytes_c`,
  `remove_c`) this class uses instead of making `Zone` objects, except for the check itself.
- Kept blocks are listed by raw size: within one backend the raw size names the layout (its bands are fixed by the
  settings), so the order of release (oldest size first) is the pure class's.
- The C-level door (``_quarantine.pxd``) is for the compiled lane: `reuse_c` and `free_c`.
"""

cimport cython

from metrale_core._device._stats cimport StatsCounter
from metrale_core._redzones._layout cimport RedZones

import logging

from .._errors import MetraleError as _MetraleError
from .quarantine import QUARANTINE_MAX_BUFFERS as _MAX_BUFFERS

_log = logging.getLogger("metrale")

cdef Py_ssize_t _MAX = _MAX_BUFFERS


@cython.final
cdef class _Held:
    """A freed zoned buffer in quarantine: off the ledger, its memory and zones still held."""

    cdef object buf
    cdef object index
    cdef object raw_ptr
    cdef object kind
    cdef object raw_bytes  # what the device gave, zones included


@cython.final
cdef class Quarantine:
    """Freed zoned blocks of one backend: held until checked, then kept for reuse or released (compiled twin)."""

    def __init__(self, ctx, stats, guard):
        if not isinstance(stats, StatsCounter) or not isinstance(guard.zones, RedZones):
            raise TypeError(
                f"the compiled quarantine needs the compiled stats and zone table, got {type(stats)!r} and "
                f"{type(guard.zones)!r}: one `pure` setting picks them all"
            )
        self._ctx = ctx
        self._raw = ctx.raw
        self._stats = stats
        self._guard = guard
        self._zones = guard.zones
        self._lock = guard.lock
        self._bound = ctx.settings.redzone_quarantine_bytes  # (settings are fixed for the backend's life)
        self._held = []
        self._reuse = {}
        self._pieces = None
        guard.on_full_check(self.full_check)

    def give_pieces_to(self, callback):
        """Where a pool's piece goes once let go of: ``callback(index)`` (the allocator's, which gives it back)."""
        self._pieces = callback

    @property
    def held_bytes(self):
        """Device memory red zones hold back from the driver: the quarantine and the blocks kept for reuse."""
        return self._stats.quarantined_bytes + self._stats.reusable_bytes

    # -- reuse ----------------------------------------------------------------------------------

    def reuse(self, layout):
        """A checked block of ``layout`` freed earlier, for a new allocation (its raw pointer), or ``None``."""
        return self.reuse_c(layout.raw_bytes)

    cdef object reuse_c(self, object raw_bytes):
        """`reuse` of the layout of ``raw_bytes`` bytes (within one backend the raw size names the layout)."""
        if not self._reuse:  # no lock for the common miss: a stale answer only costs a driver call
            return None
        with self._lock:
            blocks = self._reuse.get(raw_bytes)
            if not blocks:
                return None
            ptr = (<list>blocks).pop()
            if not blocks:
                del self._reuse[raw_bytes]
        self._stats.reusable_c(-1, -raw_bytes)
        return ptr

    # -- free -----------------------------------------------------------------------------------

    def free(self, buf, raw_ptr, kind):
        """``free`` of zoned ``buf``: its record is off the ledger; its memory starts at ``raw_ptr``."""
        self.free_c(buf, buf.index, buf.nbytes, raw_ptr, kind)

    cdef int free_c(self, object buf, object index, object nbytes, object raw_ptr, object kind) except -1:
        """`free` with ``buf``'s index and size at hand."""
        cdef Py_ssize_t zone_bytes
        cdef _Held held
        guard = self._guard
        bound = self._bound
        stats = self._stats
        with self._lock:  # no check may read these zones once the memory is released
            zone_bytes = self._zones.zone_bytes_c(index)
            if zone_bytes >= 0 and bound:
                held = _Held.__new__(_Held)
                held.buf = buf
                held.index = index
                held.raw_ptr = raw_ptr
                held.kind = kind
                held.raw_bytes = nbytes + zone_bytes
                self._held.append(held)
                stats.quarantined_c(1, held.raw_bytes)
                if self._reuse:
                    self._trim(bound)  # blocks kept for reuse give way to the quarantine first
                if stats.quarantined_bytes <= bound and len(self._held) <= _MAX:
                    return 0
                violations, when = self._drain(()), "the check of the quarantine (freed buffers)"
            else:
                zones = guard.unwatch(index)
                try:
                    violations = guard.judge(zones)
                finally:
                    if kind == "pool":
                        self._pieces(index)
                    else:
                        self._raw.free(raw_ptr, kind)
                    guard.zones_released()
                when = f"free of allocation #{index}"
        guard.report(violations, when)
        return 0

    # -- checks ---------------------------------------------------------------------------------

    def drain(self, when, *, may_raise=True, give_back=False, also=()):
        """Check every buffer waiting here (waiting for the device), keep or release them, and report; whether the
        zones were read."""
        guard = self._guard
        read = True
        with self._lock:
            try:
                violations = self._drain(also)
            except _MetraleError as exc:
                if may_raise:
                    raise
                _log.warning("%s: the check of the quarantine could not read the zones (%s); its %d buffer(s) "
                             "stay quarantined until the next check", when, exc, len(self._held))
                violations, read = [], False
            finally:
                if give_back:
                    self._trim(0)
        guard.report(violations, f"the check of the quarantine (freed buffers) at {when}", may_raise=may_raise)
        return read

    cdef list _drain(self, object also):
        """Judge the held buffers (and ``also``) and let them go (`full_check`). A read that fails raises and
        keeps them all."""
        held = self._held
        if not held and not also:
            return []
        zones, table = self._zones.batch_c([(<_Held>entry).index for entry in held])  # their table made in C
        if also:
            zones.extend(also)
            table = None  # (made of the zones, with the sweep's)
        found = self._guard.judge(zones, table)
        self.full_check(found)
        return found

    def full_check(self, found):
        """Let go of every held buffer, its zones just judged with the device idle (``found``: the violations;
        ``None``: not judged, at close only)."""
        cdef _Held held
        cdef long long count = 0, nbytes = 0, kept = 0, kept_bytes = 0
        entries, self._held = self._held, []
        if not entries:
            return
        guard = self._guard
        bad = None if found is None else {violation.index for violation in found}
        bound = self._bound
        zones = self._zones
        ctx = self._ctx
        for entry in entries:
            held = <_Held>entry
            zones.remove_c(held.index)
            count += 1
            nbytes += held.raw_bytes
            if bad is not None and held.index not in bad and held.kind == "device" and bound:
                blocks = self._reuse.get(held.raw_bytes)
                if blocks is None:
                    self._reuse[held.raw_bytes] = [held.raw_ptr]
                else:
                    (<list>blocks).append(held.raw_ptr)
                kept += 1
                kept_bytes += held.raw_bytes
            elif held.kind == "pool":
                ctx.quietly(f"giving back the pool's piece #{held.index}", self._pieces, held.index)
            else:
                ctx.quietly(f"releasing quarantined allocation #{held.index}", self._raw.free, held.raw_ptr,
                            held.kind)
        self._stats.quarantined_c(-count, -nbytes)
        self._stats.reusable_c(kept, kept_bytes)
        self._trim(bound)
        ctx.quietly("rewrite the red-zone table", guard.zones_released)

    cdef int _trim(self, object bound) except -1:
        """Release blocks kept for reuse, oldest size first, until they and the quarantine hold at most ``bound``
        bytes (``0``: all of them). The caller holds the guard's lock."""
        stats = self._stats
        while self._reuse and stats.reusable_bytes + stats.quarantined_bytes > bound:
            raw_bytes = next(iter(self._reuse))
            blocks = <list>self._reuse[raw_bytes]
            ptr = blocks.pop(0)
            if not blocks:
                del self._reuse[raw_bytes]
            stats.reusable_c(-1, -raw_bytes)
            self._ctx.quietly("release a red-zoned block kept for reuse", self._raw.free, ptr, "device")
        return 0

    def release(self):
        """At close (the device idle, the final scan done): release what is held, unjudged, and every kept block."""
        with self._lock:
            self.full_check(None)
            self._trim(0)
