"""One guard band, and where a zoned allocation's parts lie: the values every part of the red zones shares.

- `Zone`, `Layout`: one guard band; where a zoned allocation's parts lie.
- `make_zone`: a `Zone` made at a third of the cost of its constructor, for the zone table's adds.
- `zone_table`, `zone_violations`: a scan's table for some zones, and the violations in its results.
- `refill`: the bytes a block whose zones are in place needs filled for a new size; `too_big`: the error of a zoned
  allocation whose raw size does not fit 64 bits.

Run as Python only: the zone table (``layout.py``) is compiled as well (``_layout``), and these classes must be one
for both builds (a `Layout` is a dictionary key, a `Zone` is compared).
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, Literal, NamedTuple, final

from .._device.buffer import DeviceBuffer
from .._errors import InvalidArgumentError
from .._types import CLASS_SWAP, RedZoneViolation

__all__ = ["ALIGN", "Layout", "Zone", "make_zone", "refill", "round_up", "too_big", "zone_table", "zone_violations"]

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


class Layout(NamedTuple):
    """Where a zoned allocation's parts lie within its raw allocation (a named tuple: one is made per zoned
    allocation, at a third of a frozen dataclass's cost)."""

    raw_bytes: int
    lead: int
    trail: int


def too_big(raw_bytes: int, n: int, what: str) -> InvalidArgumentError:
    """The error of a zoned allocation of ``n`` bytes whose raw size, zones included, does not fit 64 bits."""
    return InvalidArgumentError(
        f"{what}: {n} bytes and their red zones ({raw_bytes} bytes in all) do not fit 64 bits (CUDA's size_t): ask "
        f"for less"
    )


def refill(layout: Layout, laid: int, nbytes: int) -> tuple[int, int]:
    """The bytes to fill, ``(offset from the raw start, length)``, for an allocation of ``nbytes`` with ``layout`` in
    a block whose zones are in place for one of ``laid`` bytes (judged intact since): the leading band stays where it
    was, and the trailing one moves with the size. Smaller, the old data the new band covers; larger,
    the part of the new trailing band past the old one. At most ``min(|nbytes - laid|, layout.trail)`` bytes; none for
    the same size. The bytes past the new band stay as they are: no zone covers them."""
    if nbytes < laid:
        return layout.lead + nbytes, min(laid - nbytes, layout.trail)
    end = layout.lead + nbytes + layout.trail
    start = max(layout.lead + nbytes, layout.lead + laid + layout.trail)
    return start, max(end - start, 0)


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
