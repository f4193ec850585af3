"""Stream capture: a call's own checks of the capture rule, on the calling thread's flag.

The rules, the record of the captures in progress and every thread's flag are ``capture_record.py``'s (one per
process, never compiled), and this module gives its names too. These checks are written once, here, and compiled as
well as run as Python (``_capture``, with ``_capture.pxd`` beside it: docs/building.md):

- `forbid_during_capture`: the barred call's check (the caller's flag at hand where it has it). Its
  common case takes no lock: the thread's flag set first, then the record read; anything else is the rule's locked
  half, `judge_under_capture`, with the flag still set (a capture starting meanwhile waits for this call).
- `leave_call`: the end of a metrale call; the outermost one ends the thread's barred call.
- Compiled, they read and write the flag's slots in place; the gate's compiled twin counts its calls on the same
  flag (``_gate.pxd``), and the compiled lanes check the rule at C level (``_capture.pxd``).
- A free-threaded build takes the record's lock where the GIL would order a flag's store and the record's load.
"""

from __future__ import annotations

from typing import Final

from .capture_record import (  # (_ACTIVE and _STARTING: C variables of their types, compiled)
    _ACTIVE,
    _IDLE,
    _LOCK,
    _MINE,
    _STARTING,
    BARRED_WAIT_S,
    GIL,
    Capture,
    GraphKernels,
    KernelNode,
    abandon_captures,
    active_captures,
    captured_event_error,
    capturing,
    invalidated_error,
    judge_under_capture,
    may_wait,
)

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

if not cython.compiled:  # (compiled: the record's classes of flags, and their layout, in _capture.pxd)
    from .capture_record import _Flag, _Starting

    def flags_in_place(flag: type, starting: type) -> bool:
        """Whether the slots ``_capture.pxd`` reads in place are those of these classes: as Python, none is."""
        return False

__all__ = [
    "BARRED_WAIT_S",
    "SLOTS",
    "Capture",
    "GraphKernels",
    "KernelNode",
    "abandon_captures",
    "active_captures",
    "call_entered",
    "call_left",
    "captured_event_error",
    "capturing",
    "forbid_during_capture",
    "invalidated_error",
    "judge_under_capture",
    "leave_call",
    "may_wait",
    "resume_calls",
    "suspend_calls",
    "thread_calls",
]

if cython.compiled and not flags_in_place(_Flag, _Starting):  # (the loader then runs the pure code, saying why)
    raise RuntimeError(
        "the capture flags' slots are not where _capture.pxd reads them: capture_record._Flag or _Starting changed "
        "without the layout _capture.pxd declares"
    )

#: Whether the checks read and write the flags in place with no lock: compiled, where the GIL is on.
SLOTS: Final = bool(cython.compiled) and GIL


def forbid_during_capture(what: str, flag: _Flag | None = None) -> None:
    """Raise ``CaptureError`` (and invalidate every capture) if any capture is in progress.

    Otherwise the calling thread is inside a barred call until its outermost metrale call
    returns (`call_left`, which the device context's gate calls): a capture that begins
    meanwhile on another thread waits for it (`Capture.start`), so the check and the
    driver call it guards are one step, as CUDA's own rule is. ``flag``: the calling thread's,
    where the caller has it at hand (the lanes': their gate's cell's).

    No lock while no capture runs or starts: the thread's own flag is set first, then the record
    read (a store and a load of the GIL's sequentially consistent kind: whichever order this and a
    starting capture take, one sees the other). A free-threaded build always judges under the lock.
    """
    if flag is None:
        flag = _MINE.flag
    was = flag.inside
    flag.inside = True
    if GIL and not _ACTIVE and not _STARTING.count:
        return
    judge_under_capture(flag, was, what)


def thread_calls() -> _Flag:
    """The calling thread's flag, for a caller that keeps it per thread (the device context's gate):
    entering a call is ``flag.calls += 1`` (`call_entered`), leaving it is `leave_call`,
    or ``flag.calls -= 1`` where ``flag.calls > 1`` (not the outermost call: nothing else to do)."""
    return _MINE.flag


def call_entered() -> None:
    """The calling thread entered a metrale call (of any backend)."""
    _MINE.flag.calls += 1


def call_left() -> None:
    """The calling thread left a metrale call; leaving its outermost one ends its barred call."""
    leave_call(_MINE.flag)


def leave_call(flag: _Flag) -> None:
    """The thread of ``flag`` (the calling one) left a metrale call: `call_left` with the flag at hand."""
    flag.calls -= 1
    if flag.calls <= 0:
        flag.calls = 0
        if flag.inside:
            _barred_call_done(flag)


def _barred_call_done(flag: _Flag) -> None:
    flag.inside = False  # cleared first, then a starting capture told (it may be waiting for this one)
    if _STARTING.count or not GIL:
        with _LOCK:
            _IDLE.notify_all()


def suspend_calls() -> tuple[int, bool]:
    """Before user code (a callback, an observer, a producer's export): the thread is outside every
    metrale call and every barred call while it runs; `resume_calls` puts it back."""
    flag = _MINE.flag
    saved = (flag.calls, flag.inside)
    flag.calls = 0
    if flag.inside:
        _barred_call_done(flag)
    return saved


def resume_calls(saved: tuple[int, bool]) -> None:
    """After user code: back inside the calls `suspend_calls` saved. A capture may have begun
    meanwhile: a barred call checks again before its next driver call."""
    calls, inside = saved
    flag = _MINE.flag
    flag.calls = calls
    if inside:
        flag.inside = True
