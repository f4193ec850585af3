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

This module is the record, never compiled: what is one per process (the captures in progress, every thread's flag,
the lock they share), the captures themselves, and the rules' locked halves. A call's own checks, which read the
record and the calling thread's flag, are ``capture.py``'s (written once and compiled as well: ``_capture``).
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NamedTuple, final

from .._errors import CaptureError, capture_error

if TYPE_CHECKING:
    from .buffer import DeviceBuffer

__all__ = [
    "BARRED_WAIT_S",
    "GIL",
    "Capture",
    "GraphKernels",
    "KernelNode",
    "abandon_captures",
    "active_captures",
    "captured_event_error",
    "capturing",
    "invalidated_error",
    "judge_under_capture",
    "may_wait",
]

_LOCK = threading.RLock()
_ACTIVE: dict[int, Capture] = {}

#: Signalled, while a capture waits to begin, each time a thread leaves its barred call (under ``_LOCK``).
_IDLE = threading.Condition(_LOCK)

#: Whether the GIL is on: a flag's store and the record's load are then seen in order by a capture that starts on
#: another thread, and a check that finds no capture takes no lock. A free-threaded build takes ``_LOCK`` instead.
GIL: Final = getattr(sys, "_is_gil_enabled", lambda: True)()

#: The longest a capture waits, before it begins, for other threads' barred calls to return (seconds).
#: A barred call that began before the capture and reaches the driver after it would fail there (and
#: invalidate the capture), so the capture waits for it; the bound keeps a call that waits a long time
#: (a synchronize behind long work, a user callback) from stalling the capture forever.
BARRED_WAIT_S = 2.0


@final
class _Flag:
    """One thread's flag: whether it is inside a barred call (its check passed, its metrale call not
    returned), and how many metrale calls it is inside, of every backend (the flag goes with the
    outermost). Written only by its thread; ``inside`` is read by a capture that waits to begin.

    Compiled, the checks of ``capture.py`` read and write its slots in place: ``_capture.pxd`` declares its layout
    (checked as that module loads)."""

    __slots__ = ("__weakref__", "calls", "inside")

    def __init__(self) -> None:
        self.inside = False
        self.calls = 0


@final
class _Starting:
    """How many captures are waiting in `Capture.start` now (changed under ``_LOCK``; its layout declared in
    ``_capture.pxd``, as `_Flag`'s)."""

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


def judge_under_capture(flag: _Flag, was: bool, what: str) -> None:
    """The locked half of `forbid_during_capture`, for a check that found a capture in progress or starting
    with its thread's ``flag`` already set (``was``: the flag before). The flag stays set throughout: a capture
    that starts meanwhile waits for this call, or this call raises (and puts the flag back).

    The fast half (``capture.py``'s `forbid_during_capture`, compiled or not) calls it: the rule's locked half is
    written once."""
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
    if GIL and not _ACTIVE and not _STARTING.count:
        return True
    with _LOCK:  # (a free-threaded build always: the flag's store is seen by a starting capture that takes it)
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
