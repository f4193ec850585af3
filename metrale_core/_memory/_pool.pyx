# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`MemoryPool`][metrale_core.MemoryPool] (``pool.py``): the same interface and behaviour,
its counters in C integers under a C-level lock (``_device/_lock.pxd``).

- The pure class is the reference and the public class: this one registers itself as its virtual subclass
  (``MemoryPool.register``), so ``isinstance(x, metrale_core.MemoryPool)`` holds, and is named ``MemoryPool`` too.
  `_twins.pick("pool", MemoryPool, pure)` chooses, once per backend.
- The compiled pool lane (``_pool_lane.pyx``) takes, hands out and gives pieces through the C-level door
  (``_pool.pxd``: `take_c`, `handed_out_c`, `give_c`), without a Python call; everything else is the pure class's
  work written out, in its order, under the lock.
- The cache is the pure class's: (stream, size, zoned) -> [(address, segment, epoch at the free)], in dicts.
"""

cimport cython

from metrale_core._device._lock cimport acquire, release
from metrale_core._memory._ledger cimport Ledger

from .pool import HUGE as _HUGE
from .pool import LARGE as _LARGE
from .pool import SEGMENT as _SEGMENT
from .pool import MemoryPool as _MemoryPool
from .pool import SHARED as _SHARED
from .pool import PoolStats as _PoolStats

cdef long long LARGE_C = _LARGE
cdef object HUGE = _HUGE  # (`take` answers ``None`` from it up: the driver refuses the segment)
cdef long long SEGMENT_C = _SEGMENT


cdef class _Segment:
    """A segment from the driver: its address, its bytes, the bytes carved and the pieces out."""

    def __init__(self, ptr, long long nbytes):
        self.ptr = ptr
        self.nbytes = nbytes
        self.used = 0
        self.out = 0


cdef class MemoryPool:
    """A caching pool of device memory on the ledger (compiled twin of [`MemoryPool`][metrale_core.MemoryPool],
    registered as its subclass)."""

    def __init__(self, front, release_threshold):
        self._front = front
        self._closed = False
        self._segments = {}
        self._small = []
        self._free = {}
        self._out = {}
        self._epoch = 0
        self._cached = self._hits = self._misses = self._given_back = self._segment_bytes = self._piece_bytes = 0
        self._threshold = release_threshold
        self._strand = False

    # -- the public face --------------------------------------------------------------------

    def alloc(self, nbytes, *, stream=None, stacklevel=1):
        """A piece of ``nbytes`` bytes (a cached one freed on ``stream``, or a new one), on the ledger with the
        caller's site (``stacklevel`` as `GpuBackend.alloc`'s); ``stream`` (the default stream if ``None``) is where
        its first use is ordered."""
        return self._front.pool_alloc(self, nbytes, stream, None, stacklevel)

    def alloc_on(self, nbytes, foreign_stream):
        """As `alloc`, for a stream another library made (its raw handle): the piece is cached for that stream at
        its free and taken again by allocations on it. The allocator doors use it."""
        return self._front.pool_alloc(self, nbytes, None, foreign_stream)

    def free(self, buf, *, stream=None):
        """Free a piece of this pool: off the ledger at once, cached for ``stream`` (the stream it was allocated
        on if ``None``)."""
        self._front.pool_free(self, buf, stream, "MemoryPool.free")

    def record_stream(self, buf, foreign_stream):
        """Say that piece ``buf`` is used on another library's stream ``foreign_stream`` too: at its free it is
        cached for no stream, and taken again only after the pool's next wait for the device."""
        self._front.pool_record(self, buf, foreign_stream)

    def trim(self, keep_bytes=0):
        """Wait for the device, then give back whole free segments until at most ``keep_bytes`` stay cached;
        returns the bytes given back."""
        return self._front.pool_trim(self, keep_bytes)

    def stats(self):
        """The pool's counters now."""
        return self._front.pool_stats(self)

    def counters(self):
        """`stats`, read inside the gate (the allocator's call)."""
        acquire(&self._lock)
        try:
            segments, segment_bytes, pieces = len(self._segments), self._segment_bytes, len(self._out)
            piece_bytes, cached, hits, misses, given = (self._piece_bytes, self._cached, self._hits, self._misses,
                                                        self._given_back)
        finally:
            release(&self._lock)
        return _PoolStats(segments, segment_bytes, pieces, piece_bytes, cached, hits, misses, given, self._threshold)

    @property
    def release_threshold(self):
        """The cached bytes a device-wide ``synchronize()`` leaves in the pool."""
        return self._threshold

    @property
    def cached_bytes(self):
        """Bytes of the pieces cached now."""
        return self._cached

    @property
    def closed(self):
        return self._closed

    def close(self):
        """Release the pool: pieces still out are swept (each a leak, named in a warning), and every segment goes
        back to the driver. Idempotent."""
        if not self._closed:
            self._front.pool_close(self)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()

    def __repr__(self):
        state = "closed" if self._closed else f"{len(self._out)} pieces out, {self._cached} bytes cached"
        return f"<MemoryPool {state}>"

    # -- the memory (the allocator's and the lane's calls, inside the gate) -------------------

    def take(self, size, stream, zoned=False):
        """A cached piece of ``size`` bytes for ``stream`` (or for any), or a new one carved from a shared segment
        with room; ``None`` where a new segment is needed (`add_segment`)."""
        if size >= HUGE:
            return None
        return self.take_c(size, stream, zoned)

    cdef object take_c(self, long long size, object stream, bint zoned):
        cdef _Segment segment
        if zoned:
            keys = ((stream, size, True), (None, size, True), (None, size, False))
        else:
            keys = ((stream, size, False), (stream, size, True), (None, size, False), (None, size, True))
        acquire(&self._lock)
        try:
            for key in <tuple>keys:
                cached = self._free.get(key)
                if cached:
                    ptr, segment, _ = (<list>cached).pop()
                    self._cached -= size
                    self._piece_bytes += size
                    self._hits += 1
                    segment.out += 1
                    return ptr, segment
            if size <= LARGE_C and self._small:
                segment = self._small[-1]
                if segment.used + size <= segment.nbytes:
                    return self._carve(segment, size)
            return None
        finally:
            release(&self._lock)

    def segment_bytes(self, size):
        """The bytes of the segment a new piece of ``size`` needs."""
        return SEGMENT_C if size <= LARGE_C else size

    def add_segment(self, ptr, nbytes, size):
        """A new segment from the driver, and the piece of ``size`` carved from it; ``None`` where the pool closed
        meanwhile (the caller gives the segment back)."""
        cdef _Segment segment = _Segment(ptr, nbytes)
        acquire(&self._lock)
        try:
            if self._closed:
                return None
            self._segments[ptr] = segment
            self._segment_bytes += segment.nbytes
            if size <= LARGE_C:
                self._small.append(segment)
            return self._carve(segment, size)
        finally:
            release(&self._lock)

    cdef tuple _carve(self, _Segment segment, long long size):
        ptr = segment.ptr + segment.used
        segment.used += size
        segment.out += 1
        self._misses += 1
        self._piece_bytes += size
        return ptr, segment

    def handed_out(self, index, ptr, size, segment, stream, zoned=False):
        """The piece at ``ptr`` of ``segment`` (just taken) is allocation ``index``, allocated on ``stream``
        (``zoned``: with red zones)."""
        if not isinstance(segment, _Segment):
            raise TypeError(f"handed_out: {segment!r} is no segment of a compiled pool")
        acquire(&self._lock)  # (the allocator's commit, under the context's lock: never after a close)
        try:
            self._out[index] = (ptr, size, segment, stream, zoned)
        finally:
            release(&self._lock)

    cdef int handed_out_c(self, object index, object ptr, long long size, _Segment segment, object stream,
                          bint zoned, Ledger ledger, object buf) except -1:
        """`handed_out` for the compiled lane, which commits without the context's lock, ledger first: ``1``;
        ``0`` with nothing changed where the pool closed (shut) meanwhile; ``2`` where the record of ``buf`` left
        the ledger meanwhile (a sweep, or a free of a record it listed): the piece is then what that sweep would
        have made of it (`swept`), cached or stranded. Judged under the pool's lock, which every taker of a record
        takes only after the ledger let go of it (`give`, `swept`)."""
        acquire(&self._lock)
        try:
            if self._closed:
                return 0
            if not ledger.has_index(index, buf):
                if self._strand:
                    self._out[index] = (ptr, size, segment, stream, zoned)
                else:
                    self._cache(ptr, size, segment, stream, zoned)
                return 2
            self._out[index] = (ptr, size, segment, stream, zoned)
        finally:
            release(&self._lock)
        return 1

    def give(self, index, stream):
        """Allocation ``index`` is off the ledger: its piece cached for ``stream`` (its own if ``None``). Nothing
        where the pool closed meanwhile (its memory went with the segments)."""
        self.give_c(index, stream)

    cdef int give_c(self, object index, object stream) except -1:
        acquire(&self._lock)
        try:
            held = self._out.pop(index, None)
            if held is None:
                return 0
            ptr, size, segment, own, zoned = <tuple>held
            self._cache(ptr, size, segment, own if stream is None or own is _SHARED else stream, zoned)
        finally:
            release(&self._lock)
        return 0

    def strand_swept(self):
        """From now on a piece a sweep takes off the ledger stays out of the cache until the pool closes."""
        acquire(&self._lock)
        self._strand = True
        release(&self._lock)

    def swept(self, index):
        """A sweep took allocation ``index`` off the ledger: back to the cache, or stranded (`strand_swept`)."""
        if not self._strand:
            self.give_c(index, None)

    def aim(self, index, stream):
        """Allocation ``index`` (freed, its zones waiting for their check) is to be cached for ``stream``."""
        acquire(&self._lock)
        try:
            held = self._out.get(index)
            if held is not None and held[3] is not _SHARED:
                self._out[index] = (held[0], held[1], held[2], stream, held[4])
        finally:
            release(&self._lock)

    def share(self, index, stream):
        """Allocation ``index`` is used on ``stream`` too: unless that is its own stream, its piece is cached for no
        stream at its free."""
        acquire(&self._lock)
        try:
            held = self._out.get(index)
            if held is not None and held[3] != stream:
                self._out[index] = (held[0], held[1], held[2], _SHARED, held[4])
        finally:
            release(&self._lock)

    def give_untaken(self, ptr, size, segment):
        """A piece taken for an allocation that did not commit: cached for any stream (nothing used it)."""
        if not isinstance(segment, _Segment):
            raise TypeError(f"give_untaken: {segment!r} is no segment of a compiled pool")
        acquire(&self._lock)
        try:
            if not self._closed:
                self._cache(ptr, size, segment, None, False)
        finally:
            release(&self._lock)

    cdef void _cache(self, object ptr, long long size, _Segment segment, object stream, bint zoned) except *:
        segment.out -= 1
        self._piece_bytes -= size
        key = (stream, size, zoned)
        cached = self._free.get(key)
        if cached is None:
            self._free[key] = [(ptr, segment, self._epoch)]
        else:
            (<list>cached).append((ptr, segment, self._epoch))
        self._cached += size

    def out(self):
        """The creation indexes of the pieces out now."""
        acquire(&self._lock)
        try:
            return list(self._out)
        finally:
            release(&self._lock)

    def shut(self):
        """Refuse every later commit; ``False`` where it was shut already."""
        acquire(&self._lock)
        try:
            if self._closed:
                return False
            self._closed = True
            return True
        finally:
            release(&self._lock)

    def mark(self):
        """Before a wait for the device: the pieces cached so far are idle once it returns."""
        acquire(&self._lock)
        self._epoch += 1
        epoch = self._epoch
        release(&self._lock)
        return epoch

    def idle(self, mark):
        """The wait that began at ``mark`` returned: the pieces cached before it serve any stream."""
        acquire(&self._lock)
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
            release(&self._lock)

    def release(self, keep_bytes, mark):
        """Take out whole segments none of whose pieces is out and all of whose cached pieces were cached before
        ``mark``, until at most ``keep_bytes`` stay cached; the ``(address, nbytes)`` taken out."""
        cdef _Segment segment
        gone = []
        acquire(&self._lock)
        try:
            busy = {id(p[1]) for pieces in self._free.values() for p in pieces if p[2] >= mark}
            for segment in [s for s in self._segments.values() if (<_Segment>s).out == 0 and id(s) not in busy]:
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
            release(&self._lock)
        return gone

    def gave_back(self, nbytes):
        """The driver took back a segment of ``nbytes``."""
        acquire(&self._lock)
        self._given_back += nbytes
        release(&self._lock)

    def release_all(self):
        """At close (shut, no piece out any more): every segment."""
        cdef _Segment segment
        acquire(&self._lock)
        try:
            gone = [(segment.ptr, segment.nbytes) for segment in self._segments.values()]
            self._segments.clear()
            self._small.clear()
            self._free.clear()
            self._out.clear()
            self._cached = self._segment_bytes = self._piece_bytes = 0
            self._closed = True
        finally:
            release(&self._lock)
        return gone


_MemoryPool.register(MemoryPool)
