"""The memory snapshot format, both ways: `write_snapshot` writes the ledger, its history and
the stats as JSON (``backend.save_snapshot(path)``), `load_snapshot` reads one back and checks
it, for ``metrale report`` (`metrale_core._reports.timeline` builds the report from what it read).

The format (``"format": "metrale-memory-snapshot"``, ``"version": 1``), one JSON object:

    {"format", "version", "backend", "device", "ordinal", "origin", "total", "created",
     "elapsed", "history_limit", "dropped",
     "events": [{"t", "op", "ptr", "nbytes", "kind", "index", "site"[, "stack"]}, ...],   # oldest first
     "live":   [{"ptr", "nbytes", "kind", "index", "site"}, ...],              # on the ledger when saved
     "stats":  {...}}

``origin`` is where it was saved (``{"host", "pid", "rank", "world_size", "backend", "ordinal",
"device_uuid"}``, an [`Origin`][metrale_core.Origin]; optional for a reader, ``rank`` and ``world_size``
``null`` outside a distributed job); ``total`` is the device's memory in bytes (0 where unknown);
``created`` when the snapshot was saved
(ISO 8601, UTC); ``elapsed`` and each event's ``t`` are seconds since the backend opened, on one
monotonic clock (``elapsed`` is optional for a reader); ``op`` is ``alloc``, ``free`` or ``sweep``
(the teardown sweep took the allocation). ``history_limit`` is the bound of the event log
(``memory_history``), ``dropped`` how many events fell off its front; ``events`` is empty when
``memory_history`` is ``0``. An ``alloc`` event has a ``stack`` (a list of ``"file:line"``, the call site first)
with ``memory_history_frames``; a reader takes its absence as none. An allocation has exactly an
[`AllocRecord`][metrale_core.AllocRecord]'s fields, ``index`` its creation number on the ledger. ``stats`` is the
backend's [`MemoryStats`][metrale_core.MemoryStats], free-form for a reader. A reader ignores fields it does not know.

A reader finds the live set before the first event by walking the log backwards from the end state
(``live``): an allocation was not live before its ``alloc``, and was live before its ``free`` or
``sweep``. So an allocation whose ``alloc`` fell off the front of the bounded log, or came before
recording began, counts as live from the start. A file that cannot be read, is not JSON, nests arrays
or objects too deeply (deeper than Python's JSON parser reads, or ``stats`` more than `MAX_STATS_DEPTH`
levels), is not a metrale snapshot, is of a newer version, or whose log contradicts itself or the ``live``
list (an allocation freed twice, or freed yet listed as live) is refused with a
[`SnapshotError`][metrale_core.SnapshotError] naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import os
import reprlib
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal, cast

from .._errors import InvalidArgumentError, SnapshotError
from .._types import AllocRecord, Origin, format_bytes  # a snapshot's allocation has exactly a ledger record's fields

if TYPE_CHECKING:
    from .._device.stats import MemoryStats
    from .._types import MemoryInfo
    from .ledger import Ledger
    from .pressure import PoolTotals

__all__ = [
    "FORMAT",
    "MAX_STATS_DEPTH",
    "VERSION",
    "EventOp",
    "MemorySnapshot",
    "SnapshotEvent",
    "initial_live",
    "load_snapshot",
    "snapshot_path",
    "write_snapshot",
]

FORMAT: Final = "metrale-memory-snapshot"
VERSION: Final = 1

EventOp = Literal["alloc", "free", "sweep"]
_OPS: Final[tuple[str, ...]] = ("alloc", "free", "sweep")
_HOW_TO_WRITE: Final = "write one with backend.save_snapshot(path)"
#: The most levels of arrays and objects ``stats`` may nest (the ``stats`` object counted): metrale writes 2. A
#: reader keeps ``stats`` as they are, so a bound keeps whoever renders them (a trace, JSON) from recursing without one.
MAX_STATS_DEPTH: Final = 64


# -- writing ----------------------------------------------------------------------------------------------


def _record(rec: AllocRecord) -> dict[str, Any]:
    return {"ptr": rec.ptr, "nbytes": rec.nbytes, "kind": rec.kind, "index": rec.index, "site": rec.site}


def write_snapshot(
    path: Path,
    backend: str,
    device: str,
    ordinal: int,
    info: MemoryInfo | None,
    ledger: Ledger,
    stats: MemoryStats,
    origin: Origin | None = None,
    pools: PoolTotals | None = None,
) -> None:
    """Write one snapshot to ``path`` (atomically: a temporary file, then a rename). The open memory ``pools`` are
    summed into ``stats["pools"]`` (what their segments hold, out and cached), where there are any."""
    events = ledger.events()
    document: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "backend": backend,
        "device": device,
        "ordinal": ordinal,
        "origin": origin.to_json() if origin is not None else None,
        "total": info.total if info is not None else 0,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "elapsed": round(ledger.elapsed(), 6),
        "history_limit": ledger.history,
        "dropped": ledger.dropped,
        "events": [
            {"t": round(e.t, 6), "op": e.op, **_record(e.record), **({"stack": list(e.stack)} if e.stack else {})}
            for e in events
        ],
        "live": [_record(r) for r in ledger.snapshot()],
        "stats": dataclasses.asdict(stats) | {"current_total_bytes": stats.current_total_bytes},
    }
    if pools is not None and pools.open:
        document["stats"]["pools"] = pools._asdict()
    _write_atomically(path, json.dumps(document, indent=1).encode("utf-8"))


def snapshot_path(path: object, what: str) -> Path:
    """``path`` (a ``str`` or an ``os.PathLike`` of one) as a `Path`; else ``InvalidArgumentError``."""
    try:
        text = os.fspath(path)  # type: ignore[call-overload]
    except Exception:  # not a path at all, or an __fspath__ that fails
        text = None
    if not isinstance(text, str) or not text or "\x00" in text:
        got = "an empty string" if text == "" else reprlib.repr(path)
        raise InvalidArgumentError(f"{what}: expected a path (str or os.PathLike) of the file to write, got {got}")
    return Path(text)


_TEMPORARY: Final = itertools.count()


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``: a reader sees the old
    file or the new one, never half of one. On any failure the temporary file is removed and nothing of
    ``path`` changed; the failure is a [`SnapshotError`][metrale_core.SnapshotError] naming ``path`` and the reason."""
    tmp = path.parent / f".{path.name[:100] or 'snapshot'}.{os.getpid()}.{next(_TEMPORARY)}.tmp"  # unique per call
    created = done = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        created = True
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
        done = True
    except (OSError, ValueError) as exc:  # ValueError: a name the file system cannot encode
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        if isinstance(exc, IsADirectoryError):
            reason += "; it is a folder: name a file in it"
        raise SnapshotError(f"cannot write the memory snapshot {path}: {reason}", path=path) from exc
    finally:
        if created and not done:
            with contextlib.suppress(OSError):
                tmp.unlink()


