"""PyTorch's memory snapshot: metrale's memory snapshots as the pickle ``torch.cuda.memory._dump_snapshot``
writes, so that https://pytorch.org/memory_viz (and ``torch.cuda._memory_viz``) opens metrale's timeline as it
opens a torch run's.

- `torch_snapshot` builds the dictionary of ``torch.cuda.memory._snapshot()``: ``segments`` (the live set
  when each snapshot was saved) and ``device_traces`` (one list of trace entries per device);
  `write_torch_snapshot` pickles it to a file; `device_notes` says, a line per device, which snapshot
  each device is and what its history holds, for ``metrale report --torch-snapshot``.
- One device per snapshot (per rank and device in a job): its ordinal, as torch numbers CUDA devices, where
  the snapshots' ordinals differ; else 0, 1, ... in rank order (`ordered_snapshots`).
- Each allocation is a segment of its own holding one block, as a ``cudaMalloc`` of its size would be: a
  snapshot says nothing of how a memory pool carved its pieces, or of the bytes it keeps cached. Its
  ``alloc`` is a ``segment_alloc`` then an ``alloc``; its ``free`` (or the teardown sweep's) a
  ``free_requested``, a ``free_completed`` and a ``segment_free``, so every view of the viewer (the
  allocator state history too) finds each block inside a segment at every step.
- A frame per call site, or per frame of the allocation's stack where the snapshot kept one
  (``memory_history_frames``): ``file:line`` as ``{"filename", "line", "name"}``, ``name`` the function around that
  line where the file can be read here (its source now), else ``"??"``. A free's frames are its
  allocation's (metrale records no call site for a free). ``user_metadata`` names the allocation's kind
  and creation index, and a sweep's leak.
- ``time_us``: microseconds since the backend opened (torch's count from the epoch), as ``--trace``'s ``ts``.
- The pickle is protocol 4: the viewer's unpickler reads protocols 2 to 4 and only the opcodes of plain
  dicts, lists, tuples, strings, numbers, booleans and ``None``, which is all it holds.
"""

from __future__ import annotations

import ast
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Final, Literal, NotRequired, TypedDict

from .._memory.snapshot import MemorySnapshot
from .._types import AllocRecord
from .merge import ordered_snapshots

__all__ = [
    "PICKLE_PROTOCOL",
    "TorchBlock",
    "TorchFrame",
    "TorchSegment",
    "TorchSnapshot",
    "TorchTraceEntry",
    "TraceAction",
    "device_notes",
    "torch_snapshot",
    "write_torch_snapshot",
]

#: The pickle protocol written: pytorch.org/memory_viz's unpickler refuses any but 2, 3 and 4 (Python 3.14
#: pickles with 5 by default).
PICKLE_PROTOCOL: Final = 4
#: torch's small segments hold allocations of at most 1 MiB (its ``kSmallSize``); larger ones are "large".
_SMALL: Final = 1 << 20
#: Devices are numbered by their ordinals only below this (a hand-written ordinal could ask for a huge list).
_MAX_ORDINAL: Final = 1024
#: A source file larger than this is not read for the names of its functions.
_MAX_SOURCE_BYTES: Final = 4 << 20
_UNKNOWN_NAME: Final = "??"

TraceAction = Literal["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free"]


class TorchFrame(TypedDict):
    """One frame of a stack, as torch symbolizes it."""

    filename: str
    line: int
    name: str


class TorchBlock(TypedDict):
    """A piece of a segment: here, the whole segment, allocated."""

    address: int
    size: int
    requested_size: int
    state: Literal["active_allocated", "active_pending_free", "inactive"]
    frames: list[TorchFrame]
    user_metadata: NotRequired[str]


class TorchSegment(TypedDict):
    """Memory from one ``cudaMalloc``: here, one metrale allocation live when its snapshot was saved."""

    device: int
    address: int
    total_size: int
    allocated_size: int
    active_size: int
    requested_size: int
    stream: int
    segment_type: Literal["small", "large"]
    segment_pool_id: tuple[int, int]
    is_expandable: bool
    frames: list[TorchFrame]
    blocks: list[TorchBlock]


