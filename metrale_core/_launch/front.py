"""The kernel front: one backend's kernel modules, launches and their timings.

It loads PTX images after the architecture preflight (into a
[`KernelRegistry`][metrale_core.KernelRegistry] it keeps track of and closes with the backend),
launches kernels after their arguments are checked and packed (``pack.pack_args``) and
their buffers checked live (the common case is its lane's, ``lane.py``), keeps the last
launches for a fault report, and owns the run metrics and the timing events of ``kernel_timing``.
"""

from __future__ import annotations

import reprlib
import weakref
from collections.abc import Mapping, Sequence
from typing import Final

from .._device.args import dims, integer, invalid_argument
from .._device.buffer import DeviceBuffer
from .._device.capture import capturing, forbid_during_capture
from .._device.context import DeviceContext, Launch
from .._device.guarded import raise_raw
from .._device.handles import Stream
from .._errors import BackendClosedError, InvalidArgumentError, MetraleError
from .._memory.holdings import Holdings
from .._streams.front import StreamFront
from .._twins import pick
from .._types import KernelImplementation
from ..kernels._ptx import PtxImage, check_architecture, parse_ptx
from .lane import LaunchLaneParts, launch_failed
from .pack import pack_args
from .registry import MAX_BLOCK, MAX_GRID, MAX_THREADS_PER_BLOCK, Kernel, KernelRegistry, RunMetrics
from .tensormaps import TensorMap

__all__ = ["KernelFront", "dims"]

#: Timed launches whose events are kept before the finished ones are resolved (``kernel_timing``).
_MAX_PENDING_TIMINGS: Final = 4096


