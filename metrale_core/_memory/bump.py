"""The bump allocation of an [`Arena`][metrale_core.Arena]: pieces of one block handed out in order, taken back all
at once.

- `Arena`: the bump, the live pieces, the block. The public class is ``arena.py``'s `Arena`: this class as it runs as
  Python; compiled, this class registers there as its subclass.
- `MAX_ALIGN`: the largest alignment ``Arena.alloc`` accepts.

Written once, here, and compiled as well as run as Python (``_bump``, with ``_bump.pxd`` beside it:
docs/building.md): the compiled build keeps the bump under the C lock and builds each piece's buffer at C level. Its
lock is the C lock where compiled: nothing under it makes a container or an error (a collection could run there,
whose finalizer may reset this arena, which takes the lock again), but the close callback, which runs under it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Self

from .._device.buffer import DeviceBuffer
from .._errors import ArenaFullError, InvalidArgumentError, InvalidBufferError, MetraleError
from .._types import WORD_LIMIT, as_index, format_bytes
from .records import INDEXES, INDEXES_LOCK_FREE, next_index

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

if not cython.compiled:  # (compiled: the C lock of _lock.pxd and the handle's make_buffer: _bump.pxd cimports them)
    from .._device._lock import acquire_lock, new_lock, release_lock

    make_buffer = DeviceBuffer._make

if TYPE_CHECKING:
    from .arena_zones import ArenaZones

__all__ = ["MAX_ALIGN", "Arena"]

#: The largest alignment ``Arena.alloc`` accepts (a 2 MiB page).
MAX_ALIGN: Final = 1 << 21
_ALIGNS: Final = frozenset(1 << i for i in range(22))

#: The largest 64-bit address.
_WORD_MAX: Final = WORD_LIMIT - 1
#: What `Arena._bump` answers where it hands out no piece.
_CLOSED: Final = -1
_FULL: Final = -2


def _check_alloc(nbytes: object, align: object) -> tuple[int, int]:
    """``Arena.alloc``'s arguments as ints (numpy integers too), or a typed error naming the bad one."""
    n = as_index(nbytes)
    if n is None or n < 0:
        raise InvalidArgumentError(f"Arena.alloc: nbytes must be a byte count >= 0, got {nbytes!r}")
    a = as_index(align)
    if a is None or a not in _ALIGNS:
        raise InvalidArgumentError(f"Arena.alloc: align must be a power of two from 1 to {MAX_ALIGN}, got {align!r}")
    return n, a


