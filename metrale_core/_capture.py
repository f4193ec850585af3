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
from typing import TYPE_CHECKING

from ._errors import CaptureError, error_for_code

if TYPE_CHECKING:
    from ._handles import HostBuffer, Stream
    from ._kernels import KernelRegistry
    from ._types import DeviceBuffer

__all__ = ["Capture", "active_captures", "captured_event_error", "forbid_during_capture", "invalidated_error"]

_LOCK = threading.Lock()
_ACTIVE: dict[int, Capture] = {}


class Capture:
    """One capture in progress: its stream, whether it is invalidated, and what it touched."""

    __slots__ = ("active", "buffers", "host_buffers", "invalidated", "reason", "registries", "stream")

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.active = False
        self.invalidated = False
        self.reason = ""
        self.buffers: dict[tuple[int, int], DeviceBuffer] = {}
        self.host_buffers: dict[int, HostBuffer] = {}
        self.registries: dict[int, KernelRegistry] = {}  # whose kernels the capture launched

    def invalidate(self, reason: str) -> None:
        if not self.invalidated:
            self.invalidated = True
            self.reason = reason

    def start(self) -> None:
        with _LOCK:
            _ACTIVE[id(self)] = self
            self.active = True

    def finish(self) -> None:
        with _LOCK:
            _ACTIVE.pop(id(self), None)
            self.active = False


def active_captures() -> list[Capture]:
    """The captures metrale's backends have begun and not ended, in this process."""
    with _LOCK:
        return list(_ACTIVE.values())


def forbid_during_capture(what: str) -> None:
    """Raise ``CaptureError`` (and invalidate every capture) if any capture is in progress."""
    captures = active_captures()
    if not captures:
        return
    for capture in captures:
        capture.invalidate(f"{what} was called during the capture")
    err = error_for_code("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", what)
    raise CaptureError(
        f"{what} is not allowed while a stream is capturing (global mode bars it in every "
        f"thread); the capture is now invalidated: call end_capture to discard it, and do "
        f"this before begin_capture or after end_capture",
        code=err.code,
        name=err.name,
    )


def invalidated_error(capture: Capture, what: str) -> CaptureError:
    err = error_for_code("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", what)
    todo = (
        "the capture has ended and its work is discarded: capture again without the forbidden call"
        if what == "end_capture"
        else "call end_capture to discard it, then capture again"
    )
    return CaptureError(
        f"{what} failed: the capture on this stream was invalidated ({capture.reason}); {todo}",
        code=err.code,
        name=err.name,
    )


def captured_event_error(what: str) -> CaptureError:
    err = error_for_code("CUDA_ERROR_CAPTURED_EVENT", what)
    return CaptureError(
        f"{what}: the event was last recorded inside a capture, so it marks a point in a graph, not "
        f"in a stream's work; record it again on a stream outside any capture first",
        code=err.code,
        name=err.name,
    )
