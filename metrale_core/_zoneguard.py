"""The zone guard: red zones from fill to verdict, for one backend.

It owns the red-zone bookkeeping (:class:`~metrale_core._redzone.RedZones`), the fills
queued on the default stream and how many of them are known done, every kind of scan
(a free's own zones, ``scan_redzones()``, the scan after a graph launch, the scans queued
behind graph launches), the scan kernel's module, one scratch pool for all of them, and
the report (observers, then a log line or a :class:`~metrale_core.RedZoneError`).

Scans run one at a time per backend (:attr:`ZoneGuard.lock`): the scratch is shared, and
a free waits for a scan that may read its zone.
"""

from __future__ import annotations

import array
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Literal

from ._buffer import DeviceBuffer
from ._capture import active_captures
from ._context import DeviceContext
from ._errors import MetraleError, RedZoneError
from ._handles import Stream
from ._pressure import StatsCounter
from ._ptx import Param, check_architecture, parse_ptx
from ._redzone import Layout, RedZones, Zone
from ._types import LaunchArg, RedZoneViolation
from .kernels import shipped_modules

__all__ = ["ZoneGuard"]

_log = logging.getLogger("metrale")

#: Fewer zones than this are read back rather than scanned by the device-side kernel.
_DEVICE_SCAN_MIN_ZONES: Final = 8

#: Scans queued behind graph launches that may be in flight at once; a launch that finds them all
#: pending waits for the oldest.
_MAX_QUEUED_SCANS: Final = 4

#: What a finished queued scan found: the launch it followed, and the violations.
_Judged = tuple[str, list[RedZoneViolation]]


def _zone_table(zones: Sequence[Zone]) -> bytes:
    """The scan kernel's table for ``zones``: an (address, length) pair of u64 per zone."""
    table = array.array("Q")
    for zone in zones:
        table.extend((zone.start, zone.length))
    return table.tobytes()


def _zone_violations(
    zones: Sequence[Zone], firsts: Iterable[int], keep: Callable[[DeviceBuffer], bool] = lambda buf: True
) -> list[RedZoneViolation]:
    """The violations in a scan's results: ``firsts[i]`` is zone ``i``'s first changed offset + 1, or 0."""
    return [
        RedZoneViolation(z.buffer.ptr, z.buffer.nbytes, z.buffer.index, z.buffer.site, z.side, first - 1)
        for z, first in zip(zones, firsts, strict=True)
        if first and keep(z.buffer)
    ]


class _Scratch:
    """The guard's one scratch pool: device and pinned host buffers by role, kept and grown as needed
    (raw arena memory and raw host memory: on no ledger). Released together at close."""

    __slots__ = ("_device", "_host", "_raw")

    def __init__(self, ctx: DeviceContext) -> None:
        self._raw = ctx.raw
        self._device: dict[str, tuple[int, int]] = {}  # role -> (pointer, bytes)
        self._host: dict[str, tuple[int, memoryview]] = {}

    def device(self, role: str, nbytes: int, *, floor: int = 1 << 16) -> tuple[int, bool]:
        """Device scratch of at least ``nbytes`` for ``role``; and whether it was just (re)allocated."""
        held = self._device.get(role)
        if held is not None and held[1] >= nbytes:
            return held[0], False
        if held is not None:
            del self._device[role]
            self._raw.free(held[0], "arena")
        size = max(nbytes * 2, floor)  # room to grow without a reallocation per scan
        self._device[role] = (self._raw.alloc(size, "arena"), size)
        return self._device[role][0], True

    def host(self, role: str, nbytes: int, *, floor: int = 1 << 16) -> memoryview:
        """Pinned host scratch of at least ``nbytes`` for ``role``."""
        held = self._host.get(role)
        if held is not None and len(held[1]) >= nbytes:
            return held[1]
        if held is not None:
            del self._host[role]
            self._raw.free_host(held[0])
        self._host[role] = self._raw.alloc_host(max(nbytes * 2, floor))
        return self._host[role][1]

    def release(self, ctx: DeviceContext) -> None:
        for ptr, _ in self._device.values():
            ctx.quietly("free a red-zone scan buffer", self._raw.free, ptr, "arena")
        for ptr, _ in self._host.values():
            ctx.quietly("free a red-zone scan buffer", self._raw.free_host, ptr)
        self._device.clear()
        self._host.clear()


