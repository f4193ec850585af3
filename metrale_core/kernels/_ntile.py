"""The GEMM N tile: [`n_tile`][metrale_core.n_tile] chooses the tile width a GEMM kernel launches with, so its last wave
of thread blocks is not mostly idle.

A GEMM over an ``m * n`` output (``groups`` of them) runs one thread block per ``block_m * n_tile`` tile;
``num_sms * occupancy`` blocks run at once, a *wave*. A kernel's time for a fixed ``block_m`` is about the
number of waves times the work of one tile, which grows with the tile's width: the rule minimises
``waves * n_tile``. DeepGEMM minimises waves alone, which favours wide tiles too much when the candidates
differ fourfold; its tie-breaks are kept (the fuller last wave, then the smaller tile).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .._errors import InvalidArgumentError
from .._types import as_index

__all__ = ["NTile", "n_tile"]


@dataclasses.dataclass(frozen=True, slots=True)
class NTile:
    """The N tile [`n_tile`][metrale_core.n_tile] chose, and what it gives.

    ``tiles`` is ``ceil(m / block_m) * ceil(n / n_tile) * groups``; ``waves`` is
    ``ceil(tiles / (num_sms * occupancy))``; ``last_wave_util`` the tiles of the last wave; ``efficiency``
    ``tiles / (waves * num_sms * occupancy)``, the share of the launched waves' slots that do work.
    """

    n_tile: int
    block_m: int
    tiles: int
    waves: int
    last_wave_util: int
    efficiency: float


def _positive(value: object, name: str) -> int:
    n = as_index(value)
    if n is None or n < 1:
        raise InvalidArgumentError(f"n_tile: {name} must be a positive int, got {value!r}")
    return n


def _fits(width: int, element_bytes: int, swizzle_bytes: int | None) -> bool:
    """Whether a TMA box can be ``width`` elements wide as its innermost dimension."""
    inner = width * element_bytes
    return width <= 256 and inner % 16 == 0 and (swizzle_bytes is None or inner <= swizzle_bytes)


def n_tile(
    m: int,
    n: int,
    *,
    num_sms: int,
    candidates: Sequence[int] = (64, 128, 256),
    block_m: int | None = None,
    groups: int = 1,
    occupancy: int = 1,
    element_bytes: int = 2,
    swizzle_bytes: int | None = None,
) -> NTile:
    """Choose the N tile of a GEMM of an ``m * n`` output on ``num_sms`` multiprocessors.

    Candidates are kept where a TMA box allows them as its innermost dimension: at most 256 elements,
    ``width * element_bytes`` a multiple of 16, and within ``swizzle_bytes`` when given. Chosen: the least
    ``waves * n_tile``, then the greater ``last_wave_util``, then the smaller ``n_tile``. ``block_m``
    defaults to 64 for ``m <= 64``, else 128. ``m`` or ``n`` below 1, no candidate left, an ``element_bytes``
    other than 1, 2, 4 or 8 (the sizes of TMA's data types), or a ``swizzle_bytes`` other than 32, 64 or 128
    (the spans of TMA's swizzle modes) raise [`InvalidArgumentError`][metrale_core.InvalidArgumentError].
    """
    rows, cols = _positive(m, "m"), _positive(n, "n")
    sms, group_count = _positive(num_sms, "num_sms"), _positive(groups, "groups")
    per_sm, size = _positive(occupancy, "occupancy"), _positive(element_bytes, "element_bytes")
    if size not in (1, 2, 4, 8):
        raise InvalidArgumentError(f"n_tile: element_bytes must be the size of a TMA data type, 1, 2, 4 or 8; got "
                                   f"{element_bytes!r}")
    bm = (64 if rows <= 64 else 128) if block_m is None else _positive(block_m, "block_m")
    span = None if swizzle_bytes is None else _positive(swizzle_bytes, "swizzle_bytes")
    if span is not None and span not in (32, 64, 128):
        raise InvalidArgumentError(f"n_tile: swizzle_bytes must be a swizzle's span, 32, 64 or 128; got "
                                   f"{swizzle_bytes!r}")
    if isinstance(candidates, str | bytes) or not isinstance(candidates, Sequence) or not candidates:
        raise InvalidArgumentError(f"n_tile: candidates must be a non-empty sequence of ints, got {candidates!r}")
    widths = sorted({_positive(c, "each candidate") for c in candidates})
    kept = [w for w in widths if _fits(w, size, span)]
    if not kept:
        raise InvalidArgumentError(
            f"n_tile: no candidate of {widths} fits a TMA box of {size}-byte elements (at most 256 wide, width * "
            f"element_bytes a multiple of 16{f', at most {span} bytes' if span else ''}); give candidates that do"
        )
    slots = sms * per_sm
    best: tuple[tuple[int, int, int], NTile] | None = None
    for width in kept:
        tiles = -(-rows // bm) * -(-cols // width) * group_count
        waves = -(-tiles // slots)
        last = tiles - (waves - 1) * slots
        choice = NTile(width, bm, tiles, waves, last, tiles / (waves * slots))
        key = (waves * width, -last, width)
        if best is None or key < best[0]:
            best = (key, choice)
    assert best is not None
    return best[1]
