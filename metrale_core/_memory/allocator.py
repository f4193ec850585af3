"""The allocator: device, managed, arena and pinned host memory of one backend, from the raw
call to the ledger and back, and the sweep.

It owns the front of the ledger (a record on before ``alloc`` returns, off before ``free``
releases), arena blocks and [`Arena`][metrale_core.Arena] objects, host buffers, and the
sweep. What it hands out it records in `Holdings`. Red zones are the zone guard's, asked for by the
allocator; freed zoned blocks wait in its `Quarantine`. Its parts:

- `DeviceLane` (``lane.py``, compiled as ``_lane``): the hot path, ``GpuBackend.alloc`` and ``free`` and every
  allocation of device, managed and arena memory, and the commit rule (the backend is open now, or nothing of the
  allocation remains), judged there in one place;
- `RawMemory` (``rawmem.py``): the driver's allocations with reclaim-and-retry (the quarantine drained, the pools
  trimmed, the ``on_out_of_memory`` callbacks) and the out-of-memory report;
- `PoolFront` (``pools.py``, compiled as ``_pools``): the memory pools, from ``create_pool`` to
  ``MemoryPool.close``.

Nothing it makes outlives ``close()``: an allocation that finds the backend closed at its commit (a callback closed
it, or another thread's ``close()`` waited for it) releases its memory and raises
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
from .._device.handles import HostBuffer
from .._device.stats import StatsCounter
from .._errors import InvalidBufferError, MetraleError, OutOfMemoryError
from .._redzones.layout import Zone
from .._twins import pick
from .._types import AllocKind, AllocRecord, format_bytes
from .arena import Arena, ArenaZones
from .holdings import Holdings
from .lane import DeviceLane
from .pools import PoolFront
from .quarantine import Quarantine
from .rawmem import RawMemory
from .records import describe_sites, largest_sites
from .sites import call_site_at, call_site_for

if TYPE_CHECKING:
    from .._redzones.guard import ZoneGuard
    from .monitor import MemoryMonitor

__all__ = ["Allocator"]

_log = logging.getLogger("metrale")

#: How many of the records sweeps took an allocator keeps for `GpuBackend.ledger_report` (the newest).
SWEPT_KEPT: Final = 10_000


class Allocator:
    """Memory of one backend: allocation, release, arenas, host buffers, sweep; its raw memory and its pools."""

    __slots__ = (
        "_arena_class",
        "_call_site",
        "_guard",
        "_holdings",
        "_quarantine",
        "_raw",
        "_releases",
        "_stats",
        "_zoned",
        "ctx",
        "lane",
        "pools",
        "raw",
        "swept",
    )

    def __init__(
        self, ctx: DeviceContext, holdings: Holdings, stats: StatsCounter, guard: ZoneGuard, monitor: MemoryMonitor,
        *, caller_frames: int = 0,
    ) -> None:
        """``caller_frames``: the frames the facade's ``GpuBackend.alloc`` has above its lane (`DeviceLane`)."""
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
        #: The Arena class this backend runs: the compiled twin where built and ``pure`` is off (chosen once).
        self._arena_class = pick("arena", Arena, ctx.settings.pure)
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
        self._quarantine.give_pieces_to(self.pools.pieces_judged)
        #: The hot path: ``GpuBackend.alloc`` and ``free``, and every allocation of device, managed and arena memory
        #: (compiled where built and ``pure`` is off).
        self.lane = pick("lane", DeviceLane, ctx.settings.pure)(
            ctx, holdings, stats, guard, self._quarantine, self.raw, self.pools, self.free_host, caller_frames
        )

    def _released(self, buf: DeviceBuffer) -> None:
        for observer in self._releases.active:
            observer(buf)

    # -- allocation ---------------------------------------------------------------------------

    def alloc(self, nbytes: object, kind: AllocKind, what: str, site: str | None = None) -> DeviceBuffer:
        """Device memory of ``kind``, inside the caller's gate (the lane's `allocate`): on the ledger unless it is
        arena memory. ``site``: the caller's own choice (`site_at`), else the first frame outside metrale and
        ``site_skip``."""
        return self.lane.allocate(nbytes, kind, what, site)

    def _arena_site_at(self, stacklevel: object) -> str:
        return self.site_at(stacklevel, "Arena.alloc")

    def site_at(self, stacklevel: object, what: str) -> str:
        """The call site an allocating call's ``stacklevel`` names (`call_site_at`); a bad one is refused."""
        if isinstance(stacklevel, bool) or not isinstance(stacklevel, int) or stacklevel < 1:
            raise invalid_argument(what, "a stacklevel of at least 1 (an int)", stacklevel)
        return call_site_at(self.ctx.internal, min(stacklevel, sys.maxsize))

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
