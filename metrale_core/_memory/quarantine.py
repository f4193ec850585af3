"""The quarantine: freed zoned blocks, their check, their reuse and their release; the allocator's.

- A ``free`` of a zoned buffer takes its record off the ledger at once, but its memory and zones wait
  here (``redzone_quarantine_bytes`` > 0). Past the bound, the whole batch is judged together.
- The zone guard judges; the quarantine frees. A block found intact is kept, within the same bound,
  for the next allocation of its layout, which fills its zones again (a stale pointer of the block's
  previous owner may have written there since the check: never blamed on the new owner).
- After a full check (``scan_redzones()``, a bad in-graph verdict, ``close()``) the guard tells the
  quarantine what it found (`Quarantine.full_check`), and the batch goes as after its own check.
- A memory pool's zoned piece waits here too (kind ``"pool"``); once judged, or at close, it goes back to its
  pool (`give_pieces_to`), never to the driver nor to the blocks kept for reuse.
- Out of memory, the allocator drains it and gives every kept block back, then tries again, as
  CuPy's ``SingleDeviceMemoryPool._try_malloc`` does.
- A check that cannot read the zones (a driver error) releases nothing: every buffer stays here,
  watched, and the next check judges it. Out of memory that is logged, and the allocation goes on.

Everything here runs under the guard's lock: no check may read a zone whose memory is released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Final, final

from .._device.buffer import DeviceBuffer
from .._device.context import DeviceContext
from .._device.stats import StatsCounter
from .._errors import MetraleError
from .._redzones.guard import ZoneGuard
from .._redzones.layout import Layout, Zone
from .._types import AllocKind, RedZoneViolation

__all__ = ["QUARANTINE_MAX_BUFFERS", "Quarantine"]


def _no_pieces(index: int) -> None:  # pragma: no cover - the allocator sets its own as it builds the quarantine
    raise AssertionError(f"a pool's piece #{index} reached a quarantine that knows no pools")

#: The quarantine is checked and released once it holds more buffers than this (or more bytes than
#: ``redzone_quarantine_bytes``).
QUARANTINE_MAX_BUFFERS: Final = 1024

_log = logging.getLogger("metrale")


@final
class _Held:
    """A freed zoned buffer in quarantine: off the ledger, its memory and zones still held."""

    __slots__ = ("buf", "kind", "layout", "raw_ptr", "zones")

    def __init__(self, buf: DeviceBuffer, zones: tuple[Zone, ...], raw_ptr: int, kind: AllocKind) -> None:
        self.buf = buf
        self.zones = zones
        self.raw_ptr = raw_ptr
        self.kind = kind
        lead = sum(zone.length for zone in zones if zone.side == "lead")
        trail = sum(zone.length for zone in zones if zone.side == "trail")
        self.layout = Layout(lead + buf.nbytes + trail, lead, trail)  # what the device gave, zones included


@final
class Quarantine:
    """Freed zoned blocks of one backend: held until checked, then kept for reuse or released."""

    __slots__ = ("_bound", "_ctx", "_guard", "_held", "_pieces", "_raw", "_reuse", "_stats")

    def __init__(self, ctx: DeviceContext, stats: StatsCounter, guard: ZoneGuard) -> None:
        self._ctx = ctx
        self._raw = ctx.raw
        self._stats = stats
        self._guard = guard
        self._bound = ctx.settings.redzone_quarantine_bytes  # (settings are fixed for the backend's life)
        self._held: list[_Held] = []
        #: Checked freed blocks by layout, kept for the next allocation of that layout (oldest layout first).
        self._reuse: dict[Layout, list[int]] = {}
        self._pieces: Callable[[int], None] = _no_pieces
        guard.on_full_check(self.full_check)

    def give_pieces_to(self, callback: Callable[[int], None]) -> None:
        """Where a pool's piece goes once let go of: ``callback(index)`` (the allocator's, which gives it back)."""
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
        if not self._reuse:  # no lock for the common miss: a stale answer only costs a driver call
            return None
        with self._guard.lock:
            blocks = self._reuse.get(layout)
            if not blocks:
                return None
            ptr = blocks.pop()
            if not blocks:
                del self._reuse[layout]
        self._stats.reusable(-1, -layout.raw_bytes)
        return ptr

    def free(self, buf: DeviceBuffer, raw_ptr: int, kind: AllocKind) -> None:
        """``free`` of zoned ``buf``: its record is off the ledger; its memory starts at ``raw_ptr``.

        - With a quarantine: keep its memory and zones until a batch is checked together.
        - Without: its zones are judged now, while the culprit is fresh; the memory is released whatever
          the judging says, then what it found is reported.
        """
        guard = self._guard
        bound = self._bound
        with guard.lock:  # no check may read these zones once the memory is released
            zones = guard.zones.zones_of(buf.index)
            if zones and bound:
                held = _Held(buf, zones, raw_ptr, kind)
                self._held.append(held)
                self._stats.quarantined(1, held.layout.raw_bytes)
                self._trim(bound)  # blocks kept for reuse give way to the quarantine first
                if self._stats.quarantined_bytes <= bound and len(self._held) <= QUARANTINE_MAX_BUFFERS:
                    return
                violations, when = self._drain(), "the check of the quarantine (freed buffers)"
            else:
                zones = guard.unwatch(buf.index)
                try:
                    violations = guard.judge(zones)
                finally:
                    if kind == "pool":
                        self._pieces(buf.index)
                    else:
                        self._raw.free(raw_ptr, kind)
                    guard.zones_released()
                when = f"free of allocation #{buf.index}"
        guard.report(violations, when)

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
        guard = self._guard
        read = True
        with guard.lock:
            try:
                violations = self._drain(also)
            except MetraleError as exc:
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

    def _drain(self, also: Sequence[Zone] = ()) -> list[RedZoneViolation]:
        """Judge the held buffers (and ``also``) and let them go (`full_check`). A read that fails raises and
        keeps them all."""
        held = self._held
        if not held and not also:
            return []
        found = self._guard.judge([zone for entry in held for zone in entry.zones] + list(also))
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
        bad = None if found is None else {violation.index for violation in found}
        bound = self._bound
        for held in entries:
            guard.unwatch(held.buf.index)
            self._stats.quarantined(-1, -held.layout.raw_bytes)
            if bad is not None and held.buf.index not in bad and held.kind == "device" and bound:
                self._reuse.setdefault(held.layout, []).append(held.raw_ptr)
                self._stats.reusable(1, held.layout.raw_bytes)
            elif held.kind == "pool":
                self._ctx.quietly(f"giving back the pool's piece #{held.buf.index}", self._pieces, held.buf.index)
            else:
                self._ctx.quietly(f"releasing quarantined allocation #{held.buf.index}", self._raw.free,
                                  held.raw_ptr, held.kind)
        self._trim(bound)
        self._ctx.quietly("rewrite the red-zone table", guard.zones_released)

    def _trim(self, bound: int) -> None:
        """Release blocks kept for reuse, oldest layout first, until they and the quarantine hold at most
        ``bound`` bytes (``0``: all of them). The caller holds the guard's lock."""
        stats = self._stats
        while self._reuse and stats.reusable_bytes + stats.quarantined_bytes > bound:
            layout = next(iter(self._reuse))
            blocks = self._reuse[layout]
            ptr = blocks.pop(0)
            if not blocks:
                del self._reuse[layout]
            stats.reusable(-1, -layout.raw_bytes)
            self._ctx.quietly("release a red-zoned block kept for reuse", self._raw.free, ptr, "device")

    def release(self) -> None:
        """At close (the device idle, the final scan done): release what is held, unjudged, and every kept block."""
        with self._guard.lock:
            self.full_check(None)
            self._trim(0)
