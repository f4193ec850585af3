"""Caching pools: device memory carved from segments and cached after free, every piece on the ledger.

Written once, here, and compiled as well as run as Python (``_pool``, with ``_pool.pxd``: docs/building.md).

- `MemoryPool` is the handle [`GpuBackend.create_pool`][metrale_core.GpuBackend.create_pool] returns. Its calls
  go to the pool front (`PoolCalls`, ``pools.py``), which owns the ledger's side (a record per piece, its own
  creation index and call site, the sweep); the pool owns its memory: segments, the pieces carved from them and
  out now, the pieces cached.
- A pool grows itself through the callable it was given (``grow``: raw memory's, with reclaim-and-retry), as
  CuPy's ``SingleDeviceMemoryPool._malloc`` calls ``_try_malloc``: an allocation calls the pool once to take its
  piece and once to hand it out (`handed_out`). A pool for another library's capture grows with the thread's
  capture mode relaxed, fills zones on the default stream, and keeps its segments until it closes (``for_capture``).
- Sizes round up to 512 bytes. A piece of up to 1 MiB is carved from a 2 MiB segment; a larger one is a
  segment of its own, which goes back to the driver when none of its pieces is out: at `trim`, at a device-wide
  ``synchronize()`` beyond ``release_threshold`` cached bytes, out of memory, and at ``close()``.
- Reuse is stream-ordered, as in PyTorch's caching allocator: a piece freed on a stream is cached for that
  stream and taken again only by an allocation on it (the stream runs the earlier work first). A piece also used
  on another stream (`record_stream`, torch's ``Tensor.record_stream``) is cached for no stream at its free: it is
  taken again only after the pool's next wait for the device. Once the device went idle (the pool waits for it
  before it gives memory back), every piece cached before that wait serves any stream: each cached piece carries
  the pool's epoch at its free, and a wait counts only for the pieces cached before it began (`mark`).
- Every call that takes its lock passes the backend's gate first (`stats` too): a collection's finalizer under the
  lock defers its free (`Gate.defer`). The public class is the pure one (an ABC) the compiled class registers
  with: ``isinstance`` holds for both builds. `PoolStats` lives in ``poolstats.py`` (one class for both builds).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Protocol, cast

from .poolstats import PoolStats

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

if not cython.compiled:  # (compiled: the C lock of _lock.pxd, cimported by _pool.pxd)
    from .._device._lock import acquire_lock, new_lock, release_lock

if TYPE_CHECKING:  # (as a module: compiled, ``Ledger`` is the one _pool.pxd cimports)
    from .._device.buffer import DeviceBuffer
    from .._device.handles import Stream
    from . import ledger as ledgers

__all__ = [
    "HUGE", "LARGE", "PLAIN", "SEGMENT", "SHARED", "ZONED", "ZONED_ON_OWN", "Grow", "MemoryPool", "PoolCalls",
    "PoolStats", "Segment", "size_class",
]

#: Pieces of at most this many bytes are carved from shared segments; larger ones are segments of their own.
LARGE: Final = 1 << 20
#: The size of a shared segment.
SEGMENT: Final = 2 << 20
_ROUND: Final = 512
#: Sizes from this one up are no cached piece's and no shared segment's (only the driver, which refuses them, could
#: serve one); below it a piece's rounded size fits a C ``long long``, as the compiled pool keeps it.
HUGE: Final = 1 << 62
#: The cache key of a piece used on a stream besides its own (`MemoryPool.record_stream`): no allocation asks for
#: it, so such a piece is taken again only once a wait for the device made it any stream's (`MemoryPool.idle`).
SHARED: Final = "used on another stream too"

#: How a pool grows (raw memory's `grow`): ``grow(nbytes, n, what, retake)``, a new segment of ``nbytes`` for an
#: allocation of ``n`` bytes by ``what``, from the driver with reclaim-and-retry: its address; 0 where ``retake()``,
#: asked once the pools were trimmed (the wait made pieces cached for other streams any stream's), served it.
Grow = Callable[[int, int, str, Callable[[], bool]], int]


def size_class(nbytes: int) -> int:
    """The bytes a piece of ``nbytes`` takes: rounded up to 512."""
    return (nbytes + _ROUND - 1) & ~(_ROUND - 1)


class PoolCalls(Protocol):
    """What a pool's public calls ask of its front (``pools.PoolFront``: the ledger's side, the gate, raw memory)."""

    def pool_alloc(
        self, pool: MemoryPool, nbytes: object, stream: Stream | None, foreign: object = None, stacklevel: object = 1
    ) -> DeviceBuffer: ...
    def pool_free(self, pool: MemoryPool, buf: object, stream: Stream | None, what: str) -> None: ...
    def pool_record(self, pool: MemoryPool, buf: object, foreign_stream: object) -> None: ...
    def pool_trim(self, pool: MemoryPool, keep_bytes: object) -> int: ...
    def pool_capturing(self, pool: MemoryPool, underway: object) -> None: ...
    def pool_stats(self, pool: MemoryPool) -> PoolStats: ...
    def pool_close(self, pool: MemoryPool) -> None: ...


class Segment:
    """A segment from the driver: its address, its bytes, the bytes carved and the pieces out."""

    __slots__ = ("nbytes", "out", "ptr", "used")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.used = 0  # bytes carved so far
        self.out = 0  # pieces carved from it and out now


#: A piece taken: its address, its segment (``None``: the pool closed as it grew; the caller gives that back), and
#: the size of the allocation whose red zones it still holds intact (``0``: none known; `MemoryPool.take`).
Taken = tuple[int, "Segment | None", int]

#: Where `MemoryPool.take`'s allocation fills its red zones: none; the default stream (which follows no other: only a
#: piece whose last use is known done serves); its own stream (another library's, borrowed: it follows that use).
PLAIN, ZONED, ZONED_ON_OWN = 0, 1, 2


class MemoryPool:
    """A caching pool of device memory on the ledger. Made by
    [`GpuBackend.create_pool`][metrale_core.GpuBackend.create_pool].

    ``alloc(nbytes, stream=None)`` hands out a [`DeviceBuffer`][metrale_core.DeviceBuffer] of kind ``"pool"``,
    usable in every operation of its backend and freed one by one, by ``free`` or by ``GpuBackend.free``.
    Thread-safe. A context manager (``close()`` on exit).
    """

    __slots__ = ("__weakref__", "_cached", "_closed", "_epoch", "_free", "_front", "_given_back", "_grow", "_hits",
                 "_lock", "_misses", "_out", "_piece_bytes", "_segment_bytes", "_segments", "_small", "_strand",
                 "_threshold", "for_capture")

    def __init__(self, front: PoolCalls, release_threshold: int, grow: Grow, for_capture: bool = False) -> None:
        self.for_capture = for_capture
        self._front = front
        self._grow = grow
        self._lock = new_lock()
        self._closed = False
        self._segments: dict[int, Segment] = {}  # by address
        self._small: list[Segment] = []  # shared segments, the newest last (carving goes there)
        #: Cached pieces: (stream, size, zoned) -> [(address, segment, epoch at the free, laid)]; stream ``None``: any
        #: stream. ``zoned``: the last owner had red zones, its free waited for their check; ``laid``: its size, where
        #: they were judged intact and are still in place (else 0).
        self._free: dict[tuple[object, int, bool], list[tuple[int, Segment, int, int]]] = {}
        #: Pieces out: creation index -> (address, size, segment, the stream it was allocated on, zoned).
        self._out: dict[int, tuple[int, int, Segment, object, bool]] = {}
        self._epoch = 0  # bumped by each `mark`: a wait that began after a piece's free makes it any stream's
        self._cached = self._hits = self._misses = self._given_back = self._segment_bytes = self._piece_bytes = 0
        self._threshold = release_threshold
        self._strand = False  # whether a swept piece stays out (`strand_swept`)

    # -- the public face --------------------------------------------------------------------

    def alloc(self, nbytes: int, *, stream: Stream | None = None, stacklevel: int = 1) -> DeviceBuffer:
        """A piece of ``nbytes`` bytes (a cached one freed on ``stream``, or a new one), on the ledger with the
        caller's site (``stacklevel`` as `GpuBackend.alloc`'s); ``stream`` (the default stream if ``None``) is where
        its first use is ordered."""
        return self._front.pool_alloc(self, nbytes, stream, None, stacklevel)

    def alloc_on(self, nbytes: int, foreign_stream: int) -> DeviceBuffer:
        """As `alloc`, for a stream another library made (its raw handle: torch's ``Stream.cuda_stream``, CuPy's
        ``Stream.ptr``): cached for that stream at its free, and taken again by allocations on it (the doors')."""
        return self._front.pool_alloc(self, nbytes, None, foreign_stream)

    def free(self, buf: DeviceBuffer, *, stream: Stream | None = None) -> None:
        """Free a piece of this pool: off the ledger at once, cached for ``stream`` (the stream it was allocated
        on if ``None``): allocations on that stream take it again."""
        self._front.pool_free(self, buf, stream, "MemoryPool.free")

    def record_stream(self, buf: DeviceBuffer, foreign_stream: int) -> None:
        """Say that piece ``buf`` is used on another library's stream ``foreign_stream`` too (torch's
        ``Tensor.record_stream``): at its free it is cached for no stream, and taken again only after the pool's next
        wait for the device (a trim, a device-wide ``synchronize()``, an out-of-memory reclaim)."""
        self._front.pool_record(self, buf, foreign_stream)

    def capturing(self, underway: bool) -> None:
        """Another library's capture allocating here began (``underway``) or ended: meanwhile the backend checks no
        red zones on its own (a check waits for the device, which the capture forbids)."""
        self._front.pool_capturing(self, underway)

    def trim(self, keep_bytes: int = 0) -> int:
        """Wait for the device, then give back whole free segments until at most ``keep_bytes`` stay cached;
        returns the bytes given back."""
        return self._front.pool_trim(self, keep_bytes)

    def stats(self) -> PoolStats:
        """The pool's counters now."""
        return self._front.pool_stats(self)

    def counters(self) -> PoolStats:
        """`stats`, read inside the gate (the front's call): a collection's finalizer then defers its free."""
        acquire_lock(self._lock)  # (the fields copied, nothing made under it: a collection may free a piece)
        try:
            segments, segment_bytes, pieces = len(self._segments), self._segment_bytes, len(self._out)
            piece_bytes, cached, hits, misses, given = (self._piece_bytes, self._cached, self._hits, self._misses,
                                                        self._given_back)
        finally:
            release_lock(self._lock)
        return PoolStats(segments, segment_bytes, pieces, piece_bytes, cached, hits, misses, given, self._threshold)

    @property
    def release_threshold(self) -> int:
        """The cached bytes a device-wide ``synchronize()`` leaves in the pool."""
        return self._threshold

    @property
    def cached_bytes(self) -> int:
        """Bytes of the pieces cached now."""
        return self._cached

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the pool: pieces still out are swept (each a leak, named in a warning), and every segment goes
        back to the driver. Idempotent."""
        if not self._closed:
            self._front.pool_close(self)

    def __enter__(self) -> MemoryPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._out)} pieces out, {self._cached} bytes cached"
        return f"<MemoryPool {state}>"

    # -- the memory (the front's calls, inside the gate) --------------------------------------

    def take(self, size: int, stream: object, fill: int, n: int, what: str) -> Taken:
        """A piece of ``size`` bytes for an allocation of ``n`` by ``what`` on ``stream``: a cached one (for
        ``stream``, or for any), a new one carved from a shared segment with room, or one of a new segment (`Grow`).
        ``fill``: where its zones are filled (`PLAIN`...): on the default stream (`ZONED`), only a piece whose last
        use is known done serves (freed with zones and checked, or cached before a wait). A zoned allocation takes
        first a piece whose zones are still in place (the third item: the size they were laid for)."""
        if size < HUGE:
            acquire_lock(self._lock)
            try:
                found = self._find(size, stream, fill)
            finally:
                release_lock(self._lock)
            if found is not None:
                return found
        return self._grown(size, stream, fill, n, what)

    def _find(self, size: int, stream: object, fill: int) -> Taken | None:
        """`take`'s cached or carved piece, under the lock; ``None`` where a new segment is needed."""
        if fill == ZONED:
            keys: tuple[tuple[object, int, bool], ...] = ((stream, size, True), (None, size, True), (None, size, False))
        elif fill == ZONED_ON_OWN:
            keys = ((stream, size, True), (None, size, True), (stream, size, False), (None, size, False))
        else:
            keys = ((stream, size, False), (stream, size, True), (None, size, False), (None, size, True))
        for key in keys:
            cached = self._free.get(key)
            if cached:
                ptr, segment, _, laid = cached.pop()
                self._cached -= size
                self._piece_bytes += size
                self._hits += 1
                segment.out += 1
                return ptr, segment, laid
        if size <= LARGE and self._small:
            segment = self._small[-1]
            if segment.used + size <= segment.nbytes:
                return self._carve(segment, size)
        return None

    def _retake(self, box: list[Taken], size: int, stream: object, fill: int) -> bool:
        """Asked by the front's `Grow` once the pools were trimmed: a cached piece now (put in ``box``)?"""
        if size >= HUGE:  # (no piece of that size is cached)
            return False
        acquire_lock(self._lock)
        try:
            found = self._find(size, stream, fill)
        finally:
            release_lock(self._lock)
        if found is None:
            return False
        box.append(found)
        return True

    def _grown(self, size: int, stream: object, fill: int, n: int, what: str) -> Taken:
        """`take` where nothing cached or carved serves: a new segment (`Grow`), and the piece carved from it."""
        nbytes, box = SEGMENT if size <= LARGE else size, cast("list[Taken]", [])
        ptr = self._grow(nbytes, n, what, functools.partial(self._retake, box, size, stream, fill))
        if box:
            return box[0]
        segment = Segment(ptr, nbytes)
        acquire_lock(self._lock)
        try:
            if self._closed:
                return ptr, None, 0
            self._segments[ptr] = segment
            self._segment_bytes += nbytes
            if size <= LARGE:
                self._small.append(segment)
            return self._carve(segment, size)
        finally:
            release_lock(self._lock)

    def _carve(self, segment: Segment, size: int) -> Taken:
        ptr = segment.ptr + segment.used
        segment.used += size
        segment.out += 1
        self._misses += 1
        self._piece_bytes += size
        return ptr, segment, 0

    def handed_out(
        self, index: int, ptr: int, size: int, segment: Segment, stream: object, zoned: bool,
        ledger: ledgers.Ledger, buf: DeviceBuffer,
    ) -> int:
        """The piece at ``ptr`` of ``segment`` (just taken) is allocation ``index`` on ``stream`` (``zoned``: with red
        zones), whose record ``buf`` the front committed to ``ledger``: ``1``. ``0``, nothing changed, where the pool
        shut meanwhile; ``2`` where the record left the ledger meanwhile (a sweep, or a free of a record it listed):
        the piece is then what that sweep made of it (`swept`). Judged under the pool's lock, which every taker of a
        record takes only after the ledger let go of it (`give`, `swept`)."""
        acquire_lock(self._lock)
        try:
            if self._closed:
                return 0
            if not ledger.has_index(index, buf):
                if self._strand:
                    self._out[index] = (ptr, size, segment, stream, zoned)
                else:
                    self._cache(ptr, size, segment, stream, zoned, 0)
                return 2
            self._out[index] = (ptr, size, segment, stream, zoned)
        finally:
            release_lock(self._lock)
        return 1

    def give(self, index: int, stream: object | None, laid: int = 0) -> None:
        """Allocation ``index`` is off the ledger: its piece cached for ``stream`` (its own if ``None``). ``laid``: its
        size, where its red zones were judged intact (they stay for the next zoned allocation). Nothing if closed."""
        acquire_lock(self._lock)
        try:
            held = self._out.pop(index, None)
            if held is not None:
                ptr, size, segment, own, zoned = held
                self._cache(ptr, size, segment, own if stream is None or own is SHARED else stream, zoned, laid)
        finally:
            release_lock(self._lock)

    def strand_swept(self) -> None:
        """From now on a piece a sweep takes off the ledger stays out of the cache until the pool closes: its owner
        (a framework, which frees by address) may still use it (the allocator doors ask for it)."""
        acquire_lock(self._lock)
        self._strand = True
        release_lock(self._lock)

    def swept(self, index: int) -> None:
        """A sweep took allocation ``index`` off the ledger: back to the cache, or stranded (`strand_swept`)."""
        if not self._strand:  # (set once, as its door makes the pool: before any piece)
            self.give(index, None)

    def aim(self, index: int, stream: object) -> None:
        """Allocation ``index`` (freed, its zones waiting for their check) is to be cached for ``stream`` (not where
        it is used on another stream too: `share`)."""
        acquire_lock(self._lock)
        try:
            held = self._out.get(index)
            if held is not None and held[3] is not SHARED:
                self._out[index] = (held[0], held[1], held[2], stream, held[4])
        finally:
            release_lock(self._lock)

    def share(self, index: int, stream: object) -> None:
        """Allocation ``index`` is used on ``stream`` too (`record_stream`): unless that is its own stream, its piece
        is cached for no stream at its free (`SHARED`)."""
        acquire_lock(self._lock)
        try:
            held = self._out.get(index)
            if held is not None and held[3] != stream:
                self._out[index] = (held[0], held[1], held[2], SHARED, held[4])
        finally:
            release_lock(self._lock)

    def give_untaken(self, ptr: int, size: int, segment: Segment, stream: object) -> None:
        """A piece taken for an allocation on ``stream`` that did not commit: cached for it, no zones known in place."""
        acquire_lock(self._lock)
        try:
            if not self._closed:
                self._cache(ptr, size, segment, stream, False, 0)
        finally:
            release_lock(self._lock)

    def _cache(self, ptr: int, size: int, segment: Segment, stream: object, zoned: bool, laid: int) -> None:
        segment.out -= 1
        self._piece_bytes -= size
        key = (stream, size, zoned)
        cached = self._free.get(key)
        if cached is None:
            self._free[key] = [(ptr, segment, self._epoch, laid)]
        else:
            cached.append((ptr, segment, self._epoch, laid))
        self._cached += size

    def out(self) -> list[int]:
        """The creation indexes of the pieces out now."""
        acquire_lock(self._lock)
        try:
            return list(self._out)
        finally:
            release_lock(self._lock)

    def shut(self) -> bool:
        """Refuse every later hand-out (`handed_out`) and growth; ``False`` where it was shut already."""
        acquire_lock(self._lock)
        try:
            if self._closed:
                return False
            self._closed = True
            return True
        finally:
            release_lock(self._lock)

    def mark(self) -> int:
        """Before a wait for the device: the pieces cached so far are idle once it returns (`idle`, `release`)."""
        acquire_lock(self._lock)
        self._epoch = epoch = self._epoch + 1
        release_lock(self._lock)
        return epoch

    def idle(self, mark: int) -> None:
        """The wait that began at ``mark`` returned: the pieces cached before it serve any stream."""
        acquire_lock(self._lock)
        try:
            for key in [k for k in self._free if k[0] is not None]:
                pieces = self._free[key]
                done = [p for p in pieces if p[2] < mark]
                if done:
                    self._free.setdefault((None, key[1], key[2]), []).extend(done)
                    kept = [p for p in pieces if p[2] >= mark]
                    if kept:
                        self._free[key] = kept
                    else:
                        del self._free[key]
        finally:
            release_lock(self._lock)

    def release(self, keep_bytes: int, mark: int) -> list[tuple[int, int]]:
        """Take out whole segments none of whose pieces is out and all of whose cached pieces were cached before
        ``mark`` (a wait since), until at most ``keep_bytes`` stay cached; the caller gives back the
        ``(address, nbytes)`` returned and counts each one it could (`gave_back`). None of a pool for a capture."""
        gone: list[tuple[int, int]] = []
        if self.for_capture:
            return gone
        acquire_lock(self._lock)
        try:
            busy = {id(p[1]) for pieces in self._free.values() for p in pieces if p[2] >= mark}
            for segment in [s for s in self._segments.values() if s.out == 0 and id(s) not in busy]:
                if self._cached <= keep_bytes:
                    break
                freed = 0
                for key, pieces in list(self._free.items()):
                    kept = [p for p in pieces if p[1] is not segment]
                    freed += (len(pieces) - len(kept)) * key[1]
                    if kept:
                        self._free[key] = kept
                    else:
                        del self._free[key]
                self._cached -= freed
                del self._segments[segment.ptr]
                self._segment_bytes -= segment.nbytes
                if segment in self._small:
                    self._small.remove(segment)
                gone.append((segment.ptr, segment.nbytes))
        finally:
            release_lock(self._lock)
        return gone

    def gave_back(self, nbytes: int) -> None:
        """The driver took back a segment of ``nbytes``."""
        acquire_lock(self._lock)
        self._given_back += nbytes
        release_lock(self._lock)

    def release_all(self) -> list[tuple[int, int]]:
        """At close (shut, no piece out any more): every segment."""
        acquire_lock(self._lock)
        try:
            gone = [(s.ptr, s.nbytes) for s in self._segments.values()]
            self._segments.clear()
            self._small.clear()
            self._free.clear()
            self._out.clear()
            self._cached = self._segment_bytes = self._piece_bytes = 0
            self._closed = True
        finally:
            release_lock(self._lock)
        return gone


if not cython.compiled:  # the public class: the pure one, an ABC the compiled class registers with (made by a call:
    # Cython matches a class statement of this name with the compiled class, even in a branch it drops)
    _Pool = MemoryPool
    MemoryPool = abc.ABCMeta(  # type: ignore[misc, assignment]
        "MemoryPool", (_Pool,), {"__slots__": (), "__doc__": _Pool.__doc__, "__module__": __name__}
    )
else:  # (compiled: a MemoryPool to ``isinstance`` too)
    from . import pool as _pure  # noqa: PLW0406 (compiled, this module is _pool: the pure one is another)

    cast(abc.ABCMeta, _pure.MemoryPool).register(MemoryPool)
