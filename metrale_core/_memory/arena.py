"""Arenas: a bump sub-allocator over one ``alloc_arena`` block, for short-lived scratch.

The fast path of metrale's memory: ``Arena.alloc`` never calls the driver. Its
buffers are arena memory, never on the ledger; they stay live until the arena's
``reset()`` or ``close()``.

- `Arena`: the bump allocation, the live pieces, the block.
- `ArenaZones`: with ``redzone_arena``, the red zones of one arena's pieces: laid out and filled
  as ``alloc``'s, watched by the zone guard (so every full check and in-graph verdict judges
  them), and judged at the arena's ``reset()`` and ``close()``.

`Arena` here is the pure reference and the public class. Its compiled twin (``_arena.pyx``, issue 38) registers
itself as a virtual subclass (`Arena` is an ABC with no abstract methods), so ``isinstance(x, metrale_core.Arena)``
holds for either; the allocator picks one per backend (``_twins.pick("arena", Arena, pure)``).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Final, final

from .._device.buffer import DeviceBuffer
from .._device.capture import may_wait
from .._errors import ArenaFullError, InvalidArgumentError, InvalidBufferError, capture_error
from .._types import RedZoneViolation, as_index, format_bytes
from .records import next_index

if TYPE_CHECKING:
    from .._device.context import DeviceContext
    from .._redzones.guard import ZoneGuard
    from .._redzones.layout import Layout

__all__ = ["Arena", "ArenaZones"]

#: The largest alignment ``Arena.alloc`` accepts (a 2 MiB page).
MAX_ALIGN: Final = 1 << 21
_ALIGNS: Final = frozenset(1 << i for i in range(22))


def _check_alloc(nbytes: object, align: object) -> tuple[int, int]:
    """``Arena.alloc``'s arguments as ints (numpy integers too), or a typed error naming the bad one."""
    n = as_index(nbytes)
    if n is None or n < 0:
        raise InvalidArgumentError(f"Arena.alloc: nbytes must be a byte count >= 0, got {nbytes!r}")
    a = as_index(align)
    if a is None or a not in _ALIGNS:
        raise InvalidArgumentError(f"Arena.alloc: align must be a power of two from 1 to {MAX_ALIGN}, got {align!r}")
    return n, a


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


