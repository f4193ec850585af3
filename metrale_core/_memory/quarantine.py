"""The quarantine: freed zoned blocks, their check, their reuse and their release; the allocator's.

- A ``free`` of a zoned buffer takes its record off the ledger at once, but its memory and zones wait
  here (``redzone_quarantine_bytes`` > 0). Past the bound, the whole batch is judged together.
- The zone guard judges; the quarantine frees. A block found intact is kept, within the same bound,
  for the next allocation of its layout, which fills its zones again (a stale pointer of the block's
  previous owner may have written there since the check: never blamed on the new owner). Kept blocks are
  listed by raw size: within one backend the raw size names the layout (its bands are fixed by the settings).
- After a full check (``scan_redzones()``, a bad in-graph verdict, ``close()``) the guard tells the
  quarantine what it found (`Quarantine.full_check`), and the batch goes as after its own check.
- A memory pool's zoned piece waits here too (kind ``"pool"``); once judged, or at close, it goes back to its
  pool (`give_pieces_to`), never to the driver nor to the blocks kept for reuse.
- Out of memory, the allocator drains it and gives every kept block back, then tries again, as
  CuPy's ``SingleDeviceMemoryPool._try_malloc`` does.
- A check that cannot read the zones (a driver error) releases nothing: every buffer stays here,
  watched, and the next check judges it. Out of memory that is logged, and the allocation goes on.

Everything here runs under the guard's lock: no check may read a zone whose memory is released.

Written once, here, and compiled as well as run as Python (``_quarantine``, with ``_quarantine.pxd`` beside it:
docs/building.md); the compiled lane calls `Quarantine.reuse_c` and `Quarantine.free_c` at C level.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Final

from .._device.buffer import DeviceBuffer
from .._device.context import DeviceContext
from .._device.stats import StatsCounter
from .._errors import MetraleError
from .._redzones.guard import ZoneGuard
from .._redzones.zone import Layout, Zone, zone_table
from .._types import AllocKind, RedZoneViolation

__all__ = ["QUARANTINE_MAX_BUFFERS", "Quarantine"]


def _no_pieces(pieces: list[tuple[int, int]]) -> None:  # pragma: no cover - the pool front sets its own at once
    raise AssertionError(f"a pool's pieces {pieces} reached a quarantine that knows no pools")

#: The quarantine is checked and released once it holds more buffers than this (or more bytes than
#: ``redzone_quarantine_bytes``).
QUARANTINE_MAX_BUFFERS: Final = 1024

_log = logging.getLogger("metrale")


class _Held:  # (final: @cython.final in _quarantine.pxd)
    """A freed zoned buffer in quarantine: off the ledger, its memory and zones still held (`_held` makes one)."""

    __slots__ = ("buf", "index", "kind", "raw_bytes", "raw_ptr", "zones")

    buf: DeviceBuffer
    index: int
    zones: tuple[Zone, ...]
    raw_ptr: int
    kind: AllocKind
    raw_bytes: int  # what the device gave, zones included


def _held(
    buf: DeviceBuffer, index: int, nbytes: int, zones: tuple[Zone, ...], raw_ptr: int, kind: AllocKind
) -> _Held:
    """A `_Held` of allocation ``index`` (``buf``, of ``nbytes``), its memory at ``raw_ptr``, its ``zones``."""
    held = _Held.__new__(_Held)
    held.buf = buf
    held.index = index
    held.zones = zones
    held.raw_ptr = raw_ptr
    held.kind = kind
    held.raw_bytes = nbytes
    for zone in zones:
        held.raw_bytes += zone.length
    return held


class Quarantine:  # (final: @cython.final in _quarantine.pxd; Cython takes no other decorator on it)
    """Freed zoned blocks of one backend: held until checked, then kept for reuse or released."""

    __slots__ = ("_bound", "_ctx", "_deferred", "_guard", "_held", "_lock", "_pieces", "_raw", "_reuse", "_stats",
                 "_zones")

    def __init__(self, ctx: DeviceContext, stats: StatsCounter, guard: ZoneGuard) -> None:
        self._ctx = ctx
        self._raw = ctx.raw
        self._stats = stats
        self._guard = guard
        self._zones = guard.zones
        self._lock = guard.lock
        self._bound = ctx.settings.redzone_quarantine_bytes  # (settings are fixed for the backend's life)
        self._held: list[_Held] = []
        #: Checked freed blocks by raw size, kept for the next allocation of that layout (oldest size first).
        self._reuse: dict[int, list[int]] = {}
        self._pieces: Callable[[list[tuple[int, int]]], None] = _no_pieces
        self._deferred = 0  # captures of other libraries underway (`defer`): no check of its own till they end
        guard.on_full_check(self.full_check)

    def defer(self, underway: bool, may_check: bool = True) -> None:
        """Another library's capture that allocates from one of the backend's pools began (``underway``) or ended
        (`MemoryPool.capturing`). While one runs, a free's zones wait here whatever the bound, no check of the
        quarantine's own runs, and an out-of-memory takes no remedy that waits: a check waits for the device, which
        a capture in global mode forbids (CUDA would invalidate it). When the last ends, what waits past the bound
        is checked (logged where it cannot be read), under the lock, so no capture that begins meanwhile meets the
        wait; not where ``may_check`` is off (a capture of metrale's own runs): the next free past the bound does."""
        with self._lock:
            self._deferred = max(0, self._deferred + (1 if underway else -1))
            if self._deferred or not may_check or not self._held or (
                    self._stats.quarantined_bytes <= self._bound and len(self._held) <= QUARANTINE_MAX_BUFFERS):
                return
            when = "the end of another library's capture"
            violations, _ = self._checked(when, may_raise=False)
        self._guard.report(violations, f"the check of the quarantine (freed buffers) at {when}", may_raise=False)

    @property
    def deferred(self) -> bool:
        """Whether another library's capture runs (`defer`)."""
        return self._deferred > 0

    def give_pieces_to(self, callback: Callable[[list[tuple[int, int]]], None]) -> None:
        """Where pools' pieces go once let go of, all of a batch in one call: ``callback([(index, laid), ...])`` (the
        pool front's, which gives them back); ``laid``: a piece's size where its zones were judged intact (they stay
        in place for the next zoned piece), else 0."""
        self._pieces = callback

    @property
    def held_bytes(self) -> int:
        """Device memory red zones hold back from the driver: the quarantine and the blocks kept for reuse."""
        return self._stats.quarantined_bytes + self._stats.reusable_bytes

    def reuse(self, layout: Layout) -> int | None:
        """A checked block of ``layout`` freed earlier, for a new allocation (its raw pointer), or ``None``.

        Such a block left the quarantine with its zones found intact (the device idle): the allocation
        needs no driver call. It fills the zones again, and zeroes the block where fresh memory reads as zeros.
        """
        return self.reuse_c(layout.raw_bytes)

    def reuse_c(self, raw_bytes: int) -> int | None:
        """`reuse` of the layout of ``raw_bytes`` bytes: the compiled lane's, at C level."""
        if not self._reuse:  # no lock for the common miss: a stale answer only costs a driver call
            return None
        lock = self._lock
        lock.acquire()  # (not ``with``: a hot path, and ``with`` makes two bound methods)
        try:
            blocks = self._reuse.get(raw_bytes)
            if not blocks:
                return None
            ptr = blocks.pop()
            if not blocks:
                del self._reuse[raw_bytes]
        finally:
            lock.release()
        self._count_kept(-1, -raw_bytes)
        return ptr

    def free(self, buf: DeviceBuffer, raw_ptr: int, kind: AllocKind) -> None:
        """``free`` of zoned ``buf``: its record is off the ledger; its memory starts at ``raw_ptr``.

        - With a quarantine: keep its memory and zones until a batch is checked together.
        - Without: its zones are judged now, while the culprit is fresh; the memory is released whatever
          the judging says, then what it found is reported.
        """
        self.free_c(buf, buf.index, buf.nbytes, raw_ptr, kind)

    def free_c(self, buf: DeviceBuffer, index: int, nbytes: int, raw_ptr: int, kind: AllocKind) -> int:
        """`free` with ``buf``'s index and size at hand: the compiled lane's, at C level."""
        guard = self._guard
        bound = self._bound
        lock = self._lock
        lock.acquire()  # no check may read these zones once the memory is released (not ``with``: as `reuse_c`)
        try:
            zones = self._zones.zones_of(index)
            if zones and (bound or self._deferred or self._held):  # (held with no bound: a capture deferred them)
                held = _held(buf, index, nbytes, zones, raw_ptr, kind)
                self._held.append(held)
                self._count_held(1, held.raw_bytes)
                if self._reuse and not self._deferred:
                    self._trim(bound)  # blocks kept for reuse give way to the quarantine first
                if self._deferred or (
                    self._stats.quarantined_bytes <= bound and len(self._held) <= QUARANTINE_MAX_BUFFERS
                ):
                    return 0
                violations, when = self._drain(), "the check of the quarantine (freed buffers)"
            else:
                zones = guard.unwatch(index)
                judged = False  # (a judge that raises leaves the zones' state unknown)
                try:
                    violations = guard.judge(zones)
                    judged = bool(zones) and not violations  # (no zones watched: none known in place)
                finally:
                    if kind == "pool":
                        self._pieces([(index, nbytes if judged else 0)])
                    else:
                        self._raw.free(raw_ptr, kind)
                    guard.zones_released()
                when = f"free of allocation #{index}"
        finally:
            lock.release()
        guard.report(violations, when)
        return 0

    def drain(
        self, when: str, *, may_raise: bool = True, give_back: bool = False, also: Sequence[Zone] = ()
    ) -> bool:
        """Check every buffer waiting here (waiting for the device), keep or release them, and report.

        - With ``give_back``, every block kept for reuse goes back to the driver too.
        - ``also``: zones judged and reported in the same check (a sweep's, of the allocations it takes).
        - A check that cannot read the zones keeps every buffer here, watched, for the next check; it
          raises that error, or with ``may_raise`` off (out of memory: the allocation goes on) logs it.
        - Returns whether the zones were read.
        """
        with self._lock:
            violations, read = self._checked(when, may_raise=may_raise, give_back=give_back, also=also)
        self._guard.report(violations, f"the check of the quarantine (freed buffers) at {when}", may_raise=may_raise)
        return read

    def _checked(
        self, when: str, *, may_raise: bool, give_back: bool = False, also: Sequence[Zone] = ()
    ) -> tuple[list[RedZoneViolation], bool]:
        """`drain`'s check, under the lock (the caller's): what it found, and whether the zones were read."""
        try:
            return self._drain(also), True
        except MetraleError as exc:
            if may_raise:
                raise
            _log.warning("%s: the check of the quarantine could not read the zones (%s); its %d buffer(s) "
                         "stay quarantined until the next check", when, exc, len(self._held))
            return [], False
        finally:
            if give_back:
                self._trim(0)

    def _drain(self, also: Sequence[Zone] = ()) -> list[RedZoneViolation]:
        """Judge the held buffers (and ``also``) and let them go (`full_check`). A read that fails raises and
        keeps them all."""
        held = self._held
        if not held and not also:
            return []
        zones: list[Zone] = []
        for entry in held:
            zones.extend(entry.zones)
        zones.extend(also)
        found = self._guard.judge(zones, zone_table(zones))
        self.full_check(found)
        return found

    def full_check(self, found: Sequence[RedZoneViolation] | None) -> None:
        """Let go of every held buffer, its zones just judged with the device idle.

        - ``found``: the violations; ``None``: not judged (at close only: a check that could not read the
          zones never comes here, and its buffers wait for the next).
        - A block judged intact is kept for reuse (within the bound); the others are released.
        - A failed release is logged: it belongs to a ``free`` that returned long ago.
        """
        entries, self._held = self._held, []
        if not entries:
            return
        guard = self._guard
        ctx = self._ctx
        bad = None if found is None else {violation.index for violation in found}
        bound = self._bound
        count = nbytes = kept = kept_bytes = 0
        zones = self._zones
        pieces: list[tuple[int, int]] = []  # a pool's pieces: given back together, after the loop
        for held in entries:
            zones.remove(held.index)  # (the guard's `unwatch`; `zones_released` after the loop)
            count += 1
            nbytes += held.raw_bytes
            if bad is not None and held.index not in bad and held.kind == "device" and bound:
                blocks = self._reuse.get(held.raw_bytes)
                if blocks is None:
                    self._reuse[held.raw_bytes] = [held.raw_ptr]
                else:
                    blocks.append(held.raw_ptr)
                kept += 1
                kept_bytes += held.raw_bytes
            elif held.kind == "pool":
                pieces.append((held.index, held.buf.nbytes if bad is not None and held.index not in bad else 0))
            else:
                ctx.quietly(f"releasing quarantined allocation #{held.index}", self._raw.free, held.raw_ptr,
                            held.kind)
        if pieces:
            ctx.quietly(f"giving back {len(pieces)} pool piece(s) judged", self._pieces, pieces)
        self._count_held(-count, -nbytes)
        self._count_kept(kept, kept_bytes)
        self._trim(bound)
        ctx.quietly("rewrite the red-zone table", guard.zones_released)

    def _trim(self, bound: int) -> None:
        """Release blocks kept for reuse, oldest size first, until they and the quarantine hold at most
        ``bound`` bytes (``0``: all of them). The caller holds the guard's lock."""
        stats = self._stats
        while self._reuse and stats.reusable_bytes + stats.quarantined_bytes > bound:
            raw_bytes = next(iter(self._reuse))
            blocks = self._reuse[raw_bytes]
            ptr = blocks.pop(0)
            if not blocks:
                del self._reuse[raw_bytes]
            self._count_kept(-1, -raw_bytes)
            self._ctx.quietly("release a red-zoned block kept for reuse", self._raw.free, ptr, "device")

    def _count_held(self, count: int, nbytes: int) -> None:
        """The stats: ``count`` more buffers in quarantine (fewer where negative), holding ``nbytes`` more."""
        self._stats.quarantined(count, nbytes)  # (compiled: at C level, _quarantine.pxd types the stats)

    def _count_kept(self, count: int, nbytes: int) -> None:
        """The stats: ``count`` more blocks kept for reuse (fewer where negative), holding ``nbytes`` more."""
        self._stats.reusable(count, nbytes)

    def release(self) -> None:
        """At close (the device idle, the final scan done): release what is held, unjudged, and every kept block."""
        with self._lock:
            self.full_check(None)
            self._trim(0)
