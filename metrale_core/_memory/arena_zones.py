"""The red zones of an arena's pieces (``redzone_arena``): laid out and filled as ``alloc``'s, watched by the zone
guard (so every full check and in-graph verdict judges them), and judged at the arena's ``reset()`` and ``close()``.

- `ArenaZones`: one arena's; both builds of `Arena` (``bump.py``, compiled as ``_bump``) own one when it is on.

Run as Python only: one class for both builds of the arena, off its fast path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, final

from .._device.buffer import DeviceBuffer
from .._device.capture import may_wait
from .._errors import capture_error
from .._types import RedZoneViolation

if TYPE_CHECKING:
    from .._device.context import DeviceContext
    from .._redzones.guard import ZoneGuard
    from .._redzones.zone import Layout

__all__ = ["ArenaZones"]


@final
class ArenaZones:
    """The red zones of one arena's pieces (``redzone_arena``); both builds of `Arena` own one when it is on.

    - A piece's zones are laid out as ``alloc``'s (`ZoneGuard.layout`: its creation index decides the sampling),
      filled on the default stream and watched by the guard, so ``scan_redzones()``, the quarantine's batches
      and the in-graph verdicts judge them with every other zone, and a violation names the piece's own site.
    - A piece made while a capture runs gets none: no fill may be issued then.
    - ``reset()`` and ``close()`` judge the zones of the pieces since the last reset (waiting for the device, so
      refused while a capture runs, changing nothing and leaving the capture alone), and take them off the guard's
      table in the same step as the arena lets go of its pieces or block (`judged`), then report.
    - `lock` is held around a zoned piece's bump and fill and around a judged reset or close, so no piece is
      filled after its arena let go of it. It is taken before the arena's own lock.
    - ``block``: where the arena's block lies, ``(base, nbytes)``: a violation its reset or close reports suspects
      the kernels that took any address of it (the block has gone from the open arenas by then).
    """

    __slots__ = ("_block", "_ctx", "_guard", "_indexes", "lock")

    def __init__(self, ctx: DeviceContext, guard: ZoneGuard, block: tuple[int, int] = (0, 0)) -> None:
        self._ctx = ctx
        self._guard = guard
        self._block = block
        self._indexes: list[int] = []  # the creation indexes of the zoned pieces since the last reset
        self.lock = threading.RLock()

    def enter(self) -> bool:
        """Enter the backend's gate for a piece; whether it may get zones (no capture runs, so its fill may be
        issued; a capture that starts meanwhile waits for this call). Pair with `leave`."""
        self._ctx.enter()
        return may_wait()

    def leave(self) -> None:
        self._ctx.leave()

    def layout(self, nbytes: int, index: int) -> Layout | None:
        """The zones of the piece of ``nbytes`` with creation ``index`` (``None``: it gets none)."""
        return self._guard.layout(nbytes, index)

    def fill(self, buf: DeviceBuffer, layout: Layout) -> None:
        """Fill the zones of a new piece and watch them (under `lock`, after the bump)."""
        self._guard.guard(buf, layout)
        self._indexes.append(buf.index)

    def judged(self, what: str, then: Callable[[], None]) -> list[RedZoneViolation]:
        """Under `lock`: wait for the device, judge the zones of the pieces since the last reset, call ``then`` (the
        arena's own reset or close, which may free the block), and take the zones off the guard's table, all under
        the guard's lock, so no other check reads them once their memory may be gone. What was found is returned
        for `report` (after the arena's locks are let go).

        - No zoned piece: ``then`` alone.
        - While a capture runs no wait is allowed: refused (``CaptureError``), changing nothing, and the capture
          goes on (a debugging setting does not break a program that resets its arena inside a capture).
        - ``then`` refused (a close during a capture): nothing changes; its error is raised.
        """
        if not self._indexes:
            then()
            return []
        ctx = self._ctx
        ctx.enter()
        try:
            if not may_wait():
                raise capture_error(
                    "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                    f"{what} of an arena with {len(self._indexes)} zoned piece(s) is refused while a capture runs: "
                    f"judging their zones waits for the device; nothing changed and the capture goes on: call "
                    f"{what}() after end_capture (or leave redzone_arena off for arenas reset inside captures)",
                )
            guard = self._guard
            with guard.lock:
                zones = [zone for index in self._indexes for zone in guard.zones.zones_of(index)]
                found = guard.judge(zones)
                then()
                self._unwatch(tell=True)
            return found
        finally:
            ctx.leave()

    def _unwatch(self, *, tell: bool) -> None:
        """The pieces went: their zones leave the guard's table (the caller holds the guard's lock); ``tell``: the
        in-graph checks' table follows (a failure there is logged: the pieces are gone all the same)."""
        guard = self._guard
        gone = False
        for index in self._indexes:
            gone = bool(guard.unwatch(index)) or gone
        self._indexes = []
        if gone and tell:
            self._ctx.quietly("the in-graph checks' zone table", guard.zones_released)

    def drop(self) -> None:
        """At the backend's close (its final scan judged every zone, and the guard goes next): forget the pieces'
        zones, writing nothing to the device."""
        if self._indexes:
            with self._guard.lock:
                self._unwatch(tell=False)

    def report(self, found: list[RedZoneViolation], when: str) -> None:
        """What `judge` found, reported as the guard reports (suspects, observers, then a log line or a
        ``RedZoneError``)."""
        self._guard.report(found, when, blocks=(self._block,) if self._block[1] else ())
