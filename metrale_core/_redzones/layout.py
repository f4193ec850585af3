"""Red-zone bookkeeping: where each guard band lies and how to judge it.

- `Zone`, `Layout`: one guard band; where a zoned allocation's parts lie.
- `RedZones`: the live zones of one backend, and the dense table the scan kernel reads.
- `zone_table`, `zone_violations`: a scan's table for some zones, and the violations in its results.
"""

from __future__ import annotations

import array
import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Literal, final

from .._device.buffer import DeviceBuffer
from .._settings.model import MetraleSettings
from .._types import RedZoneViolation

__all__ = ["ALIGN", "Layout", "RedZones", "Zone", "zone_table", "zone_violations"]

#: Device pointers handed to users are aligned to this, as cuMemAlloc's are.
ALIGN: Final = 256


def _round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@final
@dataclasses.dataclass(frozen=True, slots=True)
class Zone:
    """One guard band: ``length`` bytes at device address ``start``."""

    buffer: DeviceBuffer
    side: Literal["trail", "lead"]
    start: int
    length: int


@final
@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """Where a zoned allocation's parts lie within its raw allocation."""

    raw_bytes: int
    lead: int
    trail: int


@final
class RedZones:
    """The zones of one backend's live allocations, and the settings that shape them.

    Besides a map from each allocation to its zones, it keeps the table that the
    device-side scan reads: a dense ``array('Q')`` of (address, length) pairs, one
    slot per live zone, kept up to date as allocations come and go (a removed zone's
    slot takes the last one), so a scan copies it as it is, and only when
    `version` moved since the last copy.
    """

    __slots__ = (
        "_lock", "_patterns", "_slot_of", "_slots", "_table", "_zones", "fill", "filled", "lead", "min_idx", "sample",
        "size", "version",
    )

    def __init__(self, settings: MetraleSettings) -> None:
        self.size = settings.redzone
        self.min_idx = settings.redzone_min_idx
        self.fill = settings.redzone_fill
        self.lead = settings.redzone_lead
        self.sample = settings.redzone_sample
        self._lock = threading.Lock()
        self._zones: dict[int, tuple[Zone, ...]] = {}  # creation index -> its zones
        self._slots: list[Zone] = []  # slot i: the zone at table[2i], table[2i + 1]
        self._slot_of: dict[int, int] = {}  # zone start -> slot (live zones never share a start)
        self._table = array.array("Q")
        self._patterns: dict[int, bytes] = {}  # zone length -> that many fill bytes
        #: Moves on every change to the set of live zones.
        self.version = 0
        #: How many allocations' zones were added: each was filled first (the guard's fills issued).
        self.filled = 0

    def layout(self, nbytes: int, index: int) -> Layout | None:
        """The raw size and the zones for an ``alloc`` of ``nbytes`` with ``index``; ``None`` for none."""
        if self.size == 0 or index < self.min_idx or index % self.sample:
            return None
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
        if not zones:
            return
        with self._lock:
            self._zones[zones[0].buffer.index] = zones
            for zone in zones:
                self._slot_of[zone.start] = len(self._slots)
                self._slots.append(zone)
                self._table.extend((zone.start, zone.length))
            self.version += 1
            self.filled += 1

    def remove(self, index: int) -> tuple[Zone, ...]:
        """Forget the zones of allocation ``index``; returns them (empty if it had none)."""
        with self._lock:
            zones = self._zones.pop(index, ())
            for zone in zones:
                slot = self._slot_of.pop(zone.start)
                last = self._slots.pop()
                pair = self._table[-2:]
                del self._table[-2:]
                if slot < len(self._slots):  # the last zone moves into the freed slot
                    self._slots[slot] = last
                    self._table[2 * slot : 2 * slot + 2] = pair
                    self._slot_of[last.start] = slot
            if zones:
                self.version += 1
            return zones

    def zones_of(self, index: int) -> tuple[Zone, ...]:
        """The zones of allocation ``index`` still watched (empty if none)."""
        with self._lock:
            return self._zones.get(index, ())

    def watched(self, index: int) -> bool:
        """Whether allocation ``index`` still has zones here (live, or freed and waiting in quarantine)."""
        return index in self._zones

    def live(self) -> list[Zone]:
        with self._lock:
            return list(self._slots)

    def table(self) -> tuple[int, int, bytes]:
        """``(version, count, table bytes)``: what the device-side table holds for this version."""
        with self._lock:
            return self.version, len(self._slots), self._table.tobytes()

    def snapshot(self, known_version: int) -> tuple[int, Sequence[Zone], bytes | None]:
        """``(version, zones, table)``: the live zones in slot order and, unless the
        version is still ``known_version``, the table's bytes for the device."""
        with self._lock:
            table = None if self.version == known_version else self._table.tobytes()
            return self.version, list(self._slots), table

    def judge(self, zone: Zone, data: bytes) -> RedZoneViolation | None:
        """A violation if ``data`` (the zone read back) is not all fill bytes."""
        pattern = self._patterns.get(len(data))
        if pattern is None:
            pattern = self._patterns.setdefault(len(data), bytes((self.fill,)) * len(data))
        if data == pattern:  # one memcmp; finding the offset (lstrip) is ~30x slower, so only on a violation
            return None
        rest = data.lstrip(bytes((self.fill,)))
        buf = zone.buffer
        return RedZoneViolation(
            ptr=buf.ptr,
            nbytes=buf.nbytes,
            index=buf.index,
            site=buf.site,
            side=zone.side,
            offset=len(data) - len(rest),
        )


def zone_table(zones: Sequence[Zone]) -> bytes:
    """The scan kernel's table for ``zones``: an (address, length) pair of u64 per zone."""
    table = array.array("Q")
    for zone in zones:
        table.extend((zone.start, zone.length))
    return table.tobytes()


def zone_violations(
    zones: Sequence[Zone], firsts: Iterable[int], keep: Callable[[DeviceBuffer], bool] = lambda buf: True
) -> list[RedZoneViolation]:
    """The violations in a scan's results: ``firsts[i]`` is zone ``i``'s first changed offset + 1, or 0.

    Only the zones with a violation are looked up (a snapshot's zones may be made when asked for)."""
    return [
        RedZoneViolation(z.buffer.ptr, z.buffer.nbytes, z.buffer.index, z.buffer.site, z.side, first - 1)
        for i, first in enumerate(firsts)
        if first and keep((z := zones[i]).buffer)
    ]
