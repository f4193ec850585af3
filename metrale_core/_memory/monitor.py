"""Memory pressure, as one backend answers it: free memory, stats, OOM watchdogs, snapshots.

`MemoryMonitor` reads; it changes nothing of the memory. It owns the watchdogs it
starts (stopped first at ``close()``, before anything is released).
"""

from __future__ import annotations

import threading
from pathlib import Path

from .._device.context import DeviceContext
from .._device.stats import MemoryStats, StatsCounter
from .._errors import InvalidArgumentError, MetraleError
from .._types import MemoryInfo, as_index
from .holdings import Holdings
from .ledger import LedgerProbe
from .meminfo import effective_free_bytes, read_mem_available
from .pressure import OomWatchdog, PoolTotals, check_watchdog_args, memory_summary
from .records import describe_sites, largest_sites
from .snapshot import snapshot_path, write_snapshot

__all__ = ["MemoryMonitor"]


class MemoryMonitor:
    """Free memory, stats, watchdogs and snapshots of one backend."""

    __slots__ = ("_holdings", "_lock", "_stats", "_watchdogs", "ctx")

    def __init__(self, ctx: DeviceContext, holdings: Holdings, stats: StatsCounter) -> None:
        self.ctx = ctx
        self._holdings = holdings
        self._stats = stats
        self._lock = threading.Lock()
        self._watchdogs: list[OomWatchdog] = []

    def memory_info(self) -> MemoryInfo:
        """Free and total device memory, and what an allocation can really have."""
        raw = self.ctx.raw
        free, total = raw.mem_get_info()
        integrated = raw.is_integrated()
        available = read_mem_available() if integrated else None
        quarantined = self._stats.quarantined_bytes + self._stats.reusable_bytes
        return MemoryInfo(
            free=free,
            total=total,
            effective_free=min(total, effective_free_bytes(free, available, integrated, total) + quarantined),
            integrated=bool(integrated),
            quarantined=quarantined,
        )

    def stats(self) -> MemoryStats:
        with self._holdings.lock:
            arenas = list(self._holdings.arenas)
        return self._stats.freeze(
            sum(a.capacity for a in arenas), sum(a.used for a in arenas), sum(a.allocs for a in arenas)
        )

    def reset_peak(self) -> None:
        self._stats.reset_peak()

    def summary(self, top: object) -> str:
        """`memory_summary` of this backend now (the device's free memory left out
        where the device cannot say: after a fault)."""
        count = as_index(top)
        if count is None or count < 1:
            raise InvalidArgumentError(f"memory_summary: top must be a positive int, got {top!r}")
        ctx = self.ctx
        info, device = self._device_facts()
        title = f"{ctx.name}:{ctx.ordinal}, {device}"
        return memory_summary(title, self.stats(), self._holdings.ledger.snapshot(), info, top=count,
                              pools=self.pool_totals())

    def pool_totals(self) -> PoolTotals:
        """The open memory pools' counters, summed."""
        with self._holdings.lock:
            pools = list(self._holdings.pools)
        return PoolTotals.of([pool.counters() for pool in pools])

    def _device_facts(self) -> tuple[MemoryInfo | None, str]:
        """The device's memory and name for a summary or a snapshot, read past the gate (both answer after a
        fault): the memory is ``None`` where the device cannot say, after a fault (the raw layer is not asked:
        a fake's would answer where CUDA's fails), the name a stand-in where the device fails to give it."""
        ctx = self.ctx
        info: MemoryInfo | None = None
        device = f"{ctx.name} device {ctx.ordinal}"
        try:
            if ctx.fault is None:
                info = self.memory_info()
            device = ctx.raw.device_name()
        except MetraleError:
            pass
        return info, device

    def spawn_oom_watchdog(self, interval_s: object, min_free_bytes: object, on_low: object) -> OomWatchdog:
        interval, min_free = check_watchdog_args(interval_s, min_free_bytes, on_low)
        # the watchdog's thread reads the ledger through a probe: inside the gate, so a finalizer's free meanwhile
        # is deferred, not taken on the lock the read holds
        probe = LedgerProbe(self._holdings.ledger, self.ctx.gate)
        watchdog = OomWatchdog(
            f"{self.ctx.name}:{self.ctx.ordinal}", self._read_for_watchdog,
            lambda: describe_sites(largest_sites(probe.records())),
            interval_s=interval, min_free_bytes=min_free, on_low=on_low,  # type: ignore[arg-type]
        )
        with self._lock:
            self._watchdogs = [w for w in self._watchdogs if w.running]
            self._watchdogs.append(watchdog)
        watchdog._start()
        return watchdog

    def _read_for_watchdog(self) -> MemoryInfo:
        """``memory_info()`` through the gate, as a user's call (a watchdog stops when it is refused)."""
        self.ctx.enter()
        try:
            return self.memory_info()
        finally:
            self.ctx.leave()

    def save_snapshot(self, path: object) -> Path:
        """Write a snapshot to ``path`` (checked: a ``str`` or ``os.PathLike``); returns it as a ``Path``."""
        target = snapshot_path(path, "save_snapshot")
        ctx = self.ctx
        info, device = self._device_facts()
        write_snapshot(target, ctx.name, device, ctx.ordinal, info, self._holdings.ledger, self.stats(), ctx.origin,
                       self.pool_totals())
        return target

    def stop(self) -> None:
        """Stop every watchdog (the first thing ``close()`` does)."""
        with self._lock:
            watchdogs, self._watchdogs = self._watchdogs, []
        for watchdog in watchdogs:
            watchdog.stop()