class TorchTraceEntry(TypedDict):
    """One action of the allocator, oldest first in its device's trace."""

    action: TraceAction
    addr: int
    size: int
    stream: int
    time_us: int
    frames: list[TorchFrame]
    user_metadata: NotRequired[str]


class TorchSnapshot(TypedDict):
    """What ``torch.cuda.memory._snapshot()`` returns (the keys the viewer reads), and under ``"metrale"`` which
    snapshot each device is (a reader ignores keys it does not know)."""

    segments: list[TorchSegment]
    device_traces: list[list[TorchTraceEntry]]
    metrale: dict[str, list[dict[str, object]]]


class _Names:
    """The function around a line of a source file, each file parsed once."""

    __slots__ = ("_scopes",)

    def __init__(self) -> None:
        self._scopes: dict[str, list[tuple[int, int, str]] | None] = {}

    def scopes(self, filename: str) -> list[tuple[int, int, str]] | None:
        """The ``(first line, last line, name)`` of each function and class of the file; ``None`` where it cannot
        be read or parsed here."""
        if filename not in self._scopes:
            found: list[tuple[int, int, str]] | None = None
            try:
                path = Path(filename)
                if path.is_file() and path.stat().st_size <= _MAX_SOURCE_BYTES:
                    tree = ast.parse(path.read_bytes(), filename)
                    found = [
                        (node.lineno, node.end_lineno or node.lineno, node.name) for node in ast.walk(tree)
                        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                    ]
            except (OSError, ValueError, SyntaxError, RecursionError, MemoryError):  # ValueError: a NUL byte
                found = None
            self._scopes[filename] = found
        return self._scopes[filename]

    def at(self, filename: str, line: int) -> str:
        """The innermost function (or class body) holding ``line``, as a frame's ``co_name`` would say;
        ``"<module>"`` outside them all; ``"??"`` where the file cannot be read."""
        scopes = self.scopes(filename)
        if scopes is None or line < 1:
            return _UNKNOWN_NAME
        holding = [(first, name) for first, last, name in scopes if first <= line <= last]
        return max(holding)[1] if holding else "<module>"


def _frame(site: str, names: _Names) -> TorchFrame:
    path, colon, line = site.rpartition(":")
    if not (colon and path and line.isdigit()):
        return {"filename": site, "line": 0, "name": _UNKNOWN_NAME}
    return {"filename": path, "line": int(line), "name": names.at(path, int(line))}


def _devices(ordered: Sequence[tuple[str, MemorySnapshot]]) -> list[int]:
    ordinals = [snap.ordinal for _, snap in ordered]
    if len(set(ordinals)) == len(ordinals) and max(ordinals) < _MAX_ORDINAL:
        return ordinals
    return list(range(len(ordered)))


