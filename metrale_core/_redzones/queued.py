"""Scans queued behind graph launches: where graphs are not checked inside, with ``redzone_scan_queued``.

- `QueuedScans`: the slots, queueing a scan behind a launch, judging the finished ones, the report.
- A slot (`_Slot`): one scan in flight at most. Its scratch (roles ``queued<i>.*``) holds its own copy
  of the zone table, written on the scan's stream, only when the live zones changed since.
- At most four slots: a launch that finds them all pending waits for the oldest.
- A finished scan is reported through the ``report`` callable it was given (the guard's): one error,
  naming every launch; the kernel nodes of the graphs they followed are the suspects.

Callers hold the guard's lock (it is given here as ``lock``, and taken again where a call needs it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Final, Protocol, final

from .._device.buffer import DeviceBuffer
from .._device.capture import GraphKernels
from .._device.context import DeviceContext
from .._device.handles import Stream
from .._device.stats import StatsCounter
from .._types import RedZoneViolation
from .layout import RedZones, Zone, zone_table, zone_violations
from .scanner import Scanner

__all__ = ["QueuedScans", "Report"]

#: Scans queued behind graph launches that may be in flight at once.
_MAX_QUEUED_SCANS: Final = 4

#: What a finished queued scan found: the launch it followed, the violations, and the kernels of the graph launched.
_Judged = tuple[str, list[RedZoneViolation], GraphKernels | None]


class Report(Protocol):
    """The guard's report: name the suspects (the nodes of ``graphs``), tell the observers, then log or raise."""

    def __call__(
        self, violations: list[RedZoneViolation], when: str, *, may_raise: bool = True,
        graphs: Sequence[GraphKernels] | None = None,
    ) -> None: ...


@final
class _Slot:
    """One queued scan: its event, its zones, and the launch it follows (and that graph's kernels)."""

    __slots__ = ("capacity", "event", "kernels", "name", "pending", "seq", "table_version", "when", "zones")

    def __init__(self, name: str, event: object) -> None:
        self.name = name
        self.event = event
        self.table_version = -1
        self.capacity = 0
        self.pending = False
        self.seq = 0
        self.when = ""
        self.zones: Sequence[Zone] = ()
        self.kernels: GraphKernels | None = None


