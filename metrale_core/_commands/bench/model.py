"""The bench's results as data: a `Figure` per timed operation, a `Goal` per target,
a `Result` per measurement and the `BenchReport` of a whole run, with its table and
its JSON."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["BenchReport", "Figure", "Goal", "Result"]


@dataclasses.dataclass(frozen=True, slots=True)
class Figure:
    """One timed operation.

    :param label: what was timed, unique within its `Result`.
    :param source: whose code ran: ``"metrale"``, or a peer with its version (``"cupy 14.2.0"``).
    :param unit: ``"us"`` (lower is better) or ``"GB/s"`` (higher is better).
    :param value: the median over the rounds; ``None`` when the figure was skipped.
    :param vs: the label of the figure this one is compared with, if any.
    :param ratio: ``value`` divided by that figure's value.
    :param note: why the figure was skipped, or what it counts.
    """

    label: str
    source: str
    unit: str
    value: float | None
    vs: str | None = None
    ratio: float | None = None
    note: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Goal:
    """A target for one ratio: ``ratio <= bound`` (``at_most``) or ``ratio >= bound``."""

    text: str
    ratio: float | None
    bound: float
    at_most: bool

    @property
    def met(self) -> bool | None:
        """Whether the ratio met the target; ``None`` when a figure was skipped."""
        if self.ratio is None:
            return None
        return self.ratio <= self.bound if self.at_most else self.ratio >= self.bound


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    """One measurement's figures and goals."""

    name: str
    title: str
    detail: str
    figures: tuple[Figure, ...]
    goals: tuple[Goal, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class BenchReport:
    """A whole run: where it ran, with what, and its results."""

    date: str
    backend: str
    device: str
    versions: Mapping[str, str]
    quick: bool
    results: tuple[Result, ...]

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON data."""
        return {
            "date": self.date,
            "backend": self.backend,
            "device": self.device,
            "versions": dict(self.versions),
            "quick": self.quick,
            "results": [
                {
                    "name": r.name,
                    "title": r.title,
                    "detail": r.detail,
                    "figures": [dataclasses.asdict(f) for f in r.figures],
                    "goals": [{**dataclasses.asdict(g), "met": g.met} for g in r.goals],
                }
                for r in self.results
            ],
        }

    def text(self) -> str:
        """The report as the table ``metrale bench`` prints."""
        versions = ", ".join(f"{k} {v}" for k, v in self.versions.items())
        lines = [f"metrale bench on {self.backend}: {self.device} ({self.date})", versions]
        for result in self.results:
            lines += ["", f"{result.name}: {result.title} ({result.detail})"]
            width = max(len(f.label) for f in result.figures)
            source_width = max(len(f.source) for f in result.figures)
            for f in result.figures:
                if f.value is None:
                    lines.append(f"  {f.label:<{width}}  {f.source:<{source_width}}  {'':>12}  {f.note}".rstrip())
                    continue
                value = f"{f.value:10.2f} {f.unit}" if f.unit == "us" else f"{f.value:8.1f} {f.unit}"
                ratio = f"{f.ratio:6.3f}x vs {f.vs}" if f.ratio is not None else ""
                note = f"  ({f.note})" if f.note else ""
                lines.append(f"  {f.label:<{width}}  {f.source:<{source_width}}  {value:>12}  {ratio}{note}".rstrip())
            for goal in result.goals:
                verdict = {True: "met", False: "MISSED", None: "not measured"}[goal.met]
                ratio = "-" if goal.ratio is None else f"{goal.ratio:.3f}x"
                sign = "<=" if goal.at_most else ">="
                lines.append(f"  goal: {goal.text}: {ratio} (target {sign} {goal.bound:g}x): {verdict}")
        return "\n".join(lines)
