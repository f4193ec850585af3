"""The allocator: device, managed, arena and pinned host memory of one backend, from the raw
call to the ledger and back.

It owns the front of the ledger (a record on before ``alloc`` returns, off before ``free``
releases), reclaim-and-retry after an out-of-memory error and the report that names who holds
the memory, arena blocks and [`Arena`][metrale_core.Arena] objects, host buffers, and the
sweep. What it hands out it records in `Holdings`. Red zones are the zone guard's, asked for by the
allocator; freed zoned blocks wait in its `Quarantine`, which it drains before it gives up on memory.

Nothing it makes outlives ``close()``: an allocation finishes by committing its record under
the context's lock, and one that finds the backend closed by then (a callback closed it, or
another thread's ``close()`` waited for it) releases its memory and raises
[`BackendClosedError`][metrale_core.BackendClosedError] instead.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, cast

from .._device.args import integer, invalid_argument, positive_size
from .._device.buffer import DeviceBuffer
from .._device.capture import forbid_during_capture
from .._device.context import DeviceContext
from .._device.guarded import raise_raw
from .._device.handles import HostBuffer
from .._device.stats import StatsCounter
from .._errors import (
    BackendClosedError,
    InvalidArgumentError,
    InvalidBufferError,
    MetraleError,
    OutOfMemoryError,
    error_for_code,
)
from .._redzones.layout import Layout, Zone
from .._twins import pick
from .._types import WORD_LIMIT, AllocKind, AllocRecord, format_bytes
from .arena import Arena, ArenaZones
from .holdings import Holdings
from .lane import LaneParts, PoolLane, ZonedParts
from .pool import MemoryPool, PoolFront, PoolStats, size_class
from .quarantine import Quarantine
from .records import describe_sites, largest_sites, next_index
from .sites import call_site_at, call_site_for

if TYPE_CHECKING:
    from .._device.handles import Stream
    from .._redzones.guard import ZoneGuard
    from .monitor import MemoryMonitor

#: How a pool finds the stream an argument names (the stream front's rule), ``None`` naming the default stream.
StreamResolver = Callable[["Stream | None", str], "Stream"]

__all__ = ["Allocator"]

_log = logging.getLogger("metrale")

#: How many of the records sweeps took an allocator keeps for `GpuBackend.ledger_report` (the newest).
SWEPT_KEPT: Final = 10_000


#: The core's own folder; its frames (but not those of ``testing`` or the commands) are cut from a stack.
_CORE_DIR: Final = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_USER_DIRS: Final = tuple(os.path.join(_CORE_DIR, d) + os.sep for d in ("testing", "_commands"))


def _no_streams(stream: Stream | None, what: str) -> Stream:  # pragma: no cover - no pool before create_pool
    raise AssertionError(f"{what}: no pool was created")


def _fits(layout: Layout, n: int, what: str) -> None:
    """Refuse a zoned allocation of ``n`` bytes whose raw size, zones included, does not fit 64 bits."""
    if layout.raw_bytes >= WORD_LIMIT:
        raise InvalidArgumentError(
            f"{what}: {n} bytes and their red zones ({layout.raw_bytes} bytes in all) do not fit 64 bits "
            f"(CUDA's size_t): ask for less"
        )


def _is_core_frame(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_CORE_DIR + os.sep) and not path.startswith(_USER_DIRS)

#: Whether this module runs as Python (``dev.py accelerate`` compiles it): then ``alloc``'s own frame is
#: metrale's, and the call site's walk starts past it.
_OWN_FRAME: Final = 1 if __file__.endswith(".py") else 0


def _user_stack() -> traceback.StackSummary:
    """The calling stack up to the user's call into metrale (the core's own frames at its top cut off)."""
    frames = traceback.extract_stack()
    while frames and _is_core_frame(frames[-1].filename):
        frames.pop()
    return traceback.StackSummary.from_list(frames)


class _Reclaiming(threading.local):
    """Per thread: whether the ``on_out_of_memory`` callbacks are running on it now."""

    active = False


def _foreign_handle(foreign: object, what: str) -> int:
    """Another library's stream handle (``foreign_stream``), or a typed error: an int from 0 to 2**64 - 1."""
    handle = integer(foreign, what, "foreign_stream")
    if handle >= WORD_LIMIT:
        raise InvalidArgumentError(f"{what}: foreign_stream must be a stream's handle (below 2**64), got {handle}")
    return handle