# -- reading ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SnapshotEvent:
    """One entry of a snapshot's event log.

    :param t: seconds since the backend opened (a monotonic clock).
    :param op: ``"alloc"``; ``"free"`` or ``"sweep"`` when ``free`` or the teardown sweep took it off.
    :param allocation: the allocation it concerns.
    :param stack: an ``"alloc"``'s stack with ``memory_history_frames`` (``"file:line"``, the call site first),
        else empty.
    """

    t: float
    op: EventOp
    allocation: AllocRecord
    stack: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """A memory snapshot: what ``save_snapshot`` writes, `load_snapshot` reads back and ``metrale report`` shows.

    :param backend: the backend's name, e.g. ``"fake"``.
    :param device: the device's name as the backend reports it.
    :param ordinal: the device ordinal.
    :param total: the device's memory in bytes.
    :param created: when the snapshot was saved (ISO 8601, as written).
    :param history_limit: the bound of the event log; 0 when history recording was off.
    :param dropped: events dropped from the front of the bounded log.
    :param events: the event log, oldest first; empty when history recording was off.
    :param live: the allocations on the ledger when the snapshot was saved.
    :param elapsed: seconds from the backend's opening to the save, on the clock of the events'
        ``t``, where the file says (its optional ``"elapsed"``); else ``None``.
    :param stats: the backend's counters, as written (free-form).
    :param source: the file it was read from, named in error messages.
    :param origin: where it was saved (host, process, rank, backend, ordinal, device UUID): the file's
        optional ``"origin"``; its allocations name it too. ``None`` for a file without one.
    """

    backend: str
    device: str
    ordinal: int
    total: int
    created: str
    history_limit: int
    dropped: int
    events: tuple[SnapshotEvent, ...]
    live: tuple[AllocRecord, ...]
    elapsed: float | None = None
    stats: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}), hash=False)
    source: Path | None = None
    origin: Origin | None = None

    @property
    def name(self) -> str:
        """The file it was read from, or ``"the snapshot"``, for messages."""
        return str(self.source) if self.source is not None else "the snapshot"



