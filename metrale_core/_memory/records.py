"""What the ledger's records are made of, and where they come from: one module, run as Python only.

- `next_index`: the per-process sequence of creation indexes, shared by every backend and both builds (the
  contract: `redzone_trace_idx` names one allocation of a whole run);
- `origin_of`: the host, process, rank and device a backend's records name;
- `LedgerEvent` and `record_of`: a change to the ledger, and a record made of a buffer;
- `largest_sites` and `describe_sites`: records summed by call site.

The ledger (``ledger.py``) is compiled as well as run as Python (``_ledger``): what must be one per process (the
sequence, the count of backends) or one class for both builds (`LedgerEvent`) lives here, never in it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Final, Literal

from .._errors import ConfigError, MetraleError
from .._types import AllocRecord, Origin, format_bytes

if TYPE_CHECKING:  # (the context imports the settings: pydantic, not for a name of the ledger's)
    from .._device.buffer import DeviceBuffer
    from .._device.context import DeviceContext

__all__ = [
    "INDEXES", "INDEXES_LOCK_FREE", "LedgerEvent", "describe_sites", "largest_sites", "next_index", "origin_of",
    "record_of",
]

_log = logging.getLogger("metrale")

# One per-process sequence of creation indexes, shared by every backend: the
# contract says so, and it is what lets `redzone_trace_idx` name one allocation
# of a whole run. `itertools.count` is atomic under the GIL; the lock keeps it
# so on free-threaded builds.
_SEQUENCE = itertools.count()
_SEQUENCE_LOCK = threading.Lock()


def _next_index_locked() -> int:
    with _SEQUENCE_LOCK:
        return next(_SEQUENCE)


#: Whether the GIL makes ``next(INDEXES)`` atomic (else `next_index` takes a lock).
INDEXES_LOCK_FREE: Final = getattr(sys, "_is_gil_enabled", lambda: True)()

#: The sequence itself, for the compiled lane, which takes its next item at C level where `INDEXES_LOCK_FREE`.
INDEXES: Final[Iterator[int]] = _SEQUENCE

#: The next creation index of this process (lock-free where the GIL makes ``next`` atomic).
next_index: Callable[[], int] = _SEQUENCE.__next__ if INDEXES_LOCK_FREE else _next_index_locked


def largest_sites(records: Iterable[AllocRecord], top: int = 5) -> list[tuple[str, int, int]]:
    """``(site, bytes, count)`` aggregated by call site, largest first."""
    by_site: dict[str, list[int]] = {}
    for rec in records:
        entry = by_site.setdefault(rec.site, [0, 0])
        entry[0] += rec.nbytes
        entry[1] += 1
    rows = sorted(by_site.items(), key=lambda item: (-item[1][0], item[0]))
    return [(site, b, n) for site, (b, n) in rows[:top]]


def describe_sites(rows: list[tuple[str, int, int]]) -> str:
    """``site (1.0 MiB x3), ...`` for a log line."""
    return ", ".join(f"{site} ({format_bytes(b)} x{n})" for site, b, n in rows) or "none"


@dataclasses.dataclass(frozen=True, slots=True)
class LedgerEvent:
    """One change to the ledger, kept when history is on (``memory_history``).

    :param t: seconds since the ledger was created (a monotonic clock).
    :param op: ``"alloc"``, ``"free"``, or ``"sweep"`` (taken off by a sweep).
    :param record: the allocation.
    :param stack: an ``"alloc"``'s stack with ``memory_history_frames`` (``"file:line"`` each, the first frame
        outside metrale and ``site_skip`` first, which is the call site unless a ``stacklevel`` named one of its
        callers, then its callers outward; metrale's frames and ``site_skip``'s passed over), else empty.
    """

    t: float
    op: Literal["alloc", "free", "sweep"]
    record: AllocRecord
    stack: tuple[str, ...] = ()


#: The backends this process opened, numbered from 1 (`Origin.instance`); ``next`` on it is atomic in CPython.
_BACKENDS_OPENED: Final = itertools.count(1)


def origin_of(ctx: DeviceContext) -> Origin:
    """Where the records of the backend of ``ctx`` come from: this host and process, the rank, the device, and
    the backend's number in this process (called once per backend).

    - the device's UUID: ``""`` where the raw layer gives none (logged at DEBUG);
    - the rank and world size: ``None`` where the launcher's variables are bad (a WARNING: only
      ``placement()`` needs them right);
    - the worker and the device share: what the engine's glue gave (``MetraleSettings.with_launch``).
    """
    try:
        device_uuid = ctx.raw.device_uuid()
    except MetraleError as exc:
        _log.debug("%s:%d: no device UUID for the origin: %s", ctx.name, ctx.ordinal, exc)
        device_uuid = ""
    try:
        launch = ctx.settings.launch
        rank, world_size = launch.rank, launch.world_size
        worker, share = launch.metrale_worker or "", launch.metrale_device_share or 1.0
    except ConfigError as exc:
        _log.warning("%s:%d: the origin names no rank: %s", ctx.name, ctx.ordinal, exc)
        rank = world_size = None
        worker, share = "", 1.0
    return Origin(socket.gethostname(), os.getpid(), rank, world_size, ctx.name, ctx.ordinal, device_uuid,
                  next(_BACKENDS_OPENED), worker, share)


def record_of(buf: DeviceBuffer | AllocRecord, origin: Origin | None) -> AllocRecord:
    """The record of ``buf`` (a buffer the ledger handed out, or a record), naming ``origin``."""
    return AllocRecord(buf.ptr, buf.nbytes, buf.kind, buf.index, buf.site, origin)
