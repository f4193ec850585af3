"""Reports of many processes merged into one: [`LedgerReport`][metrale_core.LedgerReport] (one backend's
ledger and leaks, picklable, so an engine's own messaging carries it: ``torch.distributed.gather_object``,
Ray's object store), [`merge_reports`][metrale_core.merge_reports] (per rank, and the largest call sites
across the job) and `merge_snapshots` (several memory snapshots as one, each site named by its
rank, for ``metrale report A.json B.json``).

metrale carries no messages itself: the engine that started the processes does.
"""

from __future__ import annotations

import collections
import dataclasses
import reprlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .._device.stats import MemoryStats
from .._errors import InvalidArgumentError
from .._memory.ledger import Ledger
from .._memory.snapshot import MemorySnapshot, SnapshotEvent
from .._types import AllocRecord, Origin, RedZoneViolation, format_bytes, restore_fields

__all__ = [
    "LedgerReport", "MergedReport", "RankSummary", "SiteTotal", "ledger_report", "merge_reports", "merge_snapshots",
    "ordered_snapshots",
]


def _unknown_origin(backend: str, ordinal: int) -> Origin:
    return Origin(host="?", pid=0, rank=None, world_size=None, backend=backend, ordinal=ordinal)


@dataclasses.dataclass(frozen=True, slots=True)
class LedgerReport:
    """One backend's ledger, what its sweeps took (its leaks) and its counters, as
    [`GpuBackend.ledger_report`][metrale_core.GpuBackend.ledger_report] gives them: plain values, picklable, for
    another process to merge with [`merge_reports`][metrale_core.merge_reports].

    :param origin: the backend's [`Origin`][metrale_core.Origin]: host, process, rank, ordinal, device UUID.
    :param live: the allocations on its ledger when the report was made.
    :param swept: the allocations its sweeps took since it opened (each one a leak: nobody freed it).
    :param stats: its [`MemoryStats`][metrale_core.MemoryStats] as a mapping (``peak_total_bytes`` and the rest).
    :param violations: the red-zone violations it found since it opened, each zone once (the first finding).
    """

    origin: Origin
    live: tuple[AllocRecord, ...]
    swept: tuple[AllocRecord, ...]
    stats: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    violations: tuple[RedZoneViolation, ...] = ()

    def __setstate__(self, state: tuple[Any, ...] | list[Any]) -> None:
        """Unpickle, a pickle of an earlier version (without ``violations``) too: it has none."""
        restore_fields(self, state)

    @classmethod
    def from_snapshot(cls, snapshot: MemorySnapshot) -> LedgerReport:
        """The report a memory snapshot holds: its live set, the allocations its event log says a sweep took
        (none where history recording was off), its counters, and its origin (an unknown host where the file
        names none)."""
        origin = snapshot.origin or _unknown_origin(snapshot.backend, snapshot.ordinal)
        swept = tuple(e.allocation for e in snapshot.events if e.op == "sweep")
        return cls(origin, tuple(snapshot.live), swept, dict(snapshot.stats))

    @property
    def live_bytes(self) -> int:
        """Bytes on the ledger when the report was made."""
        return sum(a.nbytes for a in self.live)

    @property
    def leaked_bytes(self) -> int:
        """Bytes the sweeps took."""
        return sum(a.nbytes for a in self.swept)


def ledger_report(
    origin: Origin, ledger: Ledger, swept: Iterable[AllocRecord], stats: MemoryStats,
    violations: Iterable[RedZoneViolation] = (),
) -> LedgerReport:
    """The report of one open backend (``GpuBackend.ledger_report``): its ledger now, its counters as plain values,
    the violations it found."""
    summary = dataclasses.asdict(stats) | {"current_total_bytes": stats.current_total_bytes}
    return LedgerReport(origin, tuple(ledger.snapshot()), tuple(swept), summary, tuple(violations))


@dataclasses.dataclass(frozen=True, slots=True)
class RankSummary:
    """One process's line of a [`MergedReport`][metrale_core.MergedReport]."""

    origin: Origin
    live_bytes: int
    live_count: int
    leaked_bytes: int
    leaked_count: int
    peak_total_bytes: int
    violation_count: int = 0

    def __setstate__(self, state: tuple[Any, ...] | list[Any]) -> None:
        """Unpickle, a pickle of an earlier version (without ``violation_count``) too: 0."""
        restore_fields(self, state)


