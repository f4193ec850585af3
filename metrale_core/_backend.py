"""``GpuBackend``: the front every host application talks to, a thin facade.

- Each method enters the context's gate (refused once closed; ``close()`` waits for calls in flight).
- It delegates in a line to the part that owns the state (`BackendParts`, ``_parts.py``, makes them in order):
  `DeviceContext` (settings, guarded raw layer,
  fault latch, gate, origin), `Holdings` (what is live), `StatsCounter`, `StreamFront` (streams, graphs,
  copies, captures), `ZoneGuard` (red zones), `MemoryMonitor` (free memory, stats, watchdogs, snapshots),
  `Allocator` (alloc, free, reclaim-and-retry, arenas, the sweep), `ExportTable` (exports, wrapped
  memory), `KernelFront` (modules, launches, run metrics), `TensorMapFront` (tensor maps, the N tile).
- ``close()`` is `BackendParts.close`: quiesce (gate, watchdogs, captures, the device, the final scan), then
  release the parts.
- `parts` hands ``metrale bench`` the context and the release observers, to time each step alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, NamedTuple

from ._device.args import invalid_argument
from ._device.buffer import DeviceBuffer
from ._device.capture import forbid_during_capture
from ._device.context import DeviceContext, gated, gated_read
from ._device.handles import Event, Graph, HostBuffer, Stream
from ._device.raw import RawDevice
from ._device.stats import MemoryStats
from ._launch.registry import Kernel, KernelRegistry, RunMetrics
from ._launch.tensormaps import TensorMap
from ._memory.arena import Arena
from ._memory.ledger import LedgerProbe
from ._memory.pool import MemoryPool
from ._memory.pressure import OomWatchdog
from ._parts import BackendParts
from ._reports.merge import LedgerReport, ledger_report
from ._settings.model import MetraleSettings
from ._types import AllocKind, KernelImplementation, MemoryInfo, Origin, RedZoneChecks, RedZoneViolation
from .kernels._ntile import NTile
from .kernels._tensormap import TensorMapSpec

__all__ = ["GpuBackend", "Parts", "parts"]

_log = logging.getLogger("metrale")


class GpuBackend:
    """One open device of one backend. A context manager; thread-safe.

    - Obtain it from [`metrale_core.open_backend`][metrale_core.open_backend].
    - ``stream=None`` everywhere means [`default_stream`][metrale_core.GpuBackend.default_stream], a
      non-blocking stream of this backend's own.
    - A ``dst`` or ``src`` of a memset or copy is a live buffer, or a raw device pointer (not checked).
    - Every method raises [`MetraleError`][metrale_core.MetraleError] subclasses only.
    """

    def __init__(
        self, name: str, ordinal: int, settings: MetraleSettings, raw: RawDevice, *,
        internal_packages: Iterable[str] = (),
    ) -> None:
        self.name: Final = name
        self.ordinal: Final = ordinal
        self.settings: Final = settings
        parts = self._parts = BackendParts(self, name, ordinal, settings, raw, internal_packages)
        # what the hot paths call: one attribute each
        self._ctx, self._lane, self._stream_lane, self._launch_lane = (
            parts.ctx, parts.lane, parts.stream_lane, parts.launch_lane
        )

    @property
    def origin(self) -> Origin:
        """Where this backend's records come from (host, process, rank, device); each record and snapshot names it."""
        origin = self._ctx.origin
        assert origin is not None  # set as the backend opens
        return origin

    @property
    def closed(self) -> bool:
        """Whether [`close`][metrale_core.GpuBackend.close] has run."""
        return self._ctx.closed

    @property
    def faulted(self) -> str | None:
        """The first device fault this backend met, with the launches before it; ``None`` if none."""
        return self._ctx.fault

    @property
    def raw(self) -> RawDevice:
        """The backend's raw layer (for backend subclasses and diagnostics)."""
        return self._parts.raw

    @property
    def default_stream(self) -> Stream:
        """This backend's own non-blocking stream, used wherever ``stream=None``."""
        self._check_open()
        return self._parts.streams.default

    @property
    @gated
    def device_name(self) -> str:
        """The device's name as its backend reports it."""
        return self._ctx.raw.device_name()

    def _check_open(self) -> None:
        """Refuse use after close and after a device fault (for subclasses' own methods)."""
        self._ctx.check_open()

    @gated
    def compute_capability(self) -> tuple[int, int]:
        """The device's compute capability, ``(major, minor)``."""
        return self._ctx.raw.compute_capability()

    @gated
    def memory_info(self) -> MemoryInfo:
        """Free and total device memory, and what an allocation can really have."""
        return self._parts.monitor.memory_info()

    @gated
    def bind_to_thread(self) -> None:
        """Make this backend's context current on the calling thread (for code outside metrale)."""
        self._ctx.raw.bind_to_thread()

    def alloc(self, nbytes: int, *, stacklevel: int = 1) -> DeviceBuffer:
        """Device memory, on the ledger with the caller's ``file:line`` until ``free`` or ``sweep_unreleased``.

        :param nbytes: the size in bytes, positive (an ``int``, numpy integers too).
        :param stacklevel: which caller is the call site, as ``warnings.warn`` counts: 1, the first frame outside
            metrale and ``site_skip``; 2, the one that called it (an application's own allocating helper passes 2
            to have its callers named).
        :raises OutOfMemoryError: no room, even after ``on_out_of_memory``; it names the largest call sites.
        :raises CaptureError: a capture is in progress (allocating is not a capturable call).
        :raises InvalidArgumentError: ``nbytes`` is not a positive byte count (0 too: ``InvalidBufferError``), or
            ``stacklevel`` is not an int of at least 1.
        """
        if stacklevel == 1 and type(stacklevel) is int:
            return self._lane.alloc(nbytes)  # the gate and the allocator's work (compiled where built)
        return self._alloc_at(nbytes, "device", "alloc", stacklevel)

    @gated
    def _alloc_at(self, nbytes: int, kind: AllocKind, what: str, stacklevel: object) -> DeviceBuffer:
        """An allocating call with a ``stacklevel`` other than 1 (off the hot path: the allocator's whole work)."""
        return self._parts.memory.alloc(nbytes, kind, what, self._parts.memory.site_at(stacklevel, what))

    @gated
    def alloc_managed(self, nbytes: int, *, stacklevel: int = 1) -> DeviceBuffer:
        """Managed (unified) memory, on the ledger likewise (``stacklevel`` as ``alloc``'s)."""
        if stacklevel == 1 and type(stacklevel) is int:
            return self._parts.memory.alloc(nbytes, "managed", "alloc_managed")
        return self._alloc_at(nbytes, "managed", "alloc_managed", stacklevel)

    @gated
    def alloc_arena(self, nbytes: int, *, stacklevel: int = 1) -> DeviceBuffer:
        """Device memory never on the ledger; released only by [`free_arena`][metrale_core.GpuBackend.free_arena]
        (``stacklevel`` as ``alloc``'s)."""
        if stacklevel == 1 and type(stacklevel) is int:
            return self._parts.memory.alloc(nbytes, "arena", "alloc_arena")
        return self._alloc_at(nbytes, "arena", "alloc_arena", stacklevel)

    @gated
    def alloc_host(self, nbytes: int) -> HostBuffer:
        """Pinned host memory, in a table of its own (not on the ledger)."""
        return self._parts.memory.alloc_host(nbytes)

    def free(self, buf: DeviceBuffer | HostBuffer) -> None:
        """Free a ``DeviceBuffer`` on the ledger (its record off first, whatever the release returns), or a
        ``HostBuffer``. Anything else raises [`InvalidBufferError`][metrale_core.InvalidBufferError]."""
        self._lane.free(buf)  # the gate and the allocator's work (compiled where built)

    @gated
    def free_arena(self, buf: DeviceBuffer) -> None:
        """Release an ``alloc_arena`` buffer."""
        self._parts.memory.free_arena(buf)

    @gated
    def create_pool(self, *, release_threshold: int = 0, for_capture: bool = False) -> MemoryPool:
        """A caching [`MemoryPool`][metrale_core.MemoryPool]: device memory carved from segments and cached after
        free, each piece a ledger record of its own (kind ``"pool"``); a device-wide
        [`synchronize`][metrale_core.GpuBackend.synchronize] leaves at most ``release_threshold`` bytes cached.
        ``for_capture``: a private pool for a graph another library captures (an allocator door's, for torch's):
        it grows during that capture, keeps its segments until it closes, and fills its pieces' red zones at once
        on the backend's own stream (never captured)."""
        return self._parts.memory.pools.create(release_threshold, self._parts.streams.resolve, for_capture)

    @gated
    def create_arena(self, capacity: int) -> Arena:
        """An [`Arena`][metrale_core.Arena] over one new ``alloc_arena`` block of ``capacity`` bytes."""
        return self._parts.memory.create_arena(capacity)

    @gated
    def on_out_of_memory(self, callback: Callable[[int], object]) -> None:
        """When an allocation runs out of memory, call ``callback(nbytes)``. A true result (it freed
        memory) earns the allocation another try, at most ``oom_retries`` times."""
        self._parts.memory.raw.on_out_of_memory(callback)

    @gated_read
    def live_alloc_len(self) -> int:
        """How many allocations are on the ledger."""
        return len(self._parts.holdings.ledger)

    @gated_read
    def ledger_probe(self) -> LedgerProbe:
        """A reader of this backend's ledger that outlives the backend."""
        return LedgerProbe(self._parts.holdings.ledger, self._ctx.gate)

    @gated
    def sweep_unreleased(self) -> int:
        """Drain the ledger, free each allocation on it, and report; returns how many.

        One check judges the red zones of the allocations swept and the quarantine (then released) before
        the memory goes; what it raises (a [`RedZoneError`][metrale_core.RedZoneError], a failed read) is
        raised after the sweep."""
        forbid_during_capture("sweep_unreleased")
        return self._parts.memory.sweep()

    def memset(
        self, dst: DeviceBuffer | int, value: int, *, offset: int = 0, nbytes: int | None = None,
        stream: Stream | None = None,
    ) -> None:
        """Set ``nbytes`` bytes (``None``: the rest) of ``dst`` from ``offset`` to ``value`` (0..255) on ``stream``.

        :raises InvalidBufferError: ``dst`` is not live, or the range runs past it.
        :raises InvalidArgumentError: ``value`` is not a byte, or ``offset`` or ``nbytes`` is not a count.
        """
        self._stream_lane.memset(dst, value, offset, nbytes, stream)  # the gate and the front's work

    @gated
    def copy_to_device(
        self, dst: DeviceBuffer | int, src: Any, *, offset: int = 0, stream: Stream | None = None
    ) -> None:
        """Copy all of ``src``, C-contiguous host memory (``bytes``, numpy) or a pinned
        [`HostBuffer`][metrale_core.HostBuffer], to ``dst`` at ``offset``.

        :raises InvalidBufferError: ``dst`` is not live, or ``src`` does not fit from ``offset``.
        :raises InvalidArgumentError: ``src`` is not C-contiguous host memory.
        """
        self._parts.streams.copy_to_device(dst, src, offset, stream)

    @gated
    def copy_to_host(self, dst: Any, src: DeviceBuffer | int, *, offset: int = 0, stream: Stream | None = None) -> None:
        """Fill all of ``dst``, writable C-contiguous host memory (``bytearray``, numpy) or a
        [`HostBuffer`][metrale_core.HostBuffer], from ``src`` at ``offset``.

        :raises InvalidBufferError: ``src`` is not live, or ``dst``'s size overruns it from ``offset``.
        :raises InvalidArgumentError: ``dst`` is not writable, C-contiguous host memory.
        """
        self._parts.streams.copy_to_host(dst, src, offset, stream)

    @gated
    def copy_device(
        self, dst: DeviceBuffer | int, src: DeviceBuffer | int, *, nbytes: int | None = None, dst_offset: int = 0,
        src_offset: int = 0, stream: Stream | None = None,
    ) -> None:
        """Copy ``nbytes`` (``None``: the rest of ``src``) from ``src`` at ``src_offset`` to ``dst`` at
        ``dst_offset``, device to device. A buffer not live, or a range past its end: ``InvalidBufferError``."""
        self._parts.streams.copy_device(dst, src, nbytes, dst_offset, src_offset, stream)

    @gated
    def copy_peer(
        self, dst: DeviceBuffer, src: DeviceBuffer, nbytes: int | None = None, *, dst_offset: int = 0,
        src_offset: int = 0, stream: Stream | None = None,
    ) -> None:
        """Copy ``nbytes`` (``None``: the rest) of ``src``, a live buffer of any open backend of this plugin in this
        process, into ``dst``, one of this backend's. Queued on a stream of this backend (CUDA: ``cuMemcpyAsync``);
        direct after [`enable_peer_access`][metrale_core.GpuBackend.enable_peer_access], else through the host. A
        capture records it (its launch is refused once ``src`` is not live). Order it after the source's writes
        yourself: synchronize the source's stream or backend on the host, as with CUDA.

        :raises InvalidBufferError: a buffer is not live (or ``src``'s backend is closed), or a range overruns.
        :raises InvalidArgumentError: the backends are of different plugins, or an argument is malformed.
        """
        self._parts.streams.copy_peer(dst, src, nbytes, dst_offset, src_offset, stream)

    @gated
    def enable_peer_access(self, peer: GpuBackend) -> None:
        """Let this device reach ``peer``'s memory directly, so `copy_peer` from it goes direct (CUDA:
        ``cuCtxEnablePeerAccess``). Twice, or for a backend on the same device, does nothing.

        :raises DriverError: ``CUDA_ERROR_PEER_ACCESS_UNSUPPORTED``: no direct path (``copy_peer`` still works).
        :raises InvalidArgumentError: ``peer`` is not a backend of the same plugin.
        :raises BackendClosedError: ``peer`` is closed.
        """
        if not isinstance(peer, GpuBackend):
            raise invalid_argument("enable_peer_access", "another GpuBackend of this process", peer)
        self._parts.streams.enable_peer_access(peer._ctx)

    @gated
    def create_stream(self) -> Stream:
        """A new non-blocking stream, owned by this backend."""
        return self._parts.streams.create_stream()

    @gated
    def create_event(self) -> Event:
        """A new event, owned by this backend."""
        return self._parts.streams.create_event()

    @gated
    def synchronize(self) -> None:
        """Wait for all work of this backend; then each memory pool keeps at most its ``release_threshold`` bytes
        cached."""
        marks = self._parts.memory.pools.mark()
        self._parts.streams.synchronize()
        self._parts.memory.pools.synchronized(marks)

    @gated
    def begin_capture(self, stream: Stream | None = None) -> None:
        """Begin capturing ``stream`` in CUDA's global mode: its work is recorded, not run."""
        self._parts.streams.begin_capture(stream)

    @gated
    def end_capture(self, stream: Stream | None = None) -> Graph:
        """End the capture of ``stream``; returns the recorded [`Graph`][metrale_core.Graph]. An invalidated
        capture is ended and discarded, raising ``CaptureError``."""
        return self._parts.streams.end_capture(stream)

    @gated
    def stream_is_capturing(self, stream: Stream | None = None) -> bool:
        """Whether ``stream`` is capturing, invalidated or not. The driver answers (it sees captures begun
        outside metrale too); under the scale variant metrale's own record does."""
        return self._parts.streams.is_capturing(stream)

    @gated
    def load_modules(self, images: Mapping[str, bytes | str]) -> KernelRegistry:
        """Load named PTX images; returns the registry that hands out their kernels. Images the device
        cannot run are refused together, in one [`ArchitectureError`][metrale_core.ArchitectureError], loading none."""
        return self._parts.kernels.load_modules(images)

    @gated
    def preflight(self, images: Mapping[str, bytes | str]) -> None:
        """Check PTX images (names to ``bytes``, ``bytearray`` or ``str``; else ``InvalidArgumentError``) against
        the device without loading them; raises like [`load_modules`][metrale_core.GpuBackend.load_modules]."""
        self._parts.kernels.preflight(images)

    @gated
    def add_kernel_implementations(self, *implementations: KernelImplementation) -> None:
        """Python implementations of kernels, for a backend that runs them on the CPU (the fake; others ignore them)."""
        self._parts.kernels.add_kernel_implementations(implementations)

    def launch(
        self, kernel: Kernel, grid: int | Sequence[int], block: int | Sequence[int], args: Sequence[object], *,
        shared_mem: int = 0, stream: Stream | None = None,
    ) -> None:
        """Launch ``kernel`` (from [`KernelRegistry.kernel`][metrale_core.KernelRegistry.kernel]) on ``stream``. A
        capture records it; ``debug_sync_kernels`` waits for it (outside captures), and a failure names it.

        :param grid: blocks per grid, and ``block`` threads per block: an ``int`` or up to three dimensions.
        :param args: per parameter: a ``DeviceBuffer`` (checked live), an ``int`` pointer (unchecked), a typed scalar.
        :param shared_mem: dynamic shared memory per block, in bytes.
        :raises InvalidArgumentError: ``args`` does not match the kernel's parameters, or the shape is invalid.
        :raises InvalidBufferError: a buffer argument is not live.
        :raises DeviceFaultError: the kernel faulted (seen at the launch only with ``debug_sync_kernels``).
        """
        self._launch_lane.launch(kernel, grid, block, args, shared_mem, stream)  # the gate and the front's work

    @gated
    def tensor_map(self, buffer: DeviceBuffer, spec: TensorMapSpec, offset: int = 0) -> TensorMap:
        """A tensor map (TMA descriptor) of ``spec`` over ``buffer`` from byte ``offset``, for a kernel's
        tensor-map parameter. [`check_tensor_map`][metrale_core.check_tensor_map] checks it with this device's
        figures (a [`TensorMapError`][metrale_core.TensorMapError] names the driver's rule). ``buffer`` must be
        live here, with ``offset + spec.extent <= buffer.nbytes`` (else ``InvalidBufferError``)."""
        return self._parts.maps.make(buffer, spec, offset)

    @gated
    def n_tile(self, /, m: int, n: int, **options: Any) -> NTile:
        """[`metrale_core.n_tile`][metrale_core.n_tile] with this device's multiprocessor count and ``options``."""
        return self._parts.maps.n_tile(m, n, options)

    @gated
    def run_metrics(self) -> RunMetrics:
        """Kernels looked up, launches per kernel and (with ``kernel_timing``) GPU time, since this backend opened.
        Resolving the timings waits for their events, so this is refused during a capture."""
        return self._parts.kernels.run_metrics()

    @gated
    def scan_redzones(self) -> list[RedZoneViolation]:
        """Wait for this backend's work, then check every watched zone, those of live buffers and those of freed
        buffers still in the quarantine (``redzone_quarantine_bytes``), report every one whose bytes changed, and
        release the quarantine. Each violation goes to the observers, then is logged (``redzone_action="warn"``)
        or raised: [`RedZoneError`][metrale_core.RedZoneError]."""
        forbid_during_capture("scan_redzones()")
        return self._parts.guard.scan()

    @property
    @gated
    def redzone_checks(self) -> RedZoneChecks:
        """How this backend checks red zones around graph launches: a ``str`` in words, with a ``mode``.

        - ``mode``: ``"inside"`` every captured graph, ``"queued"`` or ``"waited"`` (a scan after each
          launch), ``"off"``, or ``"unknown"`` while a capture runs; ``reason``: why not inside."""
        return self._parts.guard.checks

    @gated
    def on_redzone_violation(self, observer: Callable[[str, RedZoneViolation], object]) -> None:
        """Call ``observer(backend_name, violation)`` for every violation this backend finds."""
        if not callable(observer):
            raise invalid_argument("on_redzone_violation", "a callable", observer)
        self._parts.guard.on_violation(observer)

    @gated
    def wrap(self, obj: object) -> DeviceBuffer:
        """Another library's memory (CUDA array interface or DLPack; on the fake, writable C-contiguous memory) as
        a ``DeviceBuffer`` of kind ``"external"``, without a copy, after the device's work. Never on the ledger, never
        freed by metrale: [`unwrap`][metrale_core.GpuBackend.unwrap] lets go of it and of ``obj``."""
        return self._parts.exports.wrap(obj)

    @gated
    def unwrap(self, buf: DeviceBuffer) -> None:
        """Let go of memory of [`wrap`][metrale_core.GpuBackend.wrap]: no longer live here; its owner frees it."""
        self._parts.exports.unwrap(buf, self._parts.streams.warn_if_graphed)

    @gated_read
    def stats(self) -> MemoryStats:
        """Counts and bytes since it opened (peaks since [`reset_peak`][metrale_core.GpuBackend.reset_peak])."""
        return self._parts.monitor.stats()

    @gated_read
    def ledger_report(self) -> LedgerReport:
        """This backend's ledger, what its sweeps took (its leaks), its counters, the red-zone violations it
        found (each zone once) and its [`origin`][metrale_core.GpuBackend.origin]: picklable values another
        process merges ([`merge_reports`][metrale_core.merge_reports], ``gather_object``). Answers after a device
        fault too."""
        parts = self._parts
        return ledger_report(self.origin, parts.holdings.ledger, parts.memory.swept, parts.monitor.stats(),
                             parts.guard.found())

    @gated_read
    def memory_summary(self, top: int = 5) -> str:
        """A table of this backend's memory, as ``torch.cuda.memory_summary()`` gives: bytes by kind, counts,
        out-of-memory failures, arenas, red zones, free memory, the ``top`` call sites. Answers after a fault too,
        without the device's free memory (the device is not asked then)."""
        return self._parts.monitor.summary(top)

    @gated_read
    def reset_peak(self) -> None:
        """Start the peaks of [`stats`][metrale_core.GpuBackend.stats] again from the bytes live now."""
        self._parts.monitor.reset_peak()

    @gated
    def spawn_oom_watchdog(
        self, *, interval_s: float, min_free_bytes: int, on_low: Callable[[MemoryInfo], object] | None = None
    ) -> OomWatchdog:
        """Start an [`OomWatchdog`][metrale_core.OomWatchdog]: a daemon thread that polls ``memory_info()`` every
        ``interval_s`` seconds and warns, once, when ``effective_free`` falls under ``min_free_bytes``."""
        return self._parts.monitor.spawn_oom_watchdog(interval_s, min_free_bytes, on_low)

    @gated_read
    def save_snapshot(self, path: str | os.PathLike[str]) -> Path:
        """Write the ledger (with its history, under ``memory_history``) and [`stats`][metrale_core.GpuBackend.stats]
        to ``path`` as JSON, atomically, for ``metrale report``; returns the path (after a fault, with the device's
        memory left out: ``total`` 0). A ``path`` that is no path raises ``InvalidArgumentError``; one not writable,
        [`SnapshotError`][metrale_core.SnapshotError] (no file left)."""
        return self._parts.monitor.save_snapshot(path)

    def close(self) -> None:
        """Abort a capture, sweep the ledger, release everything; idempotent, never raises. Safe from any
        thread: calls running finish first (a callback of this thread may close its backend);
        later ones raise [`BackendClosedError`][metrale_core.BackendClosedError]. Afterwards nothing of it holds
        memory or waits for the garbage collector; only [`raw`][metrale_core.GpuBackend.raw] keeps the raw device.
        """
        self._parts.close()

    def __enter__(self) -> GpuBackend:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<metrale {type(self).__name__} {self.name}:{self.ordinal} ({state})>"


class Parts(NamedTuple):
    """What ``metrale bench`` times step by step: the ``context`` and the ``release_observers``."""

    context: DeviceContext
    release_observers: tuple[Callable[[DeviceBuffer], None], ...]


def parts(backend: GpuBackend) -> Parts:
    """The one door into ``backend``'s parts from outside it (``_commands/bench/breakdown.py``): the release
    observers are those a free calls now (switched on by their fronts: none while no graph, export or map lives)."""
    return Parts(backend._ctx, backend._parts.holdings.releases.active)
