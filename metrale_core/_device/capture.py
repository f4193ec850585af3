"""Stream capture: the rules CUDA enforces in global mode, kept once for every backend.

Global capture mode is process-wide in CUDA: while any stream of any context
is capturing in that mode, every thread is barred from the calls that could
break the capture (allocation, freeing, synchronization, queries). metrale
keeps the record of the captures its backends began here, process-wide for
that reason, and checks the rules before any driver call, so the fake and
the CUDA backend answer alike.

Measured on an H200: a barred call fails with
``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`` and invalidates the capture;
further work issued to the capturing stream then fails with
``CUDA_ERROR_STREAM_CAPTURE_INVALIDATED``, and so does ``cuStreamEndCapture``,
which discards what was recorded.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, ParamSpec, TypeVar, final

from .._errors import CaptureError, capture_error

if TYPE_CHECKING:
    from .buffer import DeviceBuffer

_P = ParamSpec("_P")
_R = TypeVar("_R")

__all__ = [
    "Capture",
    "GraphKernels",
    "KernelNode",
    "abandon_captures",
    "active_captures",
    "call_entered",
    "call_left",
    "capturing",
    "leave_call",
    "thread_calls",
    "resume_calls",
    "suspend_calls",
    "captured_event_error",
    "forbid_during_capture",
    "invalidated_error",
    "judge_under_capture",
    "may_wait",
]

_LOCK = threading.RLock()
_ACTIVE: dict[int, Capture] = {}

#: Signalled, while a capture waits to begin, each time a thread leaves its barred call (under ``_LOCK``).
_IDLE = threading.Condition(_LOCK)

#: The longest a capture waits, before it begins, for other threads' barred calls to return (seconds).
#: A barred call that began before the capture and reaches the driver after it would fail there (and
#: invalidate the capture), so the capture waits for it; the bound keeps a call that waits a long time
#: (a synchronize behind long work, a user callback) from stalling the capture forever.
BARRED_WAIT_S = 2.0


@final
class _Flag:
    """One thread's flag: whether it is inside a barred call (its check passed, its metrale call not
    returned), and how many metrale calls it is inside, of every backend (the flag goes with the
    outermost). Written only by its thread; ``inside`` is read by a capture that waits to begin."""

    __slots__ = ("__weakref__", "calls", "inside")

    def __init__(self) -> None:
        self.inside = False
        self.calls = 0


@final
class _Starting:
    """How many captures are waiting in `Capture.start` now (changed under ``_LOCK``)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


_STARTING = _Starting()

#: Every live thread's flag (a thread's goes with it).
_FLAGS: weakref.WeakSet[_Flag] = weakref.WeakSet()


@final
class _Barred(threading.local):
    """Per thread: its `_Flag`."""

    def __init__(self) -> None:
        self.flag = _Flag()
        with _LOCK:
            _FLAGS.add(self.flag)


_MINE = _Barred()


def _others_inside(own: _Flag) -> bool:
    return any(flag.inside for flag in list(_FLAGS) if flag is not own)


#: A kernel node of a captured graph, for a red-zone report's suspects: the kernel's name, where it sits in the
#: graph (``"node 2"``; a kernel of a graph launched into the capture: ``"node 1 of graph #1, node 3"``), and the
#: device addresses its pointer-sized arguments held (a tensor map's: its buffer's).
KernelNode = tuple[str, str, tuple[int, ...]]


class GraphKernels(NamedTuple):
    """The kernels a captured graph launches, in capture order (its graph and executable graphs hold it; the zone
    guard names them as the suspects of a violation its verdict found)."""

    #: The graph's number on its backend (``graph #N``): its capture's, counted from 1 in capture order.
    number: int
    #: Its kernel nodes, in capture order.
    nodes: tuple[KernelNode, ...]


@final
class Capture:
    """One capture in progress: the device context it belongs to (``owner``), whether it is
    invalidated, and what it touched (the buffers, host buffers and kernel registries its work uses),
    and, for a red-zone report's suspects, its kernel nodes."""

    __slots__ = (
        "active", "buffers", "check", "host_buffers", "invalidated", "kernels", "nodes", "number", "owner", "peers",
        "reason", "registries",
    )

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self.active = False
        self.invalidated = False
        self.reason = ""
        self.buffers: dict[int, DeviceBuffer] = {}  # creation index -> buffer
        self.host_buffers: dict[int, object] = {}  # id -> HostBuffer
        self.registries: dict[int, object] = {}  # id -> KernelRegistry whose kernels the capture launched
        #: Buffers of other backends the work copies from (``copy_peer``, and graphs launched inside it that
        #: do), each with its owner's liveness check: creation index -> (buffer, check).
        self.peers: dict[int, tuple[DeviceBuffer, Callable[[DeviceBuffer], bool]]] = {}
        #: The red-zone check the graph ends with (the zone guard's, opaque here), or ``None``.
        self.check: Any = None
        #: The graph's number on its backend (``graph #N``; its owner's count of captures), 0 where none was given.
        self.number = 0
        #: The work items (nodes) issued into it so far: kernels, memsets, copies, graphs launched into it.
        self.nodes = 0
        #: Its kernel nodes so far, in capture order.
        self.kernels: list[KernelNode] = []

    def invalidate(self, reason: str) -> None:
        if not self.invalidated:
            self.invalidated = True
            self.reason = reason

    def start(self) -> None:
        """Enter the process-wide record, before the driver's capture begins: first wait (up to
        `BARRED_WAIT_S`) for the barred calls other threads are inside to return, so none
        of them reaches the driver while the capture runs; from then on they are refused.

        The check of a barred call and this wait need no common lock (see
        `forbid_during_capture`): the call sets its thread's flag and then reads whether a
        capture is starting; the capture says it is starting and then reads the flags. Whichever
        order the two steps of each take, one of them sees the other: the call takes the locked
        path, or the capture waits for it."""
        with _LOCK:
            own = _MINE.flag
            deadline = time.monotonic() + BARRED_WAIT_S
            _STARTING.count += 1
            try:
                while _others_inside(own):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    _IDLE.wait(left)
                _ACTIVE[id(self)] = self
            finally:
                _STARTING.count -= 1
            self.active = True

    def finish(self) -> None:
        with _LOCK:
            _ACTIVE.pop(id(self), None)
            self.active = False


