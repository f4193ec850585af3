"""One guard band, and where a zoned allocation's parts lie: the values every part of the red zones shares.

- `Zone`, `Layout`: one guard band; where a zoned allocation's parts lie.
- `make_zone`: a `Zone` made at a third of the cost of its constructor, for the zone table's adds.
- `zone_table`, `zone_violations`: a scan's table for some zones, and the violations in its results.

Run as Python only: the zone table (``layout.py``) is compiled as well (``_layout``), and these classes must be one
for both builds (a `Layout` is a dictionary key, a `Zone` is compared).
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, Literal, final

from .._device.buffer import DeviceBuffer
from .._types import CLASS_SWAP, RedZoneViolation

__all__ = ["ALIGN", "Layout", "Zone", "make_zone", "round_up", "zone_table", "zone_violations"]

#: Device pointers handed to users are aligned to this, as cuMemAlloc's are.
ALIGN: Final = 256


def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
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
class _UnfrozenZone:
    """`Zone`'s slots with a plain ``__init__``: how `make_zone` builds one."""

    __slots__ = Zone.__slots__

    def __init__(self, buffer: DeviceBuffer, side: str, start: int, length: int) -> None:
        self.buffer = buffer
        self.side = side
        self.start = start
        self.length = length


def make_zone(buffer: DeviceBuffer, side: Literal["trail", "lead"], start: int, length: int) -> Zone:
    """The same as ``Zone(buffer, side, start, length)`` at a third of the cost (`DeviceBuffer._make`'s way: a
    frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``); its constructor where
    assigning ``__class__`` stops every thread (`CLASS_SWAP`)."""
    if not CLASS_SWAP:
        return Zone(buffer, side, start, length)
    zone: Any = _UnfrozenZone(buffer, side, start, length)
    zone.__class__ = Zone
    return zone  # type: ignore[no-any-return]


@final
@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """Where a zoned allocation's parts lie within its raw allocation."""

    raw_bytes: int
    lead: int
    trail: int


_START_LENGTH: Final = operator.attrgetter("start", "length")


def zone_table(zones: Iterable[Zone]) -> bytes:
    """The scan kernel's table for ``zones``: an (address, length) pair of u64 per zone (read in C: no Python code
    runs per zone)."""
    return array.array("Q", itertools.chain.from_iterable(map(_START_LENGTH, zones))).tobytes()


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
