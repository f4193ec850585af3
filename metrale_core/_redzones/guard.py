"""The zone guard: red zones from fill to verdict, for one backend.

It owns the red-zone bookkeeping (`RedZones`), the fills
queued on the default stream and how many of them are known done, the quarantine of freed
zoned buffers, every kind of check (a free's own zones, a batch of quarantined buffers,
``scan_redzones()``, the in-graph checks of `_graphcheck`, and where those
cannot run the scans queued behind or waiting after graph launches), the scan kernel's module,
one scratch pool for all of them, and the report (observers, then a log line or a
[`RedZoneError`][metrale_core.RedZoneError]).

Checks run one at a time per backend (`ZoneGuard.lock`): the scratch is shared, a free
waits for a check that may read its zone, and a graph launch holds it while the zone table
is made current, so no check reads memory being released.
"""

from __future__ import annotations

import array
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Literal

from .._device.buffer import DeviceBuffer
from .._device.capture import active_captures, may_wait
from .._device.context import DeviceContext
from .._device.handles import Stream
from .._device.stats import StatsCounter
from .._errors import MetraleError, RedZoneError
from .._types import AllocKind, LaunchArg, RedZoneViolation
from ..kernels import shipped_modules
from ..kernels._ptx import Param, check_architecture, parse_ptx
from .ingraph import GraphCheck, GraphChecks
from .layout import Layout, RedZones, Zone

__all__ = ["QUARANTINE_MAX_BUFFERS", "ZoneGuard"]

_log = logging.getLogger("metrale")

#: Fewer zones than this are read back rather than scanned by the device-side kernel.
_DEVICE_SCAN_MIN_ZONES: Final = 8

#: Scans queued behind graph launches that may be in flight at once; a launch that finds them all
#: pending waits for the oldest.
_MAX_QUEUED_SCANS: Final = 4

#: What a finished queued scan found: the launch it followed, and the violations.
_Judged = tuple[str, list[RedZoneViolation]]

#: The quarantine is checked and released once it holds more buffers than this (or more bytes than
#: ``redzone_quarantine_bytes``).
QUARANTINE_MAX_BUFFERS: Final = 1024


