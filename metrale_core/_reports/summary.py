"""The tables ``metrale report`` and ``metrale stats`` print, as text; the CLI prints them.

- `snapshot_summary`: a snapshot's header lines and its call sites: peak, when, live when saved;
- `snapshot_stats`: the `MemoryStats` a snapshot's free-form ``stats`` hold, checked.

The CLI hands in its table helper (``table``), so this wing needs nothing of the commands above it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._device.stats import MemoryStats
from .._errors import SnapshotError
from .._memory.pressure import PoolTotals
from .._memory.snapshot import MemorySnapshot
from .._types import format_bytes
from .timeline import format_time, live_by_site

__all__ = ["Table", "snapshot_stats", "snapshot_summary"]

#: What draws rows as an aligned table, the header first (the CLI's).
Table = Callable[[Sequence[Sequence[str]]], str]


def snapshot_summary(snapshot: MemorySnapshot, top: int, table: Table) -> str:
    """What ``metrale report`` prints of one snapshot (or several merged): where and when it was saved,
    its events, its peak and what was live; then a table of the ``top`` call sites."""
    timeline = live_by_site(snapshot, top)
    lines = [
        f"snapshot   {snapshot.source or 'several, merged'} (saved {snapshot.created})",
        f"device     {snapshot.backend} on {snapshot.device} (ordinal {snapshot.ordinal})",
    ]
    rows: list[tuple[str, ...]]
    live = f"{format_bytes(sum(a.nbytes for a in snapshot.live))} in {len(snapshot.live)} allocation(s)"
    if not snapshot.events:
        why = "history recording was off: set METRALE_MEMORY_HISTORY" if snapshot.history_limit == 0 else "none kept"
        lines.append(f"events     0 ({why})")
        lines.append(f"live       {live} when saved")
        rows = [("call site", "live when saved")]
        for label, values in zip(timeline.labels, timeline.series, strict=True):
            rows.append((label, format_bytes(values[0])))
    else:
        dropped = f", {snapshot.dropped} older dropped" if snapshot.dropped else ""
        lines.append(f"events     {len(snapshot.events)} (history limit {snapshot.history_limit}{dropped})")
        step, end = timeline.peak_step, timeline.times[-1]
        peak = f"peak live  {format_bytes(timeline.totals[step])}"
        if step == 0:
            lines.append(f"{peak} before the first event")
        else:
            event = snapshot.events[step - 1]
            what = f"{'an' if event.op == 'alloc' else 'a'} {event.op} of {format_bytes(event.allocation.nbytes)}"
            lines.append(f"{peak} at {format_time(timeline.times[step], end)} (after events[{step - 1}], {what} at "
                         f"{event.allocation.site})")
        lines.append(f"live       {live} when saved")
        rows = [("call site", "peak", "at", "live when saved")]
        for label, values in zip(timeline.labels, timeline.series, strict=True):
            high = max(range(len(values)), key=lambda i: (values[i], -i))
            rows.append((label, format_bytes(values[high]), format_time(timeline.times[high], end),
                         format_bytes(values[-1])))
    if timeline.labels:
        lines += ["", table(rows)]
    return "\n".join(lines)


def snapshot_pools(snapshot: MemorySnapshot) -> PoolTotals | None:
    """The open memory pools a snapshot's ``stats["pools"]`` sum up; ``None`` where it has none (or has them in
    another shape: an older or another writer's file)."""
    pools = snapshot.stats.get("pools")
    if not isinstance(pools, Mapping) or not all(type(pools.get(k)) is int for k in PoolTotals._fields):
        return None
    return PoolTotals(*(pools[k] for k in PoolTotals._fields))


def snapshot_stats(snapshot: MemorySnapshot) -> MemoryStats:
    """The `MemoryStats` a snapshot's free-form ``stats`` hold.

    - A counter it does not give is 0 (a map, empty): a snapshot of an older version has fewer.
    - A counter of the wrong type is a ``SnapshotError``.
    """
    values: dict[str, Any] = {}
    for field in dataclasses.fields(MemoryStats):
        value = snapshot.stats.get(field.name)
        mapping = field.type in ("dict[str, int]", dict[str, int])
        if value is None:
            values[field.name] = {} if mapping else 0
            continue
        good = (
            isinstance(value, dict) and all(isinstance(k, str) and type(v) is int for k, v in value.items())
            if mapping else type(value) is int
        )
        if not good:
            need = "a map of kinds to byte counts" if mapping else "an integer"
            raise SnapshotError(
                f"{snapshot.name}: stats field {field.name!r} must be {need}, not {json.dumps(value)[:60]}; the "
                f"file is damaged or was not written by metrale",
                path=snapshot.source,
            )
        values[field.name] = dict(value) if mapping else value
    return MemoryStats(**values)
