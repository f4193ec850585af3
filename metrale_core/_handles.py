"""Handles a backend gives out: streams, events, graphs, executable graphs, host buffers.

Each holds its backend's raw handle, is owned by that backend (closed with
it), and refuses use after its own ``close()`` or the backend's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._capture import Capture, captured_event_error, forbid_during_capture, invalidated_error
from ._errors import CaptureError, InvalidBufferError, MetraleError, error_for_code

if TYPE_CHECKING:
    from ._backend import GpuBackend
    from ._kernels import KernelRegistry
    from ._types import DeviceBuffer

__all__ = ["Event", "Graph", "GraphExec", "HostBuffer", "Stream"]


class _Handle:
    __slots__ = ("__weakref__", "_backend", "_closed", "_raw")

    _what = "handle"

    def __init__(self, backend: GpuBackend, raw: object) -> None:
        self._backend = backend
        self._raw = raw
        self._closed = False

    def _live(self) -> object:
        self._backend._check_open()
        if self._closed:
            raise MetraleError(f"this {self._what} was closed; create a new one")
        return self._raw

    @property
    def backend(self) -> GpuBackend:
        """The backend that owns this handle."""
        return self._backend

    @property
    def closed(self) -> bool:
        return self._closed or self._backend.closed

    #: The ``RawDevice`` method that destroys this kind of handle.
    _destroy_op = ""

    def close(self) -> None:
        """Release the handle; idempotent, and a no-op once its backend is closed (which released it)."""
        if self._closed or self._backend.closed:
            return
        self._closed = True
        self._backend._forget_handle(self)
        self._backend._destroy(getattr(self._backend._raw, self._destroy_op), self._raw)


class Stream(_Handle):
    """A queue of device work. Work on one stream runs in issue order."""

    __slots__ = ("_capture", "_default")
    _what = "stream"
    _destroy_op = "stream_destroy"

    def __init__(self, backend: GpuBackend, raw: object, *, default: bool = False) -> None:
        super().__init__(backend, raw)
        self._capture: Capture | None = None
        self._default = default

    def synchronize(self) -> None:
        """Wait until all work issued to this stream has completed."""
        raw = self._live()
        forbid_during_capture("Stream.synchronize()")
        self._backend._raw.stream_synchronize(raw)
        self._backend._report_queued_scans()

    def query(self) -> bool:
        """Whether all work issued to this stream has completed."""
        raw = self._live()
        forbid_during_capture("Stream.query()")
        return self._backend._raw.stream_query(raw)

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for the event's last record."""
        raw = self._live()
        if not isinstance(event, Event) or event._backend is not self._backend:
            raise self._backend._invalid_argument("Stream.wait(event)", "an Event of this backend", event)
        raw_event = event._live()
        capture = self._capture
        if capture is not None:
            if capture.invalidated:
                raise invalidated_error(capture, "Stream.wait(event)")
            if event._captured_in is not capture:
                capture.invalidate("Stream.wait on an event recorded outside the capture")
                err = error_for_code("CUDA_ERROR_STREAM_CAPTURE_ISOLATION", "Stream.wait(event)")
                raise CaptureError(
                    "Stream.wait(event) on a capturing stream needs an event recorded in the "
                    "same capture; record the event on this stream after begin_capture",
                    code=err.code,
                    name=err.name,
                )
        elif event._captured_in is not None and not event._captured_in.active:
            raise captured_event_error("Stream.wait(event)")
        elif event._captured_in is not None:
            raise CaptureError(
                "Stream.wait(event) on a stream that is not capturing, with an event recorded "
                "in a capture in progress, would join this stream to the capture; metrale "
                "captures one stream at a time: wait after end_capture instead",
                code=error_for_code("CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "").code,
                name="CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            )
        self._backend._raw.stream_wait_event(raw, raw_event)

    def close(self) -> None:
        """Destroy the stream (after its work completes). The default stream closes with its backend."""
        if self._closed or self._backend.closed:
            return
        if self._default:
            raise MetraleError("the default stream is closed by its backend's close(), not by itself")
        if self._capture is not None:
            raise CaptureError("this stream is capturing: call end_capture before closing it")
        super().close()

    def __repr__(self) -> str:
        kind = "default " if self._default else ""
        return f"<metrale {kind}Stream of {self._backend.name}:{self._backend.ordinal}>"


class Event(_Handle):
    """A marker in a stream's work, for ordering and timing."""

    __slots__ = ("_captured_in", "_recorded")
    _what = "event"
    _destroy_op = "event_destroy"

    def __init__(self, backend: GpuBackend, raw: object) -> None:
        super().__init__(backend, raw)
        self._captured_in: Capture | None = None
        self._recorded = False

    def record(self, stream: Stream | None = None) -> None:
        """Record the event on ``stream`` (the default stream when ``None``)."""
        raw = self._live()
        target = self._backend._stream(stream, "Event.record")
        capture = target._capture
        if capture is not None and capture.invalidated:
            raise invalidated_error(capture, "Event.record")
        self._backend._raw.event_record(raw, target._raw)
        self._captured_in = capture
        self._recorded = True

    def synchronize(self) -> None:
        """Wait until the work before the event's last record has completed."""
        raw = self._live()
        forbid_during_capture("Event.synchronize()")
        if self._captured_in is not None:
            raise captured_event_error("Event.synchronize()")
        self._backend._raw.event_synchronize(raw)
        self._backend._report_queued_scans()

    def query(self) -> bool:
        """Whether the work before the event's last record has completed."""
        raw = self._live()
        forbid_during_capture("Event.query()")
        if self._captured_in is not None:
            raise captured_event_error("Event.query()")
        return self._backend._raw.event_query(raw)

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event's record to ``end``'s; both must have completed."""
        raw = self._live()
        if not isinstance(end, Event) or end._backend is not self._backend:
            raise self._backend._invalid_argument("Event.elapsed_ms(end)", "an Event of this backend", end)
        raw_end = end._live()
        if not (self._recorded and end._recorded):
            raise self._backend._invalid_argument(
                "Event.elapsed_ms(end)", "two events that have both been recorded", end
            )
        return self._backend._raw.event_elapsed_ms(raw, raw_end)

    def close(self) -> None:
        """Destroy the event."""
        super().close()


class HostBuffer(_Handle):
    """Pinned (page-locked) host memory: fast, truly asynchronous copies.

    ``view()`` is a writable ``memoryview`` of its bytes; do not use a view
    after ``free``.
    """

    __slots__ = ("_view", "nbytes", "ptr")
    _what = "host buffer"

    def __init__(self, backend: GpuBackend, ptr: int, nbytes: int, view: memoryview) -> None:
        super().__init__(backend, ptr)
        self.ptr = ptr
        self.nbytes = nbytes
        self._view = view

    def view(self) -> memoryview:
        """A writable byte view of the buffer."""
        self._live()
        return self._view

    def close(self) -> None:
        """Free the buffer, as ``backend.free(host_buffer)`` does; idempotent."""
        if not self.closed:
            self._backend.free(self)

    def __buffer__(self, flags: int) -> memoryview:
        """The buffer protocol (Python 3.12+): ``memoryview(host_buffer)``, ``numpy.asarray`` etc."""
        return self.view()

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"HostBuffer(ptr={self.ptr:#x}, nbytes={self.nbytes})"


class Graph(_Handle):
    """Work recorded by a stream capture; instantiate it to run it."""

    __slots__ = ("_buffers", "_host_buffers", "_registries")
    _what = "graph"
    _destroy_op = "graph_destroy"

    def __init__(self, backend: GpuBackend, raw: object, capture: Capture) -> None:
        super().__init__(backend, raw)
        self._buffers = tuple(capture.buffers.values())
        self._host_buffers = tuple(capture.host_buffers.values())
        self._registries = tuple(capture.registries.values())

    def instantiate(self) -> GraphExec:
        """An executable graph that replays the recorded work."""
        raw = self._live()
        exec_raw = self._backend._raw.graph_instantiate(raw)
        return self._backend._adopt(
            GraphExec(self._backend, exec_raw, self._buffers, self._host_buffers, self._registries)
        )

    @property
    def buffers(self) -> tuple[DeviceBuffer, ...]:
        """The device buffers the recorded work touches."""
        return self._buffers

    def close(self) -> None:
        """Release the graph (executable graphs made from it stay usable)."""
        super().close()


class GraphExec(_Handle):
    """An instantiated graph: ``launch`` replays its work on a stream."""

    __slots__ = ("_buffers", "_host_buffers", "_registries")
    _what = "executable graph"
    _destroy_op = "graph_exec_destroy"

    def __init__(
        self,
        backend: GpuBackend,
        raw: object,
        buffers: tuple[DeviceBuffer, ...],
        host_buffers: tuple[HostBuffer, ...],
        registries: tuple[KernelRegistry, ...] = (),
    ) -> None:
        super().__init__(backend, raw)
        self._buffers = buffers
        self._host_buffers = host_buffers
        self._registries = registries  # held: the modules of its kernels stay loaded while it lives

    @property
    def buffers(self) -> tuple[DeviceBuffer, ...]:
        """The device buffers the graph's work touches."""
        return self._buffers

    def launch(self, stream: Stream | None = None) -> None:
        """Replay the graph on ``stream`` (the default stream when ``None``)."""
        raw = self._live()
        backend = self._backend
        for buf in self._buffers:
            if not backend._is_live(buf):
                raise InvalidBufferError(
                    f"GraphExec.launch: the graph recorded allocation #{buf.index} "
                    f"({buf.nbytes} bytes from {buf.site}), which is no longer live; its "
                    f"address may belong to another allocation now. Capture the graph again "
                    f"with live buffers"
                )
        for registry in self._registries:
            if registry.closed:
                raise MetraleError(
                    f"GraphExec.launch: the graph launches kernels of {registry!r}, whose modules "
                    f"were unloaded; keep the registry open while its graphs run, or capture again"
                )
        for hb in self._host_buffers:
            if hb.closed:
                raise InvalidBufferError(
                    f"GraphExec.launch: the graph recorded {hb!r}, which was freed; capture again"
                )
        backend._issue(stream, "GraphExec.launch", self._buffers, lambda s: backend._raw.graph_launch(raw, s))
        backend._after_graph_launch(stream)

    def close(self) -> None:
        """Release the executable graph."""
        super().close()
