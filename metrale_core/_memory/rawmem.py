"""Raw memory: the driver's allocations with reclaim-and-retry, and the out-of-memory report that names who holds
the memory.

- `RawMemory.alloc` asks the driver; where it runs out of memory, the remedies run in turn, each followed by
  another try: the red zones' quarantine is drained (its blocks kept for reuse given back), then every trimmer
  runs (the pools register theirs: each waits for the device and gives back what its pools cache), then the
  ``on_out_of_memory`` callbacks (at most ``oom_retries`` rounds). What is left is the report's: the ledger's
  largest call sites, the free memory, the other processes' share, a snapshot where one was asked for.
- A trimmer is a callable that owes this module nothing: it says whether it had anything cached (a retry is
  worth it). The pools' front registers one as the callbacks are registered: raw memory never reaches into them.
- `RawMemory.trace`: the allocation ``redzone_trace_idx`` names, logged with its whole stack.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, cast

from .._device.args import invalid_argument
from .._device.capture import forbid_during_capture
from .._device.context import DeviceContext
from .._device.stats import StatsCounter
from .._errors import MetraleError, OutOfMemoryError, error_for_code
from .._types import WORD_LIMIT, AllocKind, AllocRecord, format_bytes
from .holdings import Holdings
from .quarantine import Quarantine
from .records import describe_sites, largest_sites, next_index

if TYPE_CHECKING:
    from .._redzones.guard import ZoneGuard
    from .monitor import MemoryMonitor

__all__ = ["RawMemory", "Trimmer"]

_log = logging.getLogger("metrale")

#: What a pool front registers (`RawMemory.add_trimmer`): wait for the device, then give back what its pools cache;
#: whether anything was cached (an allocation asked again may then be served).
Trimmer = Callable[[], bool]

#: The core's own folder; its frames (but not those of ``testing`` or the commands) are cut from a traced stack.
_CORE_DIR: Final = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_USER_DIRS: Final = tuple(os.path.join(_CORE_DIR, d) + os.sep for d in ("testing", "_commands"))


def _is_core_frame(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_CORE_DIR + os.sep) and not path.startswith(_USER_DIRS)


def _user_stack() -> traceback.StackSummary:
    """The calling stack up to the user's call into metrale (the core's own frames at its top cut off)."""
    frames = traceback.extract_stack()
    while frames and _is_core_frame(frames[-1].filename):
        frames.pop()
    return traceback.StackSummary.from_list(frames)


class _Reclaiming(threading.local):
    """Per thread: whether the ``on_out_of_memory`` callbacks are running on it now."""

    active = False


class RawMemory:
    """The raw allocations of one backend: reclaim-and-retry, and the out-of-memory report."""

    __slots__ = ("_callbacks", "_ctx", "_guard", "_holdings", "_monitor", "_quarantine", "_raw", "_reclaiming",
                 "_stats", "_trimmers")

    def __init__(
        self, ctx: DeviceContext, holdings: Holdings, stats: StatsCounter, guard: ZoneGuard, quarantine: Quarantine,
        monitor: MemoryMonitor,
    ) -> None:
        self._ctx = ctx
        self._raw = ctx.raw
        self._holdings = holdings
        self._stats = stats
        self._guard = guard
        self._quarantine = quarantine
        self._monitor = monitor
        self._callbacks: list[Callable[[int], object]] = []
        self._trimmers: list[Trimmer] = []
        self._reclaiming = _Reclaiming()

    def on_out_of_memory(self, callback: Callable[[int], object]) -> None:
        """``GpuBackend.on_out_of_memory``: ``callback(nbytes)`` is asked to free memory before an allocation fails."""
        if not callable(callback):
            raise invalid_argument("on_out_of_memory", "a callable", callback)
        self._callbacks.append(callback)

    def add_trimmer(self, trimmer: Trimmer) -> None:
        """Run ``trimmer`` when an allocation runs out of memory (after the quarantine, before the callbacks)."""
        self._trimmers.append(trimmer)

    def clear(self) -> None:
        """At close: let go of the callbacks and trimmers (what they hold may hold the backend: a cycle)."""
        with self._ctx.lock:
            self._callbacks.clear()
            self._trimmers.clear()

    def alloc(
        self, raw_bytes: int, n: int, kind: AllocKind, what: str, failed: OutOfMemoryError | None = None,
        retake: Callable[[], bool] | None = None,
    ) -> int:
        """The raw allocation of ``raw_bytes`` (for ``n`` asked by ``what``), with reclaim-and-retry: when it runs
        out of memory, the red-zone quarantine is checked and released, with the zoned blocks kept for reuse, first
        (one more try), then the trimmers run (the pools: after a wait for the device), then the
        ``on_out_of_memory`` callbacks are asked to free some, and a callback that says it did earns another try (at
        most ``oom_retries``); while another library's capture runs (`Quarantine.defer`), only the callbacks are
        asked. ``failed``: the caller's own first try already ran out of memory. ``retake``: a
        pool's allocation asks its pool again once the trimmers ran (the wait made pieces cached for other streams
        any stream's); where it is served, the answer is 0 (no raw memory taken)."""
        if raw_bytes >= WORD_LIMIT:  # (a pool's size class of a size near 2**64): no driver can take the size, and
            # no remedy makes it fit; CUDA's answer for the largest size it can take, without asking it
            self._stats.oom_count += 1
            refused = error_for_code("CUDA_ERROR_OUT_OF_MEMORY", f"cuMemAlloc of {raw_bytes} bytes", requested=n)
            raise self._out_of_memory(cast(OutOfMemoryError, refused), n, kind, what, 0)
        retries = 0
        # while another library's capture runs, no remedy that waits for the device (the capture forbids it)
        drained = trimmed = self._quarantine.deferred
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
                if not trimmed:  # then the memory pools cache
                    trimmed = True
                    if any([trimmer() for trimmer in list(self._trimmers)]):
                        if retake is not None and retake():
                            return 0
                        continue
                reclaimed = retries < self._ctx.settings.oom_retries and self._reclaim(raw_bytes, what)
                if self._ctx.closed:  # a callback closed the backend
                    raise self._ctx.closed_error() from None
                if reclaimed:
                    retries += 1
                    self._stats.oom_retries += 1
                    forbid_during_capture(what)  # a capture may have begun while the callbacks ran
                    continue
                self._stats.oom_count += 1
                raise self._out_of_memory(exc, n, kind, what, retries) from None

    def grow(self, nbytes: int, n: int, what: str, retake: Callable[[], bool]) -> int:
        """A pool's new segment (`pool.Grow`): `alloc` of device memory, with reclaim-and-retry."""
        return self.alloc(nbytes, n, "device", what, retake=retake)

    def grow_relaxed(self, nbytes: int, n: int, what: str, retake: Callable[[], bool]) -> int:
        """A new segment of a pool for another library's capture: `grow`, the calling thread's capture mode relaxed
        for it (the driver then allocates during a capture in global mode, as torch's allocator relies on)."""
        try:
            was = self._raw.exchange_capture_mode("relaxed")
        except MetraleError:  # (a backend without capture modes: it grows as any pool)
            return self.grow(nbytes, n, what, retake)
        try:
            return self.grow(nbytes, n, what, retake)
        finally:
            self._raw.exchange_capture_mode(was)

    def release_quietly(self, raw_ptr: int, kind: AllocKind) -> None:
        """Give back the raw memory of an allocation that failed after its raw call (logged if that fails too)."""
        try:
            self._raw.free(raw_ptr, kind)
        except MetraleError as exc:
            _log.warning("releasing %#x after a failed allocation also failed: %s", raw_ptr, exc)

    def trace(self, index: int, what: str, n: int, site: str) -> None:
        """``redzone_trace_idx`` names allocation ``index``: log its whole stack."""
        _log.warning(
            "redzone_trace_idx=%d: %s of %d bytes allocated at %s; full stack:\n%s",
            index, what, n, site, "".join(traceback.format_list(_user_stack())),
        )

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
                    with self._ctx.outside():  # user code: close() from another thread need not wait for it
                        if callback(nbytes):
                            freed = True
                except Exception as exc:  # a callback's bug must not hide the out-of-memory error
                    _log.warning("on_out_of_memory callback %r raised %s: %s", callback, type(exc).__name__, exc)
        finally:
            state.active = False
        if freed:
            _log.info("%s of %s: out of memory; a callback freed memory, trying again", what, format_bytes(nbytes))
        return freed

    def _out_of_memory(self, exc: OutOfMemoryError, n: int, kind: str, what: str, retries: int) -> OutOfMemoryError:
        ctx = self._ctx
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