class _Reader:
    """Typed field access on parsed JSON, every failure a [`SnapshotError`][metrale_core.SnapshotError] naming the
    file."""

    __slots__ = ("path",)

    def __init__(self, path: Path) -> None:
        self.path = path

    def bad(self, what: str) -> SnapshotError:
        return SnapshotError(
            f"{self.path} is not a valid metrale memory snapshot: {what}; "
            f"the file is damaged or was not written by metrale: {_HOW_TO_WRITE}",
            path=self.path,
        )

    def field(self, obj: Mapping[str, Any], key: str, where: str) -> Any:
        """``obj[key]``; ``where`` names ``obj`` in messages (``"events[3]"``; ``""`` for the top level)."""
        if key not in obj:
            raise self.bad(f'{where or "the file"} has no "{key}" field')
        return obj[key]

    def wrong(self, key: str, where: str, need: str, value: Any) -> SnapshotError:
        return self.bad(f'"{key}"{" of " + where if where else ""} must be {need}, not {_shown(value)}')

    def integer(self, obj: Mapping[str, Any], key: str, where: str, *, minimum: int | None = None) -> int:
        value = self.field(obj, key, where)
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            need = "an integer" if minimum is None else f"an integer of at least {minimum}"
            raise self.wrong(key, where, need, value)
        return value

    def string(self, obj: Mapping[str, Any], key: str, where: str) -> str:
        value = self.field(obj, key, where)
        if not isinstance(value, str):
            raise self.wrong(key, where, "a string", value)
        return value

    def seconds(self, obj: Mapping[str, Any], key: str, where: str) -> float:
        value = self.field(obj, key, where)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise self.wrong(key, where, "a number of seconds, at least 0", value)
        return float(value)

    def mapping(self, value: Any, where: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.bad(f"{where} must be a JSON object, not {_shown(value)}")
        return value

    def stats(self, value: Any) -> Mapping[str, Any]:
        """``"stats"``: a JSON object nesting at most `MAX_STATS_DEPTH` levels (walked without recursion)."""
        obj = self.mapping(value, '"stats"')
        level: list[Any] = [obj]
        for _ in range(MAX_STATS_DEPTH):
            level = [v for c in level for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, dict | list)]
        if level:
            raise self.bad(f'"stats" nests JSON arrays or objects too deeply (more than {MAX_STATS_DEPTH} levels)')
        return obj

    def array(self, obj: Mapping[str, Any], key: str) -> list[Any]:
        value = self.field(obj, key, "")
        if not isinstance(value, list):
            raise self.wrong(key, "", "a list", value)
        return value

    def origin(self, value: Any) -> Origin:
        where = '"origin"'
        obj = self.mapping(value, where)

        def optional(key: str, minimum: int) -> int | None:
            return None if obj.get(key) is None else self.integer(obj, key, where, minimum=minimum)

        return Origin(
            host=self.string(obj, "host", where), pid=self.integer(obj, "pid", where, minimum=0),
            rank=optional("rank", 0), world_size=optional("world_size", 1),
            backend=self.string(obj, "backend", where), ordinal=self.integer(obj, "ordinal", where, minimum=0),
            device_uuid=self.string(obj, "device_uuid", where) if obj.get("device_uuid") is not None else "",
            instance=self.integer(obj, "instance", where, minimum=0) if obj.get("instance") is not None else 0,
            worker=self.string(obj, "worker", where) if obj.get("worker") is not None else "",
            device_share=self.share(obj, where),
        )

    def share(self, obj: Mapping[str, Any], where: str) -> float:
        value = obj.get("device_share")
        if value is None:
            return 1.0
        if type(value) not in (int, float) or not 0 < value <= 1:
            raise self.wrong("device_share", where, "a number greater than 0 and of at most 1", value)
        return float(value)

    def allocation(self, obj: Mapping[str, Any], where: str) -> AllocRecord:
        return AllocRecord(
            ptr=self.integer(obj, "ptr", where, minimum=0),
            nbytes=self.integer(obj, "nbytes", where, minimum=0),
            kind=self.string(obj, "kind", where),
            index=self.integer(obj, "index", where),
            site=self.string(obj, "site", where),
        )


