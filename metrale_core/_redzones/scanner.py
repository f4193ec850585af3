"""The red-zone scans of one backend: the scan kernel, one scratch pool, and the reads that stand in.

- `Scratch`: device and pinned host buffers by role, kept and grown as needed. Raw memory, on no
  ledger; released together at close. Every scan shares it: the queued scans too.
- `ScanKernel`: the shipped ``redzone`` module, loaded once by the scanner itself (metrale's own, not
  in ``run_metrics``): ``redzone_scan``, and ``redzone_verdict`` for the in-graph checks.
- `Scanner`: judges a batch of zones once the device is idle. From eight zones on, one kernel launch
  and one small copy; fewer zones, or no kernels here, are read back and judged on the host.

It knows nothing of the guard: the guard holds its lock around every call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final, Literal, final

from .._device.context import DeviceContext
from .._errors import MetraleError
from .._types import LaunchArg, Param, RedZoneViolation
from ..kernels import shipped_modules
from ..kernels._ptx import check_architecture, parse_ptx
from .layout import RedZones, Zone, zone_table, zone_violations

__all__ = ["ScanKernel", "Scanner", "Scratch"]

_log = logging.getLogger("metrale")

#: Fewer zones than this are read back rather than scanned by the device-side kernel.
_DEVICE_SCAN_MIN_ZONES: Final = 8


@final
class Scratch:
    """The scans' one scratch pool: device and pinned host buffers by role."""

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


@final
class ScanKernel:
    """The shipped ``redzone`` module's kernels: ``redzone_scan``, and ``redzone_verdict`` if it has one."""

    __slots__ = ("function", "module", "params", "verdict")

    def __init__(
        self, module: object, function: object, params: tuple[Param, ...],
        verdict: tuple[object, tuple[Param, ...]] | None,
    ) -> None:
        self.module = module
        self.function = function
        self.params = params  # .u64 table, .u32 count, .u32 fill, .u64 results
        self.verdict = verdict  # (function, params: .u64 desc, .u64 state, .u64 slot), if the module has it


