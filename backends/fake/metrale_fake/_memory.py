"""The fake device's memory: each device's window of the process's fake address space, and the
allocations that live in it.

The process's fake address space, from ``0x5500_0000_0000`` up to ``2**63``, is cut into one
window per :class:`~metrale_fake.FakeDevice`, as separate devices have separate ranges: a buffer
of one device is never an address of another. A window's lower half is the device's pinned host
memory, its upper half its device memory (allocations and imported memory); the first device's
halves start at ``0x5500_0000_0000`` and ``0x7F00_0000_0000``. A half is 42 TiB, or twice the
device's capacity rounded up to a TiB where that is more (at most ``2**59``): room for the capacity
and the gaps. Every address is 256-byte aligned, positive and below ``2**63``, so it fits a signed
64-bit kernel argument. A window is a device's until the device object is gone; another device gets
it only once no fresh one is left.

Inside a half, an allocation of ``nbytes`` takes :func:`span` ``(nbytes)`` addresses: itself and
at least :data:`GAP` unmapped bytes after it, rounded up to :data:`ALIGN`. That span is its size
class. With address reuse on (always for host memory; for device memory unless
``fake_reuse_addresses`` is off), a new allocation takes the most recently freed range of its size
class, as CUDA's allocator hands a freed address out again at once; else a fresh range above every
range handed out so far. Freed ranges are never merged,
with each other or with live ones, so the gap after every allocation stays unmapped. A half with no
fresh range left (after 42 TiB of ranges or more) gives a freed range of the smallest larger size class
(reuse on), or is out of memory.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import os
import threading
from typing import Final

import numpy as np

from metrale_core.plugin import error_for_code, format_bytes

__all__ = [
    "ALIGN", "GAP", "AddressSpace", "Allocation", "Window", "check_importable", "check_pinnable", "give_back",
    "host_memory_bytes", "span", "take_window", "zeros",
]

ALIGN: Final = 256  # every allocation starts at a multiple of this
GAP: Final = 4096  # unmapped bytes at least between allocations, as a real address space has

_FIRST: Final = 0x5500_0000_0000  # the first window's base
_HALF: Final = 0x2A00_0000_0000  # 42 TiB: a window's half at least (the first device's memory at 0x7F00_0000_0000)
_MAX_HALF: Final = 1 << 59
_TOP: Final = 1 << 63  # every address stays below: it fits a signed 64-bit kernel argument
_TiB: Final = 1 << 40


def span(nbytes: int) -> int:
    """The addresses an allocation of ``nbytes`` takes, its gap included: its size class."""
    return (nbytes + GAP + ALIGN - 1) // ALIGN * ALIGN


@functools.cache
def host_memory_bytes() -> int | None:
    """The host's physical memory, the most pinned host memory a fake device may have; ``None`` if unknown."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows), or no such name here
        return None


def check_pinnable(nbytes: int, pinned: int) -> None:
    """``CUDA_ERROR_OUT_OF_MEMORY`` at once where ``nbytes`` more, with the ``pinned`` bytes a device
    holds, would pass the host's physical memory: pinning that much fails on a real host too."""
    limit = host_memory_bytes()
    if limit is not None and pinned + nbytes > limit:
        raise error_for_code(
            "CUDA_ERROR_OUT_OF_MEMORY",
            f"fake alloc_host of {nbytes} bytes: the fake pins at most the host's physical memory, "
            f"{format_bytes(limit)}, and holds {format_bytes(pinned)} pinned",
            requested=nbytes,
        )


def check_importable(nbytes: int, address: int) -> None:
    """``CUDA_ERROR_INVALID_VALUE`` for an import of more host memory than the host has: a claim the fake
    can see is a lie (a smaller lie it cannot see: it does not know how large the producer's memory is)."""
    limit = host_memory_bytes()
    if nbytes >= 1 << 63 or (limit is not None and nbytes > limit):
        raise error_for_code(
            "CUDA_ERROR_INVALID_VALUE",
            f"fake import of {nbytes} bytes of host memory at {address:#x}: more than this host has, so its "
            f"producer claims more than it owns",
        )


def zeros(nbytes: int, what: str) -> np.ndarray:
    """``nbytes`` zeroed host bytes; ``CUDA_ERROR_OUT_OF_MEMORY`` where numpy cannot have them."""
    try:
        return np.zeros(nbytes, dtype=np.uint8)
    except (MemoryError, ValueError, OverflowError) as exc:
        raise error_for_code(
            "CUDA_ERROR_OUT_OF_MEMORY",
            f"{what} of {nbytes} bytes: the host cannot give the fake that much memory ({exc})",
            requested=nbytes,
        ) from None


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """A fake device's addresses ``[base, base + size)``: host memory below the middle, device memory above."""

    base: int
    size: int

    @property
    def host(self) -> tuple[int, int]:
        """The pinned host memory's addresses, ``[lo, hi)``."""
        return self.base, self.base + self.size // 2

    @property
    def device(self) -> tuple[int, int]:
        """The device memory's addresses, ``[lo, hi)``."""
        return self.base + self.size // 2, self.base + self.size


