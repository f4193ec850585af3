"""The fake device's memory: each device's window of the process's fake address space, and the
allocations that live in it.

The process's fake address space, from ``0x5500_0000_0000`` up to ``2**63``, is cut into one
window per [`FakeDevice`][metrale_fake.FakeDevice], as separate devices have separate ranges: a buffer
of one device is never an address of another. A window's lower half is the device's pinned host
memory, its upper half its device memory (allocations and imported memory); the first device's
halves start at ``0x5500_0000_0000`` and ``0x7F00_0000_0000``. A half is 42 TiB, or twice the
device's capacity rounded up to a TiB where that is more (at most ``2**59``): room for the capacity
and the gaps. Every address is 256-byte aligned, positive and below ``2**63``, so it fits a signed
64-bit kernel argument. A window is a device's until the device object is gone; another device gets
it only once no fresh one is left.

Inside a half, an allocation of ``nbytes`` takes `span` ``(nbytes)`` addresses: itself and
at least `GAP` unmapped bytes after it, rounded up to `ALIGN`. That span is its size
class. With address reuse on (always for host memory; for device memory unless
``fake_reuse_addresses`` is off), a new allocation takes the most recently freed range of its size
class, as CUDA's allocator hands a freed address out again at once; else a fresh range above every
range handed out so far. Freed ranges are never merged,
with each other or with live ones, so the gap after every allocation stays unmapped. A half with no
fresh range left (after 42 TiB of ranges or more) gives a freed range of the smallest larger size class
(reuse on), or is out of memory.

An allocation's bytes are a numpy array of zeros, as ever: memory never written reads as zeros. An
array of device memory no view was ever taken of (`AddressSpace.place_zeros`, never read or
written since) is still all zeros when the allocation is freed, and nothing but the space references
it: the space keeps it, with its record, for the next allocation of exactly its size, which then
needs no fresh ``numpy.zeros``. The arrays kept are bounded by the space's ``keep_bytes`` (the fake
device's capacity, at most `KEEP_BYTES`), each counting the span its allocation had (its bytes
and a gap of `GAP` at least, so that tiny ones are bounded too); past it the sizes kept first
are let go first, and ``close()`` lets every one go. An array a view was taken of (a copy, a memset, a
kernel, an export) goes with its allocation, as before, and pinned host memory (its view is its
owner's at once) is never kept.
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
    "ALIGN", "GAP", "KEEP_BYTES", "AddressSpace", "Allocation", "Window", "check_importable", "check_pinnable",
    "give_back", "host_memory_bytes", "span", "take_window", "zeros",
]

ALIGN: Final = 256  # every allocation starts at a multiple of this
GAP: Final = 4096  # unmapped bytes at least between allocations, as a real address space has
KEEP_BYTES: Final = 256 << 20  # the most bytes of freed, never-touched arrays a space keeps for reuse

_FIRST: Final = 0x5500_0000_0000  # the first window's base
_HALF: Final = 0x2A00_0000_0000  # 42 TiB: a window's half at least (the first device's memory at 0x7F00_0000_0000)
_MAX_HALF: Final = 1 << 59
_TOP: Final = 1 << 63  # every address stays below: it fits a signed 64-bit kernel argument
_TiB: Final = 1 << 40
_SPAN_ADD: Final = GAP + ALIGN - 1  # span(n) == (n + _SPAN_ADD) & _SPAN_MASK
_SPAN_MASK: Final = -ALIGN
_NO_KINDS: Final = frozenset[str]()
_KEPT_SIZES: Final = 1024  # sizes kept at once before the emptied ones are forgotten


def span(nbytes: int) -> int:
    """The addresses an allocation of ``nbytes`` takes, its gap included: its size class."""
    return (nbytes + _SPAN_ADD) & _SPAN_MASK


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
    `give_back`: fresh while any is left, then one a device gone gave back."""
    return _WINDOWS.take(capacity)


def give_back(window: Window) -> None:
    """Let another fake device have ``window`` once no fresh one is left."""
    _WINDOWS.give_back(window)


