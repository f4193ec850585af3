"""The fake's handles: streams as queues of work, events as marks in them, graphs as recorded work, modules."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Final

from metrale_core.plugin import error_for_code

__all__ = [
    "CAPTURES", "FakeEvent", "FakeGraph", "FakeModule", "FakeStream", "GlobalCaptures", "Work", "as_event", "as_stream",
]

Work = Callable[[], None]


@dataclasses.dataclass(frozen=True, slots=True)
class FakeModule:
    name: str
    kernels: frozenset[str]


class FakeStream:
    __slots__ = ("__weakref__", "capture", "done", "invalidated", "issued", "queue")

    def __init__(self) -> None:
        self.queue: deque[tuple[int, Work]] = deque()
        self.issued = 0  # sequence number of the last work issued
        self.done = 0  # sequence number of the last work run
        self.capture: list[Work] | None = None
        self.invalidated = ""  # why its capture was invalidated (a barred call during it), or ""


class GlobalCaptures:
    """The fake streams capturing now, in the whole process: CUDA's global capture mode bars
    allocation, freeing and waits in every thread while any of them runs, and a barred call
    invalidates them (``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED``, then ``..._INVALIDATED`` at
    the end of the capture), as measured on the H200."""

    __slots__ = ("_lock", "_mode", "_streams")

    #: What a relaxed thread may call during a capture in global mode: it allocates and frees device memory (measured
    #: on an H100 by ``probe_torch_hooks``, 2026-12-08: ``cuMemAlloc`` and ``cuMemFree`` succeed, the capture stays
    #: valid); its waits, and pinned host memory (not measured), stay refused here.
    RELAXED: Final = frozenset({"alloc", "free"})

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mode = threading.local()  # each thread's capture mode (`exchange`); "global" until set
        #: capturing stream -> whether its device has faulted (a faulted device's capture bars nobody else)
        self._streams: weakref.WeakKeyDictionary[FakeStream, Callable[[], bool]] = weakref.WeakKeyDictionary()

    def begin(self, stream: FakeStream, faulted: Callable[[], bool]) -> None:
        with self._lock:
            self._streams[stream] = faulted

    def end(self, stream: FakeStream) -> None:
        with self._lock:
            self._streams.pop(stream, None)

    def exchange(self, mode: str) -> str:
        """Set the calling thread's capture mode (``"global"``, ``"thread_local"``, ``"relaxed"``); the one it had.
        The fake owns no capture to a thread: a thread-local thread is barred as a global one (more than CUDA bars)."""
        was: str = getattr(self._mode, "mode", "global")
        self._mode.mode = mode
        return was

    def bar(self, what: str) -> None:
        """Refuse barred call ``what`` if any fake stream of the process is capturing, invalidating them; a relaxed
        thread's allocations and frees pass (`RELAXED`)."""
        if not self._streams:  # the usual case, without the lock
            return
        if what in self.RELAXED and getattr(self._mode, "mode", "global") == "relaxed":
            return
        with self._lock:
            capturing = [stream for stream, faulted in self._streams.items() if not faulted()]
        if not capturing:
            return
        for stream in capturing:
            stream.invalidated = stream.invalidated or f"{what} was called during the capture"
        raise error_for_code(
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", f"fake {what} while a stream captures in global mode"
        )


#: The process's global captures, shared by every fake device (global mode is process-wide).
CAPTURES: Final = GlobalCaptures()


class FakeEvent:
    __slots__ = ("seq", "stream", "time")

    def __init__(self) -> None:
        self.stream: FakeStream | None = None
        self.seq = 0
        self.time: float | None = None


class FakeGraph:
    __slots__ = ("__weakref__", "work")

    def __init__(self, work: list[Work]) -> None:
        self.work = tuple(work)


def as_stream(stream: object) -> FakeStream:
    if not isinstance(stream, FakeStream):
        raise error_for_code("CUDA_ERROR_INVALID_HANDLE", f"stream {stream!r}")
    return stream


def as_event(event: object) -> FakeEvent:
    if not isinstance(event, FakeEvent):
        raise error_for_code("CUDA_ERROR_INVALID_HANDLE", f"event {event!r}")
    return event