class Arena:  # (final: @cython.final in _bump.pxd; Cython takes no other decorator on it)
    """A sub-allocator over one block of device memory: the bump allocation of the public
    [`Arena`][metrale_core.Arena] (``arena.py``), which says what it does. Thread-safe."""

    __slots__ = (
        "_base", "_block", "_capacity", "_era", "_lock", "_on_close", "_owner", "_pieces", "_top", "_where",
        "_where_at", "_zones", "allocs", "site",
    )

    def __init__(
        self, block: DeviceBuffer, on_close: Callable[[Self, DeviceBuffer], None],
        where: Callable[[], str] | None = None, zones: ArenaZones | None = None,
        where_at: Callable[[object], str] | None = None,
    ) -> None:
        self._block: DeviceBuffer | None = block
        self._base = block.ptr
        self._capacity = block.nbytes
        self._top = 0
        #: Each live piece's buffer, by creation index (recorded after it is made: `_piece`).
        self._pieces: dict[int, DeviceBuffer] = {}
        #: How many times the pieces were taken back (a reset, a close): a piece bumped before one is not recorded.
        self._era = 0
        self._lock = new_lock()
        self._on_close: Callable[[Any, DeviceBuffer], None] = on_close  # (given this arena: a Self)
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
        return self._piece(nbytes, align, site, -1, 0, 0)

    def _piece(self, nbytes: int, align: int, site: str, index: int, lead: int, trail: int) -> DeviceBuffer:
        """The next piece (`_bump`) and its buffer, recorded as live under its creation ``index`` (-1: drawn under
        the lock, for a piece handed out only); or its error. The buffer is made after the lock, then recorded under
        it again: unless a reset or a close took every piece back meanwhile (`_era`)."""
        acquire_lock(self._lock)
        try:
            start = self._bump(nbytes, align, lead, trail)
            if start >= 0 and index < 0:
                index = next(INDEXES) if INDEXES_LOCK_FREE else next_index()
            era = self._era
        finally:
            release_lock(self._lock)
        if start < 0:
            raise self._refused(start, nbytes, align)
        buf = make_buffer(start, nbytes, "arena", index, site, self._owner)
        acquire_lock(self._lock)
        try:
            if self._era == era:
                self._pieces[index] = buf
        finally:
            release_lock(self._lock)
        return buf

    def _bump(self, nbytes: int, align: int, lead: int, trail: int) -> int:
        """Under the lock: the address of the next piece, ``lead`` bytes of zone before it and ``trail`` after; or
        `_CLOSED`, or `_FULL` where the block has no room for it. Exact in C integers where compiled: each sum it
        compares stays within the block's bytes (``room``)."""
        if self._block is None:
            return _CLOSED
        if nbytes >= WORD_LIMIT or lead >= WORD_LIMIT or trail >= WORD_LIMIT:
            return _FULL  # (no block holds that many bytes)
        n, a, ahead, behind = nbytes, align, lead, trail  # (compiled: as C integers)
        top = self._top
        room = self._capacity - top
        skip = -(self._base + top + ahead) & (a - 1)  # to the next multiple of a, past the leading zone
        if ahead > room or skip > room - ahead:
            return _FULL
        pad = ahead + skip
        if behind > room - pad or n > room - pad - behind:
            return _FULL
        self._top = top + pad + n + behind
        self.allocs += 1
        if top + pad > _WORD_MAX - self._base:  # (a piece of a block at the very top: its address past 64 bits)
            return int(self._base) + (top + pad)
        return self._base + top + pad

    def _refused(self, why: int, nbytes: int, align: int) -> MetraleError:
        """The error of an ``alloc`` that `_bump` refused (``why``: `_CLOSED` or `_FULL`)."""
        if why == _CLOSED:
            return self._closed(f"Arena.alloc({nbytes})")
        return ArenaFullError(
            f"Arena.alloc({nbytes}, align={align}): the arena from {self.site} is full: "
            f"{format_bytes(self._top)} of {format_bytes(self._capacity)} handed out since its last "
            f"reset(); reset() it when its pieces are done with, or create a larger arena",
            requested=nbytes, capacity=self._capacity, used=self._top,
        )

    def _closed(self, what: str) -> InvalidBufferError:
        return InvalidBufferError(f"{what}: this arena (from {self.site}) is closed; create another")

    def _zoned(self, nbytes: int, align: int, site: str, zones: ArenaZones) -> DeviceBuffer:
        """``alloc`` with ``redzone_arena``: the piece's zones bumped over and filled, under the zones' lock."""
        with zones.lock:
            if self._block is None:  # (before the gate: a closed backend's arenas are closed)
                raise self._closed(f"Arena.alloc({nbytes})")
            may_fill = zones.enter()
            try:
                index = next(INDEXES) if INDEXES_LOCK_FREE else next_index()
                layout = zones.layout(nbytes, index) if may_fill else None
                if layout is None:
                    return self._piece(nbytes, align, site, index, 0, 0)
                buf = self._piece(nbytes, align, site, index, layout.lead, layout.trail)
                zones.fill(buf, layout)
                return buf
            finally:
                zones.leave()

    def holds(self, buf: DeviceBuffer) -> bool:
        """Whether ``buf`` is a live piece of this arena: one it handed out since the last ``reset()``,
        at the address and with the size it recorded (a copy of the handle with another size is not)."""
        if buf._owner is not self._owner:
            return False
        piece = self._pieces.get(buf.index)
        if piece is buf:  # (the very buffer handed out)
            return True
        return piece is not None and piece.ptr == buf.ptr and piece.nbytes == buf.nbytes

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
        acquire_lock(self._lock)
        try:
            closed = self._block is None
            if not closed:
                self._top = 0
                self._forget()
        finally:
            release_lock(self._lock)
        if closed:
            raise InvalidBufferError(f"Arena.reset: this arena (from {self.site}) is closed")

    def _forget(self) -> None:
        """Every piece taken back (the caller holds the lock: a buffer runs no code as it goes, having no finalizer,
        no weak reference, and an owner this arena holds too)."""
        self._pieces.clear()
        self._era += 1

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
        acquire_lock(self._lock)
        try:
            block = self._block
            if block is not None:
                self._on_close(self, block)  # may refuse (raise); nothing has changed then
                self._block = None
                self._top = 0
                self._forget()
        finally:
            release_lock(self._lock)

    def _take_block(self) -> DeviceBuffer | None:
        """For the backend's close (its final scan judged the zones): forget the block (the backend releases it)."""
        acquire_lock(self._lock)
        try:
            block, self._block = self._block, None
            self._top = 0
            self._forget()
        finally:
            release_lock(self._lock)
        if self._zones is not None:
            with self._zones.lock:
                self._zones.drop()
        return block

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._block is None else f"{format_bytes(self._top)} of {format_bytes(self._capacity)} used"
        return f"<Arena at {self._base:#x}, {state}, from {self.site}>"