@dataclasses.dataclass(frozen=True, slots=True)
class SiteTotal:
    """One call site across the job: its bytes and allocations, and the ranks (or hosts and pids, outside a
    distributed job) they come from."""

    site: str
    nbytes: int
    count: int
    ranks: tuple[str, ...]


def _who(origin: Origin) -> str:
    if origin.rank is not None:
        return f"rank {origin.rank}"
    return f"worker {origin.worker}" if origin.worker else f"{origin.host} pid {origin.pid}"


def _device(origin: Origin) -> str:
    return f"{origin.backend}:{origin.ordinal}"


def _labels(origins: Iterable[Origin]) -> dict[Origin, str]:
    """Each origin's name in a merged report: its rank (or host and pid), with its backend and ordinal where
    that alone is shared (several devices of one rank or one process), and its backend's number where that is
    shared too (several backends of one process on one device)."""
    unique = list(dict.fromkeys(origins))
    who = collections.Counter(_who(o) for o in unique)
    device = collections.Counter((_who(o), _device(o)) for o in unique)
    labels = {}
    for o in unique:
        label = _who(o)
        if who[label] > 1:
            label += f" {_device(o)}"
            if device[(_who(o), _device(o))] > 1 and o.instance:
                label += f" #{o.instance}"
        labels[o] = label
    return labels


def _order(origin: Origin) -> tuple[Any, ...]:
    return (origin.rank is None, origin.rank or 0, origin.worker, origin.host, origin.pid, origin.backend,
            origin.ordinal, origin.instance)


def _sites(
    groups: Iterable[tuple[Origin, Iterable[AllocRecord]]], top: int, labels: Mapping[Origin, str]
) -> tuple[SiteTotal, ...]:
    totals: dict[str, list[Any]] = {}
    for origin, records in groups:
        for a in records:
            entry = totals.setdefault(a.site, [0, 0, set()])
            entry[0] += a.nbytes
            entry[1] += 1
            entry[2].add(origin)
    ranked = sorted(totals.items(), key=lambda item: (-item[1][0], item[0]))[:top]
    return tuple(
        SiteTotal(site, nbytes, count, tuple(labels[o] for o in sorted(origins, key=_order)))
        for site, (nbytes, count, origins) in ranked
    )