@final
class QueuedScans:
    """The scans queued behind one backend's graph launches."""

    __slots__ = ("_ctx", "_lock", "_raw", "_report", "_scanner", "_stats", "_version", "_zones", "slots")

    def __init__(
        self, ctx: DeviceContext, zones: RedZones, scanner: Scanner, stats: StatsCounter,
        lock: threading.RLock, report: Report,
    ) -> None:
        self._ctx = ctx
        self._raw = ctx.raw
        self._zones = zones
        self._scanner = scanner
        self._stats = stats
        self._lock = lock
        self._report = report
        self._version = -1  # the table version last written to a slot's table
        #: The slots made so far (none until the first scan is queued).
        self.slots: list[_Slot] = []

    def queue(
        self, stream: Stream, is_live: Callable[[DeviceBuffer], bool], kernels: GraphKernels | None = None
    ) -> bool:
        """Queue a scan of every live zone on ``stream``, behind the graph just launched on it (whose kernel
        nodes are ``kernels``: what the scan finds suspects them); no wait.

        - The earlier launches' scans that have finished are reported. Never this launch's own: every
          backend reports it at the same later call.
        - ``False`` where scans cannot run as kernels.
        """
        finished: list[_Judged] = []
        raw = self._raw
        with self._lock:
            kernel = self._scanner.kernel()
            if kernel is False:
                return False
            try:
                self._judge(finished, is_live, wait=False)
                version, zones, table = self._zones.snapshot(self._version)
                if zones:
                    self._stats.redzone_scans += 1
                    n = len(zones)
                    slot = self._slot(n, finished, is_live)
                    target = stream.raw
                    pool = self._scanner.pool
                    table_ptr, _ = pool.device(f"{slot.name}.table", slot.capacity * 16, floor=0)
                    result_ptr, _ = pool.device(f"{slot.name}.result", slot.capacity * 4, floor=0)
                    host = pool.host(f"{slot.name}.host", slot.capacity * 4, floor=0)
                    if slot.table_version != version:
                        if table is None:  # unchanged since another slot was written: this one is older
                            table = zone_table(zones)
                        raw.copy_htod(table_ptr, memoryview(table), target, pinned=False)
                        slot.table_version = self._version = version
                    self._scanner.launch(kernel, table_ptr, n, result_ptr, target)
                    raw.copy_dtoh(host[: n * 4], result_ptr, target, pinned=True)
                    raw.event_record(slot.event, target)
                    slot.zones, slot.pending, slot.seq = zones, True, self._stats.graph_launches
                    slot.when = f"graph launch #{slot.seq}"
                    slot.kernels = kernels
            except BaseException:
                self._report_judged(finished, may_raise=False)  # logged: the failure to queue is what raises
                raise
        self._report_judged(finished)
        return True

    def judge_finished(self, is_live: Callable[[DeviceBuffer], bool]) -> None:
        """Report what the finished scans found, without waiting (at the waits a user makes)."""
        finished: list[_Judged] = []
        try:
            self._judge(finished, is_live, wait=False)
        finally:
            self._report_judged(finished)

    def drop_finished(self) -> None:
        """Forget the results of the finished scans: a full scan has just run (the caller holds the lock).
        Those still running are kept."""
        for slot in self.slots:
            if slot.pending and self._raw.event_query(slot.event):
                slot.pending, slot.zones, slot.kernels = False, (), None

    def _slot(self, n: int, finished: list[_Judged], is_live: Callable[[DeviceBuffer], bool]) -> _Slot:
        """A slot not in flight with room for ``n`` zones. When all are in flight, the oldest is waited
        for (its results go to ``finished``)."""
        idle = [slot for slot in self.slots if not slot.pending]
        if not idle and len(self.slots) >= _MAX_QUEUED_SCANS:
            oldest = min(self.slots, key=lambda slot: slot.seq)
            self._judge(finished, is_live, wait=True, only=oldest)
            idle = [oldest]
        slot = next((s for s in idle if s.capacity >= n), idle[0] if idle else None)
        if slot is None:
            slot = _Slot(f"queued{len(self.slots)}", self._raw.event_create())
            self.slots.append(slot)
        if slot.capacity < n:
            slot.capacity, slot.table_version = max(2 * n, 1024), -1  # the pool grows its buffers to match
        return slot

    def _judge(
        self,
        finished: list[_Judged],
        is_live: Callable[[DeviceBuffer], bool],
        *,
        wait: bool,
        only: _Slot | None = None,
    ) -> None:
        """Add to ``finished`` the violations of the scans that are done, oldest first.

        - ``wait``: all of them (or ``only``), waiting for each.
        - A zone still watched (live, or freed into the quarantine) is kept.
        - A zone whose allocation left since (freed at once, or released from the quarantine) is left
          out: that ``free`` or drain read it and reported it itself.
        """
        with self._lock:
            for slot in sorted(self.slots, key=lambda slot: slot.seq):
                if not slot.pending or (only is not None and slot is not only):
                    continue
                if wait:
                    self._raw.event_synchronize(slot.event)
                elif not self._raw.event_query(slot.event):
                    continue
                zones, slot.zones, slot.pending = slot.zones, (), False
                kernels, slot.kernels = slot.kernels, None
                pool = self._scanner.pool
                results = pool.host(f"{slot.name}.host", slot.capacity * 4, floor=0)[: len(zones) * 4]
                if bytes(results).count(0) == len(results):
                    continue
                violations = zone_violations(  # zones freed since: in quarantine, still watched, or reported
                    zones, results.cast("I"), keep=lambda buf: is_live(buf) or self._zones.watched(buf.index))
                if violations:
                    finished.append((slot.when, violations, kernels))

    def _report_judged(self, finished: list[_Judged], *, may_raise: bool = True) -> None:
        """Report the violations of finished scans together (one error, naming every launch)."""
        if not finished:
            return
        launches = [when for when, _, _ in finished]
        named = launches[0] if len(launches) == 1 else ", ".join(launches[:-1]) + " and " + launches[-1]
        scans = "the scan" if len(launches) == 1 else "the scans"
        violations = [v for _, found, _ in finished for v in found]
        graphs = [kernels for _, _, kernels in finished if kernels is not None]
        self._report(violations, f"{scans} queued after {named} of this backend", may_raise=may_raise, graphs=graphs)

    def release(self) -> None:
        """Destroy the slots' events (at close; their scratch is the scanner's)."""
        for slot in self.slots:
            self._ctx.quietly("event destroy", self._raw.event_destroy, slot.event)
        self.slots.clear()
