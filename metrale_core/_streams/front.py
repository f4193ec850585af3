"""The stream front: streams, events and graphs of one backend, and the work issued on them.

It owns every stream (the default one too), event, graph and executable graph it hands out
(released at ``close()``, dependents first), issues memsets, copies and graph launches after
their operands are checked live and in bounds (``Holdings``), records what a capture touches,
and begins and ends captures under the rules of ``_capture``. It decides for the raw layer when
a wait is allowed: never while a capture runs anywhere in the process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

from .._device.buffer import DeviceBuffer, PeerSource
from .._device.capture import Capture, active_captures, forbid_during_capture, invalidated_error
from .._device.context import DeviceContext, invalid_argument, raise_raw
from .._device.handles import Event, Graph, GraphExec, HostBuffer, Stream, _Handle
from .._device.stats import StatsCounter
from .._errors import BackendClosedError, InvalidArgumentError, InvalidBufferError, MetraleError, capture_error
from .._memory.holdings import Holdings, integer, positive_size
from .._redzones.guard import ZoneGuard
from .._types import as_index

__all__ = ["StreamFront"]

_log = logging.getLogger("metrale")

_H = TypeVar("_H", bound=_Handle)


class StreamFront:
    """Streams, events, graphs and the work on them, for one backend (the ``HandleOwner`` of those handles)."""

    __slots__ = ("_execs", "_guard", "_handles", "_holdings", "_raw", "_scan_graphs", "_stats", "ctx", "default")

    def __init__(self, ctx: DeviceContext, holdings: Holdings, stats: StatsCounter) -> None:
        self.ctx = ctx
        self._raw = ctx.raw
        self._holdings = holdings
        self._stats = stats
        self._handles: dict[int, _Handle] = {}
        self._execs = 0  # how many of them are executable graphs (a free looks for its buffer in those)
        self._scan_graphs = ctx.settings.redzone_scan_graphs  # (settings are fixed for the backend's life)
        #: This backend's own non-blocking stream, used wherever ``stream=None``.
        self.default = Stream(self, self._raw.stream_create(), default=True)
        self._guard: ZoneGuard  # set by attach(), before any use

    def attach(self, guard: ZoneGuard) -> None:
        """The zone guard (built on the default stream, so after this front): fills to settle, scans to run."""
        self._guard = guard

    @property
    def guard(self) -> ZoneGuard:
        return self._guard

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
            check = getattr(handle, "check", None)
            if check is not None:
                self.guard.drop_check(check)
            destroy = getattr(self._raw, handle._destroy_op)
            if ctx.fault is None:
                destroy(handle.raw)
            else:
                ctx.quietly("destroy after a device fault", destroy, handle.raw)
        finally:
            ctx.leave()

    def waited(self) -> None:
        self.guard.waited(self._holdings.is_live)

    def launch_graph(self, graph: GraphExec, stream: Stream | None) -> None:
        holdings = self._holdings
        is_live = holdings.is_live
        plain = graph.check is None and not graph.peers
        for registry in graph.registries:  # (loops, not any() over a generator: both are short)
            if registry.unloaded:
                plain = False
        for hb in graph.host_buffers:
            if hb.closed:
                plain = False
        if plain:
            ledger = holdings.ledger
            taken = ledger.taken  # read first: a record that comes off during the check shows at the next launch
            if graph.live_at != taken:  # records came off since its buffers were last found live: look again
                live = ledger.holds_all(graph.buffers, self.ctx.ref)
                if live:
                    graph.live_at = taken
                else:  # None: arena or external memory among them, each by its own rule
                    plain = live is None and all(is_live(buf) for buf in graph.buffers)
        if plain:
            target = self.resolve(stream, "GraphExec.launch")
            plain = target.capture is None
        if plain:  # the common case written out (a hot path): every operand live, no check, no capture
            guard = self._guard
            if guard.fills:
                guard.settle_for(target)
            ctx = self.ctx
            try:
                ctx.plugin.graph_launch(graph.raw, target.raw)
            except Exception as exc:
                raise_raw(ctx, ctx.name, "graph_launch", exc)
            self._stats.graph_launches += 1
            if self._scan_graphs:
                guard.after_graph_launch(target, is_live)
            return
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
                raise MetraleError(
                    f"GraphExec.launch: the graph launches kernels of {registry!r}, whose modules "
                    f"were unloaded; keep the registry open while its graphs run, or capture again"
                )
        for hb in graph.host_buffers:
            if hb.closed:
                raise InvalidBufferError(f"GraphExec.launch: the graph recorded {hb!r}, which was freed; capture again")
        target = self.resolve(stream, "GraphExec.launch")
        raw = graph.raw
        guard, check = self.guard, graph.check
        if check is None:
            self.issue(target, "GraphExec.launch", graph.buffers, lambda s: self._raw.graph_launch(raw, s),
                       peers=graph.peers)
        else:
            with guard.lock:  # the zone table stays as the graph's check reads it until the launch is issued
                guard.before_graph_launch(check, target)
                self.issue(target, "GraphExec.launch", graph.buffers, lambda s: self._raw.graph_launch(raw, s),
                           peers=graph.peers)
        self._stats.graph_launches += 1
        guard.after_graph_launch(target, is_live, check)

    def warn_if_graphed(self, buf: DeviceBuffer) -> None:
        """An allocator release observer: warn when live executable graphs still use ``buf``."""
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
        peers: Iterable[tuple[DeviceBuffer, Callable[[DeviceBuffer], bool]]] = (),
    ) -> None:
        """Run ``work`` on ``target``'s raw stream, recording what it touches if the stream captures
        (``peers``: buffers of other backends it reads, each with its owner's liveness check)."""
        self.guard.settle_for(target)
        capture = target.capture
        if capture is not None:
            if capture.invalidated:
                raise invalidated_error(capture, what)
            for buf in buffers:
                if buf is not None:
                    capture.buffers[buf.index] = buf
            for hb in host_buffers:
                if hb is not None:
                    capture.host_buffers[id(hb)] = hb
            for buf, is_live in peers:  # (creation indexes are the process's: one key per buffer of any backend)
                capture.peers[buf.index] = (buf, is_live)
        work(target.raw)

    def memset(self, dst: object, value: object, offset: object, nbytes: object, stream: Stream | None) -> None:
        what = "memset"
        if (  # the common case written out (a hot path): a live buffer of this backend, plain ints, no capture
            type(dst) is DeviceBuffer and type(value) is int and 0 <= value <= 255 and type(offset) is int
            and (nbytes is None or type(nbytes) is int)
            and ((dst._owner is self.ctx.ref and self._holdings.ledger.has(dst)) or self._holdings.is_live(dst))
        ):
            size = dst.nbytes
            count = size - offset if nbytes is None else nbytes
            if (
                offset >= 0 and count > 0 and offset + count <= size
                and (target := self.default if stream is None else self.resolve(stream, what)).capture is None
            ):
                guard = self._guard
                if guard.fills:
                    guard.settle_for(target)
                ctx = self.ctx
                try:
                    ctx.plugin.memset(dst.ptr + offset, value, count, target.raw)
                except Exception as exc:
                    raise_raw(ctx, ctx.name, "memset", exc)
                return
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
            target = self.resolve(stream, what)
            raw = self._raw
            own = context is self.ctx
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
        self.guard.sync_device()
        self.waited()

    # -- capture -----------------------------------------------------------------------------

    def begin_capture(self, stream: Stream | None) -> None:
        target = self.resolve(stream, "begin_capture")
        if target.capture is not None:
            raise capture_error(
                "CUDA_ERROR_ILLEGAL_STATE", "begin_capture: this stream is already capturing; call end_capture first"
            )
        self.guard.settle()  # no wait is allowed once a capture runs
        check = self.guard.reserve_check()  # the red-zone check the graph will end with (allocations allowed now)
        capture = Capture(self.ctx)
        capture.check = check
        capture.start()  # on the record first: no barred call of another thread reaches the driver now
        try:
            self._raw.begin_capture(target.raw)
        except BaseException:
            capture.finish()
            if check is not None:
                self.guard.drop_check(check)
            raise
        target.capture = capture

    def end_capture(self, stream: Stream | None) -> Graph:
        target = self.resolve(stream, "end_capture")
        capture = target.capture
        if capture is None:
            raise capture_error(
                "CUDA_ERROR_ILLEGAL_STATE", "end_capture: this stream is not capturing; call begin_capture first"
            )
        target.capture = None
        check = capture.check
        try:  # off the record only once the driver's capture has ended: until then barred calls stay refused
            if capture.invalidated:
                self._discard_raw_capture(target)
                raise invalidated_error(capture, "end_capture")
            if check is not None:
                try:
                    self.guard.seal_check(check, target)  # the graph's last node: its red-zone check
                except BaseException:
                    self._discard_raw_capture(target)
                    raise
            graph = self._raw.end_capture(target.raw)
        except BaseException:
            capture.check = None
            if check is not None:
                self.guard.drop_check(check)
            raise
        finally:
            capture.finish()
        return self.adopt(Graph(self, graph, capture))

    def _discard_raw_capture(self, target: Stream) -> None:
        try:
            graph = self._raw.end_capture(target.raw)
        except MetraleError:
            return
        try:
            self._raw.graph_destroy(graph)
        except MetraleError as exc:
            _log.debug("destroying a discarded capture's graph failed: %s", exc)

    def is_capturing(self, stream: Stream | None) -> bool:
        target = self.resolve(stream, "stream_is_capturing")
        if self.ctx.settings.scale_variant:
            return target.capture is not None
        return self._raw.is_capturing(target.raw)

    # -- close --------------------------------------------------------------------------------

    def abort_captures(self) -> None:
        """At close, first: end every capture in progress (discarding its work)."""
        with self.ctx.lock:
            streams = [h for h in self._handles.values() if isinstance(h, Stream)]
        for stream in [*streams, self.default]:
            capture = stream.capture
            if capture is not None:
                _log.warning("close: aborting the capture in progress on %r", stream)
                stream.capture = None
                capture.check = None  # the guard releases every check at close
                try:
                    self._discard_raw_capture(stream)
                finally:
                    capture.finish()

    def release_handles(self) -> None:
        """At close, first of the releases: destroy every handle given out, dependents first."""
        ctx = self.ctx
        with ctx.lock:
            handles = list(self._handles.values())
            self._handles.clear()
            self._execs = 0
        for kind in (GraphExec, Graph, Event, Stream):
            for handle in handles:
                if isinstance(handle, kind) and handle._mark_closed():
                    ctx.quietly(f"destroy {kind.__name__}", getattr(self._raw, kind._destroy_op), handle.raw)

    def release_default(self) -> None:
        """At close, last: the default stream."""
        ctx = self.ctx
        self.default._mark_closed()
        ctx.quietly("destroy default stream", self._raw.stream_destroy, self.default.raw)