@dataclasses.dataclass(frozen=True, slots=True)
class MergedReport:
    """The ledgers of many processes as one: a line per process, the largest live call sites and the largest
    leaks across the job, and every red-zone violation with the process that found it.
    [`render`][metrale_core.MergedReport.render] writes it as text,
    [`to_json`][metrale_core.MergedReport.to_json] as JSON."""

    ranks: tuple[RankSummary, ...]
    largest_live: tuple[SiteTotal, ...]
    largest_leaks: tuple[SiteTotal, ...]
    #: Every process's red-zone violations, in process order, each with its origin.
    violations: tuple[RedZoneViolation, ...] = ()

    def __setstate__(self, state: tuple[Any, ...] | list[Any]) -> None:
        """Unpickle, a pickle of an earlier version (without ``violations``) too: none."""
        restore_fields(self, state)

    @property
    def live_bytes(self) -> int:
        """Bytes live across the job."""
        return sum(r.live_bytes for r in self.ranks)

    @property
    def leaked_bytes(self) -> int:
        """Bytes the sweeps of every process took."""
        return sum(r.leaked_bytes for r in self.ranks)

    def render(self) -> str:
        """The report as a table per process and the call sites across the job."""
        violations = f", {len(self.violations)} red-zone violation(s)" if self.violations else ""
        lines = [
            f"merged ledger report: {len(self.ranks)} process(es), {format_bytes(self.live_bytes)} live, "
            f"{format_bytes(self.leaked_bytes)} leaked{violations}"
        ]
        workers = any(r.origin.worker for r in self.ranks)
        rows = [("process", *(("worker",) if workers else ()), "host", "pid", "device", "live", "leaked", "peak",
                 *(("violations",) if self.violations else ()))]
        shared = collections.Counter((r.origin.host, r.origin.pid, _device(r.origin)) for r in self.ranks)
        for r in self.ranks:
            o = r.origin
            device = _device(o) + (f" #{o.instance}" if shared[(o.host, o.pid, _device(o))] > 1 and o.instance else "")
            device += f" {o.device_uuid[:13]}" if o.device_uuid else ""
            device += f" ({o.device_share:g} shared)" if o.shared else ""
            rows.append((
                f"rank {o.rank}" if o.rank is not None else "-", *((o.worker or "-",) if workers else ()), o.host,
                str(o.pid), device,
                f"{format_bytes(r.live_bytes)} ({r.live_count})", f"{format_bytes(r.leaked_bytes)} ({r.leaked_count})",
                format_bytes(r.peak_total_bytes), *((str(r.violation_count),) if self.violations else ()),
            ))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        for title, sites in (("largest live call sites across the job", self.largest_live),
                             ("largest leaks across the job", self.largest_leaks)):
            lines.append(f"{title}:" if sites else f"{title}: none")
            lines += [
                f"  {format_bytes(s.nbytes):>10} x{s.count:<4} {s.site}  ({', '.join(s.ranks)})" for s in sites
            ]
        if self.violations:
            labels = _labels(r.origin for r in self.ranks)
            lines.append("red-zone violations across the job:")
            for v in self.violations:
                who = labels.get(v.origin, "?") if v.origin is not None else "?"
                lines.append(f"  {who}: {dataclasses.replace(v, origin=None).describe()}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready values."""
        return {
            "live_bytes": self.live_bytes,
            "leaked_bytes": self.leaked_bytes,
            "ranks": [
                {"origin": r.origin.to_json(), "live_bytes": r.live_bytes, "live_count": r.live_count,
                 "leaked_bytes": r.leaked_bytes, "leaked_count": r.leaked_count,
                 "peak_total_bytes": r.peak_total_bytes, "violation_count": r.violation_count}
                for r in self.ranks
            ],
            "largest_live": [dataclasses.asdict(s) for s in self.largest_live],
            "largest_leaks": [dataclasses.asdict(s) for s in self.largest_leaks],
            "violations": [
                {"origin": v.origin.to_json() if v.origin is not None else None, "describe": v.describe(),
                 **{k: getattr(v, k) for k in ("ptr", "nbytes", "index", "site", "side", "offset")},
                 "suspects": list(v.suspects)}
                for v in self.violations
            ],
        }


_ITEMS = "LedgerReport or MemorySnapshot items (backend.ledger_report(), load_snapshot(path))"


def _refused(where: str, what: str, got: object) -> InvalidArgumentError:
    return InvalidArgumentError(f"merge_reports: {where} {what}, got {reprlib.repr(got)}; pass {_ITEMS}")


def _records(value: object, where: str) -> tuple[AllocRecord, ...]:
    """``value`` as the records it claims to be: a tuple (or list) of `AllocRecord` with an integer ``nbytes``
    and a ``str`` site, the fields a merge reads; else ``InvalidArgumentError`` naming ``where``."""
    if not isinstance(value, tuple | list):
        raise _refused(where, "must be a tuple of AllocRecord", value)
    for i, a in enumerate(value):
        if not isinstance(a, AllocRecord) or type(a.nbytes) is not int or a.nbytes < 0 or type(a.site) is not str:
            raise _refused(f"{where}[{i}]", "must be an AllocRecord (nbytes an integer of at least 0, site a str)", a)
    return tuple(value)


def _checked(item: object, i: int) -> LedgerReport:
    """Item ``i`` of ``merge_reports`` as a `LedgerReport` whose fields are what they claim (copied, so it
    compares with its duplicates); else ``InvalidArgumentError`` naming the item and the field."""
    where = f"item {i}"
    if isinstance(item, MemorySnapshot):
        events = item.events
        if not isinstance(events, tuple | list) or not all(isinstance(e, SnapshotEvent) for e in events):
            raise _refused(f"{where} (a MemorySnapshot): its events", "must be a tuple of SnapshotEvent", events)
        _records(item.live, f"{where} (a MemorySnapshot): its live")
        if not isinstance(item.stats, Mapping):
            raise _refused(f"{where} (a MemorySnapshot): its stats", "must be a mapping", item.stats)
        if item.origin is not None and not isinstance(item.origin, Origin):
            raise _refused(f"{where} (a MemorySnapshot): its origin", "must be an Origin or None", item.origin)
        item = LedgerReport.from_snapshot(item)
    if not isinstance(item, LedgerReport):
        raise InvalidArgumentError(f"merge_reports: expected {_ITEMS}, got {type(item).__name__} ({where})")
    o = item.origin
    if not (
        isinstance(o, Origin) and type(o.host) is str and type(o.pid) is int and type(o.backend) is str
        and type(o.ordinal) is int and type(o.device_uuid) is str and (o.rank is None or type(o.rank) is int)
        and (o.world_size is None or type(o.world_size) is int)
        and type(getattr(o, "instance", None)) is int and o.instance >= 0
        and type(getattr(o, "worker", None)) is str
        and type(getattr(o, "device_share", None)) in (int, float) and 0 < o.device_share <= 1
    ):
        raise _refused(f"{where}: its origin", "must be an Origin (host, backend, device_uuid and worker str; pid, "
                       "ordinal, rank, world_size and instance integers, rank and world_size None outside a job; "
                       "device_share a number in (0, 1])", o)
    if not isinstance(item.stats, Mapping):
        raise _refused(f"{where}: its stats", "must be a mapping (as ledger_report() gives)", item.stats)
    live, swept = _records(item.live, f"{where}: its live"), _records(item.swept, f"{where}: its swept")
    violations = getattr(item, "violations", ())
    if not isinstance(violations, tuple | list):
        raise _refused(f"{where}: its violations", "must be a tuple of RedZoneViolation", violations)
    for j, v in enumerate(violations):
        if not (
            isinstance(v, RedZoneViolation)
            and all(type(getattr(v, k)) is int for k in ("ptr", "nbytes", "index", "offset"))
            and type(v.site) is str and v.side in ("trail", "lead") and isinstance(v.suspects, tuple)
            and all(type(x) is str for x in v.suspects) and (v.origin is None or v.origin == o)
        ):
            raise _refused(f"{where}: its violations[{j}]", "must be a RedZoneViolation its backend found (ptr, "
                           "nbytes, index and offset integers, site a str, side 'trail' or 'lead', suspects a tuple "
                           "of str, origin None or the report's)", v)
    # each violation named by the backend that found it (a report's own, where it names none)
    named = tuple(v if v.origin is not None else dataclasses.replace(v, origin=o) for v in violations)
    return LedgerReport(o, live, swept, dict(item.stats), named)


def _given_as(item: object) -> object:
    """What makes two items of a merge one: a snapshot's file (resolved), else the object itself."""
    source = getattr(item, "source", None) if isinstance(item, MemorySnapshot) else None
    if isinstance(source, Path):
        try:
            return ("file", source.resolve())
        except OSError:
            return ("file", source)
    return ("object", id(item))


def _name(item: object, i: int) -> str:
    source = getattr(item, "source", None) if isinstance(item, MemorySnapshot) else None
    return f"item {i} ({source})" if source is not None else f"item {i}"


def _one_report_per_backend(kept: dict[Origin, tuple[int, object]], origin: Origin, i: int, item: object,
                            what: str) -> None:
    """Refuse a second, different report of one backend (equal origins, a known instance): two moments of it."""
    first = kept.setdefault(origin, (i, item))
    if first[0] != i and origin.instance:  # (an unknown instance, 0, cannot tell two backends apart)
        raise InvalidArgumentError(
            f"{what}: {_name(first[1], first[0])} and {_name(item, i)} are two reports of one backend "
            f"({origin.describe()}), made at two moments: merge one of them (its latest)"
        )


def merge_reports(reports: Iterable[LedgerReport | MemorySnapshot], top: int = 10) -> MergedReport:
    """Merge the ledger reports (or memory snapshots) of many processes: a line per process, in rank order,
    with its live and leaked bytes and its peak; the ``top`` largest live call sites and leaks across the job,
    each with the ranks it comes from. One report given twice (the same object, or snapshots read from one
    file) counts once. Two backends of one process on one device are two lines: their origins differ in
    `Origin.instance`.

    :raises InvalidArgumentError: ``reports`` is not iterable; an item is neither a `LedgerReport` nor a memory
        snapshot, or one whose origin, records or stats are not what they claim; two different items are reports
        of one backend (equal origins, taken at two moments: merge one of them); or ``top`` is not a positive
        integer. Nothing is merged.
    """
    if type(top) is not int or top < 1:
        raise InvalidArgumentError(f"merge_reports: top must be a positive integer, got {top!r}")
    try:
        given = iter(reports)
    except TypeError:
        raise InvalidArgumentError(
            f"merge_reports: reports must be an iterable of {_ITEMS}, got {type(reports).__name__}"
        ) from None
    items: list[LedgerReport] = []
    given_items: list[object] = []  # held, so no id in `seen` is reused by a later item
    seen: set[object] = set()
    backends: dict[Origin, tuple[int, object]] = {}  # the origin of each item kept -> its number and the item
    for i, item in enumerate(given):
        report = _checked(item, i)
        given_items.append(item)
        key = _given_as(item)
        if key in seen:  # one report (or file) given twice is one process's: counted once
            continue
        seen.add(key)
        _one_report_per_backend(backends, report.origin, i, item, "merge_reports")
        items.append(report)
    items.sort(key=lambda r: _order(r.origin))
    labels = _labels(r.origin for r in items)
    ranks = tuple(
        RankSummary(
            r.origin, r.live_bytes, len(r.live), r.leaked_bytes, len(r.swept),
            int(peak) if type(peak := r.stats.get("peak_total_bytes", 0)) is int else 0,
            len(r.violations),
        )
        for r in items
    )
    return MergedReport(
        ranks,
        _sites(((r.origin, r.live) for r in items), top, labels),
        _sites(((r.origin, r.swept) for r in items), top, labels),
        tuple(v for r in items for v in r.violations),
    )


def ordered_snapshots(snapshots: Iterable[MemorySnapshot], what: str) -> list[tuple[str, MemorySnapshot]]:
    """The distinct snapshots of a job in rank order, each with its process's name (``rank 1``, or its host
    and pid; its file where it names no origin), as `merge_snapshots` and ``metrale report --torch-snapshot``
    take them.

    - A snapshot given twice (the same object, or read from one file) counts once, as in `merge_reports`.
    - ``what`` names the caller in messages.

    :raises InvalidArgumentError: no snapshot was given, or two different snapshots of one backend were
        (equal origins: two moments of it).
    """
    distinct: list[MemorySnapshot] = []
    given: list[MemorySnapshot] = []  # held, so no id in `seen` is reused by a later snapshot
    seen: set[object] = set()
    kept: dict[Origin, tuple[int, object]] = {}
    for i, snap in enumerate(snapshots):
        given.append(snap)
        if (key := _given_as(snap)) not in seen:
            seen.add(key)
            if isinstance(snap.origin, Origin):
                _one_report_per_backend(kept, snap.origin, i, snap, what)
            distinct.append(snap)
    snaps = sorted(distinct, key=lambda s: _order(s.origin or _unknown_origin(s.backend, s.ordinal)))
    if not snaps:
        raise InvalidArgumentError(f"{what}: no snapshot to merge")
    labels = _labels(s.origin for s in snaps if s.origin is not None)
    return [
        (labels[s.origin] if s.origin is not None else str(s.source or f"{s.backend}:{s.ordinal}"), s) for s in snaps
    ]


def merge_snapshots(snapshots: Iterable[MemorySnapshot]) -> MemorySnapshot:
    """Several memory snapshots as one, for one picture of a job (``metrale report A.json B.json``): every
    call site is prefixed with its process (``rank 1: app.py:12``), creation indices are renumbered so they
    stay distinct, and the event logs are merged by time since each backend opened (processes a launcher
    started together line up to within their start-up skew).

    A snapshot given twice (the same object, or read from one file) counts once, as in `merge_reports`.

    :raises InvalidArgumentError: no snapshot was given, or two different snapshots of one backend were
        (equal origins: two moments of it), as in `merge_reports`.
    """
    ordered = ordered_snapshots(snapshots, "merge_snapshots")
    snaps = [snap for _, snap in ordered]
    events: list[SnapshotEvent] = []
    live: list[AllocRecord] = []
    base = 0
    for who, snap in ordered:
        records = [e.allocation for e in snap.events] + list(snap.live)
        shift = base - min((a.index for a in records), default=0)

        def moved(a: AllocRecord, who: str = who, shift: int = shift) -> AllocRecord:
            return dataclasses.replace(a, index=a.index + shift, site=f"{who}: {a.site}")

        events += [dataclasses.replace(e, allocation=moved(e.allocation)) for e in snap.events]
        live += [moved(a) for a in snap.live]
        base += max((a.index for a in records), default=0) - min((a.index for a in records), default=0) + 1
    events.sort(key=lambda e: e.t)  # stable: each process's own order is kept where times tie
    backends = sorted({s.backend for s in snaps})
    elapsed = [s.elapsed for s in snaps if s.elapsed is not None]
    return MemorySnapshot(
        backend="+".join(backends),
        device=f"{len(snaps)} devices of {len(snaps)} snapshots",
        ordinal=0,
        total=sum(s.total for s in snaps),
        created=max(s.created for s in snaps),
        history_limit=max(s.history_limit for s in snaps),
        dropped=sum(s.dropped for s in snaps),
        events=tuple(events),
        live=tuple(live),
        elapsed=max(elapsed) if len(elapsed) == len(snaps) else None,
        stats=MappingProxyType({}),
        source=None,
    )
