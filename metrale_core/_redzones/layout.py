"""The zone table: where each live guard band lies, the dense table the scan kernel reads, and how to judge a band.

- `RedZones`: the zones of one backend's live allocations (and of those waiting in quarantine), the settings that
  shape them, and the table the device-side scan reads.
- `Zone`, `Layout`, `zone_table`, `zone_violations`: ``zone.py``'s, named here too.

Written once, here, and compiled as well as run as Python (``_layout``, with ``_layout.pxd`` beside it:
docs/building.md); the values it hands out (`Zone`, `Layout`) are ``zone.py``'s, one class for both builds. Its
lock is the C lock where compiled: nothing under it makes a container (a collection could run there, whose
finalizer may free a zoned buffer, which takes the lock again), so the lists a reader gets are made before it.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Literal

from .._device.buffer import DeviceBuffer
from .._settings.model import MetraleSettings
from .._types import WORD_LIMIT, RedZoneViolation
from .zone import ALIGN, Layout, Zone, make_zone, round_up, zone_table, zone_violations

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

if not cython.compiled:  # (compiled: the C lock of _lock.pxd, the slot stores of _slots.pxd: _layout.pxd cimports them)
    from .._device._lock import acquire_lock, new_lock, release_lock

    def slots_to_build(cls: type, names: tuple[str, ...]) -> list[int] | None:
        return None  # (as Python, `make_zone` makes a zone)

    def slot_set(obj: object, offset: int, value: object) -> None:
        raise AssertionError("a zone is stored in place only where compiled")

__all__ = ["ALIGN", "Layout", "RedZones", "Zone", "zone_table", "zone_violations"]

# Zone's slots (buffer, side, start, length): compiled, a zone is made by storing them in place (as the packer makes a
# LaunchArg); where a Zone cannot be made so (`slots_to_build`), and as Python, `make_zone` makes it.
_Z = slots_to_build(Zone, ("buffer", "side", "start", "length")) if cython.compiled else None
_Z_DIRECT = _Z is not None
_Z_BUFFER, _Z_SIDE, _Z_START, _Z_LENGTH = (-1, -1, -1, -1) if _Z is None else _Z
del _Z


def _zone(buf: DeviceBuffer, side: Literal["trail", "lead"], start: int, length: int) -> Zone:
    """The same as ``Zone(buf, side, start, length)``."""
    if cython.compiled and _Z_DIRECT:
        zone = object.__new__(Zone)
        slot_set(zone, _Z_BUFFER, buf)
        slot_set(zone, _Z_SIDE, side)
        slot_set(zone, _Z_START, start)
        slot_set(zone, _Z_LENGTH, length)
        return zone
    return make_zone(buf, side, start, length)


class RedZones:  # (final: @cython.final in _layout.pxd; Cython takes no other decorator on it)
    """The zones of one backend's live allocations, and the settings that shape them.

    Besides a map from each allocation to its zones, it keeps the table that the
    device-side scan reads: a dense ``array('Q')`` of (address, length) pairs, one
    slot per live zone, kept up to date as allocations come and go (a removed zone's
    slot takes the last one), so a scan copies it as it is, and only when
    `version` moved since the last copy.
    """

    __slots__ = (
        "_lead_bytes", "_lead_c", "_lock", "_patterns", "_seen", "_slot_of", "_slots", "_table", "_trail_c", "_zones",
        "fill", "filled", "lead", "min_idx", "sample", "size", "version",
    )

    def __init__(self, settings: MetraleSettings) -> None:
        self.size = settings.redzone
        self.min_idx = settings.redzone_min_idx
        self.fill = settings.redzone_fill
        self.lead = settings.redzone_lead
        self.sample = settings.redzone_sample
        # The leading band is rounded up so the user's pointer stays aligned.
        self._lead_bytes = round_up(self.size) if self.lead else 0
        # the bands as C integers, for the compiled lane's fills (0 where one does not fit 64 bits: no allocation
        # fits it then, and the lane hands such an allocation to the allocator)
        self._lead_c = self._lead_bytes if self._lead_bytes < WORD_LIMIT else 0
        self._trail_c = self.size if self.size < WORD_LIMIT else 0
        self._lock = new_lock()
        self._zones: dict[int, tuple[Zone, ...]] = {}  # creation index -> its zones
        self._slots: list[Zone] = []  # slot i: the zone at table[2i], table[2i + 1]
        self._slot_of: dict[int, int] = {}  # zone start -> slot (live zones never share a start)
        self._table = array.array("Q")
        self._patterns: dict[int, bytes] = {}  # zone length -> that many fill bytes
        self._seen: tuple[int, list[Zone]] | None = None  # the last snapshot's version and zones, for the next
        #: Moves on every change to the set of live zones.
        self.version = 0
        #: How many allocations' zones were added: each was filled first (the guard's fills issued).
        self.filled = 0

    def layout(self, nbytes: int, index: int) -> Layout | None:
        """The raw size and the zones for an ``alloc`` of ``nbytes`` with ``index``; ``None`` for none."""
        if self.size == 0 or index < self.min_idx or index % self.sample:
            return None
        return Layout(self._lead_bytes + nbytes + self.size, self._lead_bytes, self.size)  # (raw_bytes, lead, trail)

    def zones_for(self, buf: DeviceBuffer, layout: Layout) -> tuple[Zone, ...]:
        zones: list[Zone] = []
        if layout.lead:
            zones.append(_zone(buf, "lead", buf.ptr - layout.lead, layout.lead))
        if layout.trail:
            zones.append(_zone(buf, "trail", buf.ptr + buf.nbytes, layout.trail))
        return tuple(zones)

    # -- adding and removing ---------------------------------------------------------------------------------

    def add(self, zones: tuple[Zone, ...], filled: bool = True) -> None:
        """Watch ``zones`` (one allocation's); ``filled``: their fill was issued on the default stream (`filled`)."""
        if not zones:
            return
        index = zones[0].buffer.index
        acquire_lock(self._lock)
        try:
            self._put(index, zones, filled)
        finally:
            release_lock(self._lock)

    def add_c(self, buf: DeviceBuffer, index: int, ptr: int, nbytes: int, filled: bool = True) -> int:
        """`add` of the zones of allocation ``index``, ``nbytes`` at ``ptr`` (its buffer ``buf``), laid out as
        `layout` and `zones_for` lay them out: the compiled lane's, at C level (it laid them out and filled them on the
        default stream; ``filled`` off: no fill was issued, its zones were in place)."""
        lead = self._lead_bytes
        trail = _zone(buf, "trail", ptr + nbytes, self.size)
        zones = (_zone(buf, "lead", ptr - lead, lead), trail) if lead else (trail,)
        acquire_lock(self._lock)
        try:
            self._put(index, zones, filled)
        finally:
            release_lock(self._lock)
        return 0

    def _put(self, index: int, zones: tuple[Zone, ...], filled: bool = True) -> None:
        """Add allocation ``index``'s ``zones`` to the table's end, lead first (the caller holds the lock); ``filled``:
        a fill on the default stream was issued for them (`filled` counts it)."""
        self._zones[index] = zones
        slots = self._slots
        table = self._table
        for zone in zones:
            self._slot_of[zone.start] = len(slots)
            slots.append(zone)
            table.append(zone.start)
            table.append(zone.length)
        self.version += 1
        if filled:
            self.filled += 1

    def remove(self, index: int) -> tuple[Zone, ...]:
        """Forget the zones of allocation ``index``; returns them (empty if it had none)."""
        acquire_lock(self._lock)
        try:
            zones = self._take(index)
        finally:
            release_lock(self._lock)
        if zones and self._seen is not None:
            self._seen = None  # (after the lock: it may hold the last reference to a buffer with a finalizer)
        return zones

    def _take(self, index: int) -> tuple[Zone, ...]:
        """`remove` under the lock, which the caller holds: each zone's slot freed in the zones' order."""
        zones = self._zones.pop(index, ())
        for zone in zones:
            self._drop(self._slot_of.pop(zone.start))
        if zones:
            self.version += 1
        return zones

    def _drop(self, slot: int) -> None:
        """Free table slot ``slot``: the last zone moves into it (the caller holds the lock)."""
        slots = self._slots
        table = self._table
        last = slots.pop()
        length = table.pop()
        start = table.pop()
        if slot < len(slots):
            slots[slot] = last
            table[2 * slot] = start
            table[2 * slot + 1] = length
            self._slot_of[last.start] = slot

    # -- reading ---------------------------------------------------------------------------------------------

    def zones_of(self, index: int) -> tuple[Zone, ...]:
        """The zones of allocation ``index`` still watched (empty if none; the compiled quarantine calls it at C
        level)."""
        acquire_lock(self._lock)
        try:
            zones = self._zones.get(index, ())
        finally:
            release_lock(self._lock)
        return zones

    def watched(self, index: int) -> bool:
        """Whether allocation ``index`` still has zones here (live, or freed and waiting in quarantine)."""
        return index in self._zones

    def live(self) -> list[Zone]:
        """The live zones, in slot order."""
        return list(self._read(self.version)[1])

    def table(self) -> tuple[int, int, bytes]:
        """``(version, count, table bytes)``: what the device-side table holds for this version."""
        acquire_lock(self._lock)
        try:  # (bytes are no container: making them runs no collection)
            version = self.version
            count = len(self._slots)
            table = self._table.tobytes()
        finally:
            release_lock(self._lock)
        return version, count, table

    def snapshot(self, known_version: int) -> tuple[int, Sequence[Zone], bytes | None]:
        """``(version, zones, table)``: the live zones in slot order and, unless the
        version is still ``known_version``, the table's bytes for the device. While the version stays the same,
        the zones are the same list (read it, never change it)."""
        return self._read(known_version)

    def _read(self, known_version: int) -> tuple[int, list[Zone], bytes | None]:
        """`snapshot`: the slots copied before the lock (a list made under it could run a collection), kept where
        the version is still the one read before the copy (else copied again), and kept for the next snapshot of
        that version; the table's bytes under the lock."""
        while True:
            version = self.version
            seen = self._seen
            zones = seen[1] if seen is not None and seen[0] == version else list(self._slots)
            acquire_lock(self._lock)
            try:
                same = self.version == version
                table = None if not same or version == known_version else self._table.tobytes()
            finally:
                release_lock(self._lock)
            if same:
                if seen is None or seen[1] is not zones:
                    self._seen = (version, zones)
                return version, zones, table

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
