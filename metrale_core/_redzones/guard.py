"""The zone guard: red zones from fill to verdict, for one backend.

- Fills: the zones of each new allocation, filled on the default stream; how many fills are known
  done, so work on other streams waits for them (`ZoneGuard.settle_for`). A pool's piece for another library's
  stream is filled on that stream itself where the backend lends it (`BorrowedStreams`), and only the bytes its
  size moves where its block still holds zones judged intact (`ZoneGuard.lay`).
- Judging: a batch of zones a caller names (a free's own, the quarantine's), and the full check of
  every watched zone (``scan_redzones()``, ``close()``, a bad in-graph verdict). After a full check the
  quarantine's owner hears what it found (`ZoneGuard.on_full_check`). The guard frees no user memory.
- Graph launches: `ZoneGuard.graph_launch`, the one way the stream front launches a graph. It orders
  the in-graph checks (`.ingraph`), or queues a scan behind the launch (`.queued`), or waits for one.
- The report: `.report`'s `ZoneReport`, which the guard owns and every check's findings go to
  (`ZoneGuard.report`): each violation's suspects, observers, then a log line or a
  [`RedZoneError`][metrale_core.RedZoneError].

Checks run one at a time per backend (`ZoneGuard.lock`). The scratch is shared; a free waits for a
check that may read its zone; a checked graph launch holds the lock while the zone table is made
current and the launch issued, so no check reads memory being released.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Final, final

from .._device.buffer import DeviceBuffer
from .._device.capture import GraphKernels, active_captures, may_wait
from .._device.context import DeviceContext
from .._device.handles import Stream
from .._device.stats import StatsCounter
from .._errors import MetraleError
from .._twins import pick
from .._types import RedZoneChecks, RedZoneViolation
from .borrowed import BorrowedStreams
from .ingraph import GraphCheck, GraphChecks, open_checks
from .layout import Layout, RedZones, Zone
from .queued import QueuedScans
from .report import Blocks, ZoneReport
from .scanner import Scanner
from .zone import refill

__all__ = ["ZoneGuard"]

_log = logging.getLogger("metrale")

#: What a full check found, for the quarantine's owner (``None``: nothing was judged).
FullCheck = Callable[[Sequence[RedZoneViolation] | None], None]

@final
class ZoneGuard:
    """Red zones of one backend: fills, bookkeeping, judging, graph launches and the report."""

    __slots__ = (
        "_checks", "_checks_off", "_ctx", "_default", "_default_stream", "_fills_settled", "_full_checked",
        "_orders", "_queued", "_raw", "_report", "_scan_graphs", "_scanner", "_stats", "borrowed_streams", "fills",
        "lock", "zones",
    )

    def __init__(self, ctx: DeviceContext, stats: StatsCounter, default: Stream) -> None:
        self._ctx = ctx
        self._raw = ctx.raw
        self._stats = stats
        self._default_stream = default
        self._default = default.raw
        #: Where the live zones lie (and the table the device-side scan reads); it counts the fills issued too.
        self.zones: RedZones = pick("zones", RedZones, ctx.settings.pure)(ctx.settings)
        #: Whether this guard ever queues fills (red zones are on). Where not, work on any stream has no
        #: fill to wait for, and the hot paths skip `settle_for`.
        self.fills: Final = self.zones.size > 0
        #: One check at a time; a free holds it while it reads and releases its zones.
        self.lock = threading.RLock()
        self._scan_graphs = ctx.settings.redzone_scan_graphs  # (settings are fixed for the backend's life)
        self._report = ZoneReport(ctx, self.zones)
        self._full_checked: list[FullCheck] = []
        self._scanner = Scanner(ctx, self.zones, self._default)
        self._queued = QueuedScans(ctx, self.zones, self._scanner, stats, self.lock, self.report)
        self._fills_settled = 0  # of the fills queued on the default stream (``zones.filled``), those known done
        self._checks: GraphChecks | None = None  # the in-graph checks, once open
        self._checks_off = ""  # why graphs are not checked inside ("": not tried yet, or on)
        self._orders = True  # whether the backend orders foreign streams (until it says CUDA_ERROR_NOT_SUPPORTED)
        #: Other libraries' streams, lent for the fills of pool pieces (`BorrowedStreams.get`).
        self.borrowed_streams = BorrowedStreams(self._raw)
        stats.redzone_sample = ctx.settings.redzone_sample

    # -- fills ------------------------------------------------------------------------------

    @property
    def fill_stream(self) -> object:
        """The default stream's raw handle: every fill runs on it (the compiled lane fills there too)."""
        return self._default

    def layout(self, nbytes: int, index: int) -> Layout | None:
        """The zones of a new device allocation (``None``: it gets none)."""
        return self.zones.layout(nbytes, index)

    def guard(self, buf: DeviceBuffer, layout: Layout) -> None:
        """Fill the zones of a new allocation on the default stream, and start watching them (`lay`, with no zones in
        place).

        - Every allocation's zones are filled, a recycled block's too: a stale pointer of its previous
          owner may have written there since its check, and that write must never be reported as an
          overrun of the new allocation.
        - Work on the default stream runs after the fill; work on any other stream waits for it
          (`settle_for`), so an overrun is never erased by a late fill. No wait here.
        """
        self.lay(buf, layout, 0, None)

    def settle_for(self, stream: Stream) -> None:
        """Before work on ``stream``: wait for the fills if ``stream`` is not the default stream (and for those on
        borrowed streams, whatever ``stream`` is)."""
        default = self._default
        if self.borrowed_streams.pending or (self.zones.filled != self._fills_settled and stream.raw is not default):
            self.settle()

    def settle(self) -> None:
        """Wait for the queued fills (on the default stream, and on the borrowed streams); not while a capture runs
        anywhere.

        No wait is allowed then: ``begin_capture`` settles first, and no allocation (so no fill)
        happens during a capture.
        """
        issued = self.zones.filled
        pending = self.borrowed_streams.pending
        if (issued != self._fills_settled or pending) and may_wait():  # the check and the wait are one step
            if pending:  # (a wait for the whole device: never for a handle its library may have destroyed)
                self.sync_device()
            else:
                self._raw.stream_synchronize(self._default)
                self._fills_done(issued)

    def lay(self, buf: DeviceBuffer, layout: Layout, laid: int, stream: object | None) -> None:
        """Lay the zones of a new pool piece and start watching them: on another library's ``stream``, borrowed
        (`BorrowedStreams.get`), else (``None``) on the default stream, as `guard` does. Where its block
        still holds zones judged intact for an allocation of ``laid`` bytes (``0``: none), only the bytes the new size
        moves are filled (`refill`). A write through a stale pointer of the block's previous owner after that check is
        then found in the new owner's zone (as any overrun, with the new owner's site)."""
        zones = self.zones.zones_for(buf, layout)
        raw, fill = self._raw, self.zones.fill
        target = self._default if stream is None else stream
        if laid:
            start, length = refill(layout, laid, buf.nbytes)
            ranges = [(buf.ptr - layout.lead + start, length)] if length else []
        else:
            ranges = [(zone.start, zone.length) for zone in zones]
        for ptr, length in ranges:
            raw.memset(ptr, fill, length, target)
        if stream is not None and ranges:
            self.borrowed_streams.filled()
        self.zones.add(zones, stream is None)  # (a borrowed stream's fill is not the default stream's to settle)

    def order_foreign(self, stream: int) -> None:
        """Order another library's stream ``stream`` (DLPack's numbering: 1 the legacy default stream, 2 the
        per-thread one, else a ``CUstream``'s address) after the backend's work so far, the fills included, on the
        device; a backend without the primitive (``CUDA_ERROR_NOT_SUPPORTED``) waits for its work on the host
        instead. Fills pending on borrowed streams (which the primitive does not order) are waited for first."""
        if self.borrowed_streams.pending and may_wait():
            self.sync_device()
        if self._orders:
            try:
                self._raw.order_foreign_stream(stream)
                return
            except MetraleError as exc:
                if exc.name != "CUDA_ERROR_NOT_SUPPORTED":
                    raise
                self._orders = False
        self.sync_device()

    def sync_device(self) -> None:
        """Wait for all of the backend's work (``RawDevice.synchronize``: other libraries' streams of its context
        too); the fills issued before are done."""
        issued, borrowed = self.zones.filled, self.borrowed_streams.mark()
        self._raw.synchronize()
        self.borrowed_streams.waited(borrowed)
        self._fills_done(issued)

    def _fills_done(self, issued: int) -> None:
        with self._ctx.lock:
            self._fills_settled = max(self._fills_settled, issued)

    # -- watching and judging ----------------------------------------------------------------

    def judge(self, zones: Sequence[Zone], table: bytes | None = None) -> list[RedZoneViolation]:
        """Wait for the device, then judge ``zones`` (a free's own, or a batch of the quarantine's); ``table``: their
        scan table (`zone_table`) where the caller has it at hand, else it is made of them."""
        return self._read(zones, table)

    def unwatch(self, index: int) -> tuple[Zone, ...]:
        """Stop watching the zones of allocation ``index``; returns them. The caller holds `lock`, and calls
        `zones_released` once their memory went."""
        return self.zones.remove(index)

    def zones_released(self) -> None:
        """Zones left the table and their memory went: the in-graph checks' table follows at once."""
        if self._checks is not None:
            self._checks.zones_released(self._default_stream)

    def forget(self, index: int) -> None:
        """Stop watching the zones of allocation ``index`` (a sweep: nobody reads them)."""
        with self.lock:
            if self.zones.remove(index):
                self.zones_released()

    def on_full_check(self, callback: FullCheck) -> None:
        """Call ``callback(found)`` after every full check that read the zones, under `lock` (the quarantine's
        owner); ``callback(None)`` at close only, nothing judged."""
        self._full_checked.append(callback)

    def _full_checked_all(self, found: Sequence[RedZoneViolation] | None) -> None:
        for callback in self._full_checked:
            callback(found)

    # -- scans -------------------------------------------------------------------------------

    def scan(self) -> list[RedZoneViolation]:
        """``scan_redzones()``: wait for the device, judge every watched zone, report.

        The quarantine is released; the finished queued scans and in-graph checks are dropped (this scan
        reports every zone they could have found).
        """
        with self.lock:
            violations = self._full_check()
            self._drop_finished()
        self.report(violations, "scan_redzones()")
        return violations

    def final_scan(self) -> None:
        """The check of ``close()``: the device is idle; logged, never raised. The quarantine goes too."""
        with self.lock:
            self._ctx.quietly("drop the queued scans", self._drop_finished)
            try:
                captures = active_captures()
                if self._ctx.fault is None and not captures:
                    try:
                        self.report(self._read(), "close()", may_raise=False)
                    except MetraleError as exc:
                        _log.warning("close: the red-zone scan failed: %s", exc)
                elif watched := len(self.zones.live()):
                    why = ("the device faulted" if self._ctx.fault is not None else
                           f"{len(captures)} capture(s) run in this process, and no check may wait for the device "
                           "then (closing during another backend's capture may also invalidate it: close after its "
                           "end_capture)")
                    _log.warning("close of %s:%d: %d red zone(s) of live or freed buffers released unchecked: %s; "
                                 "call scan_redzones() before close() to judge them", self._ctx.name,
                                 self._ctx.ordinal, watched, why)
            finally:
                self._full_checked_all(None)

    def _full_check(self) -> list[RedZoneViolation]:
        """Every watched zone judged (waiting for the device); then the quarantine's owner hears of it.

        A read that fails raises, and the owner hears nothing: the quarantined zones stay watched for the
        next check.
        """
        with self.lock:
            found = self._read()
            self._full_checked_all(found)
            return found

    def _read(self, zones: Sequence[Zone] | None = None, table: bytes | None = None) -> list[RedZoneViolation]:
        """Wait for the device, then judge ``zones``: every watched zone (live or quarantined) when ``None``."""
        with self.lock:
            scanner = self._scanner
            if zones is None:
                self._stats.redzone_scans += 1
                version, zones, table = scanner.snapshot()
            else:
                version = -1
            if not zones:
                return []
            self.sync_device()
            return scanner.judge(zones, table, version)

    def _drop_finished(self) -> None:
        """Forget what the finished queued scans and in-graph checks found (the caller holds the lock)."""
        if self._checks is not None:
            self._checks.finished()
        self._queued.drop_finished()

    # -- the report (`ZoneReport`'s) -----------------------------------------------------------

    def on_violation(self, observer: Callable[[str, RedZoneViolation], object]) -> None:
        self._report.on_violation(observer)

    def watch_blocks(self, blocks: Blocks) -> None:
        """Where the open arenas' blocks lie, asked at a report (the allocator's)."""
        self._report.watch_blocks(blocks)

    def report(
        self, violations: list[RedZoneViolation], when: str, *, may_raise: bool = True,
        graphs: Sequence[GraphKernels] | None = None, blocks: Iterable[tuple[int, int]] = (),
    ) -> None:
        """`ZoneReport.report`: name each violation's backend and suspects, tell the observers, then log or raise."""
        self._report.report(violations, when, may_raise=may_raise, graphs=graphs, blocks=blocks)

    def found(self) -> tuple[RedZoneViolation, ...]:
        """The violations found since the backend opened, in the order found, each zone once (`ZoneReport.found`)."""
        return self._report.found()

    # -- graphs -------------------------------------------------------------------------------

    def _in_graph(self) -> GraphChecks | None:
        """The in-graph checks, opened on first use; ``None`` where graphs are not checked inside (then
        `checks` says why, and the queued scans stand in)."""
        if self._checks is None and not self._checks_off:
            opened = open_checks(self._ctx, self.zones, self._scanner, self._default_stream)
            if isinstance(opened, str):
                self._checks_off = opened
            else:
                self._checks = opened
        return self._checks

    @property
    def checks(self) -> RedZoneChecks:
        """How graph launches are checked: a mode, a reason, and the sentence ``metrale info`` prints."""
        settings = self._ctx.settings
        if settings.redzone == 0:
            return RedZoneChecks("off", "off", "red zones are off")
        if not settings.redzone_scan_graphs:
            when = ("when the quarantine of freed buffers passes redzone_quarantine_bytes"
                    if settings.redzone_quarantine_bytes else "at each free")
            return RedZoneChecks(f"{when}, at scan_redzones() and close() (redzone_scan_graphs is off)", "off",
                                 "redzone_scan_graphs is off")
        with self.lock:
            checks = self._in_graph()
        queued = settings.redzone_scan_queued
        wait = "queued" if queued else "waited for"
        if checks is None and not self._checks_off:
            return RedZoneChecks("not known while a capture runs (asked again after it ends)", "unknown",
                                 "a capture runs")
        if checks is not None:
            return RedZoneChecks(
                f"inside every captured graph (its last node), verdicts in mapped host memory, {wait}", "inside")
        off = self._checks_off
        if self._scanner.kernel() is False:
            return RedZoneChecks(f"after every graph launch, zones read back and waited for ({off})", "waited", off)
        return RedZoneChecks(f"by a scan {wait} after every graph launch ({off})", "queued" if queued else "waited",
                             off)

    def reserve_check(self, number: int = 0) -> GraphCheck | None:
        """At ``begin_capture`` (before its record is entered): the check its graph (``graph #number``) will end
        with."""
        with self.lock:
            checks = self._in_graph()
            return None if checks is None else checks.reserve(self._default_stream, number)

    def seal_check(self, check: GraphCheck, stream: Stream) -> None:
        """At ``end_capture``, before the driver's capture ends: the check becomes the graph's last node."""
        with self.lock:
            assert self._checks is not None
            self._checks.seal(check, stream.raw)

    def drop_check(self, check: GraphCheck) -> None:
        """A graph or executable graph holding ``check`` closed (or its capture was discarded)."""
        with self.lock:
            if self._checks is not None:
                self._checks.drop(check)

    def graph_launch(
        self, check: GraphCheck | None, stream: Stream, is_live: Callable[[DeviceBuffer], bool],
        kernels: GraphKernels | None = None,
    ) -> _GraphLaunch:
        """``with guard.graph_launch(check, stream, is_live, kernels): issue(...)``: the guard's part of one launch
        of the graph whose kernel nodes are ``kernels`` (what its scan finds suspects them; a checked graph's
        check holds its own).

        - Before: a checked graph takes `lock` until the launch is issued. The checks that finished since
          are judged (never this launch's own); the zone table is made current. The fills are settled.
        - After (only if the launch was issued): with ``redzone_scan_graphs``, the launch is checked.
          A checked graph's verdict is judged later, or at once, waiting for the stream, without
          ``redzone_scan_queued``. An unchecked graph gets a scan after it: queued behind it with
          ``redzone_scan_queued`` where scans run as kernels, else waited for.
        """
        return _GraphLaunch(self, check, stream, is_live, kernels)

    def _launching(self, check: GraphCheck | None, stream: Stream) -> None:
        """Before a launch; the caller holds `lock` for a checked graph."""
        checks = self._checks
        if check is not None and checks is not None:
            if checks.pending and may_wait():
                self._judge_checks(checks.finished())
            checks.before_launch(check, stream)
        if self.fills:
            self.settle_for(stream)

    def _launched(
        self, check: GraphCheck | None, stream: Stream, is_live: Callable[[DeviceBuffer], bool],
        kernels: GraphKernels | None,
    ) -> None:
        """After a launch was issued (the lock let go): its check, as `graph_launch` says."""
        if not self._scan_graphs:
            return
        checks = self._checks
        if check is not None and checks is not None:
            with self.lock:
                checks.launched(check, stream)
                if stream.capture is None:
                    self._stats.redzone_scans += 1
            if not self._ctx.settings.redzone_scan_queued and stream.capture is None and may_wait():
                self._raw.stream_synchronize(stream.raw)
                with self.lock:
                    bad = checks.finished(only=check)
                self._judge_checks(bad)
            return
        if active_captures():
            return
        if self._ctx.settings.redzone_scan_queued and self._queued.queue(stream, is_live, kernels):
            return
        self.report(self._full_check(), "the scan after GraphExec.launch", graphs=() if kernels is None else (kernels,))

    def _judge_checks(self, bad: Sequence[GraphCheck]) -> None:
        """Name what the checks that found bad zones found: one full check, reported as theirs.

        It waits for the device (the caller made sure it may). Zones freed since are in quarantine, or
        were reported by their release.
        """
        if not bad:
            return
        violations = self._full_check()
        graphs = ", ".join(f"#{check.number}" for check in bad)
        scanned = max(check.version for check in bad)
        if not violations:
            _log.debug("red zones: the in-graph check of graph(s) %s found bad zones (table version %d), all "
                       "reported since", graphs, scanned)
        self.report(violations, f"the check inside graph {graphs} (its latest launch)",
                    graphs=[check.kernels for check in bad])

    def waited(self, is_live: Callable[[DeviceBuffer], bool]) -> None:
        """Report what finished checks found, without waiting (at the waits a user makes)."""
        checks = self._checks
        if checks is not None and checks.pending and may_wait():
            with self.lock:
                bad = checks.finished()
            self._judge_checks(bad)
        if active_captures():
            return
        if self._queued.slots:
            self._queued.judge_finished(is_live)

    # -- close ---------------------------------------------------------------------------------

    def release(self) -> None:
        """At close: release the queued scans' events, the in-graph checks, the scratch and the scan
        kernel's module; let go of the violation observers and the full-check callbacks."""
        with self.lock:
            self._report.release()
            self._full_checked.clear()
            self._queued.release()
            if self._checks is not None:
                self._checks.release()
                self._checks = None
            self._checks_off = ""
            self._scanner.release()


@final
class _GraphLaunch:
    """`ZoneGuard.graph_launch`: the guard's part before and after one launch's issue."""

    __slots__ = ("_check", "_guard", "_is_live", "_kernels", "_stream")

    def __init__(
        self, guard: ZoneGuard, check: GraphCheck | None, stream: Stream, is_live: Callable[[DeviceBuffer], bool],
        kernels: GraphKernels | None,
    ) -> None:
        self._guard = guard
        self._check = check
        self._stream = stream
        self._is_live = is_live
        self._kernels = kernels

    def __enter__(self) -> None:
        guard = self._guard
        if self._check is None:
            guard._launching(None, self._stream)
            return
        guard.lock.acquire()  # the zone table stays as the graph's check reads it until the launch is issued
        try:
            guard._launching(self._check, self._stream)
        except BaseException:
            guard.lock.release()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        guard = self._guard
        if self._check is not None:
            guard.lock.release()
        if exc_type is None:
            guard._launched(self._check, self._stream, self._is_live, self._kernels)
