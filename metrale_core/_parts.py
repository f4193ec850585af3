"""The parts of one open backend: made in the order they need each other, quiesced and released in reverse.

- `BackendParts` owns the wiring: each part is given the parts below it, and the lanes the facade calls on the hot
  path are picked here (compiled where built, unless ``pure``).
- `BackendParts.close` is the shutdown order: quiesce (watchdogs, captures, the device, the final scan), then release
  (handles, kernels, exports, memory, zones, the default stream, the raw device, the context's cycles).
- The facade (``_backend.py``) holds one and delegates each call in a line to the part that owns the state.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import final

from ._device.context import DeviceContext
from ._device.raw import RawDevice
from ._device.stats import StatsCounter
from ._errors import MetraleError
from ._launch.front import KernelFront
from ._launch.lane import LaunchLane
from ._launch.tensormaps import TensorMapFront
from ._memory.allocator import Allocator
from ._memory.exports import ExportTable
from ._memory.holdings import Holdings
from ._memory.monitor import MemoryMonitor
from ._memory.records import origin_of
from ._redzones.guard import ZoneGuard
from ._settings.model import MetraleSettings
from ._streams.front import StreamFront
from ._streams.lane import StreamLane
from ._twins import pick

__all__ = ["BackendParts"]

_log = logging.getLogger("metrale")


@final
class BackendParts:
    """Every part of one open backend, and their order. ``owner``: the facade, which the context binds to."""

    __slots__ = (
        "ctx", "exports", "guard", "holdings", "kernels", "lane", "launch_lane", "maps", "memory", "monitor", "raw",
        "stats", "stream_lane", "streams",
    )

    def __init__(
        self, owner: object, name: str, ordinal: int, settings: MetraleSettings, raw: RawDevice,
        internal_packages: Iterable[str],
    ) -> None:
        self.raw = raw  # what the facade's `raw` answers, after close too
        ctx = self.ctx = DeviceContext(name, ordinal, settings, raw, frozenset(internal_packages))
        holdings = self.holdings = Holdings(ctx)
        stats = self.stats = pick("stats", StatsCounter, settings.pure)()
        streams = self.streams = StreamFront(ctx, holdings, stats, functools.partial(ZoneGuard, ctx, stats))
        guard = self.guard = streams.guard
        self.monitor = MemoryMonitor(ctx, holdings, stats)
        # caller_frames: GpuBackend.alloc's frame, which a call site passes over
        memory = self.memory = Allocator(ctx, holdings, stats, guard, self.monitor, caller_frames=1)
        self.lane = memory.lane
        self.stream_lane = pick("stream_lane", StreamLane, settings.pure)(streams, holdings.ledger)
        self.exports = ExportTable(ctx, holdings, guard)
        kernels = self.kernels = KernelFront(ctx, holdings, streams)
        self.launch_lane = pick("launch_lane", LaunchLane, settings.pure)(kernels, kernels.lane_parts())
        self.maps = TensorMapFront(ctx, holdings)
        origin = holdings.ledger.origin = origin_of(ctx)
        ctx.bind(owner, origin, self.exports)

    def close(self) -> None:
        """Shut the gate and release everything, once; never raises. Calls running finish first."""
        ctx = self.ctx
        gate = ctx.gate
        if not gate.closed and not gate.interrupted():
            try:
                ctx.enter()  # its outermost call runs the frees deferred from finalizers: done, not swept as leaks
            except MetraleError:  # faulted: the sweep takes them
                pass
            else:
                ctx.leave()
        if not ctx.shut():
            return
        # quiesce: nothing new starts; what runs is stopped or waited for. Then release: the handles first
        # (graphs use modules and memory), the parts in reverse order, the default stream and raw device last
        self.monitor.stop()
        self.streams.abort_captures()
        ctx.quietly("synchronize", self.guard.sync_device)  # nothing is released while the device may use it
        self.guard.final_scan()
        self.streams.release_handles()
        self.kernels.release()
        self.exports.release()
        self.memory.release()
        self.guard.release()
        self.streams.release_default()
        try:
            self.raw.close()
        except Exception as exc:  # close never raises, whatever a plugin does
            _log.warning("close of %s:%d: the backend's raw close failed: %s", ctx.name, ctx.ordinal, exc)
        ctx.release()  # the context's cycles dropped: nothing waits for the collector; `raw` keeps the device
