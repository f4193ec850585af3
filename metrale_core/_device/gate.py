"""The gate: every public call of one backend passes it, counted in and out.

- `Gate.enter` counts a call in; it is refused once the gate is shut, and after a fault unless the call
  still answers then (``faulted_ok``: ledger and stats reads). The refusal is the owner's error
  (``refusal``: the device context's closed or fault error).
- `Gate.leave` counts it out, and ends the thread's barred call of the capture rule with its outermost call.
- `Gate.enter_c` and `Gate.leave_c` are the same with the thread's cell handed from one to the other (the lanes';
  compiled, at C level).
- `Gate.shut` (``close()``) refuses every later call and waits for the calls of other threads to leave;
  the closing thread's own calls are not waited for (a callback may close its backend).
- `Gate.outside` runs user code as if the thread were outside the gate.
- `Gate.interrupted`, `Gate.defer`: a garbage collection may run a finalizer in the middle of a call of this
  gate, while the call holds a lock of its backend; a ``free`` that finalizer makes is deferred (`defer`) to the
  thread's next call of the gate that starts outside a collection, or to ``close()`` (`run_later`), and any other
  call it makes is refused (`interrupted_error`): under a lock that is not re-entrant, it would wait forever.

The counts are per thread (`_Cell`, one per thread that called, gone with the thread): a call writes only
its own thread's count, so the hot path takes no lock under the GIL. Written once, here, and compiled as well as
run as Python (``_gate``, with ``_gate.pxd`` beside it: docs/building.md). Compiled, the flags and counts are C
fields, the capture flag's slots are read in place (``_capture.pxd``), and the last thread's cell is kept beside
the id of its thread state (unique in the interpreter, never reused), so a thread calling again finds its cell
without the ``threading.local`` lookup: only under the GIL, which makes reading the pair atomic, and where
``threading.local`` is the interpreter's own; a forked child looks its cells up again. Each build has its own
collection hook (`_collector`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Final, final

from .._errors import MetraleError
from .capture import may_wait, resume_calls, suspend_calls, thread_calls

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

if not cython.compiled:  # (compiled: _gate.pxd's C, and the capture rule's C-level door of _capture.pxd)
    from threading import get_ident as thread_ident

    from .capture import leave_call
    from .capture_record import _Flag

    def thread_state_id() -> int:
        """The calling thread's state's id, compiled; not read as Python, where no cell is kept at hand (`_CACHE`)."""
        return 0

__all__ = ["Gate", "interrupted_error", "run_deferred"]

_log = logging.getLogger("metrale")

#: The thread running a garbage collection (``threading.get_ident``), 0 while none runs.
_collector = 0


def _on_collection(phase: str, info: object) -> None:
    global _collector  # noqa: PLW0603 - one collection at a time per process: its state is global
    _collector = thread_ident() if phase == "start" else 0


gc.callbacks.append(_on_collection)  # (each build registers its own: each reads only its own)

#: Bumped in a forked child: a cell kept at hand before the fork may be another (now gone) thread's, with calls
#: inside that never leave; the child finds its cells again through ``threading.local``, which the fork cleared.
_forks = 0


def _forked() -> None:
    global _forks  # noqa: PLW0603 - the process's forks: one count per process
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def interrupted_error() -> MetraleError:
    """The refusal of a call a finalizer makes while a collection interrupted a call of the same backend."""
    return MetraleError(
        "a finalizer called metrale during a garbage collection that interrupted a metrale call of the same "
        "backend on this thread; only free() may be called there (it is done at the thread's next call): "
        "release other resources outside finalizers, or with close() of the owner"
    )


def run_deferred(later: list[tuple[Callable[[object], object], object]]) -> None:
    """Run a gate's deferred calls, oldest first, inside a call of that gate (`may_wait` marks the thread inside
    a barred call until it leaves); none while a capture runs or begins (a free would be refused and end it). A
    failure is logged: a finalizer made the call."""
    if not later or not may_wait():
        return
    while later:
        try:
            call, arg = later.pop(0)
        except IndexError:  # another thread ran it
            return
        try:
            call(arg)
        except Exception as exc:  # (as Python logs a finalizer's error)
            _log.warning("metrale: a free deferred from a garbage collection failed: %s", exc)


#: Whether the gate counts without a lock: under the GIL, a cell's store and the ``closed`` flag's load
#: are seen in order by ``shut()`` on another thread; a free-threaded build takes the lock instead.
LOCK_FREE: Final = getattr(sys, "_is_gil_enabled", lambda: True)()


class _Cell:
    """How many calls of one gate one thread is inside (``depth``), and that thread's flag of the
    capture rule (``flag``: ``capture``'s, of every backend; the gate counts the thread's calls there
    too, so a call reads one thread-local). ``depth`` is written only by its thread (on a
    free-threaded build under the gate's lock) and read by ``shut()`` on another."""

    __slots__ = ("__weakref__", "depth", "flag")

    def __init__(self) -> None:
        self.depth = 0
        self.flag: _Flag = thread_calls()


@final
class _Depth(threading.local):
    """Per thread: its `_Cell` of this gate (made at the thread's first call, and added to
    the gate's cells under the gate's lock)."""

    def __init__(self, cells: weakref.WeakSet[_Cell], lock: threading.Lock) -> None:
        self.cell = _Cell()
        with lock:
            cells.add(self.cell)


#: Whether a gate keeps the last thread's cell at hand: compiled, under the GIL, and where `_Depth` is local to a
#: thread (the interpreter's ``_thread._local``), not to a green thread (gevent's patch replaces
#: ``threading.local`` and ``_thread._local`` alike: the class is judged by its module).
_CACHE: Final = bool(cython.compiled) and LOCK_FREE and _Depth.__mro__[1].__module__ == "_thread"


class Gate:
    """The gate of one backend's public calls. Thread-safe.

    :param refusal: the error a refused call raises (called at the refusal: the owner words it).
    """

    __slots__ = (
        "_cells", "_cond", "_depth", "_faulted", "_last_cell", "_last_forks", "_last_thread", "_later", "_lock",
        "_refusal", "closed",
    )

    def __init__(self, refusal: Callable[[], MetraleError]) -> None:
        self._refusal = refusal
        #: Whether `shut` has run: nothing may be committed any more (read-only, compiled).
        self.closed = False
        self._faulted = False
        self._lock = threading.Lock()  # the counts; taken bare on the hot path (a C-level lock)
        self._cond = threading.Condition(self._lock)  # for shut(), waiting for calls to leave
        self._cells: weakref.WeakSet[_Cell] = weakref.WeakSet()  # every thread's (a thread's goes with it)
        self._depth = _Depth(self._cells, self._lock)
        self._later: list[tuple[Callable[[object], object], object]] = []  # deferred frees, in order
        # the last thread's cell, kept at hand (compiled: `_cell`): its thread state's id, the forks seen then
        self._last_thread = 0
        self._last_forks = 0
        self._last_cell: _Cell | None = None

    def fault(self) -> None:
        """The backend faulted: calls are refused from now on, but those that still answer (``faulted_ok``)."""
        self._faulted = True

    def _cell(self) -> _Cell:
        """The calling thread's cell (made at its first call); kept at hand where `_CACHE` says so."""
        if not _CACHE:
            return self._depth.cell
        thread = thread_state_id()
        if thread == self._last_thread and self._last_forks == _forks and self._last_cell is not None:
            return self._last_cell
        cell: _Cell = self._depth.cell
        self._last_thread = thread
        self._last_forks = _forks
        self._last_cell = cell
        return cell

    def enter(self, faulted_ok: bool = False) -> None:
        """Count a call in; refused once shut (and after a fault unless ``faulted_ok``)."""
        self.enter_c(faulted_ok)

    def enter_c(self, faulted_ok: bool) -> _Cell:
        """`enter`, giving the calling thread's cell for `leave_c`.

        No lock: the thread's own count goes up first, then ``closed`` is read; `shut` sets
        ``closed`` first, then reads the counts, so either this call is refused or `shut`
        waits for it."""
        cell = self._cell() if _CACHE else self._depth.cell
        if _collector and cell.depth and _collector == thread_ident():
            raise interrupted_error()
        if LOCK_FREE:
            cell.depth += 1
            closed = self.closed
        else:  # pragma: no cover - free-threaded builds only
            with self._lock:
                cell.depth += 1
                closed = self.closed
        if closed:
            self._count_out(cell)
            raise self._refusal()
        cell.flag.calls += 1  # capture.call_entered(), with the flag at hand
        if self._faulted and not faulted_ok:
            self.leave_c(cell)
            raise self._refusal()
        if self._later and cell.depth == 1:
            try:
                self.run_later()
            except BaseException:  # (an interrupt): counted out, as a call that raised
                self.leave_c(cell)
                raise
        return cell

    def interrupted(self) -> bool:
        """Whether a call made now comes from a finalizer that a garbage collection runs in the middle of a
        call of this gate on this thread."""
        return bool(_collector) and self._cell().depth > 0 and _collector == thread_ident()

    def defer(self, call: Callable[[object], object], arg: object) -> None:
        """Run ``call(arg)`` at the next call of this gate that starts outside a collection (`run_later`)."""
        self._later.append((call, arg))

    def run_later(self) -> None:
        """Run the deferred calls (`run_deferred`)."""
        run_deferred(self._later)

    def leave(self) -> None:
        """Count a call out."""
        self.leave_c(self._cell() if _CACHE else self._depth.cell)

    def leave_c(self, cell: _Cell) -> None:
        """`leave`, with the calling thread's cell at hand (`enter_c`'s)."""
        flag = cell.flag
        calls = flag.calls
        if calls > 1:  # not the thread's outermost metrale call: only the count changes
            flag.calls = calls - 1
        elif flag.inside:  # leaving the outermost call ends its barred call: its driver calls are over
            leave_call(flag)
        else:  # the outermost call, in no barred call (flag.inside is only this thread's to set)
            flag.calls = 0
        if LOCK_FREE:
            cell.depth -= 1
            if self.closed:  # a shut() may be waiting for this call
                with self._cond:
                    self._cond.notify_all()
        else:  # pragma: no cover - free-threaded builds only
            self._count_out(cell)

    def _count_out(self, cell: _Cell) -> None:
        if LOCK_FREE:
            cell.depth -= 1
        else:  # pragma: no cover - free-threaded builds only
            with self._lock:
                cell.depth -= 1
        if self.closed:  # a shut() may be waiting for this call
            with self._cond:
                self._cond.notify_all()

    def _others_inside(self, own: _Cell) -> int:
        """Under the lock: how many calls other threads are inside."""
        return sum([cell.depth for cell in list(self._cells) if cell is not own])

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Run user code (a callback, an observer) as if this thread were outside the gate: a `shut` on
        another thread does not wait for it. Counted in again after it (whether or not the gate shut
        meanwhile; the caller checks `closed` before it commits anything)."""
        cell = self._cell()
        depth = cell.depth
        with self._cond:
            cell.depth = 0
            if self.closed:
                self._cond.notify_all()
        calls = suspend_calls()  # user code is in no barred call: captures on other threads need not wait for it
        try:
            yield
        finally:
            resume_calls(calls)
            with self._cond:
                cell.depth = depth

    def shut(self, timeout: float) -> int | None:
        """Refuse every call from now on and wait, at most ``timeout`` seconds, for those of other threads
        inside to leave (not this thread's own). ``None`` where it was already shut; else how many calls
        of other threads were still inside when the wait ended (0 unless it timed out)."""
        own = self._cell()  # (compiled, after a fork, this also lets go of a cell kept at hand that was another's)
        with self._cond:
            if self.closed:
                return None
            self.closed = True
            self._later.clear()  # frees deferred and not run by close(): the sweep takes their records
            if self._cond.wait_for(lambda: self._others_inside(own) == 0, timeout=timeout):
                return 0
            return self._others_inside(own)
