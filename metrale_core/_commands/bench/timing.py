"""How the bench times: operations taking turns round by round, medians, ratios, and the sizes and
comparisons its figures are written with."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from .model import Figure

__all__ = ["GIB", "KIB", "MIB", "against_first", "compare", "format_size", "ratio_of", "share", "to_us", "turns"]

KIB: Final = 1 << 10
MIB: Final = 1 << 20
GIB: Final = 1 << 30


def turns(
    ops: Mapping[str, Callable[[], object]],
    *,
    rounds: int,
    calls: int,
    finish: Mapping[str, Callable[[], object]] | None = None,
    settle: Mapping[str, Callable[[], object]] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each op.

    Each round times ``calls`` calls of every op in turn (the order rotating from round to round,
    after one untimed warm-up round), so a drift of clocks or caches falls on all of them alike.
    ``finish[label]`` runs inside the timing, after the calls (a wait that belongs to the work);
    ``settle[label]`` runs after it, untimed (draining a queue the calls filled).
    """
    finish, settle = finish or {}, settle or {}
    labels = list(ops)
    samples: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(rounds + 1):
        order = labels[r % len(labels):] + labels[: r % len(labels)]
        for label in order:
            op, done, after = ops[label], finish.get(label), settle.get(label)
            start = time.perf_counter()
            for _ in range(calls):
                op()
            if done is not None:
                done()
            elapsed = time.perf_counter() - start
            if after is not None:
                after()
            if r:  # round 0 warms up
                samples[label].append(elapsed / calls)
    return {label: statistics.median(times) for label, times in samples.items()}


def to_us(seconds: float) -> float:
    """Seconds in microseconds."""
    return seconds * 1e6


def ratio_of(value: float | None, reference: float | None) -> float | None:
    """``value / reference``; ``None`` where either is missing or the reference is 0."""
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


def format_size(nbytes: int) -> str:
    """``1 MiB``, ``64 MiB``, ``1 GiB``: the largest unit that divides ``nbytes``."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def compare(figure: Figure, reference: Figure) -> Figure:
    """``figure`` compared with ``reference``: its ``vs`` and ``ratio`` set."""
    return dataclasses.replace(figure, vs=reference.label, ratio=ratio_of(figure.value, reference.value))


def against_first(labels: Sequence[str], medians: Mapping[str, float], sources: Mapping[str, str]) -> list[Figure]:
    """Host times of ``labels`` (medians in seconds), each after the first compared with the first."""
    first = Figure(labels[0], sources[labels[0]], "us", to_us(medians[labels[0]]))
    rest = [compare(Figure(label, sources[label], "us", to_us(medians[label])), first) for label in labels[1:]]
    return [first, *rest]


def share(label: str, us: float, total: float, whole: str = "pair") -> Figure:
    """A step of a breakdown as a figure: its share of the ``whole`` (the pair, the call). A difference of
    two medians below zero is noise, shown as 0 with what was measured."""
    if us <= 0:
        return Figure(label, "metrale", "us", 0.0, note=f"within noise (measured {us:+.2f} us)")
    return Figure(label, "metrale", "us", us, note=f"{us / total:.0%} of the {whole}")
