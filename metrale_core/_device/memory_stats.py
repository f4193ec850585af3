"""What ``stats()`` reports: `MemoryStats`, and the kinds of allocation it counts bytes for (`KINDS`).

Never compiled: the class a user meets is one class in both builds (the counter that makes it, ``stats.py``, is
compiled as ``_stats`` too, and imports it from here).
"""

from __future__ import annotations

import dataclasses
from typing import Final, final

__all__ = ["KINDS", "MemoryStats"]

#: The kinds of allocation that ``stats()`` counts bytes for.
KINDS: Final = ("device", "managed", "arena", "pool")


@final
@dataclasses.dataclass(frozen=True, slots=True)
class MemoryStats:
    """What a backend has allocated since it opened (peaks since the last ``reset_peak()``).

    :ivar alloc_count: allocations made: ``alloc``, ``alloc_managed``, ``alloc_arena``, ``MemoryPool.alloc``.
    :ivar free_count: allocations released: ``free``, ``free_arena``, ``MemoryPool.free``, and each one a sweep took.
    :ivar current_bytes: bytes live now, per kind (``"device"``, ``"managed"``, ``"arena"``, and ``"pool"``: the
        pieces of memory pools out now, not the bytes the pools cache).
    :ivar peak_bytes: the most bytes live at once, per kind.
    :ivar peak_total_bytes: the most bytes live at once, all kinds together.
    :ivar arena_capacity: bytes of the open [`Arena`][metrale_core.Arena] objects.
    :ivar arena_used: bytes those arenas have handed out since their last ``reset()``.
    :ivar arena_allocs: sub-allocations the arenas have made.
    :ivar oom_count: allocations that failed for lack of memory (after any retries).
    :ivar oom_retries: allocations tried again after an ``on_out_of_memory`` callback freed memory.
    :ivar redzone_scans: full red-zone scans (``scan_redzones()``, after graph launches, at ``close()``).
    :ivar graph_launches: ``GraphExec.launch`` calls.
    :ivar redzone_quarantined: freed zoned buffers waiting in quarantine (off the ledger and out of
        ``current_bytes``; their memory not released yet).
    :ivar redzone_quarantined_bytes: the device memory they hold, zones included.
    :ivar redzone_reusable: checked freed zoned blocks kept for the next allocation of their size
        (their zones found intact: a reuse needs no driver allocation, only the fill of its zones).
    :ivar redzone_reusable_bytes: the device memory they hold, zones included.
    :ivar redzone_sample: red zones go to one allocation in this many (``redzone_sample``).
    :ivar allocated_bytes: bytes allocated since the backend opened, per kind (every allocation counted,
        freed or not; ``reset_peak()`` leaves it).
    """

    alloc_count: int
    free_count: int
    current_bytes: dict[str, int]
    peak_bytes: dict[str, int]
    peak_total_bytes: int
    arena_capacity: int
    arena_used: int
    arena_allocs: int
    oom_count: int
    oom_retries: int
    redzone_scans: int
    graph_launches: int
    redzone_quarantined: int = 0
    redzone_quarantined_bytes: int = 0
    redzone_sample: int = 1
    redzone_reusable: int = 0
    redzone_reusable_bytes: int = 0
    allocated_bytes: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def current_total_bytes(self) -> int:
        """Bytes live now, all kinds together."""
        return sum(self.current_bytes.values())