class _Quarantined:
    """A freed zoned buffer waiting in quarantine: off the ledger, its memory and zones still held."""

    __slots__ = ("buf", "kind", "layout", "raw_ptr", "zones")

    def __init__(self, buf: DeviceBuffer, zones: tuple[Zone, ...], raw_ptr: int, kind: AllocKind) -> None:
        self.buf = buf
        self.zones = zones
        self.raw_ptr = raw_ptr
        self.kind = kind
        lead = sum(zone.length for zone in zones if zone.side == "lead")
        trail = sum(zone.length for zone in zones if zone.side == "trail")
        self.layout = Layout(lead + buf.nbytes + trail, lead, trail)  # what the device gave, zones included


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
    """The shipped ``redzone`` module's kernels, loaded by the guard itself (metrale's own: not in
    ``run_metrics``): ``redzone_scan``, and ``redzone_verdict`` for the in-graph checks."""

    __slots__ = ("function", "module", "params", "verdict")

    def __init__(
        self, module: object, function: object, params: tuple[Param, ...],
        verdict: tuple[object, tuple[Param, ...]] | None,
    ) -> None:
        self.module = module
        self.function = function
        self.params = params  # .u64 table, .u32 count, .u32 fill, .u64 results
        self.verdict = verdict  # (function, params: .u64 desc, .u64 state, .u64 slot), if the module has it


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
        "_checks", "_checks_off", "_ctx", "_default", "_default_stream", "_fills_issued", "_fills_settled",
        "_observers", "_pool", "_quarantine", "_queued", "_queued_version", "_raw", "_reuse", "_scanner",
        "_stats", "_table_version", "fills", "lock", "zones",
    )

    def __init__(self, ctx: DeviceContext, stats: StatsCounter, default: Stream) -> None:
        self._ctx = ctx
        self._raw = ctx.raw
        self._stats = stats
        self._default_stream = default
        self._default = default.raw
        #: Where the live zones lie (and the table the device-side scan reads).
        self.zones = RedZones(ctx.settings)
        #: Whether this guard ever queues fills (red zones are on): where not, work on any stream has no fill
        #: to wait for, and the hot paths skip `settle_for`.
        self.fills: Final = self.zones.size > 0
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
        self._quarantine: list[_Quarantined] = []
        #: Checked freed blocks by layout, kept for the next allocation of that layout (oldest layout first).
        self._reuse: dict[Layout, list[int]] = {}
        self._checks: GraphChecks | None = None  # the in-graph checks, once open
        self._checks_off = ""  # why graphs are not checked inside ("": not tried yet, or on)
        stats.redzone_sample = ctx.settings.redzone_sample

    # -- fills ------------------------------------------------------------------------------

    def layout(self, nbytes: int, index: int) -> Layout | None:
        """The zones of a new device allocation (``None``: it gets none)."""
        return self.zones.layout(nbytes, index)

    def reuse(self, layout: Layout) -> int | None:
        """A checked block of ``layout`` freed earlier, for a new allocation (its raw pointer), or ``None``.

        Such a block left the quarantine with its zones found intact (the device idle), so its zones
        still hold the fill: the allocation needs neither the driver nor a fill. Only with a quarantine
        (``redzone_quarantine_bytes`` > 0), whose bound covers these blocks too.
        """
        if not self._reuse:  # no lock for the common miss: a stale answer only costs a driver call
            return None
        with self.lock:
            blocks = self._reuse.get(layout)
            if not blocks:
                return None
            ptr = blocks.pop()
            if not blocks:
                del self._reuse[layout]
        self._stats.reusable(-1, -layout.raw_bytes)
        return ptr

    def guard(self, buf: DeviceBuffer, layout: Layout, *, filled: bool = False) -> None:
        """Fill the zones of a new allocation on the default stream (unless ``filled``: a block from
        `reuse`) and start watching them.

        Work on the default stream runs after the fill; work on any other stream waits for it
        (`settle_for`), so an overrun is never erased by a late fill. No wait here.
        """
        zones = self.zones.zones_for(buf, layout)
        if not filled:
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
        if issued != self._fills_settled and may_wait():  # the check and the wait are one step
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

    def free_checked(self, buf: DeviceBuffer, raw_ptr: int, kind: AllocKind) -> None:
        """``free`` of ``buf`` (its record already off the ledger; its memory from ``raw_ptr``): with a
        quarantine, keep its memory and zones until a batch is checked together (then the intact blocks
        are kept for reuse, the rest released); else read its zones while the culprit is fresh, release
        the memory whatever the read says, and report what the read found."""
        bound = self._ctx.settings.redzone_quarantine_bytes
        with self.lock:  # no check may read these zones once the memory is released
            zones = self.zones.zones_of(buf.index)
            if zones and bound:
                held = _Quarantined(buf, zones, raw_ptr, kind)
                self._quarantine.append(held)
                self._stats.quarantined(1, held.layout.raw_bytes)
                self._trim(bound)  # blocks kept for reuse give way to the quarantine first
                if self._stats.quarantined_bytes <= bound and len(self._quarantine) <= QUARANTINE_MAX_BUFFERS:
                    return
                violations, when = self._drain_locked(), "the check of the quarantine (freed buffers)"
            else:
                zones = self.zones.remove(buf.index)
                try:
                    violations = self._read(zones)
                finally:
                    self._raw.free(raw_ptr, kind)
                    self._zones_released()
                when = f"free of allocation #{buf.index}"
        self.report(violations, when)

    def drain(self, when: str, *, may_raise: bool = True, give_back: bool = False) -> None:
        """Check every buffer waiting in quarantine (waiting for the device), release them or keep them
        for reuse, report; with ``give_back``, every block kept for reuse goes back to the driver too."""
        with self.lock:
            try:
                violations = self._drain_locked()
            finally:
                if give_back:
                    self._trim(0)
        self.report(violations, f"the check of the quarantine (freed buffers) at {when}", may_raise=may_raise)

    def _drain_locked(self) -> list[RedZoneViolation]:
        entries = self._quarantine
        if not entries:
            return []
        found: list[RedZoneViolation] | None = None
        try:
            found = self._read([zone for held in entries for zone in held.zones])
            return found
        finally:
            self._release_quarantine(found)

    def _release_quarantine(self, found: Sequence[RedZoneViolation] | None) -> None:
        """Let go of every quarantined buffer, its zones just judged (``found``: the violations; ``None``:
        not judged) with the device idle. A block whose zones were judged intact is kept for reuse
        (within the bound); the others are released. A failed release is logged: it belongs to a
        ``free`` that returned long ago."""
        entries, self._quarantine = self._quarantine, []
        bad = None if found is None else {violation.index for violation in found}
        bound = self._ctx.settings.redzone_quarantine_bytes
        for held in entries:
            self.zones.remove(held.buf.index)
            self._stats.quarantined(-1, -held.layout.raw_bytes)
            if bad is not None and held.buf.index not in bad and held.kind == "device" and bound:
                self._reuse.setdefault(held.layout, []).append(held.raw_ptr)
                self._stats.reusable(1, held.layout.raw_bytes)
            else:
                self._ctx.quietly(f"releasing quarantined allocation #{held.buf.index}", self._raw.free,
                                  held.raw_ptr, held.kind)
        if entries:
            self._trim(bound)
            self._ctx.quietly("rewrite the red-zone table", self._zones_released)

    def _trim(self, bound: int) -> None:
        """Release blocks kept for reuse, oldest layout first, until they and the quarantine hold at
        most ``bound`` bytes (``0``: all of them). The caller holds `lock`."""
        stats = self._stats
        while self._reuse and stats.reusable_bytes + stats.quarantined_bytes > bound:
            layout = next(iter(self._reuse))
            blocks = self._reuse[layout]
            ptr = blocks.pop(0)
            if not blocks:
                del self._reuse[layout]
            stats.reusable(-1, -layout.raw_bytes)
            self._ctx.quietly("release a red-zoned block kept for reuse", self._raw.free, ptr, "device")

    def _zones_released(self) -> None:
        """Zones left the table and their memory went: the in-graph checks' table follows at once."""
        if self._checks is not None:
            self._checks.zones_released(self._default_stream)

    @property
    def held_bytes(self) -> int:
        """Device memory red zones hold back from the driver: the quarantine and the blocks kept for reuse."""
        return self._stats.quarantined_bytes + self._stats.reusable_bytes

    def forget(self, index: int) -> None:
        """Stop watching the zones of allocation ``index`` (a sweep: nobody reads them)."""
        with self.lock:
            if self.zones.remove(index):
                self._zones_released()

    # -- scans -------------------------------------------------------------------------------

    def on_violation(self, observer: Callable[[str, RedZoneViolation], object]) -> None:
        self._observers.append(observer)

    def scan(self) -> list[RedZoneViolation]:
        """``scan_redzones()``: wait for the device, judge every zone (live and quarantined), release the
        quarantine, report."""
        with self.lock:
            violations: list[RedZoneViolation] | None = None
            try:
                violations = self._read()
            finally:
                self._release_quarantine(violations)
            self._drop_queued()  # this scan reports every zone the finished ones could have found
        self.report(violations, "scan_redzones()")
        return violations

    def final_scan(self) -> None:
        """The check of ``close()``: the device is idle; logged, never raised. The quarantine goes too."""
        with self.lock:
            self._ctx.quietly("drop the queued scans", self._drop_queued)
            try:
                if self._ctx.fault is None and not active_captures():
                    try:
                        self.report(self._read(), "close()", may_raise=False)
                    except MetraleError as exc:
                        _log.warning("close: the red-zone scan failed: %s", exc)
            finally:
                self._release_quarantine(None)
                self._trim(0)

    def _read(self, zones: Sequence[Zone] | None = None) -> list[RedZoneViolation]:
        """Wait for the device, then judge ``zones`` (every watched zone, live or quarantined, when
        ``None``): on the device where the backend runs kernels, else by reads."""
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
                verdict = None
                if "redzone_verdict" in parsed.entries:
                    try:
                        verdict = (self._raw.module_function(module, "redzone_verdict"),
                                   parsed.entries["redzone_verdict"])
                    except MetraleError as exc:
                        _log.info("red zones: the in-graph check kernel cannot load here (%s)", exc.message)
                self._scanner = _Scanner(module, function, parsed.entries["redzone_scan"], verdict)
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
        origin = self._ctx.origin
        if origin is not None:  # each names the backend that found it (the caller's list too: scan returns it)
            violations[:] = [v if v.origin is not None else dataclasses.replace(v, origin=origin) for v in violations]
        for violation in violations:
            for observer in self._observers:
                try:
                    with self._ctx.outside():  # user code: close() from another thread need not wait for it
                        observer(self._ctx.name, violation)
                except Exception as exc:  # an observer's bug must not hide the violation
                    _log.warning("red-zone observer %r raised %s: %s", observer, type(exc).__name__, exc)
        sample = self._ctx.settings.redzone_sample
        if sample > 1:
            when = f"{when} (red zones on 1 in {sample} allocations: redzone_sample={sample})"
        if self._ctx.settings.redzone_action == "raise" and may_raise:
            raise RedZoneError(
                f"{when} found {len(violations)} red-zone violation(s): "
                + "; ".join(v.describe() for v in violations)
                + ". Fix the write past the buffer's bounds (redzone_trace_idx=<index> logs where it was allocated)",
                violations,
            )
        for violation in violations:
            _log.warning("%s (found by %s)", violation.describe(), when)

    # -- graphs -------------------------------------------------------------------------------

    def _in_graph(self) -> GraphChecks | None:
        """The in-graph checks, opened on first use; ``None`` where graphs are not checked inside (off,
        or the backend cannot: then `check_mode` says why, and the queued scans stand in)."""
        if self._checks is not None or self._checks_off:
            return self._checks
        settings = self._ctx.settings
        if settings.redzone == 0 or not settings.redzone_scan_graphs:
            self._checks_off = "off"
            return None
        scanner = self._load_scanner()
        if scanner is False or scanner.verdict is None:
            self._checks_off = "the scan kernel cannot run here" if scanner is False else "no in-graph check kernel"
            return None
        if active_captures():  # opening allocates: not while a capture runs (tried again at the next one)
            return None
        function, params = scanner.verdict
        checks = GraphChecks(self._ctx, self.zones, function, params)
        try:
            checks.open(self._default_stream)
        except MetraleError as exc:
            self._checks_off = f"no mapped host memory here ({exc.message})"
            _log.info("red zones: graphs are checked by scans queued behind each launch, not inside the graph: %s",
                      self._checks_off)
            return None
        self._checks = checks
        return checks

    @property
    def check_mode(self) -> str:
        """How graph launches are checked, in words (``metrale info``)."""
        settings = self._ctx.settings
        if settings.redzone == 0:
            return "off"
        if not settings.redzone_scan_graphs:
            return "at free, scan_redzones() and close() (redzone_scan_graphs is off)"
        with self.lock:
            checks = self._in_graph()
        wait = "queued" if settings.redzone_scan_queued else "waited for"
        if checks is None and not self._checks_off:
            return "not known while a capture runs (asked again after it ends)"
        if checks is not None:
            return f"inside every captured graph (its last node), verdicts in mapped host memory, {wait}"
        if self._load_scanner() is False:
            return f"after every graph launch, zones read back and waited for ({self._checks_off})"
        return f"by a scan {wait} after every graph launch ({self._checks_off})"

    def reserve_check(self) -> GraphCheck | None:
        """At ``begin_capture`` (before its record is entered): the check its graph will end with."""
        with self.lock:
            checks = self._in_graph()
            return None if checks is None else checks.reserve(self._default_stream)

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

    def before_graph_launch(self, check: GraphCheck | None, stream: Stream) -> None:
        """Before a graph is launched on ``stream`` (the caller holds `lock` through the launch):
        judge the checks that finished since (never this launch's own), and make the table current."""
        checks = self._checks
        if check is None or checks is None:
            return
        if checks.pending and may_wait():
            self._judge_checks(checks.finished())
        checks.before_launch(check, stream)

    def after_graph_launch(
        self, stream: Stream, is_live: Callable[[DeviceBuffer], bool], check: GraphCheck | None = None
    ) -> None:
        """With ``redzone_scan_graphs``: a checked graph's verdict is judged later (at once, waiting for
        the stream, without ``redzone_scan_queued``); an unchecked graph gets a scan after the launch
        (queued behind it with ``redzone_scan_queued`` where scans run as kernels, else waiting for it)."""
        settings = self._ctx.settings
        if not settings.redzone_scan_graphs:
            return
        checks = self._checks
        if check is not None and checks is not None:
            with self.lock:
                checks.launched(check, stream)
                if stream.capture is None:
                    self._stats.redzone_scans += 1
            if not settings.redzone_scan_queued and stream.capture is None and may_wait():
                self._raw.stream_synchronize(stream.raw)
                with self.lock:
                    bad = checks.finished(only=check)
                self._judge_checks(bad)
            return
        if active_captures():
            return
        if settings.redzone_scan_queued and self._queue_scan(stream, is_live):
            return
        self.report(self._full_check(), "the scan after GraphExec.launch")

    def _judge_checks(self, bad: Sequence[GraphCheck]) -> None:
        """Name what the checks that found bad zones found: one full check (it waits for the device: the
        caller made sure it may), reported as theirs. Zones freed since are in quarantine, or were
        reported by their release."""
        if not bad:
            return
        violations = self._full_check()
        graphs = ", ".join(f"#{check.number}" for check in bad)
        scanned = max(check.version for check in bad)
        if not violations:
            _log.debug("red zones: the in-graph check of graph(s) %s found bad zones (table version %d), all "
                       "reported since", graphs, scanned)
        self.report(violations, f"the check inside graph {graphs} (its latest launch)")

    def _full_check(self) -> list[RedZoneViolation]:
        """Every watched zone judged (waiting for the device); the quarantine, checked, released."""
        with self.lock:
            found: list[RedZoneViolation] | None = None
            try:
                found = self._read()
                return found
            finally:
                self._release_quarantine(found)

    def waited(self, is_live: Callable[[DeviceBuffer], bool]) -> None:
        """Report what finished checks found, without waiting (at the waits a user makes)."""
        checks = self._checks
        if checks is not None and checks.pending and may_wait():
            with self.lock:
                bad = checks.finished()
            self._judge_checks(bad)
        if active_captures():
            return
        if self._queued:
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
        waiting, when ``wait``), oldest first. A zone still watched (live, or freed into the quarantine) is
        kept; one whose allocation left since (freed at once, or released from the quarantine) is left out:
        that ``free`` or drain read it and reported it itself."""
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
                violations = _zone_violations(  # zones freed since: in quarantine, still watched, or reported
                    zones, results.cast("I"), keep=lambda buf: is_live(buf) or self.zones.watched(buf.index))
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
        """Forget the results of the queued scans and in-graph checks that are done: a full scan that has
        just run (the caller holds the lock) reports every zone they could have found. Those still
        running are kept."""
        if self._checks is not None:
            self._checks.finished()
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
            self._trim(0)
            self._pool.release(ctx)
            if self._checks is not None:
                self._checks.release()
                self._checks = None
            self._checks_off = ""
            if isinstance(self._scanner, _Scanner):
                ctx.quietly("module unload", self._raw.module_unload, self._scanner.module)
            self._scanner = None
