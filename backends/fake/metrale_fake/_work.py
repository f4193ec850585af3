"""The fake's handles: streams as queues of work, events as marks in them, graphs as recorded work, modules."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

from metrale_core.plugin import error_for_code

__all__ = ["FakeEvent", "FakeGraph", "FakeModule", "FakeStream", "Work", "as_event", "as_stream"]

Work = Callable[[], None]


@dataclasses.dataclass(frozen=True, slots=True)
class FakeModule:
    name: str
    kernels: frozenset[str]


class FakeStream:
    __slots__ = ("capture", "done", "issued", "queue")

    def __init__(self) -> None:
        self.queue: deque[tuple[int, Work]] = deque()
        self.issued = 0  # sequence number of the last work issued
        self.done = 0  # sequence number of the last work run
        self.capture: list[Work] | None = None


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