def torch_snapshot(snapshots: Sequence[MemorySnapshot]) -> TorchSnapshot:
    """The snapshots as one ``torch.cuda.memory._snapshot()`` dictionary, a device per snapshot (see the module).

    - ``segments``: per allocation live when its snapshot was saved, a segment of one ``active_allocated``
      block, ``segment_pool_id`` ``(0, 0)`` (torch's default pool), stream 0; sorted by device and address.
    - ``device_traces``: per device, its event log as trace entries (none where history recording was off:
      the viewer then shows the live set alone); allocations of 0 bytes hold no memory and are left out.

    :raises InvalidArgumentError: no snapshot, or two snapshots of one backend at two moments
        (`ordered_snapshots`).
    """
    ordered = ordered_snapshots(snapshots, "torch_snapshot")
    devices = _devices(ordered)
    names = _Names()
    frames: dict[tuple[str, ...], list[TorchFrame]] = {}  # one list per stack: the pickle holds it once
    stacks: dict[tuple[int, int], tuple[str, ...]] = {}  # (snapshot, index) -> its alloc event's stack

    def frames_of(a: AllocRecord, stack: tuple[str, ...] = ()) -> list[TorchFrame]:
        key = stack or (a.site,)
        found = frames.get(key)
        if found is None:
            found = frames[key] = [_frame(site, names) for site in key]
        return found

    segments: list[TorchSegment] = []
    traces: list[list[TorchTraceEntry]] = [[] for _ in range(max(devices) + 1)]
    described: list[dict[str, object]] = []
    for number, (device, (who, snap)) in enumerate(zip(devices, ordered, strict=True)):
        trace = traces[device]
        for event in snap.events:
            a = event.allocation
            if not a.nbytes:
                continue
            if event.stack:  # (memory_history_frames: the allocation's whole stack, its free's too)
                stacks[number, a.index] = event.stack
            stack = stacks.get((number, a.index), ())
            us = round(event.t * 1e6)
            what = f"{a.kind} allocation #{a.index}"
            if event.op == "alloc":
                steps: tuple[TraceAction, ...] = ("segment_alloc", "alloc")
            else:
                steps = ("free_requested", "free_completed", "segment_free")
                if event.op == "sweep":
                    what += ", taken by the teardown sweep: a leak"
            for action in steps:
                trace.append({"action": action, "addr": a.ptr, "size": a.nbytes, "stream": 0, "time_us": us,
                              "frames": frames_of(a, stack), "user_metadata": what})
        for a in snap.live:
            if not a.nbytes:
                continue
            stack = stacks.get((number, a.index), ())
            block: TorchBlock = {"address": a.ptr, "size": a.nbytes, "requested_size": a.nbytes,
                                 "state": "active_allocated", "frames": frames_of(a, stack),
                                 "user_metadata": f"{a.kind} allocation #{a.index}"}
            segments.append({
                "device": device, "address": a.ptr, "total_size": a.nbytes, "allocated_size": a.nbytes,
                "active_size": a.nbytes, "requested_size": a.nbytes, "stream": 0,
                "segment_type": "small" if a.nbytes <= _SMALL else "large", "segment_pool_id": (0, 0),
                "is_expandable": False, "frames": frames_of(a, stack), "blocks": [block],
            })
        described.append({
            "device": device, "name": who, "backend": snap.backend, "ordinal": snap.ordinal,
            "source": str(snap.source) if snap.source is not None else None, "created": snap.created,
            "history_limit": snap.history_limit, "dropped": snap.dropped, "events": len(snap.events),
        })
    segments.sort(key=lambda s: (s["device"], s["address"]))
    return {"segments": segments, "device_traces": traces, "metrale": {"devices": described}}


def write_torch_snapshot(snapshots: Sequence[MemorySnapshot], path: str | os.PathLike[str]) -> TorchSnapshot:
    """Pickle `torch_snapshot` of the snapshots to ``path`` (protocol `PICKLE_PROTOCOL`), as ``_dump_snapshot``
    writes one; returns what it wrote.

    :raises OSError: the file cannot be written.
    :raises InvalidArgumentError: as `torch_snapshot`.
    """
    document = torch_snapshot(snapshots)
    Path(path).write_bytes(pickle.dumps(document, protocol=PICKLE_PROTOCOL))
    return document


def device_notes(document: TorchSnapshot) -> list[str]:
    """A line per device of a `torch_snapshot`: which snapshot it is and what its history holds.

    - ``device 1: rank 1, fake:1 (rank1.json): 12 events``;
    - with history recording off, or nothing recorded, that the viewer shows only the live set when the
      snapshot was saved (and how to turn recording on).
    """
    devices = document["metrale"]["devices"]
    lines = []
    for d in devices:
        who = f"{d['name']}, " if len(devices) > 1 else ""
        where = f"device {d['device']}: {who}{d['backend']}:{d['ordinal']} ({d['source'] or 'in memory'})"
        if d["history_limit"] == 0:
            note = ("history recording was off (set METRALE_MEMORY_HISTORY): the viewer shows only the live set "
                    "when it was saved")
        elif not d["events"]:
            note = "no events were recorded: the viewer shows only the live set when it was saved"
        else:
            note = f"{d['events']} events"
            if d["dropped"]:
                note += f" ({d['dropped']} older ones were dropped: what they left live shows from the start)"
        lines.append(f"{where}: {note}")
    return lines
