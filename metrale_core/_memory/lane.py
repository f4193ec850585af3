"""The lane: ``GpuBackend.alloc`` and ``GpuBackend.free``, the hot path of device memory, through the gate.

- `DeviceLane.alloc` and `DeviceLane.free` count the call in and out of the gate and hand it to the
  allocator, which does the work (the ledger, red zones, reclaim-and-retry, the errors).
- ``_lane.pyx`` is its compiled twin: it does the common case itself at C level (a device allocation or free,
  red zones or none, no capture in progress), through the same parts the allocator hands both (`LaneParts`,
  `ZonedParts`), and hands everything else to the allocator, as this class does with every call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, final

from .._device.buffer import DeviceBuffer
from .._device.context import DeviceContext
from .._device.stats import StatsCounter
from .._errors import OutOfMemoryError
from .._types import AllocKind
from .ledger import Ledger
from .watch import ReleaseWatch

if TYPE_CHECKING:
    from .._device.handles import Stream
    from .._redzones.guard import ZoneGuard
    from .._redzones.layout import RedZones
    from .pool import MemoryPool
    from .quarantine import Quarantine

__all__ = ["DeviceLane", "LaneParts", "LaneWork", "ZonedParts"]


class LaneWork(Protocol):
    """What a lane asks of the allocator it fronts (``allocator.Allocator``)."""

    def alloc(self, nbytes: object, kind: AllocKind, what: str) -> DeviceBuffer:
        """Every allocation: the whole work, the errors included."""

    def free(self, buf: object) -> None:
        """Every free: the whole work, the errors included."""

    def piece_taken(self, buf: DeviceBuffer, record: DeviceBuffer, stream: Stream | None) -> None:
        """A pool piece's record is off the ledger (an equal handle freed it): back to its pool."""

    def retry_alloc(self, n: int, kind: AllocKind, what: str, failed: OutOfMemoryError) -> int:
        """A raw allocation whose first try ran out of memory: reclaim-and-retry."""

    def zoned_raw(self, raw_bytes: int, n: int) -> int:
        """The raw memory of a zoned allocation of ``n`` bytes that no kept block serves: ``raw_bytes`` from the
        driver, with reclaim-and-retry."""

    def release_quietly(self, raw_ptr: int, kind: AllocKind) -> None:
        """Give back the raw memory of an allocation that cannot be committed."""

    def trace(self, index: int, what: str, n: int, site: str) -> None:
        """Log the stack of the allocation ``redzone_trace_idx`` names."""


class ZonedParts(NamedTuple):
    """What a zoned allocation and its free touch besides the ledger, each part still its owner's.

    - ``guard``: the zone guard (`ZoneGuard.forget` where a commit finds the backend closed).
    - ``zones``: its zone table, which counts the fills issued.
    - ``quarantine``: the allocator's quarantine: a kept block for an allocation, a freed buffer held.
    - ``raw_base``: the holdings' raw address of each zoned allocation, by creation index.
    - ``stream``: the default stream's raw handle, where the zones are filled.
    - ``zeroes``: whether a kept block is zeroed before a new allocation takes it (fresh memory reads as zeros).
    """

    guard: ZoneGuard
    zones: RedZones
    quarantine: Quarantine
    raw_base: dict[int, int]
    stream: object
    zeroes: bool


class LaneParts(NamedTuple):
    """What the allocator hands its lane: the parts an allocation and a free touch, each still its owner's.

    - ``ctx``: the device context (its gate, its lock, the plugin, the internal packages of call sites).
    - ``ledger``, ``stats``: the allocator's holdings' ledger and the backend's counters.
    - ``releases``: the holdings' `ReleaseWatch`, whose ``active`` observers a free calls (read at each free: empty
      while no graph, export or tensor map lives).
    - ``zoning``: where device allocations may get red zones, the parts they touch; ``None`` where they may not.
    - ``trace_idx``: the ``redzone_trace_idx`` setting (its allocation goes to the allocator's log).
    - ``caller_frames``: frames above the lane that are the backend's own for certain, passed over by the call site's
      walk without a look (the facade's ``GpuBackend.alloc``, where it runs as Python: it says so; ``0`` else).
    - ``pool_of``: the holdings' pool of each piece out, by creation index (the pool lane's).
    """

    ctx: DeviceContext
    ledger: Ledger
    stats: StatsCounter
    releases: ReleaseWatch
    trace_idx: int | None
    zoning: ZonedParts | None = None
    caller_frames: int = 0
    pool_of: dict[int, MemoryPool] | None = None


@final
class DeviceLane:
    """``GpuBackend.alloc`` and ``free``: inside the gate, the allocator's work."""

    __slots__ = ("_allocator", "_ctx")

    def __init__(self, allocator: LaneWork, parts: LaneParts) -> None:
        self._allocator = allocator
        self._ctx = parts.ctx

    def alloc(self, nbytes: object) -> DeviceBuffer:
        """``GpuBackend.alloc``."""
        ctx = self._ctx
        ctx.enter()
        try:
            return self._allocator.alloc(nbytes, "device", "alloc")
        finally:
            ctx.leave()

    def free(self, buf: object) -> None:
        """``GpuBackend.free``; from a finalizer that a collection runs in a call of this backend, at the thread's
        next call (`Gate.defer`)."""
        ctx = self._ctx
        gate = ctx.gate
        if gate.interrupted():
            gate.defer(self.free, buf)
            return
        ctx.enter()
        try:
            self._allocator.free(buf)
        finally:
            ctx.leave()
