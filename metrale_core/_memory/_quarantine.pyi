"""Stub of the compiled twin of `metrale_core._memory.quarantine.Quarantine` (``_quarantine.pyx``): the same
interface."""

from collections.abc import Sequence
from typing import final

from .._device.buffer import DeviceBuffer
from .._device.context import DeviceContext
from .._device.stats import StatsCounter
from .._redzones.guard import ZoneGuard
from .._redzones.layout import Layout, Zone
from .._types import AllocKind, RedZoneViolation

@final
class Quarantine:
    def __init__(self, ctx: DeviceContext, stats: StatsCounter, guard: ZoneGuard) -> None: ...
    @property
    def held_bytes(self) -> int: ...
    def reuse(self, layout: Layout) -> int | None: ...
    def free(self, buf: DeviceBuffer, raw_ptr: int, kind: AllocKind) -> None: ...
    def drain(
        self, when: str, *, may_raise: bool = True, give_back: bool = False, also: Sequence[Zone] = ()
    ) -> None: ...
    def full_check(self, found: Sequence[RedZoneViolation] | None) -> None: ...
    def release(self) -> None: ...
