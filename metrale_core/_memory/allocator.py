"""The allocator: device, managed, arena and pinned host memory of one backend, from the raw
call to the ledger and back, and the sweep.

It owns the front of the ledger (a record on before ``alloc`` returns, off before ``free``
releases), arena blocks and [`Arena`][metrale_core.Arena] objects, host buffers, and the
sweep. What it hands out it records in `Holdings`. Red zones are the zone guard's, asked for by the
allocator; freed zoned blocks wait in its `Quarantine`. Its parts:

- `RawMemory` (``rawmem.py``): the driver's allocations with reclaim-and-retry (the quarantine drained, the pools
  trimmed, the ``on_out_of_memory`` callbacks) and the out-of-memory report;
- `PoolFront` (``pools.py``): the memory pools, from ``create_pool`` to ``MemoryPool.close``.

Nothing it makes outlives ``close()``: an allocation finishes by committing its record under
the context's lock, and one that finds the backend closed by then (a callback closed it, or
another thread's ``close()`` waited for it) releases its memory and raises
[`BackendClosedError`][metrale_core.BackendClosedError] instead.
"""

from __future__ import annotations

import collections
import functools
import logging
import sys
from typing import TYPE_CHECKING, Final

from .._device.args import invalid_argument, positive_size
from .._device.buffer import DeviceBuffer
from .._device.capture import forbid_during_capture
from .._device.context import DeviceContext
from .._device.guarded import raise_raw
from .._device.handles import HostBuffer
from .._device.stats import StatsCounter
from .._errors import InvalidBufferError, MetraleError, OutOfMemoryError
from .._redzones.layout import Layout, Zone
from .._twins import pick
from .._types import WORD_LIMIT, AllocKind, AllocRecord, format_bytes
from .arena import Arena, ArenaZones
from .holdings import Holdings
from .lane import LaneParts, ZonedParts
from .pools import PoolFront, fits
from .quarantine import Quarantine
from .rawmem import RawMemory
from .records import describe_sites, largest_sites, next_index
from .sites import call_site_at, call_site_for

if TYPE_CHECKING:
    from .._redzones.guard import ZoneGuard
    from .monitor import MemoryMonitor

__all__ = ["Allocator"]

_log = logging.getLogger("metrale")

#: How many of the records sweeps took an allocator keeps for `GpuBackend.ledger_report` (the newest).
SWEPT_KEPT: Final = 10_000

#: Whether this module runs as Python (``dev.py accelerate`` compiles it): then ``alloc``'s own frame is
#: metrale's, and the call site's walk starts past it.
_OWN_FRAME: Final = 1 if __file__.endswith(".py") else 0


