"""Handles a backend gives out: streams, events, graphs, executable graphs, host buffers.

Each holds its raw handle and the device context, and is owned by one part of
the backend: the stream front (streams, events, graphs) or the allocator (host
buffers), each reached through the small protocol it implements here
(`HandleOwner`, `HostOwner`). A handle refuses use after its own
``close()`` or its backend's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar, final

from .._errors import BackendClosedError, InvalidArgumentError, capture_error
from .args import invalid_argument
from .capture import Capture, GraphKernels, captured_event_error, forbid_during_capture, invalidated_error
from .context import DeviceContext, gated

if TYPE_CHECKING:
    from .buffer import DeviceBuffer

__all__ = ["Event", "Graph", "GraphExec", "HandleOwner", "HostBuffer", "HostOwner", "Stream"]

_H = TypeVar("_H", bound="_Handle")


class HandleOwner(Protocol):
    """What streams, events and graphs ask of the part that owns them (the stream front)."""

    @property
    def ctx(self) -> DeviceContext: ...

    def resolve(self, stream: Stream | None, what: str) -> Stream:
        """``stream``, checked to be a live stream of this backend; the default stream for ``None``."""

    def adopt(self, handle: _H) -> _H:
        """Own ``handle``: it is released when the backend closes."""

    def release(self, handle: _Handle) -> None:
        """Forget ``handle`` and destroy its raw object (its ``close()``)."""

    def waited(self) -> None:
        """A user's wait has returned: report what finished work found (queued red-zone scans)."""

    def launch_graph(self, graph: GraphExec, stream: Stream | None) -> None:
        """Replay ``graph`` on ``stream``: the whole of its ``launch()``, the gate and the graph's liveness included."""


class HostOwner(Protocol):
    """What a host buffer asks of the part that owns it (the allocator)."""

    @property
    def ctx(self) -> DeviceContext: ...

    def free_host(self, buf: HostBuffer, what: str) -> None:
        """Release ``buf`` (its ``close()``, or ``backend.free(buf)``)."""


class _Handle:
    __slots__ = ("__weakref__", "_closed", "_ctx", "raw")

    _what = "handle"
    #: The ``RawDevice`` method that destroys this kind of handle.
    _destroy_op = ""

    def __init__(self, ctx: DeviceContext, raw: object) -> None:
        self._ctx = ctx
        #: The backend's raw handle (for the part that owns it and for diagnostics; a plain attribute, read on
        #: the hot paths, never to be set).
        self.raw = raw
        self._closed = False

    def _live(self) -> object:
        self._ctx.check_open()
        if self._closed:
            raise BackendClosedError(f"this {self._what} was closed; create a new one")
        return self.raw

    @property
    def backend(self) -> Any:
        """The backend that owns this handle (``None`` once that backend is gone)."""
        return self._ctx.facade()

    @property
    def closed(self) -> bool:
        return self._closed or self._ctx.closed

    def _mark_closed(self) -> bool:
        """For the owner: mark the handle closed; ``False`` if it already was."""
        if self._closed:
            return False
        self._closed = True
        return True


