"""The pool front: a backend's memory pools, from `GpuBackend.create_pool` to `MemoryPool.close`.

- `PoolFront` is what each [`MemoryPool`][metrale_core.MemoryPool] calls (``pool.PoolCalls``): it passes the gate,
  checks the arguments, and owns the ledger's side of a piece (its record, creation index and call site, its red
  zones, its stats, its release observers). The pool owns the memory (segments, pieces out, the cache).
- New segments are raw memory (`rawmem.RawMemory`: reclaim-and-retry); the front registers its trimmer there, so an
  allocation that runs out of memory waits for the device and gives back what the pools cache before the
  ``on_out_of_memory`` callbacks are asked.
- A zoned piece's free goes through the allocator's quarantine, and back to its pool once its zones were judged
  (`piece_judged`); a sweep gives each swept piece back to its pool (`piece_swept`), or strands it
  (`MemoryPool.strand_swept`).
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from .._device.args import integer, positive_size
from .._device.buffer import DeviceBuffer
from .._device.capture import forbid_during_capture
from .._device.context import DeviceContext
from .._device.stats import StatsCounter
from .._errors import BackendClosedError, InvalidArgumentError, InvalidBufferError, MetraleError
from .._twins import pick
from .._types import WORD_LIMIT, AllocRecord, format_bytes
from .holdings import Holdings
from .pool import MemoryPool, PoolCalls, PoolStats, size_class
from .quarantine import Quarantine
from .rawmem import RawMemory
from .records import describe_sites, largest_sites, next_index
from .sites import call_site_for

if TYPE_CHECKING:
    from .._device.handles import Stream
    from .._redzones.guard import ZoneGuard
    from .._redzones.layout import Layout

__all__ = ["PoolFront", "StreamResolver", "fits"]

_log = logging.getLogger("metrale")

#: How a pool finds the stream an argument names (the stream front's rule), ``None`` naming the default stream.
StreamResolver = Callable[["Stream | None", str], "Stream"]

#: Whether this module runs as Python: then its own frame is metrale's, and the call site's walk starts past it.
_OWN_FRAME: Final = 1 if __file__.endswith(".py") else 0


def _no_streams(stream: Stream | None, what: str) -> Stream:  # pragma: no cover - no pool before create_pool
    raise AssertionError(f"{what}: no pool was created")


def fits(layout: Layout, n: int, what: str) -> None:
    """Refuse a zoned allocation of ``n`` bytes whose raw size, zones included, does not fit 64 bits."""
    if layout.raw_bytes >= WORD_LIMIT:
        raise InvalidArgumentError(
            f"{what}: {n} bytes and their red zones ({layout.raw_bytes} bytes in all) do not fit 64 bits "
            f"(CUDA's size_t): ask for less"
        )


def _foreign_handle(foreign: object, what: str) -> int:
    """Another library's stream handle (``foreign_stream``), or a typed error: an int from 0 to 2**64 - 1."""
    handle = integer(foreign, what, "foreign_stream")
    if handle >= WORD_LIMIT:
        raise InvalidArgumentError(f"{what}: foreign_stream must be a stream's handle (below 2**64), got {handle}")
    return handle


