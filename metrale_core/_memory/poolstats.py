"""What a memory pool tells its users, one class for both builds: `PoolStats`.

The pool (``pool.py``) is compiled as well as run as Python (``_pool``); a class whose objects reach users and are
compared by type lives here, in a module that is never compiled.
"""

from __future__ import annotations

import dataclasses

__all__ = ["PoolStats"]


@dataclasses.dataclass(frozen=True, slots=True)
class PoolStats:
    """A [`MemoryPool`][metrale_core.MemoryPool]'s counters, as [`stats`][metrale_core.MemoryPool.stats] gives
    them.

    :param segments: segments held from the driver now.
    :param segment_bytes: their bytes.
    :param pieces: pieces out now (on the ledger, or freed with red zones that wait for their check).
    :param piece_bytes: the bytes they take (each size rounded up to 512).
    :param cached_bytes: bytes of the pieces cached for reuse.
    :param hits: allocations a cached piece served.
    :param misses: allocations that carved a new piece.
    :param given_back: bytes given back to the driver so far (trims, synchronizes, out-of-memory reclaims).
    :param release_threshold: the cached bytes a device-wide ``synchronize()`` leaves in the pool.
    """

    segments: int
    segment_bytes: int
    pieces: int
    piece_bytes: int
    cached_bytes: int
    hits: int
    misses: int
    given_back: int
    release_threshold: int
