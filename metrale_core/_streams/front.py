"""The stream front: streams and events of one backend, and the work issued on them.

- It owns every stream (the default one too), event, graph and executable graph it hands out, in one
  handle table; released at ``close()``, dependents first.
- It issues memsets, copies and peer copies after their operands are checked live and in bounds
  (``Holdings``), recording what a capture touches (`.graphs.record`).
- Captures and graph launches are the graph front's (`.graphs.GraphFront`), made with the front.
- It decides for the raw layer when a wait is allowed: never while a capture runs anywhere in the process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TypeVar, final

from .._device.args import integer, invalid_argument, positive_size
from .._device.buffer import DeviceBuffer, PeerSource
from .._device.capture import active_captures, forbid_during_capture
from .._device.context import DeviceContext
from .._device.handles import Event, Graph, GraphExec, HostBuffer, Stream, _Handle
from .._device.stats import StatsCounter
from .._errors import BackendClosedError, InvalidArgumentError, InvalidBufferError
from .._memory.holdings import Holdings
from .._redzones.guard import ZoneGuard
from .._types import as_index
from .graphs import GraphFront, Peer, record

__all__ = ["StreamFront"]

_log = logging.getLogger("metrale")

_H = TypeVar("_H", bound=_Handle)


@final
class StreamFront:
    """Streams, events and the work on them, for one backend (the ``HandleOwner`` of streams and events)."""

    __slots__ = ("_execs", "_guard", "_handles", "_holdings", "_raw", "_stats", "ctx", "default", "graphs")

    def __init__(
        self, ctx: DeviceContext, holdings: Holdings, stats: StatsCounter, guard: Callable[[Stream], ZoneGuard],
    ) -> None:
        """``guard`` makes the zone guard on the default stream, which this front makes first: fills to settle,
        scans to run."""
        self.ctx = ctx
        self._raw = ctx.raw
        self._holdings = holdings
        self._stats = stats
        self._handles: dict[int, _Handle] = {}
        self._execs = 0  # how many of them are executable graphs (a free looks for its buffer in those)
        #: This backend's own non-blocking stream, used wherever ``stream=None``.
        self.default = Stream(self, self._raw.stream_create(), default=True)
        self._guard = guard(self.default)
        #: Captures and graph launches (the owner of graphs and executable graphs).
        self.graphs = GraphFront(self, holdings, stats, self._guard, self.default)

    @property
    def guard(self) -> ZoneGuard:
        return self._guard

    @property
    def holdings(self) -> Holdings:
        """What is live on this backend (for its lane: a buffer's liveness)."""
        return self._holdings

    # -- HandleOwner ------------------------------------------------------------------------

    def resolve(self, stream: Stream | None, what: str) -> Stream:
        if stream is None:
            return self.default
        if type(stream) is Stream and stream._ctx is self.ctx and not stream._closed and not self.ctx.closed:
            return stream  # the common case, without the calls of the checks below (a hot path)
        if not isinstance(stream, Stream) or stream._ctx is not self.ctx:
            raise invalid_argument(what, f"a Stream of this backend ({self.ctx.name}) or None", stream)
        stream._live()
        return stream

    def adopt(self, handle: _H) -> _H:
        with self.ctx.lock:
            if self.ctx.closed:  # close() has begun: it would never release this one
                self.ctx.quietly(f"destroy {type(handle).__name__}", getattr(self._raw, handle._destroy_op), handle.raw)
                raise self.ctx.closed_error()
            self._handles[id(handle)] = handle
            if isinstance(handle, GraphExec):
                self._execs += 1
                if self._execs == 1:  # a free now looks for its buffer in the executable graphs
                    self._holdings.releases.watch(self.warn_if_graphed, True)
        return handle

    def release(self, handle: _Handle) -> None:
        """A handle's ``close()``: forget it, destroy its raw object (after a fault, quietly)."""
        ctx = self.ctx
        try:
            ctx.enter(faulted_ok=True)
        except BackendClosedError:
            return  # the backend's close() released it
        try:
            if not handle._mark_closed():
                return
            with ctx.lock:
                if self._handles.pop(id(handle), None) is not None and isinstance(handle, GraphExec):
                    self._execs -= 1
                    if not self._execs:
                        self._holdings.releases.watch(self.warn_if_graphed, False)
            check = getattr(handle, "check", None)
            if check is not None:
                self._guard.drop_check(check)
            destroy = getattr(self._raw, handle._destroy_op)
            if ctx.fault is None:
                destroy(handle.raw)
            else:
                ctx.quietly("destroy after a device fault", destroy, handle.raw)
        finally:
            ctx.leave()

    def waited(self) -> None:
        self._guard.waited(self._holdings.is_live)

    def launch_graph(self, graph: GraphExec, stream: Stream | None) -> None:
        """(``HandleOwner``'s; graphs are owned by `graphs`, which their launches reach directly.)"""
        self.graphs.launch_graph(graph, stream)

    def warn_if_graphed(self, buf: DeviceBuffer) -> None:
        """An allocator release observer, switched on while executable graphs live: warn when some still use
        ``buf``."""
        if not self._execs:  # read without the lock: an executable graph made meanwhile cannot hold buf yet
            return
        with self.ctx.lock:
            users = [h for h in self._handles.values() if isinstance(h, GraphExec) and buf in h.buffers]
        if users:
            _log.warning(
                "free of allocation #%d (%d bytes from %s) while %d live executable graph(s) "
                "still use it; launching them now raises InvalidBufferError: close them or "
                "capture again",
                buf.index, buf.nbytes, buf.site, len(users),
            )

    # -- issuing work ------------------------------------------------------------------------

    def issue(
        self,
        target: Stream,
        what: str,
        buffers: Iterable[DeviceBuffer | None],
        work: Callable[[object], None],
        host_buffers: Iterable[HostBuffer | None] = (),
        peers: Iterable[Peer] = (),
    ) -> None:
        """Run ``work`` on ``target``'s raw stream, recording what it touches if the stream captures
        (``peers``: buffers of other backends it reads, each with its owner's liveness check)."""
        self._guard.settle_for(target)
        capture = target.capture
        if capture is not None:
            record(capture, what, buffers, host_buffers, peers)
        work(target.raw)

    def memset(self, dst: object, value: object, offset: object, nbytes: object, stream: Stream | None) -> None:
        """A memset its lane does not do itself (``lane.py``: the common case): checked in full, issued, recorded
        where the stream captures."""
        what = "memset"
        byte = as_index(value)
        if byte is None or not 0 <= byte <= 255:
            raise invalid_argument(what, "a byte value 0..255", value)
        asked = None if nbytes is None else positive_size(nbytes, what)
        ptr, n, buf = self._holdings.span(dst, offset, asked, what)
        target = self.resolve(stream, what)
        raw = self._raw
        self.issue(target, what, (buf,), lambda s: raw.memset(ptr, byte, n, s) if n else None)

    def copy_to_device(self, dst: object, src: object, offset: object, stream: Stream | None) -> None:
        what = "copy_to_device"
        view, hb = self._holdings.host_view(src, what, writable=False)
        ptr, n, buf = self._holdings.span(dst, offset, view.nbytes, what)
        target = self.resolve(stream, what)
        raw = self._raw
        self.issue(target, what, (buf,), lambda s: raw.copy_htod(ptr, view, s, pinned=hb is not None) if n else None,
                   (hb,))

    def copy_to_host(self, dst: object, src: object, offset: object, stream: Stream | None) -> None:
        what = "copy_to_host"
        view, hb = self._holdings.host_view(dst, what, writable=True)
        ptr, n, buf = self._holdings.span(src, offset, view.nbytes, what)
        target = self.resolve(stream, what)
        raw = self._raw
        pinned = hb is not None

        def copy(s: object) -> None:
            if not n:
                return
            if pinned or not active_captures():
                raw.copy_dtoh(view, ptr, s, pinned=pinned)
            else:  # the rule, decided here: no wait while any capture runs
                raw.copy_dtoh(view, ptr, s, pinned=False, may_wait=False)

        self.issue(target, what, (buf,), copy, (hb,))

    def copy_device(
        self, dst: object, src: object, nbytes: object, dst_offset: object, src_offset: object, stream: Stream | None
    ) -> None:
        what = "copy_device"
        count = None if nbytes is None else positive_size(nbytes, what)
        src_ptr, n, src_buf = self._holdings.span(src, src_offset, count, what)
        dst_ptr, n, dst_buf = self._holdings.span(dst, dst_offset, n, what)
        _refuse_overlap(what, dst_ptr, src_ptr, n)
        target = self.resolve(stream, what)
        raw = self._raw
        self.issue(target, what, (dst_buf, src_buf), lambda s: raw.copy_dtod(dst_ptr, src_ptr, n, s) if n else None)

    def copy_peer(
        self, dst: object, src: object, nbytes: object, dst_offset: object, src_offset: object, stream: Stream | None
    ) -> None:
        what = "copy_peer"
        if not isinstance(src, DeviceBuffer):
            raise invalid_argument(what, "a DeviceBuffer (of any backend of this process) as the source", src)
        if not isinstance(dst, DeviceBuffer):
            raise invalid_argument(what, "a DeviceBuffer of this backend as the destination", dst)
        count = None if nbytes is None else positive_size(nbytes, what)
        start = integer(src_offset, what, "src_offset")
        context = src._owner() if src._owner is not None else None
        table = getattr(context, "exports", None)
        if not isinstance(table, PeerSource):
            raise InvalidBufferError(
                f"{what}: the source, allocation #{src.index} ({src.nbytes} bytes from {src.site}), is not a live "
                f"buffer of an open backend (its backend was closed, or it was not made by one)"
            )
        with table.peer_source(src, start, count, what) as (src_ptr, asked, src_raw):  # the source stays open
            if type(src_raw) is not type(self.ctx.plugin):
                raise InvalidArgumentError(
                    f"{what}: the source belongs to backend {getattr(context, 'name', '?')!r} and the destination "
                    f"to {self.ctx.name!r}: a peer copy runs between backends of one plugin; copy through the "
                    f"host (copy_to_host, then copy_to_device)"
                )
            dst_ptr, n, dst_buf = self._holdings.span(dst, dst_offset, asked, what)
            own = context is self.ctx
            if own:
                _refuse_overlap(what, dst_ptr, src_ptr, n)
            target = self.resolve(stream, what)
            raw = self._raw
            self.issue(
                target, what, (dst_buf, src if own else None),
                lambda s: raw.copy_peer(dst_ptr, src_raw, src_ptr, n, s) if n else None,
                peers=() if own else ((src, table.peer_is_live),),
            )

    def enable_peer_access(self, context: DeviceContext) -> None:
        what = "enable_peer_access"
        if context.closed:
            raise context.closed_error()
        if type(context.plugin) is not type(self.ctx.plugin):
            raise InvalidArgumentError(
                f"{what}: backend {context.name!r} is another plugin's than {self.ctx.name!r}; peer access runs "
                f"between backends of one plugin"
            )
        self._raw.enable_peer_access(context.plugin)

    # -- streams, events, waits ----------------------------------------------------------------

    def create_stream(self) -> Stream:
        return self.adopt(Stream(self, self._raw.stream_create()))

    def create_event(self) -> Event:
        return self.adopt(Event(self, self._raw.event_create()))

    def synchronize(self) -> None:
        forbid_during_capture("synchronize()")
        self._guard.sync_device()
        self.waited()

    # -- capture (the graph front's) ------------------------------------------------------------

    def begin_capture(self, stream: Stream | None) -> None:
        self.graphs.begin_capture(stream)

    def end_capture(self, stream: Stream | None) -> Graph:
        return self.graphs.end_capture(stream)

    def is_capturing(self, stream: Stream | None) -> bool:
        return self.graphs.is_capturing(stream)

    # -- close --------------------------------------------------------------------------------

    def abort_captures(self) -> None:
        """At close, first: end every capture in progress (discarding its work)."""
        with self.ctx.lock:
            streams = [h for h in self._handles.values() if isinstance(h, Stream)]
        self.graphs.abort([*streams, self.default])

    def release_handles(self) -> None:
        """At close, first of the releases: destroy every handle given out, dependents first."""
        ctx = self.ctx
        with ctx.lock:
            handles = list(self._handles.values())
            self._handles.clear()
            self._execs = 0
            self._holdings.releases.watch(self.warn_if_graphed, False)
        for kind in (GraphExec, Graph, Event, Stream):
            for handle in handles:
                if isinstance(handle, kind) and handle._mark_closed():
                    ctx.quietly(f"destroy {kind.__name__}", getattr(self._raw, kind._destroy_op), handle.raw)

    def release_default(self) -> None:
        """At close, last: the default stream."""
        ctx = self.ctx
        self.default._mark_closed()
        ctx.quietly("destroy default stream", self._raw.stream_destroy, self.default.raw)


def _refuse_overlap(what: str, dst_ptr: int, src_ptr: int, n: int) -> None:
    """Refuse a device copy whose source and destination ranges overlap: CUDA leaves it undefined (an H100
    left wrong bytes), so every backend refuses it before anything is issued."""
    if n and dst_ptr < src_ptr + n and src_ptr < dst_ptr + n:
        raise InvalidArgumentError(
            f"{what}: the source [{src_ptr:#x}, {src_ptr + n:#x}) and the destination [{dst_ptr:#x}, "
            f"{dst_ptr + n:#x}) overlap by {min(dst_ptr, src_ptr) + n - max(dst_ptr, src_ptr)} bytes; CUDA leaves "
            f"an overlapping copy undefined. Copy through a temporary buffer"
        )
