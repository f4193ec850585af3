"""The allocation ledger: every live device allocation, its size and its call site.

Written once, here, and shared by every backend. Its invariants:

- an allocation is on the ledger from the moment ``alloc`` returns it until
  ``free`` or ``sweep_unreleased`` takes it off;
- ``free`` takes the record off *before* the memory is released, whatever the
  release returns, so nothing is ever freed twice by a later sweep;
- arena memory is never on it;
- a record holds strings and integers only: never a frame object, which would
  keep every local of the allocating function alive.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Final, Literal, Protocol

from .._device.buffer import DeviceBuffer
from .._errors import ConfigError, MetraleError
from .._twins import pick
from .._types import AllocRecord, Origin, format_bytes

if TYPE_CHECKING:  # (the context imports the settings: pydantic, not for a name of the ledger's)
    from .._device.context import DeviceContext

__all__ = [
    "CallSite", "Ledger", "LedgerEvent", "LedgerProbe", "call_site", "call_site_for", "format_bytes", "largest_sites",
    "INDEXES", "INDEXES_LOCK_FREE", "next_index", "origin_of",
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


#: Modules (and packages) of metrale's own that call the API as a user does: their frames are call sites.
_USER_MODULES = ("metrale_core._commands.selftest", "metrale_core.testing", "metrale_core._commands.bench")


#: Per set of internal packages: per module name, whether its frames are internal (not call sites).
#: The maps grow with the modules a program runs, once. Keyed by the module's name (a string whose
#: hash is cached), not by the code object, whose hash is computed from its contents at every lookup.
_INTERNAL_MODULES: dict[frozenset[str], dict[str, bool]] = {}


#: Per call (code object and instruction): its ``"file:line"``. ``f_lineno`` decodes the line table at
#: each read (a quarter of a microsecond), so a site is formatted once.
_SITES: dict[tuple[int, int], tuple[object, str]] = {}
_SITES_MAX: Final = 4096


def _is_internal(module: str, internal: frozenset[str]) -> bool:
    """Whether frames of ``module`` are passed over: its top-level package is in ``internal``, or a dotted entry
    of ``internal`` (``site_skip``'s module prefixes, ``myapp.gpu``) is it or a package above it."""
    if module.startswith(_USER_MODULES):
        return False
    if module.partition(".")[0] in internal:
        return True
    return any(module == entry or module.startswith(entry + ".") for entry in internal if "." in entry)


#: Whether this module runs as Python: then `call_site` has a frame of its own, which the walk skips.
_OWN_FRAME: Final = 1 if __file__.endswith(".py") else 0


def call_site(internal: frozenset[str], skip: int = 0) -> str:
    """``"file:line"`` of the first frame whose top-level package is not in ``internal``.

    Whether a module's frames are internal is decided once per module name (a dict lookup
    afterwards); a plain dict read and write is atomic under the GIL, and on a free-threaded build
    two threads that race compute the same answer. The walk starts at the caller's frame (never this
    function's own, where it is Python): compiled modules (``dev.py accelerate``, the twin) have no
    frames, so no fixed depth of frames is known to be metrale's: a caller that runs as Python says so
    with ``skip`` (1: its own frame is metrale's; never more than the frames it knows to be there; a
    negative one counts as 0), and the walk starts past it, making fewer frame objects; where there are
    fewer frames than that, at the caller's own. A frame is judged by its globals' module
    name (``sys._getframemodulename``, which would need no frame object, names the function's
    ``__module__`` instead, which ``functools.wraps`` copies: a user's wrapper of a metrale method
    would pass for metrale's).
    """
    known = _INTERNAL_MODULES.get(internal)
    if known is None:
        known = _INTERNAL_MODULES.setdefault(internal, {})
    frame: FrameType | None
    try:
        frame = sys._getframe(_OWN_FRAME + skip if skip > 0 else _OWN_FRAME)
    except ValueError:  # fewer frames than that (not from a caller that told the truth): from the caller's own
        try:
            frame = sys._getframe(_OWN_FRAME)
        except ValueError:  # (no Python frame called it: from C)
            frame = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if type(module) is not str:  # (globals can hold anything)
            module = ""
        inside = known.get(module)
        if inside is None:
            inside = known[module] = _is_internal(module, internal)
        if not inside:
            return _site(frame)
        frame = frame.f_back
    return "<unknown>:0"


def _frames_outside(internal: frozenset[str], frame: FrameType | None) -> Iterator[FrameType]:
    """``frame`` and its callers outward, those of ``internal`` passed over (judged as `call_site` judges them)."""
    known = _INTERNAL_MODULES.get(internal)
    if known is None:
        known = _INTERNAL_MODULES.setdefault(internal, {})
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if type(module) is not str:
            module = ""
        inside = known.get(module)
        if inside is None:
            inside = known[module] = _is_internal(module, internal)
        if not inside:
            yield frame
        frame = frame.f_back


def call_site_at(internal: frozenset[str], stacklevel: int) -> str:
    """``"file:line"`` of the ``stacklevel``-th frame outside ``internal``, counted from the caller outward, as
    ``warnings.warn``'s ``stacklevel`` counts (1: `call_site`'s answer; 2: the frame outside ``internal`` that
    called it). Where there are fewer such frames, the outermost one. For the allocating calls' ``stacklevel``:
    not a hot path (a walk of Python frames)."""
    last = collections.deque(itertools.islice(_frames_outside(internal, sys._getframe(1)), stacklevel), maxlen=1)
    return _site(last[0]) if last else "<unknown>:0"


def user_stack(internal: frozenset[str], limit: int) -> tuple[str, ...]:
    """The caller's stack, ``"file:line"`` per frame: the call site (`call_site`'s answer) first, then its callers
    outward, frames of ``internal`` passed over, ``limit`` frames at most (``memory_history_frames``; a walk of
    Python frames, made only where that setting is on)."""
    return tuple(_site(frame) for frame in itertools.islice(_frames_outside(internal, sys._getframe(1)), limit))


class CallSite(Protocol):
    """What `call_site` and its compiled twin are (`call_site_for`)."""

    def __call__(self, internal: frozenset[str], skip: int = 0) -> str: ...


def call_site_for(pure: bool) -> CallSite:
    """The `call_site` a backend with this ``pure`` setting runs: the compiled twin (``_site.pyx``: the same
    answers, a C walk of the frames) where it was built and ``pure`` is off, else the pure function. An owner
    picks it once, as its backend opens; both take the same ``skip``."""
    return pick("site", call_site, pure)


def _site(frame: FrameType) -> str:
    """``"file:line"`` of ``frame``, formatted once per call (code object and instruction)."""
    code = frame.f_code
    key = (id(code), frame.f_lasti)  # the entry keeps its code alive: the id stays its own
    hit = _SITES.get(key)
    if hit is None:
        if len(_SITES) >= _SITES_MAX:  # code made at run time (exec, generated tests): start again
            _SITES.clear()
        hit = _SITES[key] = (code, f"{code.co_filename}:{frame.f_lineno}")
    return hit[1]


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


def _record(buf: DeviceBuffer | AllocRecord, origin: Origin | None) -> AllocRecord:
    return AllocRecord(buf.ptr, buf.nbytes, buf.kind, buf.index, buf.site, origin)


class Ledger:
    """The live allocations of one backend, keyed by creation index (an allocation's identity:
    never an address, which the driver hands out again). Thread-safe.

    It keeps the buffer each allocation handed out (the same fields as its record, and immutable)
    and makes [`AllocRecord`][metrale_core.AllocRecord] objects only when asked for them, so an ``alloc``
    and a ``free`` each cost one dictionary operation under the lock.

    With ``history`` above zero it also keeps the last ``history`` events, oldest
    dropped first (`events`, `dropped`).
    """

    __slots__ = ("_events", "_lock", "_records", "_stack", "_start", "dropped", "history", "origin", "taken")

    def __init__(self, history: int = 0, stack: Callable[[], tuple[str, ...]] | None = None) -> None:
        self._lock = threading.Lock()
        self._records: dict[int, DeviceBuffer] = {}
        self.history = history
        self._events: collections.deque[LedgerEvent] | None = (
            collections.deque(maxlen=history) if history else None
        )
        self._start = time.monotonic()
        self._stack = stack  # an allocation's stack for its history event (memory_history_frames), or None
        #: Events that fell off the front of the bounded history.
        self.dropped = 0
        #: How many times records came off (frees and sweeps): while it stays the same, every buffer found
        #: on the ledger is still on it (what lets a graph's launch skip the check of its buffers).
        self.taken = 0
        #: The origin its records name (the backend sets it once it knows its device's UUID).
        self.origin: Origin | None = None

    def _log(
        self, op: Literal["alloc", "free", "sweep"], record: AllocRecord, stack: tuple[str, ...] = ()
    ) -> None:
        events = self._events
        assert events is not None
        if len(events) == events.maxlen:
            self.dropped += 1
        events.append(LedgerEvent(time.monotonic() - self._start, op, record, stack))

    def add(self, buf: DeviceBuffer) -> None:
        """Put the allocation ``buf`` handed out on the ledger."""
        # (the stack walked before the lock: it makes objects, and a collection's finalizer may free a buffer)
        stack = () if self._stack is None or self._events is None else self._stack()
        with self._lock:
            self._records[buf.index] = buf
            if self._events is not None:
                self._log("alloc", _record(buf, self.origin), stack)

    def take(self, index: int, ptr: int, nbytes: int) -> DeviceBuffer | None:
        """Take allocation ``index`` off, if it is on the ledger at ``ptr`` with ``nbytes``; the buffer
        it handed out (its record's fields)."""
        with self._lock:
            rec = self._records.get(index)
            if rec is None or rec.ptr != ptr or rec.nbytes != nbytes:
                return None
            del self._records[index]
            self.taken += 1
            if self._events is not None:
                self._log("free", _record(rec, self.origin))
            return rec

    def holds(self, index: int, ptr: int, nbytes: int) -> bool:
        """Whether allocation ``index`` is on the ledger, at ``ptr`` with the ``nbytes`` recorded."""
        rec = self._records.get(index)
        return rec is not None and rec.ptr == ptr and rec.nbytes == nbytes

    def has(self, buf: DeviceBuffer) -> bool:
        """Whether ``buf`` is the very buffer the ledger handed out for its allocation, still on it (a copy
        of it is not: `holds` says whether one matches)."""
        return self._records.get(buf.index) is buf

    def holds_all(self, bufs: Iterable[DeviceBuffer], owner: object) -> bool | None:
        """Whether every one of ``bufs`` is ``owner``'s and on the ledger (`holds`); ``None`` where some
        are not of a kind the ledger holds (arena, external memory), which it cannot say."""
        records = self._records
        for buf in bufs:
            if buf._owner is not owner:
                return False
            rec = records.get(buf.index)
            if rec is buf:  # the very buffer the ledger handed out (the common case)
                continue
            if buf.kind not in ("device", "managed", "pool"):
                return None
            if rec is None or rec.ptr != buf.ptr or rec.nbytes != buf.nbytes:
                return False
        return True

    def drain(self) -> list[AllocRecord]:
        """Take every record off (a sweep)."""
        with self._lock:
            records = [_record(buf, self.origin) for buf in self._records.values()]
            self._records.clear()
            self.taken += 1
            if self._events is not None:
                for rec in records:
                    self._log("sweep", rec)
            return records

    def snapshot(self) -> list[AllocRecord]:
        with self._lock:
            bufs = sorted(self._records.values(), key=lambda r: r.index)
        return [_record(buf, self.origin) for buf in bufs]

    def events(self) -> list[LedgerEvent]:
        """The kept history, oldest first (empty when history is off)."""
        with self._lock:
            return list(self._events or ())

    def elapsed(self) -> float:
        """Seconds since the ledger was created, on the clock of [`LedgerEvent.t`][metrale_core.LedgerEvent.t]."""
        return time.monotonic() - self._start

    def __len__(self) -> int:
        return len(self._records)

    def live_bytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._records.values())


class LedgerProbe:
    """A reader of one backend's ledger that stays usable after the backend closes.

    Closing the backend sweeps the ledger, so a probe then reads an empty one.
    """

    __slots__ = ("_ledger",)

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def live_count(self) -> int:
        """How many allocations are on the ledger."""
        return len(self._ledger)

    def live_bytes(self) -> int:
        """The bytes asked for by the allocations on the ledger."""
        return self._ledger.live_bytes()

    def records(self) -> list[AllocRecord]:
        """The records on the ledger, in creation order."""
        return self._ledger.snapshot()
