"""Red-zone bookkeeping: where each guard band lies and how to judge it."""

from __future__ import annotations

import dataclasses
import threading
from typing import Final, Literal

from ._settings import MetraleSettings
from ._types import DeviceBuffer, RedZoneViolation

__all__ = ["ALIGN", "Layout", "RedZones", "Zone"]

#: Device pointers handed to users are aligned to this, as cuMemAlloc's are.
ALIGN: Final = 256


def _round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclasses.dataclass(frozen=True, slots=True)
class Zone:
    """One guard band: ``length`` bytes at device address ``start``."""

    buffer: DeviceBuffer
    side: Literal["trail", "lead"]
    start: int
    length: int


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """Where a zoned allocation's parts lie within its raw allocation."""

    raw_bytes: int
    lead: int
    trail: int


class RedZones:
    """The zones of one backend's live allocations, and the settings that shape them."""

    __slots__ = ("_lock", "_zones", "fill", "lead", "min_idx", "size")

    def __init__(self, settings: MetraleSettings) -> None:
        self.size = settings.redzone
        self.min_idx = settings.redzone_min_idx
        self.fill = settings.redzone_fill
        self.lead = settings.redzone_lead
        self._lock = threading.Lock()
        self._zones: dict[int, tuple[Zone, ...]] = {}

    def layout(self, nbytes: int, index: int) -> Layout:
        """The raw size and the zones for an ``alloc`` of ``nbytes`` with ``index``."""
        if self.size == 0 or index < self.min_idx:
            return Layout(raw_bytes=nbytes, lead=0, trail=0)
        # The leading band is rounded up so the user's pointer stays aligned.
        lead = _round_up(self.size) if self.lead else 0
        return Layout(raw_bytes=lead + nbytes + self.size, lead=lead, trail=self.size)

    def zones_for(self, buf: DeviceBuffer, layout: Layout) -> tuple[Zone, ...]:
        zones: list[Zone] = []
        if layout.lead:
            zones.append(Zone(buf, "lead", buf.ptr - layout.lead, layout.lead))
        if layout.trail:
            zones.append(Zone(buf, "trail", buf.ptr + buf.nbytes, layout.trail))
        return tuple(zones)

    def add(self, zones: tuple[Zone, ...]) -> None:
        if zones:
            with self._lock:
                self._zones[zones[0].buffer.ptr] = zones

    def remove(self, ptr: int) -> tuple[Zone, ...]:
        """Forget the zones of the allocation at ``ptr``; returns them (empty if it had none)."""
        with self._lock:
            return self._zones.pop(ptr, ())

    def live(self) -> list[Zone]:
        with self._lock:
            return [z for zones in self._zones.values() for z in zones]

    def judge(self, zone: Zone, data: bytes) -> RedZoneViolation | None:
        """A violation if ``data`` (the zone read back) is not all fill bytes."""
        rest = data.lstrip(bytes((self.fill,)))
        if not rest:
            return None
        buf = zone.buffer
        return RedZoneViolation(
            ptr=buf.ptr,
            nbytes=buf.nbytes,
            index=buf.index,
            site=buf.site,
            side=zone.side,
            offset=len(data) - len(rest),
        )
