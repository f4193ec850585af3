"""Memory snapshots: the ledger, its history and the stats, as JSON for ``metrale report``.

The format (``"format": "metrale-memory-snapshot"``, ``"version": 1``)::

    {"format", "version", "backend", "device", "ordinal", "total", "created",
     "history_limit", "dropped",
     "events": [{"t", "op", "ptr", "nbytes", "kind", "index", "site"}, ...],   # oldest first
     "live":   [{"ptr", "nbytes", "kind", "index", "site"}, ...],              # on the ledger when saved
     "stats":  {...}}

``t`` is seconds since the backend opened; ``op`` is ``alloc``, ``free`` or
``sweep``. ``events`` is empty when ``memory_history`` is ``0``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from typing import Any, Final

from ._ledger import Ledger
from ._pressure import MemoryStats
from ._types import AllocRecord, MemoryInfo

__all__ = ["FORMAT", "VERSION", "write_snapshot"]

FORMAT: Final = "metrale-memory-snapshot"
VERSION: Final = 1


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
) -> None:
    """Write one snapshot to ``path`` (atomically: a temporary file, then a rename)."""
    events = ledger.events()
    document = {
        "format": FORMAT,
        "version": VERSION,
        "backend": backend,
        "device": device,
        "ordinal": ordinal,
        "total": info.total if info is not None else 0,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "elapsed": round(ledger.elapsed(), 6),
        "history_limit": ledger.history,
        "dropped": ledger.dropped,
        "events": [{"t": round(e.t, 6), "op": e.op, **_record(e.record)} for e in events],
        "live": [_record(r) for r in ledger.snapshot()],
        "stats": dataclasses.asdict(stats) | {"current_total_bytes": stats.current_total_bytes},
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(document, indent=1), encoding="utf-8")
    os.replace(tmp, path)