@final
class Scanner:
    """The scans of one backend's zones: on the device where it runs kernels, else by reads."""

    __slots__ = ("_ctx", "_default", "_kernel", "_raw", "_table_version", "_zones", "pool")

    def __init__(self, ctx: DeviceContext, zones: RedZones, default: object) -> None:
        self._ctx = ctx
        self._raw = ctx.raw
        self._zones = zones
        self._default = default  # the default stream's raw handle: every scan here runs on it
        self._kernel: ScanKernel | Literal[False] | None = None  # None: not tried yet
        self._table_version = -1  # the live-zone table version the "table" scratch holds
        #: The one scratch pool of every scan (the queued ones too).
        self.pool = Scratch(ctx)

    def snapshot(self) -> tuple[int, Sequence[Zone], bytes | None]:
        """Every watched zone: ``RedZones.snapshot`` against the table the device holds."""
        return self._zones.snapshot(self._table_version)

    def judge(
        self, zones: Sequence[Zone], table: bytes | None = None, version: int = -1
    ) -> list[RedZoneViolation]:
        """Judge ``zones`` (the device idle); ``table`` and ``version`` come from `snapshot`, or none (``version``
        -1: ``table`` is the zones' own where given, else it is made of them)."""
        if len(zones) < _DEVICE_SCAN_MIN_ZONES:  # a free's own zones: one read beats three device calls
            return self._by_reads(zones)
        kernel = self.kernel()
        if kernel is False:
            return self._by_reads(zones)
        firsts = self._on_device(kernel, zones, table, version)
        return [] if firsts is None else zone_violations(zones, firsts)

    def kernel(self) -> ScanKernel | Literal[False]:
        """The scan kernel, loaded once; ``False`` where it cannot load (then zones are read back)."""
        if self._kernel is None:
            raw = self._raw
            try:
                image = shipped_modules("redzone")["redzone"]
                parsed = parse_ptx("redzone", image)
                check_architecture({"redzone": parsed}, raw.compute_capability(), raw.device_name())
                module = raw.module_load("redzone", image)
                try:
                    function = raw.module_function(module, "redzone_scan")
                except MetraleError:
                    self._ctx.quietly("module unload", raw.module_unload, module)
                    raise
            except MetraleError as exc:
                _log.info("red-zone scans read each zone back: the scan kernel cannot load here (%s)", exc.message)
                self._kernel = False
            else:
                verdict = None
                if "redzone_verdict" in parsed.entries:
                    try:
                        verdict = (raw.module_function(module, "redzone_verdict"), parsed.entries["redzone_verdict"])
                    except MetraleError as exc:
                        _log.info("red zones: the in-graph check kernel cannot load here (%s)", exc.message)
                self._kernel = ScanKernel(module, function, parsed.entries["redzone_scan"], verdict)
        return self._kernel

    def launch(self, kernel: ScanKernel, table_ptr: int, n: int, result_ptr: int, stream: object) -> None:
        """Queue the scan kernel over the ``n`` zones of the device table at ``table_ptr``."""
        table, count, fill, result = kernel.params
        args = [
            LaunchArg(table, table_ptr.to_bytes(8, "little"), table_ptr),
            LaunchArg(count, n.to_bytes(4, "little")),
            LaunchArg(fill, self._zones.fill.to_bytes(4, "little")),
            LaunchArg(result, result_ptr.to_bytes(8, "little"), result_ptr),
        ]
        self._raw.launch(kernel.function, (n, 1, 1), (256, 1, 1), 0, stream, args)

    def _on_device(
        self, kernel: ScanKernel, zones: Sequence[Zone], table: bytes | None, version: int
    ) -> list[int] | None:
        """One launch checks every zone; one small copy brings back each zone's first changed offset + 1.

        - ``table``: the zones' (address, length) pairs. ``None``: the device's copy of the live-zone
          table is used if it holds ``version``, else it is built from ``zones``.
        - ``version`` -1: zones of the caller's choosing; their table (given, or built) is always copied.
        - Returns ``None`` when no zone changed (the common case): one compare of the results.
        """
        n = len(zones)
        pool = self.pool
        table_ptr, grown = pool.device("table", n * 16)
        result_ptr, _ = pool.device("result", n * 4)
        stream = self._default
        if table is None and (grown or version < 0 or version != self._table_version):
            table = zone_table(zones)
        if table is not None:
            self._raw.copy_htod(table_ptr, memoryview(table), stream, pinned=False)
            self._table_version = version  # -1 for a caller's own zones: the next full scan copies again
        self.launch(kernel, table_ptr, n, result_ptr, stream)
        results = bytearray(n * 4)
        self._raw.copy_dtoh(memoryview(results), result_ptr, stream, pinned=False)  # no capture runs here
        if results.count(0) == len(results):
            return None
        return list(memoryview(results).cast("I"))

    def _by_reads(self, zones: Sequence[Zone]) -> list[RedZoneViolation]:
        """The fallback: every zone read into one pinned buffer, one synchronize, judged on the host."""
        scratch = self.pool.host("reads", sum(z.length for z in zones))
        stream = self._default
        offset = 0
        for zone in zones:
            self._raw.copy_dtoh(scratch[offset : offset + zone.length], zone.start, stream, pinned=True)
            offset += zone.length
        self._raw.stream_synchronize(stream)
        violations = []
        offset = 0
        for zone in zones:
            violation = self._zones.judge(zone, bytes(scratch[offset : offset + zone.length]))
            offset += zone.length
            if violation is not None:
                violations.append(violation)
        return violations

    def release(self) -> None:
        """Release the scratch and the kernel's module (at close)."""
        ctx = self._ctx
        self.pool.release(ctx)
        if isinstance(self._kernel, ScanKernel):
            ctx.quietly("module unload", self._raw.module_unload, self._kernel.module)
        self._kernel = None
