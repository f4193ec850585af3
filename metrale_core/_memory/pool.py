"""Caching pools: device memory carved from segments and cached after free, every piece on the ledger.

- `MemoryPool` is the handle [`GpuBackend.create_pool`][metrale_core.GpuBackend.create_pool] returns. Its calls
  go to the pool front (`PoolCalls`, ``pools.py``), which owns the ledger's side (a record per piece, its own
  creation index and call site, reclaim-and-retry, the sweep); the pool owns its memory: segments, the pieces
  carved from them and out now, the pieces cached.
- Sizes round up to 512 bytes. A piece of up to 1 MiB is carved from a 2 MiB segment; a larger one is a
  segment of its own. A segment goes back to the driver only when none of its pieces is out: at `trim`, at a
  device-wide ``synchronize()`` beyond ``release_threshold`` cached bytes, when an allocation runs out of
  memory, and at ``close()``.
- Reuse is stream-ordered, as in PyTorch's caching allocator: a piece freed on a stream is cached for that
  stream and taken again only by an allocation on it (the stream runs the earlier work first). A piece also used
  on another stream (`record_stream`, torch's ``Tensor.record_stream``) is cached for no stream at its free: it is
  taken again only after the pool's next wait for the device. Once the
  device went idle (the pool waits for it before it gives memory back), every piece cached before that wait
  serves any stream: each cached piece carries the pool's epoch at its free, and a wait counts only for the
  pieces cached before it began (`mark`).
- Every call that takes its lock passes the backend's gate first (`stats` too), so a finalizer that a collection
  runs under the lock defers its free (`Gate.defer`) instead of waiting for the lock.
- ``_pool.pyx`` is its compiled twin (registered as its subclass): the same work under a C-level lock, and a C-level
  door (take, hand out, give) for the compiled pool lane (``_lane.pyx``).
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from typing import TYPE_CHECKING, Final, Protocol, final

if TYPE_CHECKING:
    from .._device.buffer import DeviceBuffer
    from .._device.handles import Stream

__all__ = ["HUGE", "LARGE", "MemoryPool", "PoolCalls", "PoolStats", "SEGMENT", "SHARED", "size_class"]

#: Pieces of at most this many bytes are carved from shared segments; larger ones are segments of their own.
LARGE: Final = 1 << 20
#: The size of a shared segment.
SEGMENT: Final = 2 << 20
_ROUND: Final = 512
#: Sizes from this one up are no cached piece's and no shared segment's (only the driver, which refuses them, could
#: serve one); below it a piece's rounded size fits a C ``long long``, as the compiled pool and its lane keep it.
HUGE: Final = 1 << 62
#: The cache key of a piece used on a stream besides its own (`MemoryPool.record_stream`): no allocation asks for
#: it, so such a piece is taken again only once a wait for the device made it any stream's (`MemoryPool.idle`).
SHARED: Final = "used on another stream too"


def size_class(nbytes: int) -> int:
    """The bytes a piece of ``nbytes`` takes: rounded up to 512."""
    return (nbytes + _ROUND - 1) & ~(_ROUND - 1)


@dataclasses.dataclass(frozen=True, slots=True)
class PoolStats:
    """A [`MemoryPool`][metrale_core.MemoryPool]'s counters, as [`stats`][metrale_core.MemoryPool.stats] gives
    them.

    :param segments: segments held from the driver now.
    :param segment_bytes: their bytes.
    :param pieces: pieces out now (on the ledger, or freed with red zones that wait for their check).
    :param piece_bytes: the bytes they take (each size rounded up to 512).
    :param cached_bytes: bytes of the pieces cached for reuse.
    :param hits: allocations a cached piece served.
    :param misses: allocations that carved a new piece.
    :param given_back: bytes given back to the driver so far (trims, synchronizes, out-of-memory reclaims).
    :param release_threshold: the cached bytes a device-wide ``synchronize()`` leaves in the pool.
    """

    segments: int
    segment_bytes: int
    pieces: int
    piece_bytes: int
    cached_bytes: int
    hits: int
    misses: int
    given_back: int
    release_threshold: int


class PoolCalls(Protocol):
    """What a pool's public calls ask of its front (``pools.PoolFront``: the ledger's side, the gate, raw memory)."""

    def pool_alloc(
        self, pool: MemoryPool, nbytes: object, stream: Stream | None, foreign: object = None, stacklevel: object = 1
    ) -> DeviceBuffer: ...

    def pool_free(self, pool: MemoryPool, buf: object, stream: Stream | None, what: str) -> None: ...

    def pool_record(self, pool: MemoryPool, buf: object, foreign_stream: object) -> None: ...

    def pool_trim(self, pool: MemoryPool, keep_bytes: object) -> int: ...

    def pool_stats(self, pool: MemoryPool) -> PoolStats: ...

    def pool_close(self, pool: MemoryPool) -> None: ...


@final
class _Segment:
    __slots__ = ("nbytes", "out", "ptr", "used")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.used = 0  # bytes carved so far
        self.out = 0  # pieces carved from it and out now


@final
class MemoryPool(metaclass=abc.ABCMeta):  # noqa: B024 (an ABC for its compiled twin to register with, nothing abstract)
    """A caching pool of device memory on the ledger. Made by
    [`GpuBackend.create_pool`][metrale_core.GpuBackend.create_pool].

    ``alloc(nbytes, stream=None)`` hands out a [`DeviceBuffer`][metrale_core.DeviceBuffer] of kind ``"pool"``,
    usable in every operation of its backend and freed one by one, by ``free`` or by ``GpuBackend.free``.
    Thread-safe. A context manager (``close()`` on exit).
    """

    __slots__ = ("__weakref__", "_cached", "_closed", "_epoch", "_free", "_front", "_given_back", "_hits", "_lock",
                 "_misses", "_out", "_piece_bytes", "_segment_bytes", "_segments", "_small", "_strand", "_threshold")

    def __init__(self, front: PoolCalls, release_threshold: int) -> None:
        self._front = front
        self._lock = threading.Lock()
        self._closed = False
        self._segments: dict[int, _Segment] = {}  # by address
        self._small: list[_Segment] = []  # shared segments, the newest last (carving goes there)
        #: Cached pieces: (stream, size, zoned) -> [(address, segment, epoch at the free)]; stream ``None``: any
        #: stream. ``zoned``: the piece's last owner had red zones, so its free waited for the device (the check).
        self._free: dict[tuple[object, int, bool], list[tuple[int, _Segment, int]]] = {}
        #: Pieces out: creation index -> (address, size, segment, the stream it was allocated on, zoned).
        self._out: dict[int, tuple[int, int, _Segment, object, bool]] = {}
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
        ``Stream.ptr``): the piece is cached for that stream at its free (``free`` without a stream) and taken
        again by allocations on it, as metrale's own streams are. The allocator doors use it."""
        return self._front.pool_alloc(self, nbytes, None, foreign_stream)

    def free(self, buf: DeviceBuffer, *, stream: Stream | None = None) -> None:
        """Free a piece of this pool: off the ledger at once, cached for ``stream`` (the stream it was allocated
        on if ``None``): allocations on that stream take it again."""
        self._front.pool_free(self, buf, stream, "MemoryPool.free")

    def record_stream(self, buf: DeviceBuffer, foreign_stream: int) -> None:
        """Say that piece ``buf`` is used on another library's stream ``foreign_stream`` too (its raw handle; torch's
        ``Tensor.record_stream``): at its free it is cached for no stream, and taken again only after the pool's
        next wait for the device (a trim, a device-wide ``synchronize()``, an out-of-memory reclaim). Nothing for
        the stream it was allocated on."""
        self._front.pool_record(self, buf, foreign_stream)

    def trim(self, keep_bytes: int = 0) -> int:
        """Wait for the device, then give back whole free segments until at most ``keep_bytes`` stay cached;
        returns the bytes given back."""
        return self._front.pool_trim(self, keep_bytes)

    def stats(self) -> PoolStats:
        """The pool's counters now."""
        return self._front.pool_stats(self)

    def counters(self) -> PoolStats:
        """`stats`, read inside the gate (the allocator's call): a finalizer that a collection runs under the
        pool's lock then defers its free instead of waiting for the lock."""
        with self._lock:
            segments, segment_bytes, pieces = len(self._segments), self._segment_bytes, len(self._out)
            piece_bytes, cached, hits, misses, given = self._piece_bytes, self._cached, self._hits, self._misses, \
                self._given_back
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

    # -- the memory (the allocator's calls, inside the gate) ----------------------------------

    def take(self, size: int, stream: object, zoned: bool = False) -> tuple[int, object] | None:
        """A cached piece of ``size`` bytes for ``stream`` (or for any), or a new one carved from a shared segment
        with room; ``None`` where a new segment is needed (`add_segment`).

        A ``zoned`` allocation fills its zones on the default stream, which follows no other stream: it takes only
        a piece whose last use is known done (one freed with zones, whose check waited for the device, or one
        cached before a wait), never one freed without zones on a stream whose work may still run."""
        keys = ((stream, size, True), (None, size, True), (None, size, False)) if zoned else (
            (stream, size, False), (stream, size, True), (None, size, False), (None, size, True))
        with self._lock:
            for key in keys:
                cached = self._free.get(key)
                if cached:
                    ptr, segment, _ = cached.pop()
                    self._cached -= size
                    self._piece_bytes += size
                    self._hits += 1
                    segment.out += 1
                    return ptr, segment
            if size <= LARGE and self._small:
                segment = self._small[-1]
                if segment.used + size <= segment.nbytes:
                    return self._carve(segment, size)
            return None

    def segment_bytes(self, size: int) -> int:
        """The bytes of the segment a new piece of ``size`` needs."""
        return SEGMENT if size <= LARGE else size

    def add_segment(self, ptr: int, nbytes: int, size: int) -> tuple[int, object] | None:
        """A new segment from the driver, and the piece of ``size`` carved from it; ``None`` where the pool closed
        meanwhile (the caller gives the segment back)."""
        segment = _Segment(ptr, nbytes)
        with self._lock:
            if self._closed:
                return None
            self._segments[ptr] = segment
            self._segment_bytes += nbytes
            if size <= LARGE:
                self._small.append(segment)
            return self._carve(segment, size)

    def _carve(self, segment: _Segment, size: int) -> tuple[int, object]:
        ptr = segment.ptr + segment.used
        segment.used += size
        segment.out += 1
        self._misses += 1
        self._piece_bytes += size
        return ptr, segment

    def handed_out(self, index: int, ptr: int, size: int, segment: object, stream: object, zoned: bool = False) -> None:
        """The piece at ``ptr`` of ``segment`` (just taken) is allocation ``index``, allocated on ``stream``
        (``zoned``: with red zones)."""
        assert isinstance(segment, _Segment)
        with self._lock:
            self._out[index] = (ptr, size, segment, stream, zoned)

    def give(self, index: int, stream: object | None) -> None:
        """Allocation ``index`` is off the ledger: its piece cached for ``stream`` (its own if ``None``). Nothing
        where the pool closed meanwhile (its memory went with the segments)."""
        with self._lock:
            held = self._out.pop(index, None)
            if held is None:
                return
            ptr, size, segment, own, zoned = held
            self._cache(ptr, size, segment, own if stream is None or own is SHARED else stream, zoned)

    def strand_swept(self) -> None:
        """From now on a piece a sweep takes off the ledger stays out of the cache until the pool closes: its owner
        (a framework, which frees by address) may still use it, and a free of that address must never give back
        a piece handed out again since. The allocator doors ask for it."""
        with self._lock:
            self._strand = True

    def swept(self, index: int) -> None:
        """A sweep took allocation ``index`` off the ledger: back to the cache, or stranded (`strand_swept`: it
        stays in `_out`, its segment held until the pool closes)."""
        if not self._strand:  # (set once, as its door makes the pool: before any piece)
            self.give(index, None)

    def aim(self, index: int, stream: object) -> None:
        """Allocation ``index`` (freed, its zones waiting for their check) is to be cached for ``stream`` (not where
        it is used on another stream too: `share`)."""
        with self._lock:
            held = self._out.get(index)
            if held is not None and held[3] is not SHARED:
                self._out[index] = (held[0], held[1], held[2], stream, held[4])

    def share(self, index: int, stream: object) -> None:
        """Allocation ``index`` is used on ``stream`` too (`record_stream`): unless that is its own stream, its piece
        is cached for no stream at its free (`SHARED`)."""
        with self._lock:
            held = self._out.get(index)
            if held is not None and held[3] != stream:
                self._out[index] = (held[0], held[1], held[2], SHARED, held[4])

    def give_untaken(self, ptr: int, size: int, segment: object) -> None:
        """A piece taken for an allocation that did not commit: cached for any stream (nothing used it)."""
        assert isinstance(segment, _Segment)
        with self._lock:
            if not self._closed:
                self._cache(ptr, size, segment, None, False)

    def _cache(self, ptr: int, size: int, segment: _Segment, stream: object, zoned: bool) -> None:
        segment.out -= 1
        self._piece_bytes -= size
        self._free.setdefault((stream, size, zoned), []).append((ptr, segment, self._epoch))
        self._cached += size

    def out(self) -> list[int]:
        """The creation indexes of the pieces out now."""
        with self._lock:
            return list(self._out)

    def shut(self) -> bool:
        """Refuse every later commit (the caller holds the context's lock, under which allocations commit);
        ``False`` where it was shut already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def mark(self) -> int:
        """Before a wait for the device: the pieces cached so far are idle once it returns (`idle`, `release`)."""
        with self._lock:
            self._epoch += 1
            return self._epoch

    def idle(self, mark: int) -> None:
        """The wait that began at ``mark`` returned: the pieces cached before it serve any stream."""
        with self._lock:
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

    def release(self, keep_bytes: int, mark: int) -> list[tuple[int, int]]:
        """Take out whole segments none of whose pieces is out and all of whose cached pieces were cached before
        ``mark`` (a wait since), until at most ``keep_bytes`` stay cached; the caller gives back the
        ``(address, nbytes)`` returned and counts each one it could (`gave_back`)."""
        gone: list[tuple[int, int]] = []
        with self._lock:
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
        return gone

    def gave_back(self, nbytes: int) -> None:
        """The driver took back a segment of ``nbytes``."""
        with self._lock:
            self._given_back += nbytes

    def release_all(self) -> list[tuple[int, int]]:
        """At close (shut, no piece out any more): every segment."""
        with self._lock:
            gone = [(s.ptr, s.nbytes) for s in self._segments.values()]
            self._segments.clear()
            self._small.clear()
            self._free.clear()
            self._out.clear()
            self._cached = self._segment_bytes = self._piece_bytes = 0
            self._closed = True
        return gone
