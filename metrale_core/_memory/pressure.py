"""Memory pressure: the counters behind ``stats()``, and the OOM watchdog.

Both are small pieces the backend composes; neither calls the driver itself.
The watchdog reads memory through a function it is given (the backend's
``memory_info``, which never synchronizes a stream).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import NamedTuple

from .._device.stats import KINDS, MemoryStats
from .._errors import InvalidArgumentError, MetraleError
from .._types import AllocRecord, MemoryInfo, as_index, format_bytes
from .pool import PoolStats
from .records import largest_sites

__all__ = ["OomWatchdog", "memory_summary"]

_log = logging.getLogger("metrale.memory")

class OomWatchdog:
    """A daemon thread that warns when a backend's effective free memory runs low.

    Made by [`GpuBackend.spawn_oom_watchdog`][metrale_core.GpuBackend.spawn_oom_watchdog]. Every ``interval_s`` it reads
    ``memory_info()`` (which never synchronizes a stream). When
    ``effective_free`` falls under ``min_free_bytes`` it logs one WARNING on
    ``metrale.memory`` naming the ledger's largest call sites and calls
    ``on_low(info)``; when memory recovers it logs one INFO. Nothing more is
    logged while the state stays the same. [`stop`][metrale_core.OomWatchdog.stop] ends it promptly;
    closing the backend stops it. A context manager.
    """

    __slots__ = (
        "_describe", "_interval", "_low", "_min_free", "_name", "_on_low", "_poll_lock", "_read", "_stop", "_thread",
    )

    def __init__(
        self,
        name: str,
        read: Callable[[], MemoryInfo],
        describe_sites: Callable[[], str],
        *,
        interval_s: float,
        min_free_bytes: int,
        on_low: Callable[[MemoryInfo], object] | None,
    ) -> None:
        self._name = name
        self._read = read
        self._describe = describe_sites
        self._interval = interval_s
        self._min_free = min_free_bytes
        self._on_low = on_low
        self._low = False
        self._poll_lock = threading.RLock()  # poll() from the caller and from the thread: one transition each
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"metrale-oom-watchdog-{name}", daemon=True)

    def _start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the thread is still polling."""
        return self._thread.is_alive()

    @property
    def low(self) -> bool:
        """Whether the last reading was under the threshold."""
        return self._low

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop polling and wait (up to ``timeout`` seconds) for the thread to end; idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> OomWatchdog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<OomWatchdog {self._name} {state}, under {format_bytes(self._min_free)} every {self._interval}s>"

    def poll(self) -> MemoryInfo | None:
        """Take one reading now and act on it, as the thread does; ``None`` if it could not be read."""
        with self._poll_lock:
            return self._poll()

    def _poll(self) -> MemoryInfo | None:
        try:
            info = self._read()
        except MetraleError as exc:  # a closed or faulted backend: stop quietly
            _log.debug("OOM watchdog on %s stops: %s", self._name, exc.message)
            self._stop.set()
            return None
        if info.effective_free < self._min_free:
            if not self._low:
                self._low = True
                _log.warning(
                    "memory low on %s: %s effective free of %s, under the watchdog's %s; largest call sites: %s",
                    self._name, format_bytes(info.effective_free), format_bytes(info.total),
                    format_bytes(self._min_free), self._describe(),
                )
                if self._on_low is not None:
                    try:
                        self._on_low(info)
                    except Exception as exc:  # the callback's bug must not end the watchdog
                        _log.warning("OOM watchdog callback %r raised %s: %s", self._on_low, type(exc).__name__, exc)
        elif self._low:
            self._low = False
            _log.info(
                "memory recovered on %s: %s effective free, at or over the watchdog's %s",
                self._name, format_bytes(info.effective_free), format_bytes(self._min_free),
            )
        return info

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self._interval)


def check_watchdog_args(interval_s: object, min_free_bytes: object, on_low: object) -> tuple[float, int]:
    """Validate ``spawn_oom_watchdog``'s arguments; a typed error names the bad one."""
    if isinstance(interval_s, bool) or not isinstance(interval_s, int | float) or not 0 < interval_s <= 3600:
        raise InvalidArgumentError(
            f"spawn_oom_watchdog: interval_s must be a number of seconds in (0, 3600], got {interval_s!r}"
        )
    min_free = as_index(min_free_bytes)
    if min_free is None or min_free < 0:
        raise InvalidArgumentError(
            f"spawn_oom_watchdog: min_free_bytes must be a byte count >= 0, got {min_free_bytes!r}"
        )
    if on_low is not None and not callable(on_low):
        raise InvalidArgumentError(f"spawn_oom_watchdog: on_low must be callable or None, got {on_low!r}")
    return float(interval_s), min_free


