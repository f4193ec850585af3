"""Arenas: a bump sub-allocator over one ``alloc_arena`` block, for short-lived scratch.

The fast path of metrale's memory: ``Arena.alloc`` never calls the driver. Its
buffers are arena memory, so never on the ledger and never red-zoned; they stay
live until the arena's ``reset()`` or ``close()``.

`Arena` here is the pure reference and the public class. Its compiled twin (``_arena.pyx``, issue 38) registers
itself as a virtual subclass (`Arena` is an ABC with no abstract methods), so ``isinstance(x, metrale_core.Arena)``
holds for either; the allocator picks one per backend (``_twins.pick("arena", Arena, pure)``).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Final

from .._device.buffer import DeviceBuffer
from .._errors import ArenaFullError, InvalidArgumentError, InvalidBufferError
from .._types import as_index, format_bytes
from .ledger import next_index

__all__ = ["Arena"]

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
        "_base", "_block", "_capacity", "_lock", "_on_close", "_owner", "_pieces", "_top", "_where", "allocs",
        "site",
    )

    def __init__(
        self, block: DeviceBuffer, on_close: Callable[[Arena, DeviceBuffer], None],
        where: Callable[[], str] | None = None,
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

    def alloc(self, nbytes: int, align: int = 256) -> DeviceBuffer:
        """The next ``nbytes`` of the block, at an address that is a multiple of ``align`` (a power of two).

        :param nbytes: the size in bytes.
        :param align: the address alignment, a power of two.
        :returns: a buffer of kind ``"arena"``, live until the next ``reset()``; it is not on the ledger.
        :raises ArenaFullError: the block has no room left for it since the last ``reset()``.
        :raises InvalidBufferError: the arena is closed.
        :raises InvalidArgumentError: ``nbytes`` or ``align`` is not valid.
        """
        if type(nbytes) is not int or nbytes < 0 or type(align) is not int or align not in _ALIGNS:
            nbytes, align = _check_alloc(nbytes, align)
        site = self.site if self._where is None else self._where()
        with self._lock:
            if self._block is None:
                raise InvalidBufferError(
                    f"Arena.alloc({nbytes}): this arena (from {self.site}) is closed; create another"
                )
            start = (self._base + self._top + align - 1) & -align
            end = start + nbytes - self._base
            if end > self._capacity:
                raise ArenaFullError(
                    f"Arena.alloc({nbytes}, align={align}): the arena from {self.site} is full: "
                    f"{format_bytes(self._top)} of {format_bytes(self._capacity)} handed out since its last "
                    f"reset(); reset() it when its pieces are done with, or create a larger arena",
                    requested=nbytes, capacity=self._capacity, used=self._top,
                )
            self._top = end
            self.allocs += 1
            index = next_index()
            self._pieces[index] = (start, nbytes)
        return DeviceBuffer._make(start, nbytes, "arena", index, site, self._owner)

    def holds(self, buf: DeviceBuffer) -> bool:
        """Whether ``buf`` is a live piece of this arena: one it handed out since the last ``reset()``,
        at the address and with the size it recorded (a copy of the handle with another size is not)."""
        return buf._owner is self._owner and self._pieces.get(buf.index) == (buf.ptr, buf.nbytes)

    def reset(self) -> None:
        """Take every piece back; buffers handed out so far are no longer live."""
        with self._lock:
            if self._block is None:
                raise InvalidBufferError(f"Arena.reset: this arena (from {self.site}) is closed")
            self._top = 0
            self._pieces = {}

    def close(self) -> None:
        """Release the block; idempotent. Its pieces are no longer live.

        Refused (during a capture, say) it changes nothing: the arena stays open and usable.
        """
        with self._lock:
            block = self._block
            if block is None:
                return
            self._on_close(self, block)  # may refuse; nothing has changed then
            self._block = None
            self._top = 0
            self._pieces = {}

    def _take_block(self) -> DeviceBuffer | None:
        """For the backend's close: forget the block (the backend releases it)."""
        with self._lock:
            block, self._block = self._block, None
            self._top = 0
            self._pieces = {}
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
