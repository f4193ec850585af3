"""The hot paths' calls into the other parts where they run as Python: what ``_hot.pxd`` declares in C for the
compiled one-source modules of the memory wing (``lane.py`` compiled as ``_lane``, ``pools.py`` as ``_pools``).

- A one-source module imports these names only where it runs as Python (``if not cython.compiled:``); compiled, it
  ``cimport``s the C functions of the same names through its ``.pxd``: each is a C-level door of another twin (the
  gate, the capture rule, the handle, the stats, the zone table, the quarantine) or a call through the plugin's C
  device calls, where these call the pure parts' methods.
- As Python there are no device calls: the plugin's methods do the work (`ask_device_calls` asks nothing).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Final

from .._device.buffer import DeviceBuffer
from .._device.capture import forbid_during_capture
from .._device.gate import Gate
from .._device.stats import StatsCounter
from .._redzones.layout import Layout, RedZones
from .._types import AllocKind
from .quarantine import Quarantine

__all__ = [
    "add_zones", "ask_device_calls", "buf_index", "buf_kind", "buf_nbytes", "buf_owner", "buf_ptr", "calls_alloc",
    "calls_free", "calls_have_memset", "calls_memset", "check_parts", "device_calls_of", "device_in", "device_out",
    "forbid", "gate_closed", "gate_in", "gate_out", "interrupted", "make_buffer", "pool_in", "pool_out",
    "quarantine_free", "reuse", "zone_lead",
]

# -- the gate and the capture rule ------------------------------------------------------------------------------


def gate_in(gate: Gate) -> object:
    """Count the calling thread in (``Gate.enter``); compiled, its cell."""
    gate.enter()
    return None


def gate_out(gate: Gate, cell: object) -> None:
    """Count the calling thread out (``Gate.leave``)."""
    gate.leave()


def forbid(cell: object, what: str) -> None:
    """``forbid_during_capture(what)``."""
    forbid_during_capture(what)


def interrupted(gate: Gate) -> bool:
    return gate.interrupted()


def gate_closed(gate: Gate) -> bool:
    return gate.closed


def check_parts(gate: Gate, ledger: object, stats: StatsCounter, zones: RedZones | None, quarantine: object) -> None:
    """As Python, any parts do (compiled: the compiled ones only)."""


# -- handles --------------------------------------------------------------------------------------------------

make_buffer: Final = DeviceBuffer._make
buf_ptr: Final[Callable[[DeviceBuffer], int]] = operator.attrgetter("ptr")
buf_nbytes: Final[Callable[[DeviceBuffer], int]] = operator.attrgetter("nbytes")
buf_kind: Final[Callable[[DeviceBuffer], str]] = operator.attrgetter("kind")
buf_index: Final[Callable[[DeviceBuffer], int]] = operator.attrgetter("index")
buf_owner: Final[Callable[[DeviceBuffer], object]] = operator.attrgetter("_owner")

# -- the stats ------------------------------------------------------------------------------------------------


def device_in(stats: StatsCounter, nbytes: int) -> None:
    stats.allocated("device", nbytes)


def device_out(stats: StatsCounter, nbytes: int) -> None:
    stats.released("device", nbytes)


def pool_in(stats: StatsCounter, nbytes: int) -> None:
    stats.allocated("pool", nbytes)


def pool_out(stats: StatsCounter, nbytes: int) -> None:
    stats.released("pool", nbytes)


# -- red zones ------------------------------------------------------------------------------------------------


def zone_lead(zones: RedZones, nbytes: int, index: int) -> int:
    """The leading band of a new allocation's zones (0 where none leads), or -1 where it gets no zones."""
    layout = zones.layout(nbytes, index)
    return -1 if layout is None else layout.lead


def add_zones(zones: RedZones, buf: DeviceBuffer, index: int, ptr: int, nbytes: int, lead: int) -> None:
    """Watch the zones of ``buf`` (filled), as `zone_lead` laid them out."""
    zones.add(zones.zones_for(buf, Layout(lead + nbytes + zones.size, lead, zones.size)))


def reuse(quarantine: Quarantine, raw_bytes: int, lead: int, trail: int) -> int | None:
    """A checked block of ``raw_bytes`` kept for reuse (its raw address), or ``None``."""
    return quarantine.reuse(Layout(raw_bytes, lead, trail))


def quarantine_free(
    quarantine: Quarantine, buf: DeviceBuffer, index: int, nbytes: int, raw_ptr: int, kind: AllocKind
) -> None:
    """``Quarantine.free`` of a zoned allocation off the ledger."""
    quarantine.free(buf, raw_ptr, kind)


# -- the plugin's device calls: none as Python ----------------------------------------------------------------


def ask_device_calls(plugin: object, log: object) -> object:
    """The plugin's capsule of device calls: none asked for as Python."""
    return None


def device_calls_of(plugin: object, capsule: object, name: bytes, log: object) -> object:
    return None


def calls_have_memset(calls: object) -> bool:
    return False


def calls_alloc(calls: object, gate: Gate, nbytes: int) -> int | None:
    return None


def calls_free(calls: object, gate: Gate, ptr: int) -> bool:
    return False


def calls_memset(
    calls: object, has_memset: bool, gate: Gate, ptr: int, value: int, nbytes: int, stream: object
) -> bool:
    return False