class Allocator:
    """Memory of one backend: allocation, release, arenas, host buffers, sweep; its raw memory and its pools."""

    __slots__ = (
        "_arena_class",
        "_call_site",
        "_guard",
        "_holdings",
        "_make",
        "_quarantine",
        "_raw",
        "_releases",
        "_stats",
        "_trace_idx",
        "_zeroes",
        "_zoned",
        "ctx",
        "pools",
        "raw",
        "swept",
    )

    def __init__(
        self, ctx: DeviceContext, holdings: Holdings, stats: StatsCounter, guard: ZoneGuard, monitor: MemoryMonitor
    ) -> None:
        self.ctx = ctx
        self._raw = ctx.raw
        self._holdings = holdings
        self._stats = stats
        self._guard = guard
        self._quarantine: Quarantine = pick("quarantine", Quarantine, ctx.settings.pure)(ctx, stats, guard)
        guard.watch_blocks(self._arena_blocks)  # a piece's suspects: the kernels that took any of its block
        #: The release observers switched on (the fronts' own switches), read at each release.
        self._releases = holdings.releases
        #: What sweeps took since the backend opened (the leaks), the last `SWEPT_KEPT` of them.
        self.swept: collections.deque[AllocRecord] = collections.deque(maxlen=SWEPT_KEPT)
        #: Whether device allocations may get red zones at all (the setting is fixed for the backend's life).
        self._zoned = guard.zones.size > 0
        self._trace_idx = ctx.settings.redzone_trace_idx  # (fixed too)
        #: Whether a recycled block is zeroed before a new allocation takes it (fresh memory reads as zeros).
        self._zeroes = bool(ctx.raw.fresh_memory_reads_zeros())
        #: The Arena class this backend runs: the compiled twin where built and ``pure`` is off (chosen once).
        self._arena_class = pick("arena", Arena, ctx.settings.pure)
        #: How it builds a handle: ``DeviceBuffer._make``, or its compiled twin (chosen once, as the arena's class).
        self._make = pick("handle", DeviceBuffer._make, ctx.settings.pure)
        #: How it finds an allocation's call site: ``ledger.call_site``, or its compiled twin.
        self._call_site = call_site_for(ctx.settings.pure)
        #: Raw memory: the driver's allocations with reclaim-and-retry, and the out-of-memory report.
        self.raw = RawMemory(ctx, holdings, stats, guard, self._quarantine, monitor)
        #: The memory pools: the pool front, compiled where built and ``pure`` is off (chosen once, as the arena's
        #: class); its trimmer runs when raw memory runs out, and the quarantine gives its zoned pieces back to it.
        self.pools = pick("pool_front", PoolFront, ctx.settings.pure)(
            ctx, holdings, stats, guard, self._quarantine, self.raw, self.swept, self.site_at
        )
        self.raw.add_trimmer(self.pools.trim_for_memory)
        self._quarantine.give_pieces_to(self.pools.piece_judged)

    def lane_parts(self) -> LaneParts:
        """What the backend's lane (``GpuBackend.alloc`` and ``free``) uses of this allocator's parts."""
        guard = self._guard
        zoning = ZonedParts(
            guard, guard.zones, self._quarantine, self._holdings.raw_base, guard.fill_stream, self._zeroes
        ) if self._zoned else None
        holdings = self._holdings
        return LaneParts(self.ctx, holdings.ledger, self._stats, self._releases, self._trace_idx, zoning,
                         pool_of=holdings.pool_of)

    def _released(self, buf: DeviceBuffer) -> None:
        for observer in self._releases.active:
            observer(buf)

    # -- allocation ---------------------------------------------------------------------------

    def alloc(self, nbytes: object, kind: AllocKind, what: str, site: str | None = None) -> DeviceBuffer:
        """Device memory of ``kind``; on the ledger unless it is arena memory. ``site``: the caller's own choice
        (`site_at`), else the first frame outside metrale and ``site_skip``."""
        forbid_during_capture(what)
        # the size rule (positive_size) with its common case written out: a hot path
        n = nbytes if type(nbytes) is int and 0 < nbytes < WORD_LIMIT else positive_size(nbytes, what)
        ctx = self.ctx
        index = next_index()
        if site is None:
            site = self._call_site(ctx.internal, _OWN_FRAME)
        layout = self._guard.layout(n, index) if kind == "device" and self._zoned else None
        if layout is None:
            try:  # the raw call straight to the plugin, with the guarded layer's rule for its errors
                raw_ptr = ctx.plugin.alloc(n, kind)
            except OutOfMemoryError as exc:
                raw_ptr = self.retry_alloc(n, kind, what, exc)
            except Exception as exc:
                raise_raw(ctx, ctx.name, "alloc", exc)
            buf = self._make(raw_ptr, n, kind, index, site, ctx.ref)
        else:
            raw_ptr, recycled = self._zoned_alloc(layout, n, what)
            buf = self._make(raw_ptr + layout.lead, n, kind, index, site, ctx.ref)
            try:
                self._guard.guard(buf, layout, zero=recycled and self._zeroes)
            except MetraleError:
                self.release_quietly(raw_ptr, kind)
                raise
        holdings = self._holdings
        with ctx.lock:  # the commit: the backend is open now, or nothing of this allocation remains
            committed = not ctx.closed
            if committed:
                if layout is not None:
                    holdings.raw_base[index] = raw_ptr
                if kind == "arena":
                    holdings.arena_blocks[index] = buf
                else:
                    holdings.ledger.add(buf)
                self._stats.allocated(kind, n)
        if not committed:
            if layout is not None:
                self._guard.forget(index)
            self.release_quietly(raw_ptr, kind)
            raise ctx.closed_error()
        if self._trace_idx == index:
            self.trace(index, what, n, site)
        return buf

    def _arena_site_at(self, stacklevel: object) -> str:
        return self.site_at(stacklevel, "Arena.alloc")

    def site_at(self, stacklevel: object, what: str) -> str:
        """The call site an allocating call's ``stacklevel`` names (`call_site_at`); a bad one is refused."""
        if isinstance(stacklevel, bool) or not isinstance(stacklevel, int) or stacklevel < 1:
            raise invalid_argument(what, "a stacklevel of at least 1 (an int)", stacklevel)
        return call_site_at(self.ctx.internal, min(stacklevel, sys.maxsize))

    def zoned_raw(self, raw_bytes: int, n: int) -> int:
        """The raw memory of a zoned device allocation of ``n`` bytes that no kept block serves (the lane's)."""
        return self.raw.alloc(raw_bytes, n, "device", "alloc")

    def retry_alloc(self, n: int, kind: AllocKind, what: str, failed: OutOfMemoryError) -> int:
        """The raw allocation of ``n`` bytes whose first try (the caller's) ran out of memory: reclaim-and-retry."""
        return self.raw.alloc(n, n, kind, what, failed)

    def release_quietly(self, raw_ptr: int, kind: AllocKind) -> None:
        """Give back the raw memory of an allocation that cannot be committed."""
        self.raw.release_quietly(raw_ptr, kind)

    def trace(self, index: int, what: str, n: int, site: str) -> None:
        """``redzone_trace_idx`` names allocation ``index``: log its whole stack."""
        self.raw.trace(index, what, n, site)

    def piece_taken(self, buf: DeviceBuffer, record: DeviceBuffer, stream: object) -> None:
        """A pool piece's record is off the ledger (an equal handle freed it): back to its pool."""
        self.pools.piece_taken(buf, record, None)

    def _zoned_alloc(self, layout: Layout, n: int, what: str) -> tuple[int, bool]:
        """The raw memory of a zoned device allocation, and whether it is recycled: a checked block kept
        for reuse, or a new one from the driver (``False``)."""
        fits(layout.raw_bytes, n, what)
        reused = self._quarantine.reuse(layout)
        if reused is not None:
            return reused, True
        return self.raw.alloc(layout.raw_bytes, n, "device", what), False

    def alloc_host(self, nbytes: object) -> HostBuffer:
        """Pinned host memory, in a table of its own (not on the ledger)."""
        forbid_during_capture("alloc_host")
        n = positive_size(nbytes, "alloc_host")
        try:
            ptr, view = self._raw.alloc_host(n)
        except OutOfMemoryError as exc:
            raise OutOfMemoryError(
                f"alloc_host({n}) failed: out of pinned host memory; free host buffers or ask for less",
                requested=n, code=exc.code, name=exc.name,
            ) from None
        hb = HostBuffer(self, ptr, n, view)
        with self.ctx.lock:
            if not self.ctx.closed:
                self._holdings.host[id(hb)] = hb
                return hb
        self.ctx.quietly("free host buffer", self._raw.free_host, ptr)
        raise self.ctx.closed_error()

    # -- release --------------------------------------------------------------------------------

    def free(self, buf: object) -> None:
        """Free a ``DeviceBuffer`` on the ledger (record off first, then the memory), or a ``HostBuffer``."""
        forbid_during_capture("free")
        if type(buf) is not DeviceBuffer or buf.kind != "device":  # (the common case skips these checks)
            if isinstance(buf, HostBuffer):
                self.free_host(buf, "free")
                return
            if not isinstance(buf, DeviceBuffer):
                raise InvalidBufferError(f"free: expected a DeviceBuffer or HostBuffer, got {buf!r}")
            if buf.kind == "arena":
                with self._holdings.lock:
                    block = buf.index in self._holdings.arena_blocks
                if block:
                    raise InvalidBufferError(
                        f"free: allocation #{buf.index} is an arena block of alloc_arena(); release it with "
                        f"free_arena()"
                    )
                raise InvalidBufferError(
                    f"free: allocation #{buf.index} is arena memory: a piece of an Arena is released with the "
                    f"Arena's reset() or close(), all pieces at once, and an Arena made by create_arena() with "
                    f"its close(); free() never takes arena memory"
                )
            if buf.kind == "pool":
                self.pools.free_piece(None, buf, None, "free")
                return
            if buf.kind == "external":
                raise InvalidBufferError(
                    f"free: allocation #{buf.index} is another library's memory (from wrap()); metrale never "
                    f"frees it: let go of it with unwrap(), then free it where it came from"
                )
        ctx, holdings = self.ctx, self._holdings
        record = None if buf._owner is not ctx.ref else holdings.ledger.take(buf.index, buf.ptr, buf.nbytes)
        if record is None:
            raise InvalidBufferError(
                f"free: allocation #{buf.index} ({buf.nbytes} bytes at {buf.ptr:#x}, from "
                f"{buf.site}) is not on this backend's ledger: already freed, swept, or not "
                f"from this backend. Free each buffer once"
            )
        if record.kind == "pool":  # an equal handle of a pool's piece: the piece goes back to its pool
            self.piece_taken(buf, record, None)
            return
        self._stats.released(record.kind, record.nbytes)  # off the ledger: off the stats, whatever the release says
        for observer in self._releases.active:  # (_released, written out: a hot path)
            observer(buf)
        kind: AllocKind = "managed" if record.kind == "managed" else "device"
        if buf.index in holdings.raw_base:  # zoned (a racing free of the same buffer found no record above)
            with holdings.lock:
                raw_ptr = holdings.raw_base.pop(buf.index)
            self._quarantine.free(buf, raw_ptr, kind)
            return
        try:  # the raw call straight to the plugin, with the guarded layer's rule for its errors
            ctx.plugin.free(buf.ptr, kind)
        except Exception as exc:
            raise_raw(ctx, ctx.name, "free", exc)

    def free_host(self, hb: HostBuffer, what: str) -> None:
        """Release a pinned host buffer of this backend (by identity: the driver hands addresses out again)."""
        forbid_during_capture(what)
        with self._holdings.lock:
            if not self._holdings.host_is_live(hb):
                raise InvalidBufferError(f"{what}: {hb!r} is not a live host buffer of this backend")
            del self._holdings.host[id(hb)]
        hb._mark_closed()
        self._raw.free_host(hb.ptr)

    def free_arena(self, buf: object, what: str = "free_arena") -> None:
        """Release an ``alloc_arena`` buffer."""
        forbid_during_capture(what)
        if not isinstance(buf, DeviceBuffer) or buf.kind != "arena":
            raise InvalidBufferError(f"{what}: expected an arena DeviceBuffer, got {buf!r}")
        holdings = self._holdings
        with holdings.lock:
            live = holdings.arena_blocks.get(buf.index)
            if live is None or buf._owner is not self.ctx.ref or (live.ptr, live.nbytes) != (buf.ptr, buf.nbytes):
                if any(arena.holds(buf) for arena in holdings.arenas):
                    raise InvalidBufferError(
                        f"{what}: allocation #{buf.index} is a piece of an Arena; reset() or close() the arena"
                    )
                raise InvalidBufferError(
                    f"{what}: arena allocation #{buf.index} is not live on this backend; release each arena buffer once"
                )
            del holdings.arena_blocks[buf.index]
        self._released(buf)
        self._stats.released("arena", buf.nbytes)
        self._raw.free(buf.ptr, "arena")

    # -- arenas ---------------------------------------------------------------------------------

    def create_arena(self, capacity: object) -> Arena:
        block = self.alloc(capacity, "arena", "create_arena")
        # each piece carries its own Arena.alloc's site (a partial: no frame of its own on the walk)
        # (with redzone_arena, the pieces' zones: the arena owns them, the guard watches them)
        zoned = self._zoned and self.ctx.settings.redzone_arena
        zones = ArenaZones(self.ctx, self._guard, (block.ptr, block.nbytes)) if zoned else None
        arena = self._arena_class(
            block, self._arena_closed, functools.partial(self._call_site, self.ctx.internal, 0), zones,
            self._arena_site_at,
        )
        with self._holdings.lock:
            self._holdings.arenas.append(arena)
        return arena

    def _arena_blocks(self) -> list[tuple[int, int]]:
        """Where the open arenas' blocks lie, ``(base, nbytes)`` each (the zone guard asks at a report: no lock
        taken, as a report may come while the holdings' lock is held; the copy is one step)."""
        return [(arena.base, arena.capacity) for arena in list(self._holdings.arenas)]

    def _arena_closed(self, arena: Arena, block: DeviceBuffer) -> None:
        """``Arena.close()``: refused (changing nothing) where a free would be; else the block goes."""
        self.ctx.enter()
        try:
            forbid_during_capture("Arena.close")
            holdings = self._holdings
            with holdings.lock:  # its pieces stop being live before the block is released
                if holdings.arena_blocks.pop(block.index, None) is None:
                    raise InvalidBufferError(f"Arena.close: the block of {arena!r} is not live on this backend")
                if arena in holdings.arenas:
                    holdings.arenas.remove(arena)
                    self._stats.arena_allocs += arena.allocs
            self._released(block)
            self._stats.released("arena", block.nbytes)
            self._raw.free(block.ptr, "arena")
        finally:
            self.ctx.leave()

    # -- sweep and close ------------------------------------------------------------------------

    def sweep(self, *, judge: bool = True) -> int:
        """Drain the ledger, free each allocation on it, and report; returns how many.

        - One check judges the quarantine and the zones of the zoned allocations swept (``judge``; off at
          close, whose final scan judged them), before their memory goes.
        - What it raises (a violation with ``redzone_action="raise"``, a failed read) is raised after the
          sweep, as ``free`` raises after its release: the leaks never stay on the ledger. A failed read
          keeps the quarantine for the next check; the swept allocations go unjudged.
        """
        ctx = self.ctx
        records = self._holdings.ledger.drain()
        guard = self._guard
        swept: list[Zone] = []
        if judge and self._zoned:
            with guard.lock:
                for rec in records:
                    swept.extend(guard.zones.zones_of(rec.index))
        # freed buffers waiting in quarantine are no leaks: released, with the blocks kept for reuse
        pending: MetraleError | None = None
        try:
            when = "sweep_unreleased(), with the swept allocations' zones" if swept else "sweep_unreleased()"
            self._quarantine.drain(when, give_back=True, also=swept)
        except MetraleError as exc:
            pending = exc
        if records:
            ctx.quietly("synchronize before a sweep", self._guard.sync_device)  # in-graph checks may read their zones
            total = sum(r.nbytes for r in records)
            origin = ctx.origin
            _log.warning(
                "sweep on %s:%d: %d allocation(s) totalling %s had no owner; largest sites: %s%s",
                ctx.name, ctx.ordinal, len(records), format_bytes(total), describe_sites(largest_sites(records)),
                f" (on {origin.describe()})" if origin is not None and origin.rank is not None else "",
            )
            self.swept.extend(records)
        for rec in records:
            self._stats.released(rec.kind, rec.nbytes)
            if rec.kind == "pool":  # the piece goes back to its pool, which gives its segments back
                self.pools.piece_swept(rec.index)
                continue
            with self._holdings.lock:
                raw_ptr = self._holdings.raw_base.pop(rec.index, rec.ptr)
            self._guard.forget(rec.index)
            ctx.quietly(f"sweep: freeing allocation #{rec.index} at {rec.ptr:#x}", self._raw.free, raw_ptr, rec.kind)
        if pending is not None:
            raise pending
        return len(records)

    def release(self) -> None:
        """At close (the device is idle): sweep the ledger, release arena blocks and host buffers, and
        let go of the on_out_of_memory callbacks (what they hold may hold this backend: a cycle)."""
        ctx = self.ctx
        holdings = self._holdings
        self.raw.clear()
        with holdings.lock:
            arenas, holdings.arenas = holdings.arenas, []
            blocks, holdings.arena_blocks = holdings.arena_blocks, {}
            hosts, holdings.host = holdings.host, {}
        for arena in arenas:
            arena._take_block()  # its block is among the blocks released below
        self.sweep(judge=False)
        self.pools.release()  # (the sweep gave their pieces back)
        self._quarantine.release()
        for buf in blocks.values():
            ctx.quietly("free_arena", self._raw.free, buf.ptr, "arena")
        for hb in hosts.values():
            hb._mark_closed()
            ctx.quietly("free host buffer", self._raw.free_host, hb.ptr)
