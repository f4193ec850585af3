"""The pool front: a backend's memory pools, from `GpuBackend.create_pool` to `MemoryPool.close`.

Written once, here, and compiled as well as run as Python (``_pools``, with ``_pools.pxd``: docs/building.md);
compiled, an allocator door's common case (``MemoryPool.alloc_on`` and its free) runs at C level, the other parts
called at C level (their ``.pxd``), a piece's fields read in place (``_device/_fields.pxd``).

- `PoolFront` is what each [`MemoryPool`][metrale_core.MemoryPool] calls (``pool.PoolCalls``): it passes the gate,
  checks the arguments, and owns the ledger's side of a piece (its record, creation index and call site, its red
  zones, its stats, its release observers). The pool owns the memory (segments, pieces out, the cache).
- The commit of a piece: the ledger's (`Ledger.commit`: the backend is open now, or nothing of it remains, judged
  under the ledger's lock), then the pool's hand-out (`MemoryPool.handed_out`: the pool is open, and the record
  still on the ledger, judged under the pool's lock). Neither takes the context's lock.
- Its trimmer (`trim_for_memory`, raw memory's): out of memory, the pools give back their cache first. A zoned
  piece's free goes through the allocator's quarantine, and back to its pool once judged (`pieces_judged`); a sweep
  gives each swept piece back to its pool (`piece_swept`), or strands it (`MemoryPool.strand_swept`).
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._device.args import flag, integer, positive_size
from .._device.capture_record import may_wait
from .._device.context import DeviceContext
from .._errors import BackendClosedError, InvalidArgumentError, InvalidBufferError, MetraleError
from .._redzones.zone import too_big
from .._types import WORD_LIMIT, AllocRecord, format_bytes
from .holdings import Holdings
from .pool import PLAIN, ZONED, ZONED_ON_OWN  # (ints: compiled too, the pure module's)
from .poolstats import PoolStats
from .quarantine import Quarantine
from .rawmem import RawMemory
from .records import INDEXES, INDEXES_LOCK_FREE, describe_sites, largest_sites, next_index

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

if not cython.compiled:  # (compiled: what _pools.pxd cimports, a buffer as _fields.pxd lays it out)
    from .._device.buffer import DeviceBuffer
    from .._device.capture import forbid_during_capture
    from .._device.stats import KIND_POOL
    from .pool import MemoryPool, Segment, size_class
    from .sites import call_site

    make_buffer = DeviceBuffer._make

    def check_fields(lane: str) -> None:
        """(Compiled: refuse to load where the handles' fields are not where the front reads them in place.)"""

if TYPE_CHECKING:  # (as modules where _pools.pxd cimports the class)
    from .._device import stats as counters
    from .._device.handles import Stream
    from .._redzones.guard import ZoneGuard

__all__ = ["PoolFront", "StreamResolver"]

check_fields("pool front")
_log = logging.getLogger("metrale")

#: How a pool finds the stream an argument names (the stream front's rule), ``None`` naming the default stream.
StreamResolver = Callable[["Stream | None", str], "Stream"]

def _no_streams(stream: Stream | None, what: str) -> Stream:  # pragma: no cover - no pool before create_pool
    raise AssertionError(f"{what}: no pool was created")


def _foreign_handle(foreign: object, what: str) -> int:
    """Another library's stream handle (``foreign_stream``), or a typed error: an int from 0 to 2**64 - 1."""
    if type(foreign) is int and 0 <= foreign < WORD_LIMIT:  # (the common case)
        return foreign
    handle = integer(foreign, what, "foreign_stream")
    if handle >= WORD_LIMIT:
        raise InvalidArgumentError(f"{what}: foreign_stream must be a stream's handle (below 2**64), got {handle}")
    return handle


def _piece_of(buf: object, what: str) -> tuple[int, object, int, int]:
    """The creation index, owner, address and size of ``buf`` where it is a piece's handle; refused else."""
    if isinstance(buf, DeviceBuffer) and buf.kind == "pool":
        return buf.index, buf._owner, buf.ptr, buf.nbytes
    raise InvalidBufferError(f"{what}: expected a piece of a MemoryPool (a DeviceBuffer of kind 'pool'), got {buf!r}")


class PoolFront:
    """The memory pools of one backend: what their calls do, inside the gate."""

    __slots__ = ("_gate", "_guard", "_holdings", "_indexes", "_internal", "_ledger", "_lent", "_pool_of",
                 "_quarantine", "_raw", "_raw_base", "_ref", "_releases", "_resolve", "_stats", "_swept", "_trace_idx",
                 "_zoned", "_zones", "ctx", "site_at")

    def __init__(
        self, ctx: DeviceContext, holdings: Holdings, stats: counters.StatsCounter, guard: ZoneGuard,
        quarantine: Quarantine, raw: RawMemory, swept: collections.deque[AllocRecord],
        site_at: Callable[[object, str], str],
    ) -> None:
        self.ctx = ctx
        self._gate = ctx.gate
        self._holdings = holdings
        self._ledger = holdings.ledger
        self._pool_of = holdings.pool_of
        self._raw_base = holdings.raw_base
        self._releases = holdings.releases
        self._stats = stats
        self._guard = guard
        self._quarantine = quarantine
        self._raw = raw
        self._swept = swept  # the allocator's record of what sweeps took (a closed pool's leaks go there too)
        self._zones, self._zoned, self._lent = guard.zones, guard.zones.size > 0, guard.borrowed_streams.lent
        self._trace_idx = ctx.settings.redzone_trace_idx
        self._internal = ctx.internal
        self._ref = ctx.ref
        self._indexes = INDEXES if INDEXES_LOCK_FREE else None  # (its next item taken at C level, compiled)
        #: How a pool's calls find their stream (the stream front's rule: given at the first `create`).
        self._resolve: StreamResolver = _no_streams
        #: The call site a ``stacklevel`` names (the allocator's rule).
        self.site_at = site_at

    def create(self, release_threshold: object, resolve: StreamResolver, for_capture: object = False) -> MemoryPool:
        """``GpuBackend.create_pool``: a caching pool on this front's ledger (`MemoryPool`, of this front's build)."""
        forbid_during_capture("create_pool")
        threshold = integer(release_threshold, "create_pool", "release_threshold")
        capture = flag(for_capture, "create_pool", "for_capture")
        self._resolve = resolve
        pool = MemoryPool(self, threshold, self._raw.grow_relaxed if capture else self._raw.grow, capture)
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

    # -- allocation ---------------------------------------------------------------------------

    def pool_alloc(
        self, pool: MemoryPool, nbytes: object, stream: Stream | None, foreign: object = None, stacklevel: object = 1
    ) -> DeviceBuffer:
        """`MemoryPool.alloc` (``foreign`` ``None``) and `MemoryPool.alloc_on` (``foreign`` a stream's handle made
        by another library): a piece (cached or new) committed on the ledger as an allocation of its own."""
        what = "MemoryPool.alloc" if foreign is None else "MemoryPool.alloc_on"
        gate = self._gate
        cell = gate.enter_c(False)
        try:
            forbid_during_capture(what, cell.flag)
            if pool.closed:
                raise InvalidArgumentError(f"{what}: {pool!r} is closed; create another with create_pool()")
            n = nbytes if type(nbytes) is int and 0 < nbytes < WORD_LIMIT else positive_size(nbytes, what)
            # another library's stream: the piece's reuse is ordered on it, its handle the cache's key
            target = self._resolve(stream, what) if foreign is None else ("foreign", _foreign_handle(foreign, what))
            site = None if stacklevel == 1 and type(stacklevel) is int else self.site_at(stacklevel, what)
            index = next_index() if self._indexes is None else next(self._indexes)
            return self._piece(pool, n, target, foreign is not None, index, what, site)
        finally:
            gate.leave_c(cell)

    def _piece(
        self, pool: MemoryPool, n: int, target: object, foreign: bool, index: int, what: str, site: str | None
    ) -> DeviceBuffer:
        """`pool_alloc` once its arguments passed and its creation index was drawn: the piece, committed. Inside
        the gate. ``site``: a ``stacklevel``'s (`site_at`), else the first frame outside metrale and ``site_skip``."""
        if site is None:
            site = call_site(self._internal, 0 if cython.compiled else 1)  # (as Python: its own frame)
        layout = self._zones.layout(n, index) if self._zoned else None
        handle, own = target[1] if foreign else 0, None  # type: ignore[index]  # (a foreign stream; it, borrowed)
        if layout is None:
            zoned, fill, size = False, PLAIN, size_class(n)
        else:
            if layout.raw_bytes >= WORD_LIMIT:
                raise too_big(layout.raw_bytes, n, what)
            own = (self._lent.get(handle) or self._guard.borrowed_streams.get(handle)) if foreign else None  # (C dict)
            own = None if pool.for_capture else own  # (not on a stream it captures: now, on the default stream)
            zoned, fill, size = True, ZONED if own is None else ZONED_ON_OWN, size_class(layout.raw_bytes)
        ptr, segment, laid = pool.take(size, target, fill, n, what)
        if segment is None:  # the pool closed while it grew: its new segment goes back
            self._raw.release_quietly(ptr, "device")
            raise InvalidArgumentError(f"{what}: {pool!r} was closed meanwhile")
        if layout is None:
            buf = make_buffer(ptr, n, "pool", index, site, self._ref)
        else:
            buf = make_buffer(ptr + layout.lead, n, "pool", index, site, self._ref)
            try:
                if laid == n:  # its zones in place for this size: nothing to fill
                    self._zones.add_c(buf, index, ptr + layout.lead, n, False)
                else:  # filled on the borrowed stream, else on the default one, which the foreign one must follow
                    self._guard.lay(buf, layout, laid, own)
                    if foreign and own is None and not pool.for_capture:
                        self._guard.order_foreign(handle or 1)  # (0: the legacy default)
            except MetraleError:
                self._guard.forget(index)
                pool.give_untaken(ptr, size, segment, target)
                raise
        self._commit(pool, buf, index, ptr, size, segment, target, zoned, what)
        if self._trace_idx is not None and self._trace_idx == index:
            self._raw.trace(index, what, n, site)
        return buf

    def _commit(
        self, pool: MemoryPool, buf: DeviceBuffer, index: int, ptr: int, size: int, segment: Segment, target: object,
        zoned: bool, what: str,
    ) -> None:
        """The commit of piece ``buf``, without the context's lock: the ledger first, judged under its lock against
        the backend's close (`Ledger.commit`), then the pool's hand-out, judged under the pool's lock against its
        close. A close between finds the record on the ledger, not out of the pool: it leaves it, and the refused
        hand-out takes it back off. A sweep between takes the record: the hand-out makes of the piece what the sweep
        would have (cached, or stranded). Each of the holdings' items is one dict operation here (atomic)."""
        n = buf.nbytes
        self._pool_of[index] = pool
        if zoned:  # (before the record: a sweep that drains it finds its raw base)
            self._raw_base[index] = ptr
        self._stats.allocated_c(KIND_POOL, n)  # (before the record is out: a sweep's release never comes first)
        committed = None  # (an interrupt leaves it None: the record may be on the ledger, then the sweep's)
        try:
            committed = self._ledger.commit(index, buf, self._gate)
        except Exception:  # the history's event failed: nothing of it is on the ledger
            committed = False
            raise
        finally:
            if committed is False:  # (or refused at close)
                self._stats.released_c(KIND_POOL, n)
                self._untaken(pool, index, ptr, size, segment, target, zoned)
        if not committed:
            raise self.ctx.closed_error()
        if not pool.handed_out(index, ptr, size, segment, target, zoned, self._ledger, buf):  # (2: swept already)
            if self._ledger.take(index, buf.ptr, n) is not None:  # (None where the backend's sweep took it)
                self._stats.released_c(KIND_POOL, n)
            self._untaken(pool, index, ptr, size, segment, target, zoned)
            raise InvalidArgumentError(f"{what}: {pool!r} was closed meanwhile")

    def _untaken(
        self, pool: MemoryPool, index: int, ptr: int, size: int, segment: Segment, target: object, zoned: bool
    ) -> None:
        """A piece whose allocation did not commit: off the holdings, its zones unwatched, back to its pool."""
        self._pool_of.pop(index, None)
        if zoned:
            self._raw_base.pop(index, None)
            self._guard.forget(index)
        pool.give_untaken(ptr, size, segment, target)

    # -- release ------------------------------------------------------------------------------

    def pool_free(self, pool: MemoryPool, buf: object, stream: Stream | None, what: str) -> None:
        """`MemoryPool.free`; from a finalizer that a collection runs in a call of this backend, at the thread's
        next call (`Gate.defer`), as ``GpuBackend.free``."""
        gate = self._gate
        if gate.interrupted():
            gate.defer(functools.partial(self.pool_free, pool, stream=stream, what=what), buf)
            return
        cell = gate.enter_c(False)
        try:
            forbid_during_capture(what, cell.flag)
            self.free_piece(pool, buf, stream, what)
        finally:
            gate.leave_c(cell)

    def pool_record(self, pool: MemoryPool, buf: object, foreign: object) -> None:
        """`MemoryPool.record_stream`: a live piece of ``pool`` is used on another library's stream too."""
        what = "MemoryPool.record_stream"
        ctx = self.ctx
        ctx.enter()
        try:
            self._open_pool(pool, what)
            handle = _foreign_handle(foreign, what)
            index, owner, _, _ = _piece_of(buf, what)
            piece: DeviceBuffer = buf  # type: ignore[assignment]
            if (self._pool_of.get(index) if owner is self._ref else None) is not pool or not self._ledger.has(piece):
                raise InvalidBufferError(
                    f"{what}: allocation #{piece.index} ({piece.nbytes} bytes at {piece.ptr:#x}, from {piece.site}) is "
                    f"not a live piece of {pool!r}"
                )
            pool.share(index, ("foreign", handle))
        finally:
            ctx.leave()

    def free_piece(self, pool: MemoryPool | None, buf: object, stream: Stream | None, what: str) -> None:
        """Free a piece (of ``pool``, or of any pool of this backend): off the ledger, back to its pool, cached
        for ``stream``; refused, changing nothing, where it is no live piece (of ``pool``)."""
        handle = buf if type(buf) is DeviceBuffer else None  # (compiled: its fields read in place)
        if handle is not None and handle.kind == "pool":  # (the common case: the handle metrale made)
            index, owner, ptr, nbytes = handle.index, handle._owner, handle.ptr, handle.nbytes
        else:
            index, owner, ptr, nbytes = _piece_of(buf, what)
        piece: DeviceBuffer = buf  # type: ignore[assignment]
        held = self._pool_of.get(index) if owner is self._ref else None
        if held is not None and pool is not None and held is not pool:
            raise InvalidBufferError(
                f"{what}: allocation #{index} is a piece of another pool ({held!r}); free it with that "
                f"pool's free() or with GpuBackend.free()"
            )
        target = None if stream is None else self._resolve(stream, what)
        record = None if held is None else self._ledger.take(index, ptr, nbytes)
        if record is None:
            raise InvalidBufferError(
                f"{what}: allocation #{index} ({nbytes} bytes at {ptr:#x}, from {piece.site}) is not a "
                f"live piece of this backend's pools: already freed, swept, or not from this backend. Free each "
                f"piece once"
            )
        self.piece_taken(piece, record, target)

    def piece_taken(self, buf: DeviceBuffer, record: DeviceBuffer, stream: Stream | None) -> None:
        """A piece's record is off the ledger (``buf`` freed it): the stats, the observers, and its pool; a zoned
        piece goes to the quarantine first, and back to its pool once its zones were judged (`pieces_judged`)."""
        index = record.index
        raw_ptr = None
        if self._zoned:
            holdings = self._holdings
            with holdings.lock:
                pool = self._pool_of.pop(index)
                raw_ptr = self._raw_base.pop(index, None)
                if raw_ptr is not None:  # (in the same step: a pool's close finds it judging or still out)
                    holdings.judging[index] = pool
        else:  # (no piece has zones: one dict operation)
            pool = self._pool_of.pop(index)
        self._stats.released_c(KIND_POOL, record.nbytes)
        observers = self._releases.active
        if observers:
            for observer in observers:
                observer(buf)
        if raw_ptr is None:
            pool.give(index, stream)
            return
        if stream is not None:
            pool.aim(index, stream)
        self._quarantine.free(record, raw_ptr, "pool")

    def piece_swept(self, index: int) -> None:
        """Piece ``index`` was taken off the ledger by a sweep (its zones judged with the sweep's, or not at all):
        its zones unwatched, back to its pool."""
        with self._holdings.lock:
            pool = self._pool_of.pop(index, None)
            zoned = self._raw_base.pop(index, None) is not None
        if zoned:
            self._guard.forget(index)
        if pool is not None:
            pool.swept(index)

    def pieces_judged(self, pieces: list[tuple[int, int]]) -> None:
        """The quarantine let go of zoned ``pieces`` (``(index, laid)``: judged, or at close): back to their pools,
        zones in place where judged intact (``laid``: the size; else 0). A batch in one call, one hold of the lock."""
        judging = self._holdings.judging
        with self._holdings.lock:
            taken = [(judging.pop(index, None), index, laid) for index, laid in pieces]
        for pool, index, laid in taken:
            if pool is not None:
                pool.give(index, None, laid)

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
        self.ctx.enter()
        try:
            self._open_pool(pool, "MemoryPool.trim")
            return self._trim_pools(pool, integer(keep_bytes, "MemoryPool.trim", "keep_bytes"))
        finally:
            self.ctx.leave()

    def pool_capturing(self, pool: MemoryPool, underway: object) -> None:
        """`MemoryPool.capturing`: the quarantine defers its checks while another library's capture runs."""
        underway = flag(underway, "MemoryPool.capturing", "underway")
        self.ctx.enter()
        try:  # (its check at the capture's end, inside the gate; none while a capture of metrale's own runs)
            self._quarantine.defer(underway, may_wait())
        finally:
            self.ctx.leave()

    def trim_for_memory(self) -> bool:
        """Raw memory's trimmer, out of memory: no pool keeps anything cached (after a wait); whether any had."""
        if not any(pool.cached_bytes and not pool.for_capture for pool in list(self._holdings.pools)):
            return False
        self._trim_pools(None, 0)
        return True

    def _trim_pools(self, only: MemoryPool | None, keep: int | None, marks: dict[MemoryPool, int] | None = None) -> int:
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
            self._trim_pools(None, None, marks)

    # -- close ----------------------------------------------------------------------------------

    def pool_close(self, pool: MemoryPool) -> None:
        """`MemoryPool.close`: the pieces still out are swept (leaks), then the segments go back. A commit in
        flight is refused by the pool's hand-out once it is shut (`PoolFront._commit`)."""
        what = "MemoryPool.close"
        ctx = self.ctx
        ctx.enter()
        try:
            forbid_during_capture(what)
            if pool.shut():
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
