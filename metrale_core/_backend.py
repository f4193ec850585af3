"""``GpuBackend``: the front every host application talks to, a thin facade.

Each method checks that the backend is open (through the context's gate, which also
makes ``close()`` safe against every other call from any thread) and delegates to the
part that owns the state it touches:

=================  ==============================================================
part               owns
=================  ==============================================================
DeviceContext      name, ordinal, settings, the guarded raw layer, the fault latch,
                   the closed state and the gate (``_context``)
Holdings           what is live: the ledger, arena blocks and arenas, wrapped
                   memory, host buffers; liveness and bounds (``_holdings``)
StatsCounter       the counters behind ``stats()`` (``_pressure``)
StreamFront        streams, events, graphs, copies, memsets, captures (``_streams``)
ZoneGuard          red zones: fills, quarantine, scans, in-graph checks (``_graphcheck``), the report (``_zoneguard``)
MemoryMonitor      free memory, stats, watchdogs, snapshots (``_monitor``)
Allocator          alloc/free of every kind, reclaim-and-retry, arenas, sweep
                   (``_allocator``)
ExportTable        exports to other libraries and wrapped memory (``_exports``)
KernelFront        kernel modules, launches, run metrics (``_kernels``)
TensorMapFront     tensor maps (TMA descriptors) and the GEMM N tile (``_tensormaps``)
=================  ==============================================================

``close()`` runs in two phases: quiesce (shut the gate and wait for calls in flight,
stop the watchdogs, abort captures, wait for the device, the final red-zone scan), then
release in the reverse order of construction.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final

from ._device.args import invalid_argument
from ._device.buffer import DeviceBuffer
from ._device.capture import forbid_during_capture
from ._device.context import DeviceContext, gated, gated_read
from ._device.handles import Event, Graph, GraphExec, HostBuffer, Stream
from ._device.raw import RawDevice
from ._device.stats import MemoryStats, StatsCounter
from ._errors import ConfigError, MetraleError
from ._launch.front import KernelFront
from ._launch.registry import Kernel, KernelRegistry, RunMetrics
from ._launch.tensormaps import TensorMap, TensorMapFront
from ._memory.allocator import Allocator
from ._memory.arena import Arena
from ._memory.exports import ExportTable
from ._memory.holdings import Holdings
from ._memory.ledger import LedgerProbe
from ._memory.monitor import MemoryMonitor
from ._memory.pressure import OomWatchdog
from ._redzones.guard import ZoneGuard
from ._reports.merge import LedgerReport
from ._settings.model import MetraleSettings
from ._streams.front import StreamFront
from ._types import KernelImplementation, MemoryInfo, Origin, RedZoneChecks, RedZoneViolation
from .kernels._ntile import NTile
from .kernels._tensormap import TensorMapSpec

__all__ = ["GpuBackend"]

_log = logging.getLogger("metrale")


class GpuBackend:
    """One open device of one backend. A context manager; thread-safe.

    Obtain it from [`metrale_core.open_backend`][metrale_core.open_backend]. ``stream=None``
    everywhere means [`default_stream`][metrale_core.GpuBackend.default_stream], a non-blocking stream of this
    backend's own. Every method raises [`MetraleError`][metrale_core.MetraleError]
    subclasses only.
    """

    def __init__(
        self,
        name: str,
        ordinal: int,
        settings: MetraleSettings,
        raw: RawDevice,
        *,
        internal_packages: Iterable[str] = (),
    ) -> None:
        self.name: Final = name
        self.ordinal: Final = ordinal
        self.settings: Final = settings
        self._raw_device = raw  # what `raw` answers, after close() too
        ctx = self._ctx = DeviceContext(name, ordinal, settings, raw, frozenset(internal_packages))
        self._holdings = Holdings(ctx)
        self._stats = StatsCounter()
        self._streams = StreamFront(ctx, self._holdings, self._stats)
        self._guard = ZoneGuard(ctx, self._stats, self._streams.default)
        self._streams.attach(self._guard)
        self._monitor = MemoryMonitor(ctx, self._holdings, self._stats)
        self._memory = Allocator(ctx, self._holdings, self._stats, self._guard, self._monitor)
        self._exports = ExportTable(ctx, self._holdings, self._guard)
        self._kernels = KernelFront(ctx, self._holdings, self._streams)
        self._maps = TensorMapFront(ctx, self._holdings)
        self._memory.on_release(self._streams.warn_if_graphed)
        self._memory.on_release(self._exports.warn_if_exported)
        self._memory.on_release(self._maps.warn_if_mapped)
        try:
            device_uuid = ctx.raw.device_uuid()
        except MetraleError as exc:
            _log.debug("%s:%d: no device UUID for the origin: %s", name, ordinal, exc)
            device_uuid = ""
        try:
            launch = settings.launch
            rank, world_size = launch.rank, launch.world_size
        except ConfigError as exc:  # only placement() needs them right: the origin goes without
            _log.warning("%s:%d: the origin names no rank: %s", name, ordinal, exc)
            rank = world_size = None
        origin = self._holdings.ledger.origin = Origin(
            socket.gethostname(), os.getpid(), rank, world_size, name, ordinal, device_uuid
        )
        ctx.bind(self, origin, self._exports)

    # -- the device ---------------------------------------------------------------------

    @property
    def origin(self) -> Origin:
        """Where this backend's records come from: host, process, rank, backend, ordinal and device UUID.
        Every ledger record, red-zone violation and snapshot of this backend names it."""
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
        return self._raw_device

    @property
    def default_stream(self) -> Stream:
        """This backend's own non-blocking stream, used wherever ``stream=None``."""
        self._check_open()
        return self._streams.default

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
        return self._monitor.memory_info()

    @gated
    def bind_to_thread(self) -> None:
        """Make this backend's context current on the calling thread (for code outside metrale)."""
        self._ctx.raw.bind_to_thread()

    # -- memory -------------------------------------------------------------------------

    def alloc(self, nbytes: int) -> DeviceBuffer:
        """Device memory, on the ledger until ``free`` or ``sweep_unreleased`` takes it off.

        :param nbytes: the size in bytes (an ``int``, numpy integers too; 0 is allowed).
        :returns: the buffer, recorded on the ledger with the caller's ``file:line``.
        :raises OutOfMemoryError: the device has no room, after the ``on_out_of_memory`` callbacks had
            their turn; the message names the call sites holding the most memory.
        :raises CaptureError: a capture is in progress (allocating is not a capturable call).
        :raises InvalidArgumentError: ``nbytes`` is not a byte count.
        """
        ctx = self._ctx
        ctx.enter()  # what @gated does, written out: a hot path (a frame less)
        try:
            return self._memory.alloc(nbytes, "device", "alloc")
        finally:
            ctx.leave()

    def _cost_probes(self, nbytes: int) -> dict[str, Callable[[], object]]:
        """The steps of an ``alloc`` + ``free`` pair, one callable each (``metrale bench --only breakdown``)."""
        return self._memory.cost_probes(nbytes)

    def _eager_probes(
        self, buf: DeviceBuffer, nbytes: int, kernel: Kernel, grid: int, block: int, args: Sequence[object]
    ) -> dict[str, Callable[[], object]]:
        """The steps of an eager ``memset`` and ``launch`` (``metrale bench --only eager_breakdown``)."""
        return {**self._streams.memset_probes(buf, nbytes), **self._kernels.launch_probes(kernel, grid, block, args)}

    def _replay_probe(self, graph: GraphExec, stream: Stream) -> Callable[[], None]:
        """The plugin's raw launch of ``graph`` on ``stream`` (``metrale bench``'s raw graph row)."""
        return self._streams.replay_probe(graph, stream)

    @gated
    def alloc_managed(self, nbytes: int) -> DeviceBuffer:
        """Managed (unified) memory, on the ledger likewise."""
        return self._memory.alloc(nbytes, "managed", "alloc_managed")

    @gated
    def alloc_arena(self, nbytes: int) -> DeviceBuffer:
        """Device memory never on the ledger; released only by [`free_arena`][metrale_core.GpuBackend.free_arena]."""
        return self._memory.alloc(nbytes, "arena", "alloc_arena")

    @gated
    def alloc_host(self, nbytes: int) -> HostBuffer:
        """Pinned host memory, in a table of its own (not on the ledger)."""
        return self._memory.alloc_host(nbytes)

    def free(self, buf: DeviceBuffer | HostBuffer) -> None:
        """Free a ``DeviceBuffer`` on the ledger, or a ``HostBuffer``.

        The ledger record comes off first, then the memory is released,
        whatever the release returns. Anything else raises
        [`InvalidBufferError`][metrale_core.InvalidBufferError] and changes nothing.
        """
        ctx = self._ctx
        ctx.enter()  # what @gated does, written out: a hot path
        try:
            self._memory.free(buf)
        finally:
            ctx.leave()

    @gated
    def free_arena(self, buf: DeviceBuffer) -> None:
        """Release an ``alloc_arena`` buffer."""
        self._memory.free_arena(buf)

    @gated
    def create_arena(self, capacity: int) -> Arena:
        """An [`Arena`][metrale_core.Arena] over one new ``alloc_arena`` block of ``capacity`` bytes."""
        return self._memory.create_arena(capacity)

    @gated
    def on_out_of_memory(self, callback: Callable[[int], object]) -> None:
        """When an allocation runs out of memory, call ``callback(nbytes)``; if it returns a
        true value (it freed memory), the allocation is tried again, at most ``oom_retries`` times."""
        self._memory.on_out_of_memory(callback)

    # -- the ledger ---------------------------------------------------------------------

    @gated_read
    def live_alloc_len(self) -> int:
        """How many allocations are on the ledger."""
        return len(self._holdings.ledger)

    @gated_read
    def ledger_probe(self) -> LedgerProbe:
        """A reader of this backend's ledger that outlives the backend."""
        return LedgerProbe(self._holdings.ledger)

    @gated
    def sweep_unreleased(self) -> int:
        """Drain the ledger, free each allocation on it, and report; returns how many."""
        forbid_during_capture("sweep_unreleased")
        return self._memory.sweep()

    # -- work on streams ----------------------------------------------------------------

    def memset(
        self, dst: DeviceBuffer | int, value: int, *, offset: int = 0, nbytes: int | None = None,
        stream: Stream | None = None,
    ) -> None:
        """Set bytes of ``dst`` to ``value`` (0..255) on ``stream``.

        :param dst: a live buffer, or a raw device pointer (not checked).
        :param value: the byte to write, 0..255.
        :param offset: where in ``dst`` to start.
        :param nbytes: how many bytes; ``None``: the rest of ``dst`` from ``offset``.
        :param stream: the stream to queue it on; ``None``: [`default_stream`][metrale_core.GpuBackend.default_stream].
        :raises InvalidBufferError: ``dst`` is not live, or the range runs past it.
        :raises InvalidArgumentError: ``value`` is not a byte value, or ``offset`` or ``nbytes`` is not a count.
        """
        ctx = self._ctx
        ctx.enter()  # what @gated does, written out: a hot path
        try:
            self._streams.memset(dst, value, offset, nbytes, stream)
        finally:
            ctx.leave()

    @gated
    def copy_to_device(
        self, dst: DeviceBuffer | int, src: Any, *, offset: int = 0, stream: Stream | None = None
    ) -> None:
        """Copy all of ``src`` (host bytes or a ``HostBuffer``) to ``dst`` at ``offset``.

        :param dst: a live buffer, or a raw device pointer (not checked).
        :param src: host memory: any C-contiguous buffer (``bytes``, a numpy array) or a
            [`HostBuffer`][metrale_core.HostBuffer]; a pinned one makes the copy asynchronous.
        :param offset: where in ``dst`` the bytes go.
        :param stream: the stream to queue it on; ``None``: [`default_stream`][metrale_core.GpuBackend.default_stream].
        :raises InvalidBufferError: ``dst`` is not live, or ``src`` does not fit from ``offset``.
        :raises InvalidArgumentError: ``src`` is not C-contiguous host memory.
        """
        self._streams.copy_to_device(dst, src, offset, stream)

    @gated
    def copy_to_host(self, dst: Any, src: DeviceBuffer | int, *, offset: int = 0, stream: Stream | None = None) -> None:
        """Fill all of ``dst`` (writable host memory or a ``HostBuffer``) from ``src`` at ``offset``.

        :param dst: writable, C-contiguous host memory (a ``bytearray``, a numpy array) or a
            [`HostBuffer`][metrale_core.HostBuffer]; its size is the number of bytes copied.
        :param src: a live buffer, or a raw device pointer (not checked).
        :param offset: where in ``src`` the bytes start.
        :param stream: the stream to queue it on; ``None``: [`default_stream`][metrale_core.GpuBackend.default_stream].
        :raises InvalidBufferError: ``src`` is not live, or ``dst``'s size runs past its end from ``offset``.
        :raises InvalidArgumentError: ``dst`` is not writable, C-contiguous host memory.
        """
        self._streams.copy_to_host(dst, src, offset, stream)

    @gated
    def copy_device(
        self, dst: DeviceBuffer | int, src: DeviceBuffer | int, *, nbytes: int | None = None, dst_offset: int = 0,
        src_offset: int = 0, stream: Stream | None = None,
    ) -> None:
        """Copy device to device; ``nbytes=None`` copies the rest of ``src`` from ``src_offset``.

        :param dst: a live buffer, or a raw device pointer (not checked).
        :param src: a live buffer, or a raw device pointer (not checked).
        :param nbytes: how many bytes; ``None``: the rest of ``src`` from ``src_offset``.
        :param dst_offset: where in ``dst`` the bytes go.
        :param src_offset: where in ``src`` they start.
        :param stream: the stream to queue it on; ``None``: [`default_stream`][metrale_core.GpuBackend.default_stream].
        :raises InvalidBufferError: a buffer is not live, or a range runs past its end.
        """
        self._streams.copy_device(dst, src, nbytes, dst_offset, src_offset, stream)

    @gated
    def copy_peer(
        self, dst: DeviceBuffer, src: DeviceBuffer, nbytes: int | None = None, *, dst_offset: int = 0,
        src_offset: int = 0, stream: Stream | None = None,
    ) -> None:
        """Copy from a buffer of another backend of this process (another device, or another backend on the
        same device) into one of this backend's, queued on one of this backend's streams (CUDA:
        ``cuMemcpyAsync`` between devices, which unified addressing routes, and a device-to-device copy within
        one; direct where [`enable_peer_access`][metrale_core.GpuBackend.enable_peer_access] was called,
        through the host where it was not). Recorded into a capture like any copy; launching
        the graph later is refused once ``src`` is no longer live. Order it after the source's writes
        yourself, as with CUDA: synchronize the source's stream or backend on the host (a stream of one
        backend cannot wait for an event of another).

        :param dst: a live buffer of this backend.
        :param src: a live buffer of any open backend of the same plugin in this process (this one too).
        :param nbytes: how many bytes; ``None``: the rest of ``src`` from ``src_offset``.
        :param dst_offset: where in ``dst`` the bytes go.
        :param src_offset: where in ``src`` they start.
        :param stream: a stream of this backend; ``None``: [`default_stream`][metrale_core.GpuBackend.default_stream].
        :raises InvalidBufferError: a buffer is not live (or ``src``'s backend is closed), or a range runs past
            its end.
        :raises InvalidArgumentError: the two backends are of different plugins, or an argument is malformed.
        """
        self._streams.copy_peer(dst, src, nbytes, dst_offset, src_offset, stream)

    @gated
    def enable_peer_access(self, peer: GpuBackend) -> None:
        """Let this backend's device read and write ``peer``'s memory directly, so `copy_peer` from it takes
        the direct path (CUDA: ``cuCtxEnablePeerAccess``). Doing it twice, or for a backend on the same device,
        does nothing.

        :raises DriverError: ``CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`` where the two devices cannot reach each
            other (``copy_peer`` still works, through the host).
        :raises InvalidArgumentError: ``peer`` is not a backend of the same plugin.
        :raises BackendClosedError: ``peer`` is closed.
        """
        if not isinstance(peer, GpuBackend):
            raise invalid_argument("enable_peer_access", "another GpuBackend of this process", peer)
        self._streams.enable_peer_access(peer._ctx)

    @gated
    def create_stream(self) -> Stream:
        """A new non-blocking stream, owned by this backend."""
        return self._streams.create_stream()

    @gated
    def create_event(self) -> Event:
        """A new event, owned by this backend."""
        return self._streams.create_event()

    @gated
    def synchronize(self) -> None:
        """Wait for all work of this backend."""
        self._streams.synchronize()

    # -- capture ------------------------------------------------------------------------

    @gated
    def begin_capture(self, stream: Stream | None = None) -> None:
        """Begin capturing ``stream`` in CUDA's global mode: its work is recorded, not run."""
        self._streams.begin_capture(stream)

    @gated
    def end_capture(self, stream: Stream | None = None) -> Graph:
        """End the capture of ``stream`` and return the recorded [`Graph`][metrale_core.Graph].

        An invalidated capture is ended and discarded, and ``CaptureError`` raised.
        """
        return self._streams.end_capture(stream)

    @gated
    def stream_is_capturing(self, stream: Stream | None = None) -> bool:
        """Whether ``stream`` is capturing (also while the capture is invalidated).

        Asks the driver, which also sees captures begun outside metrale;
        under the scale variant the driver is never asked and metrale's own
        record answers.
        """
        return self._streams.is_capturing(stream)

    # -- kernels ------------------------------------------------------------------------

    @gated
    def load_modules(self, images: Mapping[str, bytes | str]) -> KernelRegistry:
        """Load named PTX images; returns the registry that hands out their kernels.

        Every image is checked against the device's compute capability first;
        the images the device cannot run are refused together, in one
        [`ArchitectureError`][metrale_core.ArchitectureError], and nothing is loaded.
        """
        return self._kernels.load_modules(images)

    @gated
    def preflight(self, images: Mapping[str, bytes | str]) -> None:
        """Check PTX images against the device without loading them; raises like
        [`load_modules`][metrale_core.GpuBackend.load_modules].

        ``images`` maps module names (``str``) to PTX images (``bytes``, ``bytearray`` or ``str``);
        anything else raises [`InvalidArgumentError`][metrale_core.InvalidArgumentError] saying so."""
        self._kernels.preflight(images)

    @gated
    def add_kernel_implementations(self, *implementations: KernelImplementation) -> None:
        """Python implementations of kernels, for a backend that runs kernels on the CPU (the fake).

        Backends that run kernels on a device ignore them.
        """
        self._kernels.add_kernel_implementations(implementations)

    def launch(
        self, kernel: Kernel, grid: int | Sequence[int], block: int | Sequence[int], args: Sequence[object], *,
        shared_mem: int = 0, stream: Stream | None = None,
    ) -> None:
        """Launch ``kernel`` with ``grid`` x ``block`` threads on ``stream``.

        ``args`` holds one value per kernel parameter: a ``DeviceBuffer``
        (checked live), an ``int`` device pointer (unchecked), or an
        explicitly typed scalar (a numpy scalar or a ctypes value) of the
        parameter's type. Anything else is refused before the driver sees it.
        In a capture the launch is recorded. With ``debug_sync_kernels`` the
        stream is synchronized after the launch (outside captures) and a
        failure names this launch.

        :param kernel: from [`KernelRegistry.kernel`][metrale_core.KernelRegistry.kernel].
        :param grid: blocks per grid: an ``int`` or up to three dimensions.
        :param block: threads per block: an ``int`` or up to three dimensions.
        :param args: one value per kernel parameter, as above.
        :param shared_mem: dynamic shared memory per block, in bytes.
        :param stream: the stream to queue it on; ``None``: [`default_stream`][metrale_core.GpuBackend.default_stream].
        :raises InvalidArgumentError: ``args`` does not match the kernel's parameters, or the shape is invalid.
        :raises InvalidBufferError: a buffer argument is not live.
        :raises DeviceFaultError: the kernel faulted (seen at the launch only with ``debug_sync_kernels``).
        """
        ctx = self._ctx
        ctx.enter()  # what @gated does, written out: a hot path
        try:
            self._kernels.launch(kernel, grid, block, args, shared_mem, stream)
        finally:
            ctx.leave()

    @gated
    def tensor_map(self, buffer: DeviceBuffer, spec: TensorMapSpec, offset: int = 0) -> TensorMap:
        """A tensor map (TMA descriptor) of ``spec`` over ``buffer`` from byte ``offset``.

        Checked by [`check_tensor_map`][metrale_core.check_tensor_map] with this device's compute capability and shared
        memory per multiprocessor (a [`TensorMapError`][metrale_core.TensorMapError] names the rule the driver would
        refuse), then by metrale's own rules: ``buffer`` a live buffer of this backend and
        ``offset + spec.extent <= buffer.nbytes`` (else [`InvalidBufferError`][metrale_core.InvalidBufferError]); then
        encoded. Pass the map as the argument of a kernel's tensor-map parameter.
        """
        return self._maps.make(buffer, spec, offset)

    @gated
    def n_tile(self, /, m: int, n: int, **options: Any) -> NTile:
        """[`metrale_core.n_tile`][metrale_core.n_tile] with this device's multiprocessor count (``options`` are its
        other keywords)."""
        return self._maps.n_tile(m, n, options)

    @gated
    def run_metrics(self) -> RunMetrics:
        """Kernels looked up, launches per kernel and (with ``kernel_timing``) GPU time, since this backend opened.

        Resolving the timings waits for their events, so this is refused during a capture.
        """
        return self._kernels.run_metrics()

    # -- red zones ----------------------------------------------------------------------

    @gated
    def scan_redzones(self) -> list[RedZoneViolation]:
        """Wait for this backend's work, then report every live zone whose bytes changed.

        Each violation goes to the observers, then is logged (``redzone_action="warn"``,
        the default) or raised as one [`RedZoneError`][metrale_core.RedZoneError]
        (``"raise"``).
        """
        forbid_during_capture("scan_redzones()")
        return self._guard.scan()

    @property
    @gated
    def redzone_checks(self) -> RedZoneChecks:
        """How this backend checks red zones around graph launches: a ``str``, in words, with a ``mode``.

        - ``mode``: ``"inside"`` every captured graph (where the backend maps host memory);
          ``"queued"`` or ``"waited"``, a scan after each launch (where it cannot); ``"off"``
          (``redzone_scan_graphs`` off, or red zones off); ``"unknown"`` while a capture runs.
        - ``reason``: why graphs are not checked inside (``""`` where they are).
        - Compare ``mode``; print the string."""
        return self._guard.checks

    @gated
    def on_redzone_violation(self, observer: Callable[[str, RedZoneViolation], object]) -> None:
        """Call ``observer(backend_name, violation)`` for every violation this backend finds."""
        if not callable(observer):
            raise invalid_argument("on_redzone_violation", "a callable", observer)
        self._guard.on_violation(observer)

    # -- interop ------------------------------------------------------------------------

    @gated
    def wrap(self, obj: object) -> DeviceBuffer:
        """Another library's memory as a ``DeviceBuffer`` of kind ``"external"``, without a copy.

        ``obj`` exports the CUDA array interface or DLPack (a CuPy array, a PyTorch tensor) or, on
        a backend whose device memory is host memory (the fake), is a writable C-contiguous
        buffer (a numpy array). metrale's copies, memsets and launches then work on it; it is
        never on the ledger and never freed by metrale: [`unwrap`][metrale_core.GpuBackend.unwrap] lets go of it (and of
        ``obj``, which is kept alive until then). Wrapping waits for the device's work, so what
        the producer issued in this context is done.
        """
        return self._exports.wrap(obj)

    @gated
    def unwrap(self, buf: DeviceBuffer) -> None:
        """Let go of memory of [`wrap`][metrale_core.GpuBackend.wrap]; the buffer is no longer live here (its owner
        still frees it)."""
        self._exports.unwrap(buf, self._streams.warn_if_graphed)

    # -- memory pressure ----------------------------------------------------------------

    @gated_read
    def stats(self) -> MemoryStats:
        """Counts and bytes since the backend opened (peaks since the last
        [`reset_peak`][metrale_core.GpuBackend.reset_peak])."""
        return self._monitor.stats()

    @gated_read
    def ledger_report(self) -> LedgerReport:
        """This backend's ledger now, what its sweeps took since it opened (its leaks) and its counters, with
        its [`origin`][metrale_core.GpuBackend.origin]: plain values another process can merge
        ([`merge_reports`][metrale_core.merge_reports]; picklable, for ``torch.distributed.gather_object``).
        Answers after a device fault too."""
        stats = self._monitor.stats()
        summary = dataclasses.asdict(stats) | {"current_total_bytes": stats.current_total_bytes}
        return LedgerReport(
            self.origin, tuple(self._holdings.ledger.snapshot()), tuple(self._memory.swept), summary
        )

    @gated_read
    def memory_summary(self, top: int = 5) -> str:
        """A table of this backend's memory, as ``torch.cuda.memory_summary()`` gives: current, peak and
        allocated bytes by kind, allocation counts, out-of-memory failures and retries, arenas, red zones,
        the device's free memory, and the ``top`` call sites holding the most live memory. Answers after a
        device fault too (without the device's free memory)."""
        return self._monitor.summary(top)

    @gated_read
    def reset_peak(self) -> None:
        """Start the peaks of [`stats`][metrale_core.GpuBackend.stats] again from the bytes live now."""
        self._monitor.reset_peak()

    @gated
    def spawn_oom_watchdog(
        self, *, interval_s: float, min_free_bytes: int, on_low: Callable[[MemoryInfo], object] | None = None
    ) -> OomWatchdog:
        """Start an [`OomWatchdog`][metrale_core.OomWatchdog]: a daemon thread that polls
        ``memory_info()`` every ``interval_s`` seconds and warns, once, when
        ``effective_free`` falls under ``min_free_bytes``."""
        return self._monitor.spawn_oom_watchdog(interval_s, min_free_bytes, on_low)

    @gated_read
    def save_snapshot(self, path: str | os.PathLike[str]) -> Path:
        """Write the ledger (and its history, with ``memory_history``) and [`stats`][metrale_core.GpuBackend.stats] to
        ``path`` as JSON, for ``metrale report``; returns the path.

        The file is written atomically (a temporary file beside it, then a rename). A ``path`` that
        is not a ``str`` or ``os.PathLike`` raises [`InvalidArgumentError`][metrale_core.InvalidArgumentError]; one
        that cannot be written (a folder, a missing folder, no permission) raises
        [`SnapshotError`][metrale_core.SnapshotError] naming it, and leaves no temporary file behind."""
        return self._monitor.save_snapshot(path)

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Abort a capture, sweep the ledger, release everything; idempotent, never raises.

        Safe from any thread against any other call: calls already running finish first
        (those of this thread excepted: a callback may close the backend it was called by),
        later ones raise [`BackendClosedError`][metrale_core.BackendClosedError].

        Afterwards the backend holds no memory: the parts let go of every buffer, module,
        wrapped object, ``on_out_of_memory`` callback and violation observer, and of the raw
        device (only [`raw`][metrale_core.GpuBackend.raw] still answers with it); nothing of it waits for the garbage
        collector, and its handles keep neither it nor its raw device alive.
        """
        ctx = self._ctx
        if not ctx.shut():
            return
        # quiesce: nothing new starts; what runs is stopped or waited for
        self._monitor.stop()
        self._streams.abort_captures()
        ctx.quietly("synchronize", self._guard.sync_device)  # nothing is released while the device may use it
        self._guard.final_scan()
        # release: the handles first (graphs depend on modules and memory), then the parts in the
        # reverse order of construction, the default stream and the raw device last
        self._streams.release_handles()
        self._kernels.release()
        self._exports.release()
        self._memory.release()
        self._guard.release()
        self._streams.release_default()
        target = self._raw_device
        try:
            target.close()
        except Exception as exc:  # close never raises, whatever a plugin does
            _log.warning("close of %s:%d: the backend's raw close failed: %s", self.name, self.ordinal, exc)
        # drop what the core holds of the raw device and the cycles through the context, so nothing of
        # this backend waits for the garbage collector; this object keeps the raw device for `raw`
        ctx.release()

    def __enter__(self) -> GpuBackend:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<metrale {type(self).__name__} {self.name}:{self.ordinal} ({state})>"