class PoolTotals(NamedTuple):
    """The open memory pools of a backend, summed: a summary's line, a snapshot's ``stats["pools"]``."""

    open: int
    segment_bytes: int
    piece_bytes: int
    cached_bytes: int

    @classmethod
    def of(cls, pools: Sequence[PoolStats]) -> PoolTotals:
        return cls(len(pools), sum(p.segment_bytes for p in pools), sum(p.piece_bytes for p in pools),
                   sum(p.cached_bytes for p in pools))


def memory_summary(
    title: str,
    stats: MemoryStats,
    live: Sequence[AllocRecord],
    info: MemoryInfo | None = None,
    *,
    top: int = 5,
    pools: PoolTotals | None = None,
) -> str:
    """A table of ``stats`` as people read it, as ``torch.cuda.memory_summary()`` gives: current, peak and
    allocated bytes by kind, counts, out-of-memory failures and retries, arenas, red zones, the device's free
    memory (``info``, where known), the open memory ``pools`` (what their segments hold, cached or out) and the
    ``top`` call sites of the ``live`` allocations by bytes."""
    rule = "-" * 76
    rows = [("kind", "current", "peak", "allocated"), *(
        (kind, format_bytes(stats.current_bytes.get(kind, 0)), format_bytes(stats.peak_bytes.get(kind, 0)),
         format_bytes(stats.allocated_bytes.get(kind, 0)))
        for kind in KINDS
    ), ("all", format_bytes(stats.current_total_bytes), format_bytes(stats.peak_total_bytes),
        format_bytes(sum(stats.allocated_bytes.values())))]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    table = [f"{r[0]:<{widths[0]}}  " + "  ".join(f"{c:>{w + 4}}" for c, w in zip(r[1:], widths[1:], strict=True))
             for r in rows]
    lines = [f"metrale memory summary: {title}", "=" * 76, *table[:1], *table[1:-1], table[-1], rule]
    facts = [
        ("allocations", f"{stats.alloc_count} made, {stats.free_count} released, {len(live)} on the ledger"),
        ("out of memory", f"{stats.oom_count} failed, {stats.oom_retries} retried after a reclaim"),
        ("arenas", f"{format_bytes(stats.arena_used)} of {format_bytes(stats.arena_capacity)} handed out, "
                   f"{stats.arena_allocs} piece{'s' * (stats.arena_allocs != 1)}"),
        ("red zones", f"{stats.redzone_scans} scans; quarantine {stats.redzone_quarantined} "
                      f"({format_bytes(stats.redzone_quarantined_bytes)}); reusable {stats.redzone_reusable} "
                      f"({format_bytes(stats.redzone_reusable_bytes)})"
                      + (f"; one allocation in {stats.redzone_sample} zoned" if stats.redzone_sample > 1 else "")),
        ("graph launches", str(stats.graph_launches)),
    ]
    if pools is not None and pools.open:
        facts.append(("memory pools", f"{pools.open} open: {format_bytes(pools.segment_bytes)} in segments, "
                                      f"{format_bytes(pools.piece_bytes)} in pieces out, "
                                      f"{format_bytes(pools.cached_bytes)} cached"))
    if info is not None:
        facts.append(("device memory", f"{format_bytes(info.free)} free of {format_bytes(info.total)} "
                                       f"(an allocation can have {format_bytes(info.effective_free)})"))
    width = max(len(name) for name, _ in facts)
    lines += [f"{name:<{width}}  {text}" for name, text in facts]
    lines.append(rule)
    sites = largest_sites(live, top)
    if not sites:
        lines.append("no live allocations")
    else:
        lines.append(f"largest live call sites (of {len({r.site for r in live})})")
        site_width = max(len(site) for site, _, _ in sites)
        lines += [f"  {site:<{site_width}}  {format_bytes(nbytes):>10}  in {count} allocation{'s' * (count != 1)}"
                  for site, nbytes, count in sites]
    return "\n".join(lines)