class Arena(metaclass=abc.ABCMeta):  # noqa: B024 (an ABC for its compiled twin to register with, nothing abstract)
    """A sub-allocator over one block of device memory. Made by
    [`GpuBackend.create_arena`][metrale_core.GpuBackend.create_arena].

    ``alloc(nbytes, align=256)`` hands out the next aligned piece of the block
    (a [`DeviceBuffer`][metrale_core.DeviceBuffer] of kind ``"arena"``, usable in every
    operation of its backend); there is no per-buffer free: ``reset()`` takes
    every piece back at once, and ``close()`` releases the block. A buffer from
    before a ``reset()`` is no longer live, and operations on it raise
    [`InvalidBufferError`][metrale_core.InvalidBufferError]. ``reset()`` does not wait for the
    device: synchronize first if work still uses the old pieces. When the block
    has no room, ``alloc`` raises [`ArenaFullError`][metrale_core.ArenaFullError].

    Thread-safe. A context manager (``close()`` on exit).
    """

    __slots__ = (
        "_base", "_block", "_capacity", "_lock", "_on_close", "_owner", "_pieces", "_top", "_where", "_where_at",
        "_zones", "allocs", "site",
    )

    def __init__(
        self, block: DeviceBuffer, on_close: Callable[[Arena, DeviceBuffer], None],
        where: Callable[[], str] | None = None, zones: ArenaZones | None = None,
        where_at: Callable[[object], str] | None = None,
    ) -> None:
        self._block: DeviceBuffer | None = block
        self._base = block.ptr
        self._capacity = block.nbytes
        self._top = 0
        self._pieces: dict[int, tuple[int, int]] = {}  # creation index -> (address, nbytes) of each live piece
        self._lock = threading.Lock()
        self._on_close = on_close
        self._owner = block._owner
        #: Where the arena was created.
        self.site = block.site
        #: Where a piece is made: its ``Arena.alloc``'s call site (``None``: the arena's own site).
        self._where = where
        #: Where a piece is made with a ``stacklevel`` other than 1 (``None``: the arena's own site).
        self._where_at = where_at
        #: The pieces' red zones (``redzone_arena``), or ``None``.
        self._zones = zones
        #: Pieces handed out so far.
        self.allocs = 0

    @property
    def base(self) -> int:
        """The device address of the block's first byte."""
        return self._base

    @property
    def capacity(self) -> int:
        """Bytes in the block."""
        return self._capacity

    @property
    def used(self) -> int:
        """Bytes handed out since the last ``reset()`` (alignment padding included)."""
        return self._top

    @property
    def closed(self) -> bool:
        return self._block is None

    def alloc(self, nbytes: int, align: int = 256, *, stacklevel: int = 1) -> DeviceBuffer:
        """The next ``nbytes`` of the block, at an address that is a multiple of ``align`` (a power of two).

        :param nbytes: the size in bytes.
        :param align: the address alignment, a power of two.
        :param stacklevel: which caller is the piece's call site, as `GpuBackend.alloc`'s.
        :returns: a buffer of kind ``"arena"``, live until the next ``reset()``; it is not on the ledger.
        :raises ArenaFullError: the block has no room left for it since the last ``reset()``.
        :raises InvalidBufferError: the arena is closed.
        :raises InvalidArgumentError: ``nbytes``, ``align`` or ``stacklevel`` is not valid.
        """
        if type(nbytes) is not int or nbytes < 0 or type(align) is not int or align not in _ALIGNS:
            nbytes, align = _check_alloc(nbytes, align)
        if stacklevel == 1 and type(stacklevel) is int:
            site = self.site if self._where is None else self._where()
        else:
            site = self.site if self._where_at is None else self._where_at(stacklevel)
        if self._zones is not None:
            return self._zoned(nbytes, align, site, self._zones)
        with self._lock:
            start = self._bump(nbytes, align, 0, 0)
            index = next_index()
            self._pieces[index] = (start, nbytes)
        return DeviceBuffer._make(start, nbytes, "arena", index, site, self._owner)

    def _bump(self, nbytes: int, align: int, lead: int, trail: int) -> int:
        """Under the lock: the address of the next piece, ``lead`` bytes of zone before it and ``trail`` after."""
        if self._block is None:
            raise self._closed(f"Arena.alloc({nbytes})")
        start = (self._base + self._top + lead + align - 1) & -align
        end = start + nbytes + trail - self._base
        if end > self._capacity:
            raise ArenaFullError(
                f"Arena.alloc({nbytes}, align={align}): the arena from {self.site} is full: "
                f"{format_bytes(self._top)} of {format_bytes(self._capacity)} handed out since its last "
                f"reset(); reset() it when its pieces are done with, or create a larger arena",
                requested=nbytes, capacity=self._capacity, used=self._top,
            )
        self._top = end
        self.allocs += 1
        return start

    def _closed(self, what: str) -> InvalidBufferError:
        return InvalidBufferError(f"{what}: this arena (from {self.site}) is closed; create another")

    def _zoned(self, nbytes: int, align: int, site: str, zones: ArenaZones) -> DeviceBuffer:
        """``alloc`` with ``redzone_arena``: the piece's zones bumped over and filled, under the zones' lock."""
        with zones.lock:
            if self._block is None:  # (before the gate: a closed backend's arenas are closed)
                raise self._closed(f"Arena.alloc({nbytes})")
            may_fill = zones.enter()
            try:
                index = next_index()
                layout = zones.layout(nbytes, index) if may_fill else None
                with self._lock:
                    start = self._bump(nbytes, align, *((0, 0) if layout is None else (layout.lead, layout.trail)))
                    self._pieces[index] = (start, nbytes)
                buf = DeviceBuffer._make(start, nbytes, "arena", index, site, self._owner)
                if layout is not None:
                    zones.fill(buf, layout)
                return buf
            finally:
                zones.leave()

    def holds(self, buf: DeviceBuffer) -> bool:
        """Whether ``buf`` is a live piece of this arena: one it handed out since the last ``reset()``,
        at the address and with the size it recorded (a copy of the handle with another size is not)."""
        return buf._owner is self._owner and self._pieces.get(buf.index) == (buf.ptr, buf.nbytes)

    def reset(self) -> None:
        """Take every piece back; buffers handed out so far are no longer live.

        With ``redzone_arena``, their zones are judged first (it waits for the device; refused while a capture
        runs, changing nothing), and a violation is reported once the pieces went.
        """
        zones = self._zones
        if zones is None:
            self._reset()
            return
        with zones.lock:
            if self._block is None:
                raise InvalidBufferError(f"Arena.reset: this arena (from {self.site}) is closed")
            found = zones.judged("Arena.reset", self._reset)
        zones.report(found, "Arena.reset()")

    def _reset(self) -> None:
        with self._lock:
            if self._block is None:
                raise InvalidBufferError(f"Arena.reset: this arena (from {self.site}) is closed")
            self._top = 0
            self._pieces = {}

    def close(self) -> None:
        """Release the block; idempotent. Its pieces are no longer live.

        Refused (during a capture, say) it changes nothing: the arena stays open and usable. With
        ``redzone_arena``, the pieces' zones are judged first, as by ``reset()``.
        """
        zones = self._zones
        if zones is None:
            self._close()
            return
        with zones.lock:
            if self._block is None:
                return
            found = zones.judged("Arena.close", self._close)
        zones.report(found, "Arena.close()")

    def _close(self) -> None:
        with self._lock:
            block = self._block
            if block is None:
                return
            self._on_close(self, block)  # may refuse; nothing has changed then
            self._block = None
            self._top = 0
            self._pieces = {}

    def _take_block(self) -> DeviceBuffer | None:
        """For the backend's close (its final scan judged the zones): forget the block (the backend releases it)."""
        with self._lock:
            block, self._block = self._block, None
            self._top = 0
            self._pieces = {}
        if self._zones is not None:
            with self._zones.lock:
                self._zones.drop()
        return block

    def __enter__(self) -> Arena:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._block is None else f"{format_bytes(self._top)} of {format_bytes(self._capacity)} used"
        return f"<Arena at {self._base:#x}, {state}, from {self.site}>"