def abandon_captures(owner: object, reason: str) -> None:
    """Take the captures of ``owner`` out of the process-wide record, invalidated with ``reason``
    (a device fault: a faulted backend's capture can never end well, and must not bar the others)."""
    with _LOCK:
        mine = [c for c in _ACTIVE.values() if c.owner is owner]
        for capture in mine:
            del _ACTIVE[id(capture)]
            capture.active = False
            capture.invalidate(reason)


def active_captures() -> list[Capture]:
    """The captures metrale's backends have begun and not ended, in this process."""
    with _LOCK:
        return list(_ACTIVE.values())


def capturing() -> bool:
    """Whether any capture is in progress in the process (a read without the lock, for a hot path's
    choice of what to do, never for the capture rule itself: `forbid_during_capture` is that)."""
    return bool(_ACTIVE)


def forbid_during_capture(what: str) -> None:
    """Raise ``CaptureError`` (and invalidate every capture) if any capture is in progress.

    Otherwise the calling thread is inside a barred call until its outermost metrale call
    returns (`call_left`, which the device context's gate calls): a capture that begins
    meanwhile on another thread waits for it (`Capture.start`), so the check and the
    driver call it guards are one step, as CUDA's own rule is.

    No lock while no capture runs or starts: the thread's own flag is set first, then the record
    read (a store and a load of the GIL's sequentially consistent kind; a free-threaded build
    takes ``_LOCK`` around it instead, see `_serialized`).
    """
    flag = _MINE.flag
    was = flag.inside
    flag.inside = True
    if not _ACTIVE and not _STARTING.count:
        return
    judge_under_capture(flag, was, what)


def judge_under_capture(flag: _Flag, was: bool, what: str) -> None:
    """The locked half of `forbid_during_capture`, for a check that found a capture in progress or starting
    with its thread's ``flag`` already set (``was``: the flag before). The flag stays set throughout: a capture
    that starts meanwhile waits for this call, or this call raises (and puts the flag back).

    Its compiled twin's fast half (``_capture.pyx``) calls it too: the rule's locked half is written once."""
    with _LOCK:
        if not _ACTIVE:  # a capture is starting: it waits for this call
            return
        captures = list(_ACTIVE.values())
        _restore(flag, was)
    for capture in captures:
        capture.invalidate(f"{what} was called during the capture")
    raise capture_error(
        "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        f"{what} is not allowed while a stream is capturing (global mode bars it in every "
        f"thread); the capture is now invalidated: call end_capture to discard it, and do "
        f"this before begin_capture or after end_capture",
    )


def may_wait() -> bool:
    """For a wait metrale chooses to make (a check's): ``True``, and the calling thread inside a
    barred call as with `forbid_during_capture`, when no capture is in progress; else
    ``False``, invalidating nothing (the wait is left for later)."""
    flag = _MINE.flag
    was = flag.inside
    flag.inside = True
    if not _ACTIVE and not _STARTING.count:
        return True
    with _LOCK:
        if not _ACTIVE:
            return True
        _restore(flag, was)
        return False


def _restore(flag: _Flag, was: bool) -> None:
    """Under ``_LOCK``: a refused check puts its thread's flag back as it was."""
    if not was:
        flag.inside = False
        if _STARTING.count:
            _IDLE.notify_all()


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
    if _STARTING.count:
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


def _serialized(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` under ``_LOCK``: on a free-threaded build, where the flag's store and the record's load
    in `forbid_during_capture` need the lock to be seen in order by a starting capture."""

    @functools.wraps(fn)
    def serialized(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with _LOCK:
            return fn(*args, **kwargs)

    return serialized


if not getattr(sys, "_is_gil_enabled", lambda: True)():  # pragma: no cover - free-threaded builds only
    forbid_during_capture = _serialized(forbid_during_capture)
    may_wait = _serialized(may_wait)
    call_left = _serialized(call_left)
    leave_call = _serialized(leave_call)
    suspend_calls = _serialized(suspend_calls)
    resume_calls = _serialized(resume_calls)


def invalidated_error(capture: Capture, what: str) -> CaptureError:
    todo = (
        "the capture has ended and its work is discarded: capture again without the forbidden call"
        if what == "end_capture"
        else "call end_capture to discard it, then capture again"
    )
    return capture_error(
        "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        f"{what} failed: the capture on this stream was invalidated ({capture.reason}); {todo}",
    )


def captured_event_error(what: str) -> CaptureError:
    return capture_error(
        "CUDA_ERROR_CAPTURED_EVENT",
        f"{what}: the event was last recorded inside a capture, so it marks a point in a graph, not "
        f"in a stream's work; record it again on a stream outside any capture first",
    )
