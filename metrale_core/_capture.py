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

import threading
import time
from typing import TYPE_CHECKING, Any

from ._errors import CaptureError, capture_error

if TYPE_CHECKING:
    from ._buffer import DeviceBuffer

__all__ = [
    "Capture",
    "abandon_captures",
    "active_captures",
    "call_entered",
    "call_left",
    "resume_calls",
    "suspend_calls",
    "captured_event_error",
    "forbid_during_capture",
    "invalidated_error",
    "may_wait",
]

_LOCK = threading.Lock()
_ACTIVE: dict[int, Capture] = {}

#: Signalled when no thread is inside a barred call any more (under ``_LOCK``).
_IDLE = threading.Condition(_LOCK)


class _Flight:
    """How many threads are inside a barred call now: past its check, maybe inside its driver call
    (under ``_LOCK``)."""

    __slots__ = ("threads", "waiters")

    def __init__(self) -> None:
        self.threads = 0
        self.waiters = 0  # captures waiting in Capture.start for the barred calls to return


_FLIGHT = _Flight()
#: The longest a capture waits, before it begins, for other threads' barred calls to return (seconds).
#: A barred call that began before the capture and reaches the driver after it would fail there (and
#: invalidate the capture), so the capture waits for it; the bound keeps a call that waits a long time
#: (a synchronize behind long work, a user callback) from stalling the capture forever.
BARRED_WAIT_S = 2.0


class _Barred(threading.local):
    """Per thread: whether it is inside a barred call (its check passed, its metrale call not returned),
    and how many metrale calls it is inside, of every backend (the flag goes with the outermost)."""

    inside = False
    calls = 0


_MINE = _Barred()


class Capture:
    """One capture in progress: the device context it belongs to (``owner``), whether it is
    invalidated, and what it touched (the buffers, host buffers and kernel registries its work uses)."""

    __slots__ = ("active", "buffers", "check", "host_buffers", "invalidated", "owner", "reason", "registries")

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self.active = False
        self.invalidated = False
        self.reason = ""
        self.buffers: dict[int, DeviceBuffer] = {}  # creation index -> buffer
        self.host_buffers: dict[int, object] = {}  # id -> HostBuffer
        self.registries: dict[int, object] = {}  # id -> KernelRegistry whose kernels the capture launched
        #: The red-zone check the graph ends with (the zone guard's, opaque here), or ``None``.
        self.check: Any = None

    def invalidate(self, reason: str) -> None:
        if not self.invalidated:
            self.invalidated = True
            self.reason = reason

    def start(self) -> None:
        """Enter the process-wide record, before the driver's capture begins: first wait (up to
        :data:`BARRED_WAIT_S`) for the barred calls other threads are inside to return, so none
        of them reaches the driver while the capture runs; from then on they are refused."""
        with _LOCK:
            own = 1 if _MINE.inside else 0
            deadline = time.monotonic() + BARRED_WAIT_S
            _FLIGHT.waiters += 1
            try:
                while _FLIGHT.threads > own:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    _IDLE.wait(left)
            finally:
                _FLIGHT.waiters -= 1
            _ACTIVE[id(self)] = self
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


def forbid_during_capture(what: str) -> None:
    """Raise ``CaptureError`` (and invalidate every capture) if any capture is in progress.

    Otherwise the calling thread is inside a barred call until its outermost metrale call
    returns (:func:`call_left`, which the device context's gate calls): a capture that begins
    meanwhile on another thread waits for it (:meth:`Capture.start`), so the check and the
    driver call it guards are one step, as CUDA's own rule is.
    """
    with _LOCK:
        if not _ACTIVE:
            if not _MINE.inside:
                _MINE.inside = True
                _FLIGHT.threads += 1
            return
        captures = list(_ACTIVE.values())
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
    barred call as with :func:`forbid_during_capture`, when no capture is in progress; else
    ``False``, invalidating nothing (the wait is left for later)."""
    with _LOCK:
        if _ACTIVE:
            return False
        if not _MINE.inside:
            _MINE.inside = True
            _FLIGHT.threads += 1
        return True


def call_entered() -> None:
    """The calling thread entered a metrale call (of any backend)."""
    _MINE.calls += 1


def call_left() -> None:
    """The calling thread left a metrale call; leaving its outermost one ends its barred call."""
    mine = _MINE
    mine.calls -= 1
    if mine.calls <= 0:
        mine.calls = 0
        if mine.inside:
            _barred_call_done()


def _barred_call_done() -> None:
    with _LOCK:
        _MINE.inside = False
        flight = _FLIGHT
        flight.threads -= 1
        if flight.waiters:  # every decrement while a capture waits: its own flag may be the one left
            _IDLE.notify_all()


def suspend_calls() -> tuple[int, bool]:
    """Before user code (a callback, an observer, a producer's export): the thread is outside every
    metrale call and every barred call while it runs; :func:`resume_calls` puts it back."""
    mine = _MINE
    saved = (mine.calls, mine.inside)
    mine.calls = 0
    if mine.inside:
        _barred_call_done()
    return saved


def resume_calls(saved: tuple[int, bool]) -> None:
    """After user code: back inside the calls :func:`suspend_calls` saved. A capture may have begun
    meanwhile: a barred call checks again before its next driver call."""
    calls, inside = saved
    mine = _MINE
    mine.calls = calls
    if inside and not mine.inside:
        with _LOCK:
            mine.inside = True
            _FLIGHT.threads += 1


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