def load_snapshot(path: str | os.PathLike[str]) -> MemorySnapshot:
    """Read and check a memory snapshot written by ``backend.save_snapshot(path)``.

    Besides each field's type, it checks that the event log agrees with itself
    and with the ``live`` list (see `initial_live`). Fields it does not
    know are ignored.

    :raises SnapshotError: the file cannot be read, is not JSON, is not a metrale
        memory snapshot of version 1, or is damaged; the message and its ``path`` name the file.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SnapshotError(f"cannot read the memory snapshot {path}: {reason}", path=path) from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SnapshotError(
            f"{path} is not a metrale memory snapshot: it is not JSON ({exc.msg} at line {exc.lineno} "
            f"column {exc.colno}); {_HOW_TO_WRITE}",
            path=path,
        ) from exc
    except RecursionError:  # the parser recurses once per level: the file is damaged, or not a snapshot
        raise _Reader(path).bad(
            "it nests JSON arrays or objects too deeply to read (a snapshot nests a few levels)"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SnapshotError(
            f'{path} is not a metrale memory snapshot (no "format": "{FORMAT}"); {_HOW_TO_WRITE}', path=path
        )
    version = doc.get("version")
    if version != VERSION:
        if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
            advice = "it was written by a newer metrale: upgrade metrale (pip install -U metrale) to read it"
        else:
            advice = _HOW_TO_WRITE
        raise SnapshotError(
            f"{path} is a metrale memory snapshot of version {json.dumps(version)}; this metrale reads "
            f"version {VERSION}: {advice}",
            path=path,
        )
    read = _Reader(path)
    top = ""
    events: list[SnapshotEvent] = []
    for i, raw in enumerate(read.array(doc, "events")):
        where = f"events[{i}]"
        entry = read.mapping(raw, where)
        op = read.string(entry, "op", where)
        if op not in _OPS:
            raise read.wrong("op", where, 'one of "alloc", "free", "sweep"', op)
        stack = entry.get("stack")
        stack = [] if stack is None else stack
        if not isinstance(stack, list) or not all(isinstance(frame, str) for frame in stack):
            raise read.wrong("stack", where, 'a list of "file:line" strings', stack)
        events.append(SnapshotEvent(read.seconds(entry, "t", where), cast(EventOp, op), read.allocation(entry, where),
                                    tuple(stack)))
    live = tuple(
        read.allocation(read.mapping(raw, f"live[{i}]"), f"live[{i}]") for i, raw in enumerate(read.array(doc, "live"))
    )
    elapsed = read.seconds(doc, "elapsed", top) if doc.get("elapsed") is not None else None
    origin = read.origin(doc["origin"]) if doc.get("origin") is not None else None
    if origin is not None:
        events = [dataclasses.replace(e, allocation=dataclasses.replace(e.allocation, origin=origin)) for e in events]
        live = tuple(dataclasses.replace(a, origin=origin) for a in live)
    snapshot = MemorySnapshot(
        backend=read.string(doc, "backend", top),
        device=read.string(doc, "device", top),
        ordinal=read.integer(doc, "ordinal", top, minimum=0),
        total=read.integer(doc, "total", top, minimum=0),
        created=read.string(doc, "created", top),
        history_limit=read.integer(doc, "history_limit", top, minimum=0),
        dropped=read.integer(doc, "dropped", top, minimum=0),
        events=tuple(events),
        live=live,
        elapsed=elapsed,
        stats=MappingProxyType(dict(read.stats(read.field(doc, "stats", top)))),
        source=path,
        origin=origin,
    )
    initial_live(snapshot)  # refuses a log that contradicts itself
    return snapshot


def _shown(value: Any) -> str:
    """The start of ``value`` as JSON, for a message; a value nested too deeply to encode is said to be."""
    try:
        return json.dumps(value)[:60]
    except RecursionError:
        return "a value that nests JSON arrays or objects too deeply to show"


def _describe(event: SnapshotEvent, i: int) -> str:
    a = event.allocation
    return f"events[{i}] ({event.op} of allocation #{a.index}, {format_bytes(a.nbytes)} from {a.site})"


def initial_live(snapshot: MemorySnapshot) -> tuple[AllocRecord, ...]:
    """The live set before the snapshot's first event, in creation order.

    Walks the log backwards from the ``live`` list: an ``alloc`` takes its
    allocation out (it was not live before), a ``free`` or ``sweep`` puts it
    back (it was). What remains is every allocation of ``live`` whose ``alloc``
    is not in the log, and every allocation the log takes off without its
    ``alloc``. Allocations are told apart by their creation index.

    :raises SnapshotError: the log contradicts itself or ``live``: two live
        allocations share an index, an allocation is taken off while not live,
        or allocated while already live, or an ``alloc`` and what takes it off
        disagree on its size or site.
    """
    live: dict[int, AllocRecord] = {}
    for a in snapshot.live:
        if a.index in live:
            raise _inconsistent(snapshot, f'"live" lists allocation #{a.index} twice')
        live[a.index] = a
    for i in range(len(snapshot.events) - 1, -1, -1):
        event = snapshot.events[i]
        a = event.allocation
        after = live.get(a.index)
        if event.op == "alloc":
            if after is None:
                raise _inconsistent(
                    snapshot, f"{_describe(event, i)} is not live right after it: nothing later takes it off, "
                    'and "live" does not list it'
                )
            if (after.nbytes, after.site) != (a.nbytes, a.site):
                raise _inconsistent(
                    snapshot, f"{_describe(event, i)} is taken off later, or listed as live, with "
                    f"{after.nbytes} bytes from {after.site}"
                )
            del live[a.index]
        else:
            if after is not None:
                raise _inconsistent(
                    snapshot, f"{_describe(event, i)} is still live right after it: it is taken off again later, "
                    'or "live" lists it'
                )
            live[a.index] = a
    return tuple(sorted(live.values(), key=lambda a: a.index))


def _inconsistent(snapshot: MemorySnapshot, what: str) -> SnapshotError:
    return SnapshotError(
        f"{snapshot.name} is not a consistent metrale memory snapshot: {what}; the file is damaged: "
        f"{_HOW_TO_WRITE}",
        path=snapshot.source,
    )