@final
class Stream(_Handle):
    """A queue of device work. Work on one stream runs in issue order."""

    __slots__ = ("_owner", "capture", "default")
    _what = "stream"
    _destroy_op = "stream_destroy"

    def __init__(self, owner: HandleOwner, raw: object, *, default: bool = False) -> None:
        super().__init__(owner.ctx, raw)
        self._owner = owner
        #: The capture in progress on this stream (the stream front's to set), or ``None``.
        self.capture: Capture | None = None
        #: Whether this is the backend's default stream (closed only with the backend).
        self.default = default

    @gated
    def synchronize(self) -> None:
        """Wait until all work issued to this stream has completed."""
        raw = self._live()
        forbid_during_capture("Stream.synchronize()")
        self._ctx.raw.stream_synchronize(raw)
        self._owner.waited()

    @gated
    def query(self) -> bool:
        """Whether all work issued to this stream has completed."""
        raw = self._live()
        forbid_during_capture("Stream.query()")
        return self._ctx.raw.stream_query(raw)

    @gated
    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for the event's last record."""
        raw = self._live()
        if not isinstance(event, Event) or event._ctx is not self._ctx:
            raise invalid_argument("Stream.wait(event)", "an Event of this backend", event)
        raw_event = event._live()
        capture = self.capture
        if capture is not None:
            if capture.invalidated:
                raise invalidated_error(capture, "Stream.wait(event)")
            if event.captured_in is not capture:
                capture.invalidate("Stream.wait on an event recorded outside the capture")
                raise capture_error(
                    "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
                    "Stream.wait(event) on a capturing stream needs an event recorded in the "
                    "same capture; record the event on this stream after begin_capture",
                )
        elif event.captured_in is not None and not event.captured_in.active:
            raise captured_event_error("Stream.wait(event)")
        elif event.captured_in is not None:
            raise capture_error(
                "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                "Stream.wait(event) on a stream that is not capturing, with an event recorded "
                "in a capture in progress, would join this stream to the capture; metrale "
                "captures one stream at a time: wait after end_capture instead",
            )
        self._ctx.raw.stream_wait_event(raw, raw_event)

    def close(self) -> None:
        """Destroy the stream (after its work completes). The default stream closes with its backend."""
        if self.closed:
            return
        if self.default:
            raise InvalidArgumentError("the default stream is closed by its backend's close(), not by itself")
        if self.capture is not None:
            raise capture_error(
                "CUDA_ERROR_ILLEGAL_STATE", "this stream is capturing: call end_capture before closing it"
            )
        self._owner.release(self)

    def __repr__(self) -> str:
        kind = "default " if self.default else ""
        return f"<metrale {kind}Stream of {self._ctx.name}:{self._ctx.ordinal}>"