class _Scanner:
    """The shipped ``redzone.redzone_scan`` kernel, loaded by the guard itself (metrale's own: not in
    ``run_metrics``)."""

    __slots__ = ("function", "module", "params")

    def __init__(self, module: object, function: object, params: tuple[Param, ...]) -> None:
        self.module = module
        self.function = function
        self.params = params  # .u64 table, .u32 count, .u32 fill, .u64 results


class _QueuedScan:
    """A scan queued behind a graph launch. Its scratch (roles ``queued<i>.*``) holds its own copy of
    the zone table, written on the stream of the scan that reads it, and only when the live-zone set
    changed since this slot last held it."""

    __slots__ = ("capacity", "event", "name", "pending", "seq", "table_version", "when", "zones")

    def __init__(self, name: str, event: object) -> None:
        self.name = name
        self.event = event
        self.table_version = -1
        self.capacity = 0
        self.pending = False
        self.seq = 0
        self.when = ""
        self.zones: Sequence[Zone] = ()


class ZoneGuard:
    """Red zones of one backend: fills, bookkeeping, scans and their report."""

    __slots__ = (
        "_ctx", "_default", "_fills_issued", "_fills_settled", "_observers", "_pool", "_queued",
        "_queued_version", "_raw", "_scanner", "_stats", "_table_version", "lock", "zones",
    )

    def __init__(self, ctx: DeviceContext, stats: StatsCounter, default: Stream) -> None:
        self._ctx = ctx
        self._raw = ctx.raw
        self._stats = stats
        self._default = default.raw
        #: Where the live zones lie (and the table the device-side scan reads).
        self.zones = RedZones(ctx.settings)
        #: One scan at a time; a free holds it while it reads and releases its zones.
        self.lock = threading.RLock()
        self._observers: list[Callable[[str, RedZoneViolation], object]] = []
        self._scanner: _Scanner | Literal[False] | None = None  # None: not tried yet
        self._pool = _Scratch(ctx)
        self._table_version = -1  # the live-zone table version the "table" scratch holds
        self._queued: list[_QueuedScan] = []
        self._queued_version = -1  # the version last written to a queued scan's table
        self._fills_issued = 0  # fills queued on the default stream
        self._fills_settled = 0  # of those, known done

    # -- fills ------------------------------------------------------------------------------

    def layout(self, nbytes: int, index: int) -> Layout:
        return self.zones.layout(nbytes, index)

    def guard(self, buf: DeviceBuffer, layout: Layout) -> None:
        """Fill the zones of a new allocation on the default stream and start watching them.

        Work on the default stream runs after the fill; work on any other stream waits for it
        (:meth:`settle_for`), so an overrun is never erased by a late fill. No wait here.
        """
        zones = self.zones.zones_for(buf, layout)
        for zone in zones:
            self._raw.memset(zone.start, self.zones.fill, zone.length, self._default)
        with self._ctx.lock:
            self._fills_issued += 1
        self.zones.add(zones)

    def settle_for(self, stream: Stream) -> None:
        """Before work on ``stream``: wait for the fills if ``stream`` is not the default stream."""
        if self._fills_issued != self._fills_settled and stream.raw is not self._default:
            self.settle()

    def settle(self) -> None:
        """Wait for the queued fills; not while a capture runs anywhere (then no wait is allowed:
        ``begin_capture`` settles first, and no allocation, so no fill, happens during a capture)."""
        issued = self._fills_issued
        if issued != self._fills_settled and not active_captures():
            self._raw.stream_synchronize(self._default)
            self._fills_done(issued)

    def sync_device(self) -> None:
        """Wait for all of the backend's work (``RawDevice.synchronize``); the fills issued before are done."""
        issued = self._fills_issued
        self._raw.synchronize()
        self._fills_done(issued)

    def _fills_done(self, issued: int) -> None:
        with self._ctx.lock:
            self._fills_settled = max(self._fills_settled, issued)

    # -- frees and sweeps ----------------------------------------------------------------------

    def free_checked(self, buf: DeviceBuffer, release: Callable[[], None]) -> None:
        """Stop watching ``buf``'s zones, read them while the culprit is fresh, ``release()`` the memory
        whatever the read says, then report what the read found (a free waits for the device anyway)."""
        with self.lock:  # no scan may read these zones once the memory is released
            zones = self.zones.remove(buf.index)
            try:
                violations = self._read(zones)
            finally:
                release()
        self.report(violations, f"free of allocation #{buf.index}")

    def forget(self, index: int) -> None:
        """Stop watching the zones of allocation ``index`` (a sweep: nobody reads them)."""
        with self.lock:
            self.zones.remove(index)

    # -- scans -------------------------------------------------------------------------------

    def on_violation(self, observer: Callable[[str, RedZoneViolation], object]) -> None:
        self._observers.append(observer)

    def scan(self) -> list[RedZoneViolation]:
        """``scan_redzones()``: wait for the device, judge every live zone, report."""
        with self.lock:
            violations = self._read()
            self._drop_queued()  # this scan reports every zone the finished ones could have found
        self.report(violations, "scan_redzones()")
        return violations

    def final_scan(self) -> None:
        """The scan of ``close()``: the device is idle; logged, never raised."""
        with self.lock:
            self._ctx.quietly("drop the queued scans", self._drop_queued)
            if self._ctx.fault is None and not active_captures():
                try:
                    self.report(self._read(), "close()", may_raise=False)
                except MetraleError as exc:
                    _log.warning("close: the red-zone scan failed: %s", exc)

    def _read(self, zones: Sequence[Zone] | None = None) -> list[RedZoneViolation]:
        """Wait for the device, then judge ``zones`` (every live zone when ``None``): on the device
        where the backend runs kernels, else by reads."""
        with self.lock:
            table: bytes | None
            if zones is None:
                self._stats.redzone_scans += 1
                version, zones, table = self.zones.snapshot(self._table_version)
            else:
                version, table = -1, None
            if not zones:
                return []
            self.sync_device()
            if len(zones) < _DEVICE_SCAN_MIN_ZONES:  # a free's own zones: one read beats three device calls
                return self._scan_by_reads(zones)
            scanner = self._load_scanner()
            if scanner is False:
                return self._scan_by_reads(zones)
            firsts = self._scan_on_device(scanner, zones, table, version)
            return [] if firsts is None else _zone_violations(zones, firsts)

    def _load_scanner(self) -> _Scanner | Literal[False]:
        """The scan kernel, loaded once; ``False`` where it cannot load (then zones are read back)."""
        if self._scanner is None:
            try:
                image = shipped_modules("redzone")["redzone"]
                parsed = parse_ptx("redzone", image)
                check_architecture({"redzone": parsed}, self._raw.compute_capability(), self._raw.device_name())
                module = self._raw.module_load("redzone", image)
                try:
                    function = self._raw.module_function(module, "redzone_scan")
                except MetraleError:
                    self._ctx.quietly("module unload", self._raw.module_unload, module)
                    raise
            except MetraleError as exc:
                _log.info("red-zone scans read each zone back: the scan kernel cannot load here (%s)", exc.message)
                self._scanner = False
            else:
                self._scanner = _Scanner(module, function, parsed.entries["redzone_scan"])
        return self._scanner

    def _launch_scan(self, scanner: _Scanner, table_ptr: int, n: int, result_ptr: int, stream: object) -> None:
        """Queue the scan kernel over the ``n`` zones of the device table at ``table_ptr``."""
        table, count, fill, result = scanner.params
        args = [
            LaunchArg(table, table_ptr.to_bytes(8, "little"), table_ptr),
            LaunchArg(count, n.to_bytes(4, "little")),
            LaunchArg(fill, self.zones.fill.to_bytes(4, "little")),
            LaunchArg(result, result_ptr.to_bytes(8, "little"), result_ptr),
        ]
        self._raw.launch(scanner.function, (n, 1, 1), (256, 1, 1), 0, stream, args)

    def _scan_on_device(
        self, scanner: _Scanner, zones: Sequence[Zone], table: bytes | None, version: int
    ) -> list[int] | None:
        """One launch checks every zone; one small copy brings back, per zone, first changed offset + 1
        (or 0). ``table`` is the zones' (address, length) pairs, or ``None``: then the device's copy of
        the live-zone table of ``version`` is used if it holds that version, else it is built from
        ``zones`` (always for ``version`` -1, zones of the caller's choosing). ``None`` when no zone
        changed (the common case, judged with one compare of the results, not a loop over them)."""
        n = len(zones)
        table_ptr, grown = self._pool.device("table", n * 16)
        result_ptr, _ = self._pool.device("result", n * 4)
        stream = self._default
        if table is None and (grown or version < 0 or version != self._table_version):
            table = _zone_table(zones)
        if table is not None:
            self._raw.copy_htod(table_ptr, memoryview(table), stream, pinned=False)
            self._table_version = version  # -1 for a caller's own zones: the next full scan copies again
        self._launch_scan(scanner, table_ptr, n, result_ptr, stream)
        results = bytearray(n * 4)
        self._raw.copy_dtoh(memoryview(results), result_ptr, stream, pinned=False)  # no capture runs here
        if results.count(0) == len(results):
            return None
        return list(memoryview(results).cast("I"))

    def _scan_by_reads(self, zones: Sequence[Zone]) -> list[RedZoneViolation]:
        """The fallback: every zone read into one pinned buffer, one synchronize, judged on the host."""
        scratch = self._pool.host("reads", sum(z.length for z in zones))
        stream = self._default
        offset = 0
        for zone in zones:
            self._raw.copy_dtoh(scratch[offset : offset + zone.length], zone.start, stream, pinned=True)
            offset += zone.length
        self._raw.stream_synchronize(stream)
        violations = []
        offset = 0
        for zone in zones:
            violation = self.zones.judge(zone, bytes(scratch[offset : offset + zone.length]))
            offset += zone.length
            if violation is not None:
                violations.append(violation)
        return violations

    # -- the report ----------------------------------------------------------------------------

    def report(self, violations: list[RedZoneViolation], when: str, *, may_raise: bool = True) -> None:
        """Tell the observers, then log or raise, as ``redzone_action`` says."""
        if not violations:
            return
        for violation in violations:
            for observer in self._observers:
                try:
                    with self._ctx.outside():  # user code: close() from another thread need not wait for it
                        observer(self._ctx.name, violation)
                except Exception as exc:  # an observer's bug must not hide the violation
                    _log.warning("red-zone observer %r raised %s: %s", observer, type(exc).__name__, exc)
        if self._ctx.settings.redzone_action == "raise" and may_raise:
            raise RedZoneError(
                f"{when} found {len(violations)} red-zone violation(s): "
                + "; ".join(v.describe() for v in violations)
                + ". Fix the write past the buffer's bounds (redzone_trace_idx=<index> logs where it was allocated)",
                violations,
            )
        for violation in violations:
            _log.warning("%s (found by %s)", violation.describe(), when)

    # -- after graph launches -----------------------------------------------------------------

    def after_graph_launch(self, stream: Stream, is_live: Callable[[DeviceBuffer], bool]) -> None:
        """With ``redzone_scan_graphs``: scan after the launch (queued behind it with
        ``redzone_scan_queued`` where scans run as kernels, else waiting for it)."""
        settings = self._ctx.settings
        if not settings.redzone_scan_graphs or active_captures():
            return
        if settings.redzone_scan_queued and self._queue_scan(stream, is_live):
            return
        self.report(self._read(), "the scan after GraphExec.launch")

    def waited(self, is_live: Callable[[DeviceBuffer], bool]) -> None:
        """Report the queued scans that have finished, without waiting (at the waits a user makes)."""
        if self._queued and not active_captures():
            finished: list[_Judged] = []
            try:
                self._judge_queued(finished, is_live, wait=False)
            finally:
                self._report_judged(finished)

    def _queue_scan(self, stream: Stream, is_live: Callable[[DeviceBuffer], bool]) -> bool:
        """Queue a scan of every live zone on ``stream`` behind the graph just launched on it, without
        waiting; report the earlier launches' scans that have finished (never this launch's own, so
        every backend reports it at the same later call). ``False`` where scans cannot run as kernels."""
        finished: list[_Judged] = []
        with self.lock:
            scanner = self._load_scanner()
            if scanner is False:
                return False
            try:
                self._judge_queued(finished, is_live, wait=False)
                version, zones, table = self.zones.snapshot(self._queued_version)
                if zones:
                    self._stats.redzone_scans += 1
                    n = len(zones)
                    slot = self._slot(n, finished, is_live)
                    target = stream.raw
                    table_ptr, _ = self._pool.device(f"{slot.name}.table", slot.capacity * 16, floor=0)
                    result_ptr, _ = self._pool.device(f"{slot.name}.result", slot.capacity * 4, floor=0)
                    host = self._pool.host(f"{slot.name}.host", slot.capacity * 4, floor=0)
                    if slot.table_version != version:
                        if table is None:  # unchanged since another slot was written: this one is older
                            table = _zone_table(zones)
                        self._raw.copy_htod(table_ptr, memoryview(table), target, pinned=False)
                        slot.table_version = self._queued_version = version
                    self._launch_scan(scanner, table_ptr, n, result_ptr, target)
                    self._raw.copy_dtoh(host[: n * 4], result_ptr, target, pinned=True)
                    self._raw.event_record(slot.event, target)
                    slot.zones, slot.pending, slot.seq = zones, True, self._stats.graph_launches
                    slot.when = f"graph launch #{slot.seq}"
            except BaseException:
                self._report_judged(finished, may_raise=False)  # logged: the failure to queue is what raises
                raise
        self._report_judged(finished)
        return True

    def _slot(self, n: int, finished: list[_Judged], is_live: Callable[[DeviceBuffer], bool]) -> _QueuedScan:
        """A queued-scan slot not in flight with room for ``n`` zones; when all are in flight, the oldest
        is waited for (its results go to ``finished``)."""
        idle = [slot for slot in self._queued if not slot.pending]
        if not idle and len(self._queued) >= _MAX_QUEUED_SCANS:
            oldest = min(self._queued, key=lambda slot: slot.seq)
            self._judge_queued(finished, is_live, wait=True, only=oldest)
            idle = [oldest]
        slot = next((s for s in idle if s.capacity >= n), idle[0] if idle else None)
        if slot is None:
            slot = _QueuedScan(f"queued{len(self._queued)}", self._raw.event_create())
            self._queued.append(slot)
        if slot.capacity < n:
            slot.capacity, slot.table_version = max(2 * n, 1024), -1  # the pool grows its buffers to match
        return slot

    def _judge_queued(
        self,
        finished: list[_Judged],
        is_live: Callable[[DeviceBuffer], bool],
        *,
        wait: bool,
        only: _QueuedScan | None = None,
    ) -> None:
        """Add to ``finished`` the violations found by the queued scans that are done (all of them,
        waiting, when ``wait``), oldest first. A zone whose allocation was freed since is left out:
        ``free`` read it and reported it itself."""
        with self.lock:
            for slot in sorted(self._queued, key=lambda slot: slot.seq):
                if not slot.pending or (only is not None and slot is not only):
                    continue
                if wait:
                    self._raw.event_synchronize(slot.event)
                elif not self._raw.event_query(slot.event):
                    continue
                zones, slot.zones, slot.pending = slot.zones, (), False
                results = self._pool.host(f"{slot.name}.host", slot.capacity * 4, floor=0)[: len(zones) * 4]
                if bytes(results).count(0) == len(results):
                    continue
                violations = _zone_violations(zones, results.cast("I"), keep=is_live)
                if violations:
                    finished.append((slot.when, violations))

    def _report_judged(self, finished: list[_Judged], *, may_raise: bool = True) -> None:
        """Report the violations of finished queued scans together (one error, naming every launch)."""
        if not finished:
            return
        launches = [when for when, _ in finished]
        named = launches[0] if len(launches) == 1 else ", ".join(launches[:-1]) + " and " + launches[-1]
        scans = "the scan" if len(launches) == 1 else "the scans"
        violations = [v for _, found in finished for v in found]
        self.report(violations, f"{scans} queued after {named} of this backend", may_raise=may_raise)

    def _drop_queued(self) -> None:
        """Forget the results of the queued scans that are done: a full scan that has just run (the
        caller holds the lock) reports every zone they could have found. Scans still running are kept."""
        for slot in self._queued:
            if slot.pending and self._raw.event_query(slot.event):
                slot.pending, slot.zones = False, ()

    # -- close ---------------------------------------------------------------------------------

    def release(self) -> None:
        """Release the scratch, the queued scans' events and the scan kernel's module, and let go of the
        violation observers (at close)."""
        ctx = self._ctx
        with self.lock:
            self._observers.clear()
            for slot in self._queued:
                ctx.quietly("event destroy", self._raw.event_destroy, slot.event)
            self._queued.clear()
            self._pool.release(ctx)
            if isinstance(self._scanner, _Scanner):
                ctx.quietly("module unload", self._raw.module_unload, self._scanner.module)
            self._scanner = None