class _Windows:
    """The process's fake address space, handed out one window per fake device."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = _FIRST
        self._returned: list[Window] = []  # windows of devices gone, handed out only when no fresh one is left

    def take(self, capacity: int) -> Window:
        half = min(max(_HALF, -(-2 * capacity // _TiB) * _TiB), _MAX_HALF)
        with self._lock:
            if self._next + 2 * half <= _TOP:
                window = Window(self._next, 2 * half)
                self._next += 2 * half
                return window
            fits = [w for w in self._returned if w.size >= 2 * half]
            if not fits:
                raise error_for_code(
                    "CUDA_ERROR_OUT_OF_MEMORY",
                    f"opening a fake device of {format_bytes(capacity)}: the process's fake address space is "
                    f"taken by the fake devices open (close some)",
                )
            window = min(fits, key=lambda w: w.size)
            self._returned.remove(window)
            return window

    def give_back(self, window: Window) -> None:
        with self._lock:
            self._returned.append(window)


_WINDOWS: Final = _Windows()


def take_window(capacity: int) -> Window:
    """A window of the process's fake address space for a device of ``capacity`` bytes, its own until
    :meth:`give_back`: fresh while any is left, then one a device gone gave back."""
    return _WINDOWS.take(capacity)


def give_back(window: Window) -> None:
    """Let another fake device have ``window`` once no fresh one is left."""
    _WINDOWS.give_back(window)


@dataclasses.dataclass(slots=True)
class Allocation:
    """Live memory at ``base``: ``size`` bytes of ``kind`` (an ``AllocKind``, ``"host"`` or ``"external"``)."""

    base: int
    size: int
    kind: str
    data: np.ndarray


class AddressSpace:
    """The addresses ``[lo, hi)`` and the allocations in them, found by any address inside.

    Not thread-safe: the device calls it under its lock.
    """

    def __init__(self, lo: int, hi: int, *, reuse: bool, what: str) -> None:
        self._lo, self._hi, self._next = lo, hi, lo
        self._reuse = reuse
        self._what = what
        self._bases: list[int] = []  # live bases, sorted
        self._allocs: dict[int, Allocation] = {}
        self._spans: dict[int, int] = {}  # live base -> the span of its range
        self._freed: dict[int, list[int]] = {}  # span -> freed bases, most recently freed last

    @property
    def window(self) -> tuple[int, int]:
        """``[lo, hi)``: every address this space hands out lies inside."""
        return self._lo, self._hi

    def place(self, nbytes: int, kind: str, data: np.ndarray) -> int:
        """The base of a new allocation of ``data`` (``nbytes`` bytes); ``CUDA_ERROR_OUT_OF_MEMORY`` if no
        range is left."""
        need = span(nbytes)
        base, taken = self._range(need)
        if base is None:
            raise error_for_code(
                "CUDA_ERROR_OUT_OF_MEMORY",
                f"fake {self._what} of {nbytes} bytes: the device's {self._what} addresses "
                f"[{self._lo:#x}, {self._hi:#x}) are all handed out",
                requested=nbytes,
            )
        self._allocs[base] = Allocation(base, nbytes, kind, data)
        self._spans[base] = taken
        bisect.insort(self._bases, base)
        return base

    def _range(self, need: int) -> tuple[int | None, int]:
        """A range of ``need`` addresses at least: ``(base, its span)``, or ``(None, 0)``."""
        if self._reuse:
            freed = self._freed.get(need)
            if freed:  # as a caching driver does: the most recently freed range of the size class
                base = freed.pop()
                if not freed:
                    del self._freed[need]
                return base, need
        if self._next + need <= self._hi:
            base = self._next
            self._next += need
            return base, need
        # No fresh range left: a freed one of the smallest larger size class (it keeps its span).
        larger = [s for s in self._freed if s >= need]
        if not larger:
            return None, 0
        best = min(larger)
        freed = self._freed[best]
        base = freed.pop()
        if not freed:
            del self._freed[best]
        return base, best

    def remove(self, base: int) -> Allocation | None:
        """Take the allocation at ``base`` out (its range may come back); ``None`` if none starts there."""
        alloc = self._allocs.pop(base, None)
        if alloc is None:
            return None
        del self._bases[bisect.bisect_left(self._bases, base)]
        taken = self._spans.pop(base)
        if self._reuse:
            self._freed.setdefault(taken, []).append(base)
        return alloc

    def get(self, base: int) -> Allocation | None:
        """The allocation starting at ``base``, else ``None``."""
        return self._allocs.get(base)

    def holding(self, ptr: int) -> Allocation | None:
        """The allocation ``ptr`` lies inside (an empty one holds its own base), else ``None``."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            alloc = self._allocs[self._bases[i]]
            if ptr < alloc.base + alloc.size or ptr == alloc.base:
                return alloc
        return None

    def tail(self, ptr: int) -> np.ndarray | None:
        """The bytes from ``ptr`` to the end of the allocation holding it (empty at its end), else ``None``."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            alloc = self._allocs[self._bases[i]]
            if ptr - alloc.base <= alloc.size:
                return alloc.data[ptr - alloc.base :]
        return None

    def find(self, ptr: int, nbytes: int) -> np.ndarray | None:
        """The bytes ``[ptr, ptr + nbytes)`` if they lie inside one allocation, else ``None``."""
        tail = self.tail(ptr)
        return None if tail is None or len(tail) < nbytes else tail[:nbytes]

    def view(self, ptr: int, nbytes: int) -> np.ndarray:
        """The bytes ``[ptr, ptr + nbytes)``; ``IndexError`` (an illegal address, to a kernel) unless they
        lie inside one allocation."""
        found = self.find(ptr, nbytes)
        if found is None:
            raise IndexError(f"[{ptr:#x}, {ptr + nbytes:#x}) is not inside one allocation")
        return found

    def clear(self) -> None:
        """Drop every allocation and every freed range; no address handed out comes back."""
        self._bases.clear()
        self._allocs.clear()
        self._spans.clear()
        self._freed.clear()
