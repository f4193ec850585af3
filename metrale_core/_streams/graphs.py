"""Captures and graph launches of one backend.

- `record`: what work issued into a capture touches (buffers, host buffers, other backends' buffers),
  kept on the capture, so its graph can check them live at every launch.
- `GraphFront`: begins and ends captures under the rules of ``_device.capture``; owns the graphs and
  executable graphs it hands out (through the stream front's handle table); launches graphs.
- A graph launch crosses the zone guard once: ``with guard.graph_launch(check, stream, is_live)``.
  The plain one (every operand live, no capture, no check after it) goes straight to the plugin, from the lane.
- ``GraphExec.launch`` reaches the front's `launch_graph`: its lane's ``launch`` (``graph_lane.py``, compiled where
  built), which passes the gate, finds the operands live, launches the plain case and hands the front every other
  launch (`launch_checked`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from typing import TypeVar, final

from .._device.buffer import DeviceBuffer
from .._device.capture import Capture, invalidated_error
from .._device.context import DeviceContext
from .._device.handles import Graph, GraphExec, HandleOwner, HostBuffer, Stream, _Handle
from .._device.stats import StatsCounter
from .._errors import BackendClosedError, InvalidBufferError, MetraleError, capture_error
from .._memory.holdings import Holdings
from .._redzones.guard import ZoneGuard
from .._twins import pick
from .graph_lane import GraphLane, GraphLaneParts

__all__ = ["GraphFront", "record"]

_log = logging.getLogger("metrale")

_H = TypeVar("_H", bound=_Handle)

#: A buffer of another backend, with its owner's liveness check.
Peer = tuple[DeviceBuffer, Callable[[DeviceBuffer], bool]]


def record(
    capture: Capture, what: str, buffers: Iterable[DeviceBuffer | None],
    host_buffers: Iterable[HostBuffer | None] = (), peers: Iterable[Peer] = (),
) -> None:
    """Keep on ``capture`` what work issued into it touches, and count it as one of its nodes (a kernel's own
    record names it after this, as node ``capture.nodes``); refused once the capture was invalidated."""
    if capture.invalidated:
        raise invalidated_error(capture, what)
    capture.nodes += 1
    for buf in buffers:
        if buf is not None:
            capture.buffers[buf.index] = buf
    for hb in host_buffers:
        if hb is not None:
            capture.host_buffers[id(hb)] = hb
    for buf, is_live in peers:  # (creation indexes are the process's: one key per buffer of any backend)
        capture.peers[buf.index] = (buf, is_live)


@final
class GraphFront:
    """Captures, graphs and graph launches of one backend (the ``HandleOwner`` of its graphs)."""

    __slots__ = (
        "_captures", "_default", "_guard", "_holdings", "_raw", "_scan_graphs", "_stats", "_streams", "ctx",
        "launch_graph",
    )

    def __init__(
        self, streams: HandleOwner, holdings: Holdings, stats: StatsCounter, guard: ZoneGuard, default: Stream
    ) -> None:
        self.ctx: DeviceContext = streams.ctx
        self._raw = self.ctx.raw
        self._streams = streams  # the stream front: streams, and the handle table graphs are kept in
        self._holdings = holdings
        self._stats = stats
        self._guard = guard
        self._scan_graphs = self.ctx.settings.redzone_scan_graphs  # (settings are fixed for the backend's life)
        self._default = default
        self._captures = itertools.count(1)  # each capture's number: its graph is ``graph #N`` in red-zone reports
        #: ``HandleOwner.launch_graph``: the whole of ``GraphExec.launch``, the gate included (its lane's).
        self.launch_graph: Callable[[GraphExec, Stream | None], None] = (
            pick("graph_lane", GraphLane, self.ctx.settings.pure)(self, self.lane_parts()).launch
        )

    def lane_parts(self) -> GraphLaneParts:
        """What its lane touches of the front's parts (`GraphLaneParts`)."""
        return GraphLaneParts(
            self.ctx, self._holdings.ledger, self._stats, self._guard, self._default, self._scan_graphs,
            self._holdings.is_live,
        )

    # -- HandleOwner: the stream front's, but graph launches come here ------------------------

    def resolve(self, stream: Stream | None, what: str) -> Stream:
        return self._streams.resolve(stream, what)

    def adopt(self, handle: _H) -> _H:
        return self._streams.adopt(handle)

    def release(self, handle: _Handle) -> None:
        self._streams.release(handle)

    def waited(self) -> None:
        self._streams.waited()

    def launch_checked(self, graph: GraphExec, stream: Stream | None, live: bool) -> None:
        """A graph's launch, inside the gate, that its lane does not do itself (``graph_lane.py``: the plain one):
        the zone guard's part, a capture's record; ``live``: whether the lane found every operand live (else the
        error names the one gone)."""
        if not live:
            self._check_operands(graph)
        target = self._streams.resolve(stream, "GraphExec.launch")
        is_live = self._holdings.is_live
        with self._guard.graph_launch(graph.check, target, is_live, graph.kernels):
            capture = target.capture
            if capture is not None:
                record(capture, "GraphExec.launch", graph.buffers, peers=graph.peers)
                inner = graph.kernels  # its kernels are the capture's too, inside the node it makes
                capture.kernels += [
                    (name, f"{where} of graph #{inner.number}, node {capture.nodes}", pointers)
                    for name, where, pointers in inner.nodes
                ]
            self._raw.graph_launch(graph.raw, target.raw)
            self._stats.graph_launches += 1

    def _check_operands(self, graph: GraphExec) -> None:
        """Refuse a launch whose graph uses a buffer, registry or host buffer that is gone."""
        is_live = self._holdings.is_live
        for buf in graph.buffers:
            if not is_live(buf):
                raise InvalidBufferError(
                    f"GraphExec.launch: the graph recorded allocation #{buf.index} "
                    f"({buf.nbytes} bytes from {buf.site}), which is no longer live; its "
                    f"address may belong to another allocation now. Capture the graph again "
                    f"with live buffers"
                )
        for buf, peer_is_live in graph.peers:
            if not peer_is_live(buf):
                raise InvalidBufferError(
                    f"GraphExec.launch: the graph copies from allocation #{buf.index} of another backend "
                    f"({buf.nbytes} bytes from {buf.site}), which is no longer live (freed, or its backend "
                    f"closed). Capture the graph again with live buffers"
                )
        for registry in graph.registries:
            if registry.closed:
                raise BackendClosedError(
                    f"GraphExec.launch: the graph launches kernels of {registry!r}, whose modules "
                    f"were unloaded; keep the registry open while its graphs run, or capture again"
                )
        for hb in graph.host_buffers:
            if hb.closed:
                raise InvalidBufferError(f"GraphExec.launch: the graph recorded {hb!r}, which was freed; capture again")

    # -- capture -----------------------------------------------------------------------------

    def begin_capture(self, stream: Stream | None) -> None:
        target = self._streams.resolve(stream, "begin_capture")
        if target.capture is not None:
            raise capture_error(
                "CUDA_ERROR_ILLEGAL_STATE", "begin_capture: this stream is already capturing; call end_capture first"
            )
        guard = self._guard
        guard.settle()  # no wait is allowed once a capture runs
        number = next(self._captures)
        check = guard.reserve_check(number)  # the red-zone check the graph will end with (allocations allowed now)
        capture = Capture(self.ctx)
        capture.check = check
        capture.number = number
        capture.start()  # on the record first: no barred call of another thread reaches the driver now
        try:
            self._raw.begin_capture(target.raw)
        except BaseException:
            capture.finish()
            if check is not None:
                guard.drop_check(check)
            raise
        target.capture = capture

    def end_capture(self, stream: Stream | None) -> Graph:
        target = self._streams.resolve(stream, "end_capture")
        capture = target.capture
        if capture is None:
            raise capture_error(
                "CUDA_ERROR_ILLEGAL_STATE", "end_capture: this stream is not capturing; call begin_capture first"
            )
        target.capture = None
        check = capture.check
        try:  # off the record only once the driver's capture has ended: until then barred calls stay refused
            if capture.invalidated:
                self._discard(target)
                raise invalidated_error(capture, "end_capture")
            if check is not None:
                try:
                    self._guard.seal_check(check, target)  # the graph's last node: its red-zone check
                except BaseException:
                    self._discard(target)
                    raise
            graph = self._raw.end_capture(target.raw)
        except BaseException:
            capture.check = None
            if check is not None:
                self._guard.drop_check(check)
            raise
        finally:
            capture.finish()
        handle = self._streams.adopt(Graph(self, graph, capture))
        if check is not None:
            check.kernels = handle.kernels  # what its verdict finds names them
        return handle

    def _discard(self, target: Stream) -> None:
        """End the driver's capture on ``target`` and destroy what it made."""
        try:
            graph = self._raw.end_capture(target.raw)
        except MetraleError:
            return
        try:
            self._raw.graph_destroy(graph)
        except MetraleError as exc:
            _log.debug("destroying a discarded capture's graph failed: %s", exc)

    def is_capturing(self, stream: Stream | None) -> bool:
        target = self._streams.resolve(stream, "stream_is_capturing")
        if self.ctx.settings.scale_variant:
            return target.capture is not None
        return self._raw.is_capturing(target.raw)

    def abort(self, streams: Iterable[Stream]) -> None:
        """At close, first: end every capture in progress on ``streams`` (discarding its work)."""
        for stream in streams:
            capture = stream.capture
            if capture is not None:
                _log.warning("close: aborting the capture in progress on %r", stream)
                stream.capture = None
                capture.check = None  # the guard releases every check at close
                try:
                    self._discard(stream)
                finally:
                    capture.finish()