class PoolFront:
    """The memory pools of one backend: what their calls do, inside the gate."""

    __slots__ = ("_call_site", "_guard", "_holdings", "_make", "_pool_class", "_quarantine", "_raw", "_resolve",
                 "_stats", "_swept", "_trace_idx", "_zoned", "calls", "ctx", "site_at")

    def __init__(
        self, ctx: DeviceContext, holdings: Holdings, stats: StatsCounter, guard: ZoneGuard, quarantine: Quarantine,
        raw: RawMemory, swept: collections.deque[AllocRecord], site_at: Callable[[object, str], str],
    ) -> None:
        self.ctx = ctx
        self._holdings = holdings
        self._stats = stats
        self._guard = guard
        self._quarantine = quarantine
        self._raw = raw
        #: The allocator's record of what sweeps took (a closed pool's leaks go there too).
        self._swept = swept
        self._zoned = guard.zones.size > 0
        self._trace_idx = ctx.settings.redzone_trace_idx
        self._make = pick("handle", DeviceBuffer._make, ctx.settings.pure)
        self._call_site = call_site_for(ctx.settings.pure)
        #: How a pool's calls find their stream (the stream front's rule: given at the first `create`).
        self._resolve: StreamResolver = _no_streams
        #: The MemoryPool class this backend runs: the compiled twin where built and ``pure`` is off (chosen once).
        self._pool_class = pick("pool", MemoryPool, ctx.settings.pure)
        #: The call site a ``stacklevel`` names (the allocator's rule).
        self.site_at = site_at
        #: What the pools call: this front, or its compiled lane (the allocator sets it).
        self.calls: PoolCalls = self
        raw.add_trimmer(self._trim_for_memory)
        quarantine.give_pieces_to(self.piece_judged)

    def create(self, release_threshold: object, resolve: StreamResolver) -> MemoryPool:
        """``GpuBackend.create_pool``: a caching pool on this front's ledger (`MemoryPool`)."""
        forbid_during_capture("create_pool")
        threshold = integer(release_threshold, "create_pool", "release_threshold")
        self._resolve = resolve
        pool = self._pool_class(self.calls, threshold)
        with self.ctx.lock:
            if self.ctx.closed:
                raise self.ctx.closed_error()
            with self._holdings.lock:
                self._holdings.pools.append(pool)
        return pool

    def _open_pool(self, pool: MemoryPool, what: str) -> None:
        forbid_during_capture(what)
        if pool.closed:
            raise InvalidArgumentError(f"{what}: {pool!r} is closed; create another with create_pool()")

    def trace(self, index: int, what: str, n: int, site: str) -> None:
        """``redzone_trace_idx`` names allocation ``index``: log its whole stack."""
        self._raw.trace(index, what, n, site)

    # -- allocation ---------------------------------------------------------------------------

    def pool_alloc(
        self, pool: MemoryPool, nbytes: object, stream: Stream | None, foreign: object = None, stacklevel: object = 1
    ) -> DeviceBuffer:
        """`MemoryPool.alloc` (``foreign`` ``None``) and `MemoryPool.alloc_on` (``foreign`` a stream's handle made
        by another library): a piece (cached or new) committed on the ledger as an allocation of its own."""
        what = "MemoryPool.alloc" if foreign is None else "MemoryPool.alloc_on"
        ctx = self.ctx
        ctx.enter()
        try:
            self._open_pool(pool, what)
            n = positive_size(nbytes, what)
            # another library's stream: the piece's reuse is ordered on it, its handle the cache's key
            target = self._resolve(stream, what) if foreign is None else ("foreign", _foreign_handle(foreign, what))
            site = None if stacklevel == 1 and type(stacklevel) is int else self.site_at(stacklevel, what)
            return self.pool_piece(pool, n, target, foreign is not None, next_index(), what, site)
        finally:
            ctx.leave()

    def pool_piece(
        self, pool: MemoryPool, n: int, target: object, foreign: bool, index: int, what: str, site: str | None = None
    ) -> DeviceBuffer:
        """`pool_alloc` once its arguments passed and its creation index was drawn (the pool lane's twin hands it
        here for a piece that gets red zones): the piece, committed. Inside the gate. ``site``: a ``stacklevel``'s
        (`site_at`), else the first frame outside metrale and ``site_skip``."""
        ctx = self.ctx
        if site is None:
            site = self._call_site(ctx.internal, _OWN_FRAME)
        layout = self._guard.layout(n, index) if self._zoned else None
        if layout is not None:
            fits(layout, n, what)
        size = size_class(n if layout is None else layout.raw_bytes)
        taken = pool.take(size, target, layout is not None)
        if taken is None:
            taken = self.new_piece(pool, size, n, what, target, layout is not None)
        ptr, segment = taken
        if layout is None:
            buf = self._make(ptr, n, "pool", index, site, ctx.ref)
        else:
            buf = self._make(ptr + layout.lead, n, "pool", index, site, ctx.ref)
            try:
                self._guard.guard(buf, layout)  # filled on the default stream, which metrale's streams follow
                if foreign:  # another library's stream follows nothing of metrale's: order it
                    self._guard.order_foreign(target[1] or 1)  # type: ignore[index]  # (0: the legacy default)
            except MetraleError:
                self._guard.forget(index)
                pool.give_untaken(ptr, size, segment)
                raise
        holdings = self._holdings
        with ctx.lock:
            committed = not ctx.closed and not pool.closed
            if committed:
                with holdings.lock:
                    holdings.pool_of[index] = pool
                    if layout is not None:
                        holdings.raw_base[index] = ptr
                pool.handed_out(index, ptr, size, segment, target, layout is not None)
                holdings.ledger.add(buf)
                self._stats.allocated("pool", n)
        if not committed:
            if layout is not None:
                self._guard.forget(index)
            pool.give_untaken(ptr, size, segment)
            if ctx.closed:
                raise ctx.closed_error()
            raise InvalidArgumentError(f"{what}: {pool!r} was closed meanwhile")
        if self._trace_idx == index:
            self.trace(index, what, n, site)
        return buf

    def new_piece(
        self, pool: MemoryPool, size: int, n: int, what: str, target: object, zoned: bool
    ) -> tuple[int, object]:
        """A piece of ``size`` bytes (for ``n`` asked, for stream ``target``) in a new segment of ``pool``, with
        reclaim-and-retry: its address and its segment. Where the driver runs out of memory, the pools' trim waits
        for the device, and ``pool`` is asked again (`take`) before anything else. Inside the gate."""
        nbytes_segment = pool.segment_bytes(size)
        retaken: list[tuple[int, object]] = []

        def retake() -> bool:
            taken = pool.take(size, target, zoned)
            if taken is not None:
                retaken.append(taken)
            return taken is not None

        raw = self._raw.alloc(nbytes_segment, n, "device", what, retake=retake)
        if retaken:
            return retaken[0]
        taken = pool.add_segment(raw, nbytes_segment, size)
        if taken is None:  # the pool closed meanwhile
            self._raw.release_quietly(raw, "device")
            raise InvalidArgumentError(f"{what}: {pool!r} was closed meanwhile")
        return taken

    # -- release ------------------------------------------------------------------------------

    def pool_free(self, pool: MemoryPool, buf: object, stream: Stream | None, what: str) -> None:
        """`MemoryPool.free`; from a finalizer that a collection runs in a call of this backend, at the thread's
        next call (`Gate.defer`), as ``GpuBackend.free``."""
        ctx = self.ctx
        gate = ctx.gate
        if gate.interrupted():
            gate.defer(functools.partial(self.pool_free, pool, stream=stream, what=what), buf)
            return
        ctx.enter()
        try:
            forbid_during_capture(what)
            self.free_piece(pool, buf, stream, what)
        finally:
            ctx.leave()

    def _piece(self, buf: object, what: str) -> tuple[DeviceBuffer, MemoryPool | None]:
        """``buf`` as a piece's handle, and its pool on this backend (``None`` where it is no piece out now);
        refused where ``buf`` is no piece's handle at all."""
        if not isinstance(buf, DeviceBuffer) or buf.kind != "pool":
            raise InvalidBufferError(f"{what}: expected a piece of a MemoryPool (a DeviceBuffer of kind 'pool'), "
                                     f"got {buf!r}")
        holdings = self._holdings
        with holdings.lock:
            return buf, holdings.pool_of.get(buf.index) if buf._owner is self.ctx.ref else None

    def pool_record(self, pool: MemoryPool, buf: object, foreign: object) -> None:
        """`MemoryPool.record_stream`: a live piece of ``pool`` is used on another library's stream too."""
        what = "MemoryPool.record_stream"
        ctx = self.ctx
        ctx.enter()
        try:
            self._open_pool(pool, what)
            handle = _foreign_handle(foreign, what)
            piece, owner = self._piece(buf, what)
            if owner is not pool or not self._holdings.ledger.has(piece):
                raise InvalidBufferError(
                    f"{what}: allocation #{piece.index} ({piece.nbytes} bytes at {piece.ptr:#x}, from {piece.site}) is "
                    f"not a live piece of {pool!r}"
                )
            pool.share(piece.index, ("foreign", handle))
        finally:
            ctx.leave()

    def free_piece(self, pool: MemoryPool | None, buf: object, stream: Stream | None, what: str) -> None:
        """Free a piece (of ``pool``, or of any pool of this backend): off the ledger, back to its pool, cached
        for ``stream``; refused, changing nothing, where it is no live piece (of ``pool``)."""
        buf, owner = self._piece(buf, what)
        holdings = self._holdings
        if owner is not None and pool is not None and owner is not pool:
            raise InvalidBufferError(
                f"{what}: allocation #{buf.index} is a piece of another pool ({owner!r}); free it with that "
                f"pool's free() or with GpuBackend.free()"
            )
        target = None if stream is None else self._resolve(stream, what)
        record = None if owner is None else holdings.ledger.take(buf.index, buf.ptr, buf.nbytes)
        if record is None:
            raise InvalidBufferError(
                f"{what}: allocation #{buf.index} ({buf.nbytes} bytes at {buf.ptr:#x}, from {buf.site}) is not a "
                f"live piece of this backend's pools: already freed, swept, or not from this backend. Free each "
                f"piece once"
            )
        self.piece_taken(buf, record, target)

    def piece_taken(self, buf: DeviceBuffer, record: DeviceBuffer, stream: Stream | None) -> None:
        """A piece's record is off the ledger (``buf`` freed it): the stats, the observers, and its pool; a zoned
        piece goes to the quarantine first, and back to its pool once its zones were judged (`piece_judged`)."""
        holdings = self._holdings
        with holdings.lock:
            pool = holdings.pool_of.pop(record.index)
            raw_ptr = holdings.raw_base.pop(record.index, None)
            if raw_ptr is not None:  # (in the same step: a pool's close finds it judging or still out)
                holdings.judging[record.index] = pool
        self._stats.released("pool", record.nbytes)
        for observer in holdings.releases.active:
            observer(buf)
        if raw_ptr is None:
            pool.give(record.index, stream)
            return
        if stream is not None:
            pool.aim(record.index, stream)
        self._quarantine.free(record, raw_ptr, "pool")

    def piece_swept(self, index: int) -> None:
        """Piece ``index`` was taken off the ledger by a sweep (its zones judged with the sweep's, or not at all):
        its zones unwatched, back to its pool."""
        holdings = self._holdings
        with holdings.lock:
            pool = holdings.pool_of.pop(index, None)
            zoned = holdings.raw_base.pop(index, None) is not None
        if zoned:
            self._guard.forget(index)
        if pool is not None:
            pool.swept(index)

    def piece_judged(self, index: int) -> None:
        """The quarantine let go of zoned piece ``index`` (its zones judged, or at close): back to its pool."""
        with self._holdings.lock:
            pool = self._holdings.judging.pop(index, None)
        if pool is not None:
            pool.give(index, None)

    # -- the pools' memory --------------------------------------------------------------------

    def pool_stats(self, pool: MemoryPool) -> PoolStats:
        """`MemoryPool.stats`, inside the gate (it answers after a fault and once the pool closed)."""
        ctx = self.ctx
        try:
            ctx.enter(True)
        except BackendClosedError:  # the backend closed: its pools hold nothing any more
            return pool.counters()
        try:
            return pool.counters()
        finally:
            ctx.leave()

    def pool_trim(self, pool: MemoryPool, keep_bytes: object) -> int:
        """`MemoryPool.trim`."""
        what = "MemoryPool.trim"
        ctx = self.ctx
        ctx.enter()
        try:
            self._open_pool(pool, what)
            keep = integer(keep_bytes, what, "keep_bytes")
            return self._trim_pools(pool, keep)
        finally:
            ctx.leave()

    def _trim_for_memory(self) -> bool:
        """The trimmer raw memory runs when an allocation runs out of memory: every pool keeps nothing cached (after
        a wait for the device); whether any had something cached."""
        if not any(pool.cached_bytes for pool in list(self._holdings.pools)):
            return False
        self._trim_pools(None, 0)
        return True

    def _trim_pools(
        self, only: MemoryPool | None, keep: int | None, *, marks: dict[MemoryPool, int] | None = None
    ) -> int:
        """Wait for the device, then give back the free segments of ``only`` (or of every pool) beyond ``keep``
        cached bytes (``None``: each pool's ``release_threshold``); the bytes given back. ``marks``: the wait was
        made already (a ``synchronize()``), after each pool's mark."""
        pools = [only] if only is not None else list(self._holdings.pools)
        if marks is None:
            if not any(pool.cached_bytes for pool in pools):
                return 0
            marks = {pool: pool.mark() for pool in pools}
            self.ctx.raw.synchronize()  # nothing queued before it uses what was cached: any stream may reuse it
        given = 0
        for pool in pools:
            mark = marks.get(pool)
            if mark is None:  # created since the marks were taken
                continue
            pool.idle(mark)
            for ptr, nbytes in pool.release(pool.release_threshold if keep is None else keep, mark):
                given += self._give_segment(pool, ptr, nbytes)
        return given

    def _give_segment(self, pool: MemoryPool, ptr: int, nbytes: int) -> int:
        """A pool's segment back to the driver; the bytes it took back (0 where the release failed: logged)."""
        if not self.ctx.quietly(f"free a memory pool's segment at {ptr:#x}", self.ctx.raw.free, ptr, "device"):
            return 0
        pool.gave_back(nbytes)
        return nbytes

    def mark(self) -> dict[MemoryPool, int]:
        """Before a device-wide ``synchronize()``: each pool's mark (`synchronized`)."""
        return {pool: pool.mark() for pool in list(self._holdings.pools)}

    def synchronized(self, marks: dict[MemoryPool, int]) -> None:
        """A device-wide ``synchronize()`` that began after ``marks`` returned: every pool keeps at most its
        ``release_threshold`` cached."""
        if marks:
            self._trim_pools(None, None, marks=marks)

    # -- close ----------------------------------------------------------------------------------

    def pool_close(self, pool: MemoryPool) -> None:
        """`MemoryPool.close`: the pieces still out are swept (leaks), then the segments go back."""
        what = "MemoryPool.close"
        ctx = self.ctx
        ctx.enter()
        try:
            forbid_during_capture(what)
            with ctx.lock:  # allocations commit under this lock: none commits into the pool after this
                if not pool.shut():
                    return
            self._close(pool, what)
        finally:
            ctx.leave()

    def _close(self, pool: MemoryPool, what: str) -> None:
        ctx = self.ctx
        holdings = self._holdings
        out = set(pool.out())
        leaks = [rec for rec in holdings.ledger.snapshot() if rec.index in out]
        taken = []
        for rec in leaks:
            buf = holdings.ledger.take(rec.index, rec.ptr, rec.nbytes)
            if buf is not None:
                taken.append(rec)
                self._stats.released("pool", rec.nbytes)
        with holdings.lock:
            judging = any(owner is pool for owner in holdings.judging.values())
        read = True
        if self._zoned and (judging or taken):
            # the pool's freed zoned pieces and its leaks' zones are judged before their memory goes. A read
            # that fails is logged: then the freed pieces stay in the quarantine (a later check judges them),
            # the leaks' zones stay watched (every later scan judges them), and the pool keeps its segments
            # until the backend closes
            with self._guard.lock:
                also = [zone for rec in taken for zone in self._guard.zones.zones_of(rec.index)]
            read = self._quarantine.drain(what, may_raise=False, also=also)
        if read:
            for rec in taken:
                self.piece_swept(rec.index)
        if taken:
            _log.warning(
                "MemoryPool.close on %s:%d: %d piece(s) totalling %s were still out; largest sites: %s",
                ctx.name, ctx.ordinal, len(taken), format_bytes(sum(r.nbytes for r in taken)),
                describe_sites(largest_sites(taken)),
            )
            self._swept.extend(taken)
        with holdings.lock:
            unjudged = not read or any(owner is pool for owner in holdings.judging.values())
            if pool in holdings.pools and not unjudged:
                holdings.pools.remove(pool)
        if unjudged:  # zones still watched over its memory: the backend's close releases it, after its scan
            _log.warning("MemoryPool.close on %s:%d: the red zones of its pieces could not be read; they stay "
                         "watched, and the pool's segments stay held until the backend closes",
                         ctx.name, ctx.ordinal)
            return
        ctx.quietly("synchronize before a pool's segments go", ctx.raw.synchronize)
        for ptr, nbytes in pool.release_all():
            self._give_segment(pool, ptr, nbytes)

    def release(self) -> None:
        """At the backend's close, after its sweep gave every piece back: every pool's segments go."""
        holdings = self._holdings
        with holdings.lock:
            pools, holdings.pools = holdings.pools, []
        for pool in pools:
            pool.shut()
            for ptr, nbytes in pool.release_all():
                self._give_segment(pool, ptr, nbytes)