class KernelFront:
    """Kernel modules, launches and run metrics of one backend."""

    __slots__ = ("_holdings", "_metrics", "_pack", "_raw", "_registries", "_streams", "ctx")

    def __init__(self, ctx: DeviceContext, holdings: Holdings, streams: StreamFront) -> None:
        self.ctx = ctx
        self._raw = ctx.raw
        self._holdings = holdings
        self._streams = streams
        self._metrics = RunMetrics()
        self._registries: weakref.WeakSet[KernelRegistry] = weakref.WeakSet()
        self._pack = pick("pack", pack_args, ctx.settings.pure)

    def lane_parts(self) -> LaunchLaneParts:
        """What its lane touches of the front's parts (`LaunchLaneParts`)."""
        settings = self.ctx.settings
        streams = self._streams
        return LaunchLaneParts(
            self.ctx, self._holdings, streams.guard, streams.default, self._metrics,
            not (settings.kernel_timing or settings.debug_sync_kernels),
        )

    # -- modules -------------------------------------------------------------------------------

    def load_modules(self, images: Mapping[str, bytes | str]) -> KernelRegistry:
        forbid_during_capture("load_modules")
        if not isinstance(images, Mapping) or not images:
            raise invalid_argument("load_modules", "a non-empty mapping of module name to PTX image", images)
        texts: dict[str, bytes] = {}
        for name, image in images.items():
            if not isinstance(name, str) or not isinstance(image, bytes | bytearray | str):
                raise invalid_argument("load_modules", "str names and PTX images as bytes or str", (name, image))
            texts[name] = image.encode() if isinstance(image, str) else bytes(image)
        parsed = {name: parse_ptx(name, text) for name, text in texts.items()}
        check_architecture(parsed, self._raw.compute_capability(), self._raw.device_name())
        loaded: dict[str, object] = {}  # nothing is loaded until every image passed
        try:
            for name, text in texts.items():
                loaded[name] = self._raw.module_load(name, text)
        except MetraleError:
            for module in loaded.values():
                self.ctx.quietly("module unload", self._raw.module_unload, module)
            raise
        registry = KernelRegistry(self.ctx, self._metrics, parsed, loaded)
        with self.ctx.lock:
            self._registries.add(registry)
        return registry

    def preflight(self, images: object) -> None:
        expected = "a mapping of module names (str) to PTX images (bytes, bytearray or str)"
        if not isinstance(images, Mapping):
            raise InvalidArgumentError(f"preflight: expected {expected}, got {reprlib.repr(images)}")
        parsed: dict[str, PtxImage] = {}
        for name, image in images.items():
            if not isinstance(name, str) or not isinstance(image, bytes | bytearray | str):
                raise InvalidArgumentError(
                    f"preflight: expected {expected}, got the entry {reprlib.repr(name)}: {reprlib.repr(image)}"
                )
            parsed[name] = parse_ptx(name, image)
        check_architecture(parsed, self._raw.compute_capability(), self._raw.device_name(), what="preflight")

    def add_kernel_implementations(self, implementations: Sequence[object]) -> None:
        for impl in implementations:
            if not isinstance(impl, KernelImplementation):
                raise invalid_argument(
                    "add_kernel_implementations", "functions decorated with @kernel_implementation", impl
                )
        self._raw.add_kernel_implementations(implementations)  # type: ignore[arg-type]

    # -- launches ------------------------------------------------------------------------------

    def launch(
        self, kernel: Kernel, grid: object, block: object, args: Sequence[object], shared_mem: object,
        stream: Stream | None,
    ) -> None:
        what = "launch"
        ctx = self.ctx
        if not isinstance(kernel, Kernel) or not kernel.registry._owned_by(ctx):
            raise invalid_argument(what, "a Kernel of a registry of this backend", kernel)
        if kernel.registry.unloaded:  # (inside the gate the backend is open: only the registry can be closed)
            raise BackendClosedError(f"{what}: the registry of {kernel.signature} was closed; load the modules again")
        g = dims(grid, "grid", MAX_GRID)
        b = dims(block, "block", MAX_BLOCK)
        if b[0] * b[1] * b[2] > MAX_THREADS_PER_BLOCK:
            raise InvalidArgumentError(f"{what}: block {b} has more than {MAX_THREADS_PER_BLOCK} threads")
        shm = shared_mem if type(shared_mem) is int and shared_mem >= 0 else integer(shared_mem, what, "shared_mem")
        packed = self._pack(kernel, args, what, self._live)
        streams = self._streams
        target = streams.default if stream is None else streams.resolve(stream, what)
        outside_capture = target.capture is None and not capturing()
        settings = ctx.settings
        timing = settings.kernel_timing and outside_capture
        raw = self._raw
        start = end = None
        if timing:
            start, end = raw.event_create(), raw.event_create()
            raw.event_record(start, target.raw)
        launched: Launch = (kernel.module, kernel.name, g, b, packed)
        ctx.recent.append(launched)  # formatted only when a fault is reported: launches are a hot path
        try:
            function = kernel.raw
            if target.capture is None:  # the common case written out (a hot path): straight to the plugin
                guard = streams.guard
                if guard.fills:
                    guard.settle_for(target)
                try:
                    ctx.plugin.launch(function, g, b, shm, target.raw, packed)
                except Exception as exc:
                    raise_raw(ctx, ctx.name, "launch", exc)
            else:
                capture = target.capture
                capture.registries[id(kernel.registry)] = kernel.registry
                maps = [a.tensor_map.buffer for a in packed if isinstance(a.tensor_map, TensorMap)]
                buffers = [a for a in args if isinstance(a, DeviceBuffer)] + maps
                streams.issue(target, what, buffers, lambda s: raw.launch(function, g, b, shm, s, packed))
                # its node, for a red-zone report's suspects: the addresses it took (issue counted the node)
                pointers = tuple(a.pointer for a in packed if a.pointer is not None) + tuple(m.ptr for m in maps)
                capture.kernels.append((kernel.name, f"node {capture.nodes}", pointers))
            key = kernel.key
            if timing:
                raw.event_record(end, target.raw)
                self._metrics.pending.append((key, start, end))
                if len(self._metrics.pending) > _MAX_PENDING_TIMINGS:
                    self._resolve_timings(wait=False)
            self._metrics.launched(key)
            if settings.debug_sync_kernels and outside_capture:
                raw.stream_synchronize(target.raw)
        except MetraleError as exc:
            failed = launch_failed(exc, launched)
            if failed is exc:
                raise
            raise failed from exc

    def _live(self, buf: DeviceBuffer) -> None:
        """A launch's check of a buffer argument (for ``pack_args``): the very buffer the ledger handed out
        passes at once; anything else goes through the whole rule (which names what is wrong)."""
        if buf._owner is not self.ctx.ref or not self._holdings.ledger.has(buf):
            self._holdings.require_live(buf, "launch")

    def run_metrics(self) -> RunMetrics:
        if self._metrics.pending:
            forbid_during_capture("run_metrics()")
            self._resolve_timings(wait=True)
        return self._metrics

    def _resolve_timings(self, *, wait: bool) -> None:
        """Turn timed launches into GPU milliseconds: all of them, or (``wait=False``) those already done.
        Called outside any capture only, where event queries are allowed."""
        pending = self._metrics.pending
        raw = self._raw
        while pending:
            key, start, end = pending[0]
            if wait:
                raw.event_synchronize(end)
            elif not raw.event_query(end):
                break
            pending.pop(0)
            ms = raw.event_elapsed_ms(start, end)
            self._metrics.gpu_ms[key] = self._metrics.gpu_ms.get(key, 0.0) + ms
            self.ctx.quietly("event destroy", raw.event_destroy, start)
            self.ctx.quietly("event destroy", raw.event_destroy, end)

    def release(self) -> None:
        """At close: unload every registry's modules, destroy the pending timing events."""
        with self.ctx.lock:
            registries = list(self._registries)
        for registry in registries:
            registry.close()
        for _, start, end in self._metrics.pending:
            self.ctx.quietly("event destroy", self._raw.event_destroy, start)
            self.ctx.quietly("event destroy", self._raw.event_destroy, end)
        self._metrics.pending.clear()