@final
class Event(_Handle):
    """A marker in a stream's work, for ordering and timing."""

    __slots__ = ("_owner", "_recorded", "captured_in")
    _what = "event"
    _destroy_op = "event_destroy"

    def __init__(self, owner: HandleOwner, raw: object) -> None:
        super().__init__(owner.ctx, raw)
        self._owner = owner
        #: The capture the event was last recorded in, or ``None``.
        self.captured_in: Capture | None = None
        self._recorded = False

    @gated
    def record(self, stream: Stream | None = None) -> None:
        """Record the event on ``stream`` (the default stream when ``None``)."""
        raw = self._live()
        target = self._owner.resolve(stream, "Event.record")
        capture = target.capture
        if capture is not None and capture.invalidated:
            raise invalidated_error(capture, "Event.record")
        self._ctx.raw.event_record(raw, target.raw)
        self.captured_in = capture
        self._recorded = True

    @gated
    def synchronize(self) -> None:
        """Wait until the work before the event's last record has completed."""
        raw = self._live()
        forbid_during_capture("Event.synchronize()")
        if self.captured_in is not None:
            raise captured_event_error("Event.synchronize()")
        self._ctx.raw.event_synchronize(raw)
        self._owner.waited()

    @gated
    def query(self) -> bool:
        """Whether the work before the event's last record has completed."""
        raw = self._live()
        forbid_during_capture("Event.query()")
        if self.captured_in is not None:
            raise captured_event_error("Event.query()")
        return self._ctx.raw.event_query(raw)

    @gated
    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event's record to ``end``'s; both must have completed."""
        raw = self._live()
        if not isinstance(end, Event) or end._ctx is not self._ctx:
            raise invalid_argument("Event.elapsed_ms(end)", "an Event of this backend", end)
        raw_end = end._live()
        if not (self._recorded and end._recorded):
            raise invalid_argument("Event.elapsed_ms(end)", "two events that have both been recorded", end)
        return self._ctx.raw.event_elapsed_ms(raw, raw_end)

    def close(self) -> None:
        """Destroy the event."""
        if not self.closed:
            self._owner.release(self)


#: The view of a closed host buffer.
_NO_BYTES: Final = memoryview(b"")


@final
class HostBuffer(_Handle):
    """Pinned (page-locked) host memory: fast, truly asynchronous copies.

    ``view()`` is a writable ``memoryview`` of its bytes; do not use a view
    after ``free``.
    """

    __slots__ = ("_owner", "_view", "nbytes", "ptr")
    _what = "host buffer"

    def __init__(self, owner: HostOwner, ptr: int, nbytes: int, view: memoryview) -> None:
        super().__init__(owner.ctx, ptr)
        self._owner = owner
        self.ptr = ptr
        self.nbytes = nbytes
        self._view = view

    def view(self) -> memoryview:
        """A writable byte view of the buffer."""
        self._live()
        return self._view

    def _mark_closed(self) -> bool:
        """Closed, it lets go of its view: a handle still referenced pins no memory the backend released."""
        if not super()._mark_closed():
            return False
        self._view = _NO_BYTES
        return True

    def close(self) -> None:
        """Free the buffer, as ``backend.free(host_buffer)`` does; idempotent."""
        if self.closed:
            return
        try:
            self._ctx.enter()
        except BackendClosedError:
            return  # the backend's close() released it
        try:
            self._owner.free_host(self, "HostBuffer.close")
        finally:
            self._ctx.leave()

    def __buffer__(self, flags: int) -> memoryview:
        """The buffer protocol (Python 3.12+): ``memoryview(host_buffer)``, ``numpy.asarray`` etc."""
        return self.view()

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"HostBuffer(ptr={self.ptr:#x}, nbytes={self.nbytes})"


@final
class Graph(_Handle):
    """Work recorded by a stream capture; instantiate it to run it."""

    __slots__ = ("_owner", "buffers", "check", "host_buffers", "kernels", "peers", "registries")
    _what = "graph"
    _destroy_op = "graph_destroy"

    def __init__(self, owner: HandleOwner, raw: object, capture: Capture) -> None:
        super().__init__(owner.ctx, raw)
        self._owner = owner
        #: The red-zone check captured as its last node (the zone guard's), or ``None``.
        self.check: Any = capture.check
        #: The device buffers the recorded work touches.
        self.buffers: tuple[DeviceBuffer, ...] = tuple(capture.buffers.values())
        #: The host buffers the recorded work reads or writes.
        self.host_buffers: tuple[Any, ...] = tuple(capture.host_buffers.values())
        #: The kernel registries whose kernels it launches.
        self.registries: tuple[Any, ...] = tuple(capture.registries.values())
        #: Buffers of other backends it copies from, each with its owner's liveness check.
        self.peers: tuple[tuple[DeviceBuffer, Any], ...] = tuple(capture.peers.values())
        #: Its number and kernel nodes, in capture order (a red-zone report's suspects).
        self.kernels = GraphKernels(capture.number, tuple(capture.kernels))

    @gated
    def instantiate(self) -> GraphExec:
        """An executable graph that replays the recorded work."""
        raw = self._live()
        exec_raw = self._ctx.raw.graph_instantiate(raw)
        return self._owner.adopt(
            GraphExec(
                self._owner, exec_raw, self.buffers, self.host_buffers, self.registries, self.check, self.peers,
                self.kernels,
            )
        )

    def close(self) -> None:
        """Release the graph (executable graphs made from it stay usable)."""
        if not self.closed:
            self._owner.release(self)


@final
class GraphExec(_Handle):
    """An instantiated graph: ``launch`` replays its work on a stream."""

    __slots__ = ("_owner", "buffers", "check", "host_buffers", "kernels", "live_at", "peers", "registries")
    _what = "executable graph"
    _destroy_op = "graph_exec_destroy"

    def __init__(
        self,
        owner: HandleOwner,
        raw: object,
        buffers: tuple[DeviceBuffer, ...],
        host_buffers: tuple[Any, ...],
        registries: tuple[Any, ...] = (),
        check: Any = None,
        peers: tuple[tuple[DeviceBuffer, Any], ...] = (),
        kernels: GraphKernels | None = None,
    ) -> None:
        super().__init__(owner.ctx, raw)
        self._owner = owner
        #: The number and kernel nodes of the graph it was made from (a red-zone report's suspects).
        self.kernels = GraphKernels(0, ()) if kernels is None else kernels
        #: The red-zone check of the graph it was made from (it holds one reference), or ``None``.
        self.check = check
        if check is not None:
            check.refs += 1
        #: The device buffers the graph's work touches.
        self.buffers = buffers
        #: The host buffers the graph's work reads or writes.
        self.host_buffers = host_buffers
        #: Held: the modules of its kernels stay loaded while it lives.
        self.registries = registries
        #: Buffers of other backends its work copies from, each with its owner's liveness check.
        self.peers = peers
        #: For its owner: the ledger's ``taken`` count when every one of its buffers was last found on the
        #: ledger (``-1``: never), so a launch while no record came off since checks none of them again.
        self.live_at = -1

    def launch(self, stream: Stream | None = None) -> None:
        """Replay the graph on ``stream`` (the default stream when ``None``)."""
        self._owner.launch_graph(self, stream)  # the gate, this handle's liveness and the launch: its owner's lane

    def close(self) -> None:
        """Release the executable graph."""
        if not self.closed:
            self._owner.release(self)