@dataclasses.dataclass(slots=True, eq=False)
class Allocation:
    """Live memory at ``base``: ``size`` bytes of ``kind`` (an ``AllocKind``, ``"host"`` or ``"external"``).

    ``span`` is the range it takes (its size class, or a larger one's); ``zeroed`` says that ``data`` is
    the space's own array of zeros and no view of it was ever handed out (so it is zeros still)."""

    base: int
    size: int
    kind: str
    data: np.ndarray
    span: int = 0
    zeroed: bool = False


class AddressSpace:
    """The addresses ``[lo, hi)`` and the allocations in them, found by any address inside.

    ``keep_bytes``: the most bytes of freed, never-touched arrays of zeros it keeps for the next
    allocation of their size (`place_zeros`); ``0`` keeps none.

    Not thread-safe: the device calls it under its lock.
    """

    def __init__(self, lo: int, hi: int, *, reuse: bool, what: str, keep_bytes: int = 0) -> None:
        self._lo, self._hi, self._next = lo, hi, lo
        self._reuse = reuse
        self._what = what
        # The bases of the ranges handed out, sorted: the live ones and (reuse on) the freed ones, which
        # hold no allocation. Ranges never overlap, so the last base at or below an address starts the
        # only range that can hold it. A fresh range lies above all: it is appended.
        self._bases: list[int] = []
        self._allocs: dict[int, Allocation] = {}
        self._freed: dict[int, list[int]] = {}  # span -> freed bases, most recently freed last (may be empty)
        self._keep_bytes = keep_bytes
        self._kept: dict[int, list[Allocation]] = {}  # size -> freed records, zeros still (may be empty)
        self._room = keep_bytes  # keep_bytes less the spans of the records kept

    @property
    def window(self) -> tuple[int, int]:
        """``[lo, hi)``: every address this space hands out lies inside."""
        return self._lo, self._hi

    @property
    def kept_bytes(self) -> int:
        """What the freed arrays of zeros kept for the next allocations of their sizes count against
        ``keep_bytes``: each the span its allocation had (its bytes, `GAP` and more)."""
        return self._keep_bytes - self._room

    def place(self, nbytes: int, kind: str, data: np.ndarray) -> int:
        """The base of a new allocation of ``data`` (``nbytes`` bytes); ``CUDA_ERROR_OUT_OF_MEMORY`` if no
        range is left."""
        base, taken = self._range((nbytes + _SPAN_ADD) & _SPAN_MASK)
        if base is None:
            raise self._exhausted(nbytes)
        self._allocs[base] = Allocation(base, nbytes, kind, data, taken)
        return base

    def place_zeros(self, nbytes: int, kind: str, what: str) -> int:
        """The base of a new allocation of ``nbytes`` zeroed bytes: a kept array of its size if there is
        one, else a fresh one (``CUDA_ERROR_OUT_OF_MEMORY`` naming ``what`` where the host cannot give
        it); out of memory as `place` if no range is left."""
        kept = self._kept.get(nbytes)
        if kept:
            alloc = kept.pop()
            self._room += alloc.span  # (what it was kept for)
            alloc.kind = kind
        else:
            alloc = Allocation(0, nbytes, kind, zeros(nbytes, what), 0, True)
        need = (nbytes + _SPAN_ADD) & _SPAN_MASK
        freed = self._freed.get(need) if self._reuse else None
        if freed:  # the usual case, inline: the most recently freed range of the size class
            base = freed.pop()
            alloc.span = need
        else:
            found, taken = self._range(need)
            if found is None:
                alloc.span = need
                self._keep(alloc)  # (its array is zeros still)
                raise self._exhausted(nbytes)
            base, alloc.span = found, taken
        alloc.base = base
        self._allocs[base] = alloc
        return base

    def _exhausted(self, nbytes: int) -> Exception:
        return error_for_code(
            "CUDA_ERROR_OUT_OF_MEMORY",
            f"fake {self._what} of {nbytes} bytes: the device's {self._what} addresses "
            f"[{self._lo:#x}, {self._hi:#x}) are all handed out",
            requested=nbytes,
        )

    def _range(self, need: int) -> tuple[int | None, int]:
        """A range of ``need`` addresses at least: ``(base, its span)``, or ``(None, 0)``."""
        if self._reuse:
            freed = self._freed.get(need)
            if freed:  # as a caching driver does: the most recently freed range of the size class
                return freed.pop(), need
        if self._next + need <= self._hi:
            base = self._next
            self._next += need
            self._bases.append(base)  # above every range handed out so far: the list stays sorted
            return base, need
        # No fresh range left: a freed one of the smallest larger size class (it keeps its span).
        larger = [s for s, bases in self._freed.items() if s >= need and bases]
        if not larger:
            return None, 0
        best = min(larger)
        return self._freed[best].pop(), best

    def remove(self, base: int) -> Allocation | None:
        """Take the allocation at ``base`` out (its range may come back); ``None`` if none starts there."""
        return self.remove_unless(base, _NO_KINDS)

    def remove_unless(self, base: int, kinds: frozenset[str]) -> Allocation | None:
        """`remove` the allocation at ``base`` unless it is of one of ``kinds``; ``None`` (and
        nothing changed) if none starts there or it is of one of them."""
        allocs = self._allocs
        alloc = allocs.get(base)
        if alloc is None or alloc.kind in kinds:
            return None
        del allocs[base]
        if self._reuse:  # its base stays among the bases: a freed range, holding nothing
            freed = self._freed.get(alloc.span)
            if freed is None:
                self._freed[alloc.span] = [base]
            else:
                freed.append(base)
        else:  # never handed out again
            bases = self._bases
            del bases[bisect.bisect_left(bases, base)]
        if alloc.zeroed:
            kept = self._kept.get(alloc.size)
            room = self._room - alloc.span
            if kept is not None and room >= 0:  # the usual case, inline
                kept.append(alloc)
                self._room = room
            else:
                self._keep(alloc)
        return alloc

    def _keep(self, alloc: Allocation) -> None:
        """Keep ``alloc``'s record and array of zeros for the next allocation of its size, within
        ``keep_bytes`` (each counts its span), letting the arrays of the sizes kept first go first; an
        empty one, or one that would not fit alone, goes itself."""
        size, charge = alloc.size, alloc.span
        if not size or charge > self._keep_bytes:
            return
        kept = self._kept
        if charge > self._room:
            for old, records in list(kept.items()):
                while records and charge > self._room:
                    self._room += records.pop(0).span
                if not records:
                    del kept[old]
                if charge <= self._room:
                    break
        elif size not in kept and len(kept) >= _KEPT_SIZES:  # many sizes kept once: forget the empty ones
            for old in [old for old, records in kept.items() if not records]:
                del kept[old]
        kept.setdefault(size, []).append(alloc)
        self._room -= charge

    def get(self, base: int) -> Allocation | None:
        """The allocation starting at ``base``, else ``None``."""
        return self._allocs.get(base)

    def holding(self, ptr: int) -> Allocation | None:
        """The allocation ``ptr`` lies inside (an empty one holds its own base), else ``None``."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            alloc = self._allocs.get(self._bases[i])
            if alloc is not None and (ptr < alloc.base + alloc.size or ptr == alloc.base):
                return alloc
        return None

    def tail(self, ptr: int) -> np.ndarray | None:
        """The bytes from ``ptr`` to the end of the allocation holding it (empty at its end), else ``None``."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            alloc = self._allocs.get(self._bases[i])
            if alloc is not None and ptr - alloc.base <= alloc.size:
                alloc.zeroed = False  # a view goes out: its bytes may be written (or held) from now on
                return alloc.data[ptr - alloc.base :]
        return None

    def extent(self, ptr: int) -> tuple[int, int, np.ndarray] | None:
        """The allocation holding ``ptr``, as ``(base, size, bytes)`` (its bytes may be written from now on), else
        ``None``: what `tail` reads, for a reader that keeps it (`FakeLaunch.reader`)."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            alloc = self._allocs.get(self._bases[i])
            if alloc is not None and ptr - alloc.base <= alloc.size:
                alloc.zeroed = False
                return alloc.base, alloc.size, alloc.data
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
        """Drop every allocation, every freed range and every kept array; no address handed out comes back."""
        self._bases.clear()
        self._allocs.clear()
        self._freed.clear()
        self._kept.clear()
        self._room = self._keep_bytes