class Allocator:
    """Memory of one backend: allocation, release, reclaim-and-retry, arenas, host buffers, sweep."""

    __slots__ = (
        "_arena_class",
        "_call_site",
        "_callbacks",
        "_guard",
        "_holdings",
        "_make",
        "_monitor",
        "_pool_class",
        "_pool_front",
        "_quarantine",
        "_raw",
        "_reclaiming",
        "_releases",
        "_resolve",
        "_stats",
        "_trace_idx",
        "_zeroes",
        "_zoned",
        "ctx",
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
        self._quarantine.give_pieces_to(self._piece_judged)
        guard.watch_blocks(self._arena_blocks)  # a piece's suspects: the kernels that took any of its block
        self._monitor = monitor
        self._callbacks: list[Callable[[int], object]] = []
        #: The release observers switched on (the fronts' own switches), read at each release.
        self._releases = holdings.releases
        #: What sweeps took since the backend opened (the leaks), the last `SWEPT_KEPT` of them.
        self.swept: collections.deque[AllocRecord] = collections.deque(maxlen=SWEPT_KEPT)
        self._reclaiming = _Reclaiming()
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
        #: How a pool's calls find their stream (the stream front's rule: given at the first `create_pool`).
        self._resolve: StreamResolver = _no_streams
        #: The MemoryPool class this backend runs, and the front its pools call: the pool lane, whose compiled twin
        #: does a door's common case at C level and hands everything else here (chosen once, as the arena's class).
        self._pool_class = pick("pool", MemoryPool, ctx.settings.pure)
        self._pool_front: PoolFront = pick("pool_lane", PoolLane, ctx.settings.pure)(self, self.lane_parts())

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
        return self._raw_alloc(raw_bytes, n, "device", "alloc")

    def retry_alloc(self, n: int, kind: AllocKind, what: str, failed: OutOfMemoryError) -> int:
        """The raw allocation of ``n`` bytes whose first try (the caller's) ran out of memory: reclaim-and-retry."""
        return self._raw_alloc(n, n, kind, what, failed)

    def trace(self, index: int, what: str, n: int, site: str) -> None:
        """``redzone_trace_idx`` names allocation ``index``: log its whole stack."""
        _log.warning(
            "redzone_trace_idx=%d: %s of %d bytes allocated at %s; full stack:\n%s",
            index, what, n, site, "".join(traceback.format_list(_user_stack())),
        )

    def _zoned_alloc(self, layout: Layout, n: int, what: str) -> tuple[int, bool]:
        """The raw memory of a zoned device allocation, and whether it is recycled: a checked block kept
        for reuse, or a new one from the driver (``False``)."""
        _fits(layout, n, what)
        reused = self._quarantine.reuse(layout)
        if reused is not None:
            return reused, True
        return self._raw_alloc(layout.raw_bytes, n, "device", what), False

    def _raw_alloc(
        self, raw_bytes: int, n: int, kind: AllocKind, what: str, failed: OutOfMemoryError | None = None,
        retake: Callable[[], bool] | None = None,
    ) -> int:
        """The raw allocation, with reclaim-and-retry: when it runs out of memory, the red-zone
        quarantine is checked and released, with the zoned blocks kept for reuse, first (one more try),
        then the memory pools are trimmed (after a wait for the device), then the ``on_out_of_memory``
        callbacks are asked to free some, and a callback that says it did earns another try (at
        most ``oom_retries``). ``failed``: the caller's own first try already ran out of memory. ``retake``: a
        pool's allocation asks its pool again once the pools were trimmed (the wait made pieces cached for other
        streams any stream's); where it is served, the answer is 0 (no raw memory taken)."""
        if raw_bytes >= WORD_LIMIT:  # (a pool's size class of a size near 2**64): no driver can take the size, and
            # no remedy makes it fit; CUDA's answer for the largest size it can take, without asking it
            self._stats.oom_count += 1
            refused = error_for_code("CUDA_ERROR_OUT_OF_MEMORY", f"cuMemAlloc of {raw_bytes} bytes", requested=n)
            raise self._out_of_memory(cast(OutOfMemoryError, refused), n, kind, what, 0)
        retries = 0
        drained = trimmed = False
        while True:
            try:
                if failed is None:
                    return self._raw.alloc(raw_bytes, kind)
                first, failed = failed, None  # the caller's first try ran out of memory: on to the remedies
                raise first
            except OutOfMemoryError as exc:
                if not drained and self._quarantine.held_bytes:  # freed memory the red zones hold back first
                    drained = True
                    # logged, not raised: the allocation goes on
                    self._quarantine.drain(f"{what}, out of memory", may_raise=False, give_back=True)
                    continue
                if not trimmed and any(pool.cached_bytes for pool in list(self._holdings.pools)):
                    trimmed = True  # then the memory pools cache
                    self._trim_pools(None, 0)
                    if retake is not None and retake():
                        return 0
                    continue
                reclaimed = retries < self.ctx.settings.oom_retries and self._reclaim(raw_bytes, what)
                if self.ctx.closed:  # a callback closed the backend
                    raise self.ctx.closed_error() from None
                if reclaimed:
                    retries += 1
                    self._stats.oom_retries += 1
                    forbid_during_capture(what)  # a capture may have begun while the callbacks ran
                    continue
                self._stats.oom_count += 1
                raise self._out_of_memory(exc, n, kind, what, retries) from None

    def on_out_of_memory(self, callback: Callable[[int], object]) -> None:
        if not callable(callback):
            raise invalid_argument("on_out_of_memory", "a callable", callback)
        self._callbacks.append(callback)

    def _reclaim(self, nbytes: int, what: str) -> bool:
        """Call the ``on_out_of_memory`` callbacks, each once; whether any says it freed memory.

        Never re-entered: an allocation that runs out of memory inside a callback (on the same
        thread) gets its ``OutOfMemoryError`` without the callbacks being asked again.
        """
        state = self._reclaiming
        if state.active:
            _log.debug("%s of %s: out of memory inside an on_out_of_memory callback; not asking the callbacks "
                       "again", what, format_bytes(nbytes))
            return False
        freed = False
        state.active = True
        try:
            for callback in list(self._callbacks):
                try:
                    with self.ctx.outside():  # user code: close() from another thread need not wait for it
                        if callback(nbytes):
                            freed = True
                except Exception as exc:  # a callback's bug must not hide the out-of-memory error
                    _log.warning("on_out_of_memory callback %r raised %s: %s", callback, type(exc).__name__, exc)
        finally:
            state.active = False
        if freed:
            _log.info("%s of %s: out of memory; a callback freed memory, trying again", what, format_bytes(nbytes))
        return freed

    def release_quietly(self, raw_ptr: int, kind: AllocKind) -> None:
        """Give back the raw memory of an allocation that failed after its raw call (logged if that fails too)."""
        try:
            self._raw.free(raw_ptr, kind)
        except MetraleError as exc:
            _log.warning("releasing %#x after a failed allocation also failed: %s", raw_ptr, exc)

    def _out_of_memory(self, exc: OutOfMemoryError, n: int, kind: str, what: str, retries: int) -> OutOfMemoryError:
        ctx = self.ctx
        records = self._holdings.ledger.snapshot()
        live = sum(r.nbytes for r in records)
        try:
            info = self._monitor.memory_info()
            memory = (
                f"{format_bytes(info.free)} free ({format_bytes(info.effective_free)} effective) "
                f"of {format_bytes(info.total)}"
            )
            memory += self._held_by_others(info.total - info.free, records)
        except MetraleError:
            memory = "free memory unknown"
        sites = describe_sites(largest_sites(records))
        retried = f"; tried {retries + 1} times after on_out_of_memory callbacks freed memory" if retries else ""
        saved = ""
        folder = ctx.settings.oom_snapshot_dir
        if folder is not None:
            path = folder / f"metrale-oom-{ctx.name}-{os.getpid()}-{next_index()}.json"
            try:
                folder.mkdir(parents=True, exist_ok=True)
                self._monitor.save_snapshot(path)
                saved = f"; memory snapshot saved to {path} (see it with: metrale report {path} --png oom.png)"
            except (OSError, MetraleError) as err:
                saved = f"; the memory snapshot could not be saved to {path}: {err}"
        return OutOfMemoryError(
            f"{what}({n}) on {ctx.name}:{ctx.ordinal} failed: out of device memory asking for "
            f"{format_bytes(n)} ({kind}); {memory}; {format_bytes(live)} live on the ledger in "
            f"{len(records)} allocation(s), largest call sites: {sites}{retried}{saved}. Free buffers "
            f"you no longer need, register an on_out_of_memory callback that can, or ask for less",
            requested=n, code=exc.code, name=exc.name,
        )

    def _held_by_others(self, used: int, records: list[AllocRecord]) -> str:
        """Where the engine shares this device with other processes (``Origin.device_share`` below 1), the bytes in
        use on it outside this backend's allocations: its ledger (with the red zones of what is on it), arenas,
        quarantine (zones included), reuse lists and pools' caches are this backend's; the rest is the other
        processes', with the driver's own memory and metrale's scratch for its checks."""
        origin = self._holdings.ledger.origin
        if origin is None or not origin.shared:
            return ""
        stats = self._monitor.stats()
        on_ledger = {r.index for r in records}
        zones = sum(z.length for z in self._guard.zones.live() if z.buffer.index in on_ledger)
        here = (stats.current_total_bytes + zones + stats.arena_capacity + stats.redzone_quarantined_bytes
                + stats.redzone_reusable_bytes + sum(pool.cached_bytes for pool in list(self._holdings.pools)))
        return (
            f"; {format_bytes(max(0, used - here))} in use outside this backend's allocations, most of it held by "
            f"other processes on this device (it is shared: this process has {origin.device_share:g} of it; the "
            "driver's own memory and metrale's scratch are counted in)"
        )

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
                self.free_piece(None, buf, None, "free")
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

    # -- memory pools ---------------------------------------------------------------------------

    def create_pool(self, release_threshold: object, resolve: StreamResolver) -> MemoryPool:
        """A caching pool on this allocator's ledger (`MemoryPool`)."""
        forbid_during_capture("create_pool")
        threshold = integer(release_threshold, "create_pool", "release_threshold")
        self._resolve = resolve
        pool = self._pool_class(self._pool_front, threshold)
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
            _fits(layout, n, what)
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

        raw = self._raw_alloc(nbytes_segment, n, "device", what, retake=retake)
        if retaken:
            return retaken[0]
        taken = pool.add_segment(raw, nbytes_segment, size)
        if taken is None:  # the pool closed meanwhile
            self.release_quietly(raw, "device")
            raise InvalidArgumentError(f"{what}: {pool!r} was closed meanwhile")
        return taken

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
        piece goes to the quarantine first, and back to its pool once its zones were judged (`_piece_judged`)."""
        holdings = self._holdings
        with holdings.lock:
            pool = holdings.pool_of.pop(record.index)
            raw_ptr = holdings.raw_base.pop(record.index, None)
            if raw_ptr is not None:  # (in the same step: a pool's close finds it judging or still out)
                holdings.judging[record.index] = pool
        self._stats.released("pool", record.nbytes)
        for observer in self._releases.active:
            observer(buf)
        if raw_ptr is None:
            pool.give(record.index, stream)
            return
        if stream is not None:
            pool.aim(record.index, stream)
        self._quarantine.free(record, raw_ptr, "pool")

    def _piece_swept(self, index: int) -> None:
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

    def _piece_judged(self, index: int) -> None:
        """The quarantine let go of zoned piece ``index`` (its zones judged, or at close): back to its pool."""
        with self._holdings.lock:
            pool = self._holdings.judging.pop(index, None)
        if pool is not None:
            pool.give(index, None)

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
            self._raw.synchronize()  # nothing queued before it uses what was cached: any stream may reuse it
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
        if not self.ctx.quietly(f"free a memory pool's segment at {ptr:#x}", self._raw.free, ptr, "device"):
            return 0
        pool.gave_back(nbytes)
        return nbytes

    def mark_pools(self) -> dict[MemoryPool, int]:
        """Before a device-wide ``synchronize()``: each pool's mark (`synchronized`)."""
        return {pool: pool.mark() for pool in list(self._holdings.pools)}

    def synchronized(self, marks: dict[MemoryPool, int]) -> None:
        """A device-wide ``synchronize()`` that began after ``marks`` returned: every pool keeps at most its
        ``release_threshold`` cached."""
        if marks:
            self._trim_pools(None, None, marks=marks)

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
                    self._piece_swept(rec.index)
            if taken:
                _log.warning(
                    "MemoryPool.close on %s:%d: %d piece(s) totalling %s were still out; largest sites: %s",
                    ctx.name, ctx.ordinal, len(taken), format_bytes(sum(r.nbytes for r in taken)),
                    describe_sites(largest_sites(taken)),
                )
                self.swept.extend(taken)
            with holdings.lock:
                unjudged = not read or any(owner is pool for owner in holdings.judging.values())
                if pool in holdings.pools and not unjudged:
                    holdings.pools.remove(pool)
            if unjudged:  # zones still watched over its memory: the backend's close releases it, after its scan
                _log.warning("MemoryPool.close on %s:%d: the red zones of its pieces could not be read; they stay "
                             "watched, and the pool's segments stay held until the backend closes",
                             ctx.name, ctx.ordinal)
                return
            ctx.quietly("synchronize before a pool's segments go", self._raw.synchronize)
            for ptr, nbytes in pool.release_all():
                self._give_segment(pool, ptr, nbytes)
        finally:
            ctx.leave()

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
                self._piece_swept(rec.index)
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
        with ctx.lock:
            self._callbacks.clear()
        with holdings.lock:
            arenas, holdings.arenas = holdings.arenas, []
            blocks, holdings.arena_blocks = holdings.arena_blocks, {}
            hosts, holdings.host = holdings.host, {}
        for arena in arenas:
            arena._take_block()  # its block is among the blocks released below
        self.sweep(judge=False)
        with holdings.lock:
            pools, holdings.pools = holdings.pools, []
        for pool in pools:  # the sweep gave their pieces back
            pool.shut()
            for ptr, nbytes in pool.release_all():
                self._give_segment(pool, ptr, nbytes)
        self._quarantine.release()
        for buf in blocks.values():
            ctx.quietly("free_arena", self._raw.free, buf.ptr, "arena")
        for hb in hosts.values():
            hb._mark_closed()
            ctx.quietly("free host buffer", self._raw.free_host, hb.ptr)
