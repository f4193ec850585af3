"""Stub of the compiled twin of `metrale_core._device.stats.StatsCounter` (``_stats.pyx``): the same interface."""

from typing import final

from .stats import MemoryStats

@final
class StatsCounter:
    allocs: int
    frees: int
    arena_allocs: int
    oom_count: int
    oom_retries: int
    redzone_scans: int
    graph_launches: int
    quarantined_count: int
    quarantined_bytes: int
    reusable_count: int
    reusable_bytes: int
    redzone_sample: int
    def __init__(self) -> None: ...
    def quarantined(self, count: int, nbytes: int) -> None: ...
    def reusable(self, count: int, nbytes: int) -> None: ...
    def allocated(self, kind: str, nbytes: int) -> None: ...
    def released(self, kind: str, nbytes: int) -> None: ...
    def reset_peak(self) -> None: ...
    def freeze(self, arena_capacity: int, arena_used: int, arena_allocs: int) -> MemoryStats: ...
