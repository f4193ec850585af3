"""The report of red-zone violations, for one backend: what every check found, told and kept.

- `ZoneReport.report`: each violation named with the backend that found it and its suspects (the kernels that
  took an address of the allocation, or of its arena's block), the observers told, then a log line or a
  [`RedZoneError`][metrale_core.RedZoneError], as ``redzone_action`` says.
- `ZoneReport.found`: the violations found since the backend opened, a zone once, for its reports.

The zone guard owns it and hands every check's findings to it; it judges nothing and waits for nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Final, final

from .._device.capture import GraphKernels
from .._device.context import DeviceContext, Launch
from .._errors import RedZoneError
from .._types import Origin, RedZoneViolation
from .layout import ALIGN, RedZones

__all__ = ["FOUND_KEPT", "Blocks", "ZoneReport"]

_log = logging.getLogger("metrale")

#: Where the open arenas' blocks lie: ``(base, nbytes)`` each (the allocator's; a piece's suspects are the kernels
#: that took any address of its block).
Blocks = Callable[[], Iterable[tuple[int, int]]]

#: How many violated zones a backend keeps for its reports (`ZoneReport.found`).
FOUND_KEPT: Final = 1024


def _no_blocks() -> Iterable[tuple[int, int]]:
    return ()


@final
class ZoneReport:
    """The violations of one backend's red zones: named, told to the observers, logged or raised, and kept."""

    __slots__ = ("_blocks", "_ctx", "_found", "_found_lock", "_observers", "_zones")

    def __init__(self, ctx: DeviceContext, zones: RedZones) -> None:
        self._ctx = ctx
        self._zones = zones
        self._observers: list[Callable[[str, RedZoneViolation], object]] = []
        #: The violations found since the backend opened, a zone once (its first finding), for its reports.
        self._found: dict[tuple[int, str], RedZoneViolation] = {}
        #: Its own lock, never held while waiting: a report reads it while a scan (holding the guard's lock) waits
        #: for the device.
        self._found_lock = threading.Lock()
        self._blocks: Blocks = _no_blocks  # where the open arenas' blocks lie (the allocator says: `watch_blocks`)

    def on_violation(self, observer: Callable[[str, RedZoneViolation], object]) -> None:
        self._observers.append(observer)

    def watch_blocks(self, blocks: Blocks) -> None:
        """Where the open arenas' blocks lie, asked at a report (the allocator's): a violation of an arena's
        piece suspects the kernels that took any address of its block."""
        self._blocks = blocks

    def report(
        self, violations: list[RedZoneViolation], when: str, *, may_raise: bool = True,
        graphs: Sequence[GraphKernels] | None = None, blocks: Iterable[tuple[int, int]] = (),
    ) -> None:
        """Name each violation's backend and suspects, tell the observers, then log or raise, as
        ``redzone_action`` says.

        - ``graphs``: the graphs whose verdicts found them (an in-graph check, a scan after a graph launch); their
          kernel nodes that took an address of the allocation (its zones included), or of its arena's block, are
          the suspects. ``None``: an eager check (a scan, a free, the quarantine, an arena's reset); the backend's
          last launches (`DeviceContext.recent`) that did are.
        - ``blocks``: arena blocks, ``(base, nbytes)``, besides the open arenas' (an arena closing names its own).
        """
        if not violations:
            return
        origin = self._ctx.origin
        spans = self._spans(violations, blocks)
        # each names the backend that found it, and its suspects (the caller's list too: scan returns it)
        violations[:] = [
            self._named(v, origin, self._suspects(span, graphs)) for v, span in zip(violations, spans, strict=True)
        ]
        with self._found_lock:
            for v in violations:
                if len(self._found) < FOUND_KEPT:
                    self._found.setdefault((v.index, v.side), v)
        for violation in violations:
            for observer in self._observers:
                try:
                    with self._ctx.outside():  # user code: close() from another thread need not wait for it
                        observer(self._ctx.name, violation)
                except Exception as exc:  # an observer's bug must not hide the violation
                    _log.warning("red-zone observer %r raised %s: %s", observer, type(exc).__name__, exc)
        sample = self._ctx.settings.redzone_sample
        if sample > 1:
            when = f"{when} (red zones on 1 in {sample} allocations: redzone_sample={sample})"
        if self._ctx.settings.redzone_action == "raise" and may_raise:
            raise RedZoneError(
                f"{when} found {len(violations)} red-zone violation(s): "
                + "; ".join(v.describe() for v in violations)
                + ". Fix the write past the buffer's bounds (redzone_trace_idx=<index> logs where it was allocated)",
                violations,
            )
        for violation in violations:
            _log.warning("%s (found by %s)", violation.describe(), when)

    def found(self) -> tuple[RedZoneViolation, ...]:
        """The violations found since the backend opened, in the order found, each zone once (the first
        `FOUND_KEPT` zones: a report of more would not be read). It never waits for a check, nor for the device."""
        with self._found_lock:
            return tuple(self._found.values())

    def release(self) -> None:
        """At close: let go of the observers."""
        self._observers.clear()

    @staticmethod
    def _named(v: RedZoneViolation, origin: Origin | None, suspects: tuple[str, ...]) -> RedZoneViolation:
        """``v`` with the backend that found it and its suspects, where it has none yet."""
        origin = v.origin if v.origin is not None else origin
        suspects = v.suspects or suspects
        if origin is v.origin and suspects is v.suspects:
            return v
        return dataclasses.replace(v, origin=origin, suspects=suspects)

    def _spans(
        self, violations: Sequence[RedZoneViolation], blocks: Iterable[tuple[int, int]]
    ) -> list[tuple[int, int]]:
        """Each violation's span, ``[lo, hi)``: its allocation with its zones, or its arena's whole block."""
        zones = self._zones
        lead = -(-zones.size // ALIGN) * ALIGN if zones.lead else 0  # (as `RedZones.layout` lays them out)
        trail = zones.size
        known = [*blocks, *self._blocks()]
        spans = []
        for v in violations:
            lo, hi = v.ptr - lead, v.ptr + v.nbytes + trail
            for base, nbytes in known:
                if base <= v.ptr < base + nbytes:  # a piece of an arena (or its block itself): the whole block
                    lo, hi = min(lo, base), max(hi, base + nbytes)
                    break
            spans.append((lo, hi))
        return spans

    def _suspects(self, span: tuple[int, int], graphs: Sequence[GraphKernels] | None) -> tuple[str, ...]:
        """The kernels that took an address in ``span``: the nodes of ``graphs`` (a graph's verdict), then the last
        launches (every check: a graph's verdict is a full check, and an eager kernel may have made the overrun it
        found)."""
        lo, hi = span
        found: list[str] = []
        for graph in graphs or ():
            found += [
                f"{name} ({where} of graph #{graph.number})"
                for name, where, pointers in graph.nodes
                if any(lo <= p < hi for p in pointers)
            ]
        # the recent launches that are these graphs' own nodes (captured launches are kept as recent ones too)
        captured = {(name, frozenset(pointers)) for graph in graphs or () for name, _, pointers in graph.nodes}
        recent: list[Launch] = list(self._ctx.recent)  # (a copy: launches on other threads go on)
        for back, (_, name, _, _, packed) in zip(range(len(recent) - 1, -1, -1), recent, strict=True):
            pointers = [a.pointer for a in packed if a.pointer is not None]
            pointers += [m.buffer.ptr for a in packed if (m := a.tensor_map) is not None and hasattr(m, "buffer")]
            if (name, frozenset(pointers)) in captured:
                continue
            if any(lo <= p < hi for p in pointers):
                ago = "the latest launch" if back == 0 else f"{back} launch{'es' if back > 1 else ''} before the latest"
                found.append(f"{name} ({ago})")
        return tuple(dict.fromkeys(found))  # (a graph launched again: its nodes once)
