# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`Gate`][metrale_core._device.gate.Gate]: the same interface and behaviour, its
flags and counts as C fields.

- The pure class in ``gate.py`` is the reference: `_twins.pick` picks this one where it was built
  and ``pure`` is off. A differential test runs both through the same programs.
- ``_gate.pxd`` gives compiled callers (the allocator's lane) `Gate.enter_c` and `Gate.leave_c`: a call
  in and out at C level, the thread's cell handed from one to the other.
- A thread's cell lives in a ``threading.local``; the last thread's cell is also kept beside the id of its thread
  state (``PyThreadState_GetID``: unique in the interpreter, never reused), so a thread calling again finds its
  cell without the ``threading.local`` lookup. Only under the GIL, which makes reading the pair atomic, and where
  ``threading.local`` is the interpreter's own; a forked child looks its cells up again.
"""

cimport cython
from cpython.pystate cimport PyThreadState, PyThreadState_Get

cdef extern from "Python.h":
    unsigned long long PyThreadState_GetID(PyThreadState* tstate)
    unsigned long PyThread_get_thread_ident()

import contextlib
import gc
import os
import sys
import threading
import weakref

from ._capture cimport enter_c as _enter_call
from ._capture cimport leave_c as _leave_call

from .capture import resume_calls, suspend_calls, thread_calls
from .gate import interrupted_error, run_deferred

#: As in ``gate.py``: the thread running a garbage collection, 0 while none runs (this module's own callback).
cdef unsigned long _collector = 0


def _on_collection(phase, info):
    global _collector
    _collector = PyThread_get_thread_ident() if phase == "start" else 0


gc.callbacks.append(_on_collection)

#: As in ``gate.py``: the counts without a lock under the GIL; a free-threaded build takes the lock.
cdef bint LOCK_FREE = getattr(sys, "_is_gil_enabled", lambda: True)()


#: Bumped in a forked child: a cell kept at hand before the fork may be another (now gone) thread's, with calls
#: inside that never leave; the child finds its cells again through ``threading.local``, which the fork cleared.
cdef unsigned long long _forks = 0


def _forked():
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


@cython.final
cdef class _Cell:
    """How many calls of one gate one thread is inside, and that thread's flag of the capture rule."""

    def __init__(self):
        self.depth = 0
        self.flag = thread_calls()


class _Depth(threading.local):
    """Per thread: its `_Cell` of this gate (made at the thread's first call)."""

    def __init__(self, cells, lock):
        self.cell = _Cell()
        with lock:
            cells.add(self.cell)


#: Whether a gate keeps the last thread's cell at hand: under the GIL, and where `_Depth` is local to a thread (the
#: interpreter's ``_thread._local``), not to a green thread (gevent's patch replaces ``threading.local`` and
#: ``_thread._local`` alike: the class is judged by its module).
cdef bint _CACHE = LOCK_FREE and _Depth.__mro__[1].__module__ == "_thread"


@cython.final
cdef class Gate:
    """The gate of one backend's public calls. Thread-safe (compiled twin)."""

    def __init__(self, refusal):
        self._refusal = refusal
        self._closed = False
        self._faulted = False
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._cells = weakref.WeakSet()
        self._depth = _Depth(self._cells, self._lock)
        self._later = []

    @property
    def closed(self):
        """Whether `shut` has run: nothing may be committed any more."""
        return self._closed

    def fault(self):
        """The backend faulted: calls are refused from now on, but those that still answer (``faulted_ok``)."""
        self._faulted = True

    cdef _Cell _cell(self):
        """The calling thread's cell (made at its first call)."""
        cdef unsigned long long thread
        cdef _Cell cell
        if not _CACHE:
            return <_Cell>self._depth.cell
        thread = PyThreadState_GetID(PyThreadState_Get())
        if thread == self._last_thread and self._last_forks == _forks and self._last_cell is not None:
            return self._last_cell
        cell = <_Cell>self._depth.cell
        self._last_thread = thread
        self._last_forks = _forks
        self._last_cell = cell
        return cell

    cdef _Cell enter_c(self, bint faulted_ok):
        cdef _Cell cell = self._cell()
        cdef bint closed
        if _collector != 0 and cell.depth and _collector == PyThread_get_thread_ident():
            raise interrupted_error()
        if LOCK_FREE:
            cell.depth += 1
            closed = self._closed
        else:
            with self._lock:
                cell.depth += 1
                closed = self._closed
        if closed:
            self._count_out(cell)
            raise self._refusal()
        _enter_call(cell.flag)
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

    cdef bint interrupted_c(self) except -1:
        return _collector != 0 and self._cell().depth > 0 and _collector == PyThread_get_thread_ident()

    def interrupted(self):
        """Whether a call made now comes from a finalizer that a collection runs in a call of this gate."""
        return self.interrupted_c()

    def defer(self, call, arg):
        """Run ``call(arg)`` at the next call of this gate that starts outside a collection."""
        self._later.append((call, arg))

    def run_later(self):
        """Run the deferred calls (the pure module's `run_deferred`)."""
        run_deferred(self._later)

    cdef int leave_c(self, _Cell cell) except -1:
        _leave_call(cell.flag)  # (`leave_call`: the outermost call ends the thread's barred call)
        if LOCK_FREE:
            cell.depth -= 1
            if self._closed:
                with self._cond:
                    self._cond.notify_all()
        else:
            self._count_out(cell)
        return 0

    cdef int _count_out(self, _Cell cell) except -1:
        if LOCK_FREE:
            cell.depth -= 1
        else:
            with self._lock:
                cell.depth -= 1
        if self._closed:
            with self._cond:
                self._cond.notify_all()
        return 0

    def enter(self, bint faulted_ok=False):
        """Count a call in; refused once shut (and after a fault unless ``faulted_ok``)."""
        self.enter_c(faulted_ok)

    def leave(self):
        """Count a call out."""
        self.leave_c(self._cell())

    def _others_inside(self, own):
        cdef Py_ssize_t total = 0
        cdef _Cell cell
        for c in list(self._cells):
            cell = <_Cell>c
            if cell is not own:
                total += cell.depth
        return total

    @contextlib.contextmanager
    def outside(self):
        """Run user code as if this thread were outside the gate (see the pure class)."""
        cdef _Cell cell = self._cell()
        depth = cell.depth
        with self._cond:
            cell.depth = 0
            if self._closed:
                self._cond.notify_all()
        calls = suspend_calls()
        try:
            yield
        finally:
            resume_calls(calls)
            with self._cond:
                cell.depth = depth

    def shut(self, timeout):
        """Refuse every later call and wait for those of other threads inside (see the pure class)."""
        own = self._cell()  # (after a fork, this also lets go of a cell kept at hand that was another thread's)
        with self._cond:
            if self._closed:
                return None
            self._closed = True
            self._later.clear()  # frees deferred and not run by close(): the sweep takes their records
            if self._cond.wait_for(lambda: self._others_inside(own) == 0, timeout=timeout):
                return 0
            return self._others_inside(own)
