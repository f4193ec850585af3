"""The work a CUDA device issues: copies, streams, events, captures, graphs, kernel modules and launches.

- `CuStream`, `CuGraph`, `CuGraphExec`, `CuFunction`: the handles, with the host objects their work still reads
  (and each handle as an int, ``raw``, for the compiled calls of ``_compiled``);
- `ArgSlots`: each kernel's argument slots, kept per thread, that a launch packs its arguments into;
- `CudaWork`: the primitives that issue work, one method per driver call; the base of
  [`CudaDevice`][metrale_cuda.CudaDevice], which adds the context, memory and interop.

**Host memory in flight.** An asynchronous copy reads or writes its host
buffer after the call returns. The buffer is kept alive on its stream until
the stream is known idle: at ``stream_synchronize``, a ``stream_query`` that
answers true, or ``synchronize``. Work issued while a capture is active is
also kept by the graph the capture makes (and its executable graphs, and
their launches), since a graph reads the host buffer again at each launch.
Whether the raw layer may wait is the core's decision, never this module's
(see [`CudaDevice.close`][metrale_cuda.CudaDevice.close]).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, cast

from metrale_core import InvalidArgumentError, LaunchArg, MetraleError, RawDevice, TensorMapEncoding, error_for_code
from metrale_core.plugin import CaptureMode

from . import _driver as _d
from ._driver import THREAD, bound, bound_checked, call, call1, call_ready, call_teardown, check, drv, foreign_error

__all__ = ["EVENT_ORDER_ONLY", "ArgSlots", "CuFunction", "CuGraph", "CuGraphExec", "CuStream", "CudaWork"]

_log = logging.getLogger("metrale.cuda")

#: ``CU_EVENT_DISABLE_TIMING``: the events that order foreign streams only order (cheaper to record).
EVENT_ORDER_ONLY: Final = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING if drv is not None else 0

#: The alignment of every argument buffer's start, and of a tensor map's slot in it (CUDA 13's ``CUtensorMap``
#: is declared 128-byte aligned: keep a descriptor's storage so).
_SLOT_BASE_ALIGN: Final = 128


class ArgSlots:
    """Where a kernel's arguments go for ``cuLaunchKernel``: one buffer with a slot per argument (8-byte
    aligned; a tensor map's 128-byte aligned) and the array of pointers to the slots, built once per kernel
    per thread and reused at every launch (the driver copies the arguments at the call, so the next launch
    may overwrite them)."""

    __slots__ = ("_span", "address", "offsets", "pointers", "sizes", "storage", "view")

    def __init__(self, sizes: tuple[int, ...]) -> None:
        offsets, end = [], 0
        for size in sizes:
            align = _SLOT_BASE_ALIGN if size >= 64 else 8
            end = -(-end // align) * align
            offsets.append(end)
            end += -(-size // 8) * 8
        self.sizes = sizes
        self.storage = ctypes.create_string_buffer(max(end, 8) + _SLOT_BASE_ALIGN)
        raw = ctypes.addressof(self.storage)
        skip = -raw % _SLOT_BASE_ALIGN  # the slots start 128-byte aligned
        self.offsets = tuple(skip + offset for offset in offsets)
        self._span = (skip, skip + end)
        self.view = memoryview(self.storage).cast("B")
        self.pointers = (ctypes.c_void_p * max(len(sizes), 1))(*(raw + offset for offset in self.offsets))
        self.address: int | None = ctypes.addressof(self.pointers) if sizes else None

    def fill(self, args: Sequence[LaunchArg]) -> bool:
        """Write ``args`` into their slots; ``False`` (nothing to trust) where their sizes differ."""
        if len(args) != len(self.sizes):
            return False
        view = self.view
        for arg, offset, size in zip(args, self.offsets, self.sizes, strict=True):
            data = arg.data
            if len(data) != size:
                return False
            view[offset : offset + size] = data
        return True

    def image(self) -> bytes:
        """The slots' bytes, from the first slot's start to the last one's end (padding included): what the
        compiled twin (``_cdriver.ArgSlots``) must write alike."""
        start, end = self._span
        return self.view[start:end].tobytes()


class _Packing(threading.local):
    """Per thread: the argument slots of each kernel it launched (by the function handle's identity;
    a slot's sizes are checked at every launch, so a handle whose identity was reused only costs a
    rebuild)."""

    def __init__(self) -> None:
        self.slots: dict[int, ArgSlots] = {}


_PACKING: Final = _Packing()

#: A ``CUtensorMap``'s size, and the most dimensions one has.
_TENSOR_MAP_BYTES: Final = 128
_TENSOR_MAP_RANK: Final = 5


def _tensor_map_bytes(tmap: Any) -> bytes:
    """The 128 bytes of a ``CUtensorMap``."""
    try:
        return ctypes.string_at(int(tmap.getPtr()), _TENSOR_MAP_BYTES)
    except Exception as exc:
        raise foreign_error(exc, "reading a CUtensorMap") from exc


class CuStream:
    """A ``CUstream`` and the host objects its issued work may still read or write.

    ``keep`` holds them in issue order; ``dropped`` counts those already let
    go, so a synchronization lets go of exactly what was issued before it.
    """

    __slots__ = ("dropped", "handle", "keep", "raw")

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.raw = 0 if handle is None else int(handle)  # the CUstream as an int, made once
        self.keep: list[object] = []
        self.dropped = 0

    def __repr__(self) -> str:
        return f"<cuda stream {self.handle!r}>"


class CuGraph:
    """A ``CUgraph`` and the host objects its nodes read or write."""

    __slots__ = ("handle", "keep")

    def __init__(self, handle: Any, keep: tuple[object, ...]) -> None:
        self.handle = handle
        self.keep = keep


class CuGraphExec:
    """A ``CUgraphExec`` and the host objects its nodes read or write."""

    __slots__ = ("handle", "keep", "raw")

    def __init__(self, handle: Any, keep: tuple[object, ...]) -> None:
        self.handle = handle
        self.keep = keep
        self.raw = int(handle)  # the CUgraphExec as an int, made once


class CuFunction:
    """A ``CUfunction`` (what ``module_function`` gives the core, and a launch takes back)."""

    __slots__ = ("handle", "raw")

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.raw = int(handle)  # the CUfunction as an int, made once

    def __repr__(self) -> str:
        return f"<cuda function {self.handle!r}>"


class CudaWork(RawDevice):
    """The primitives that issue work on one CUDA device, each a method over one driver call.

    The base of [`CudaDevice`][metrale_cuda.CudaDevice], which owns the context (``_key``, ``_bind``) and
    makes this state (``__init__``) with its own.
    """

    if TYPE_CHECKING:
        _key: int

        def _bind(self) -> None: ...

        def _bind_checked(self) -> None: ...

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: set[CuStream] = set()
        self._orphans = CuStream(None)  # host objects of destroyed streams, until synchronize()
        self._captures: dict[CuStream, list[object]] = {}
        #: A stream of this module's own that no work is issued to, only waits: each stream destroyed since it
        #: was made leaves its pending work here (an event recorded, waited for), so order_foreign_stream
        #: orders a foreign stream after the work of destroyed streams too. Made on the first destroy.
        self._graveyard: Any = None
        #: Other libraries' streams lent to the core (`foreign_stream`), by handle: never destroyed here.
        self._borrowed: dict[int, CuStream] = {}

    # -- host objects in flight -----------------------------------------------------

    def _hold(self, stream: CuStream, obj: object) -> None:
        """Keep ``obj`` alive until ``stream`` is known idle (and by any capture in progress)."""
        stream.keep.append(obj)  # atomic; a release only ever deletes from the front
        if self._captures:
            with self._lock:
                for held in self._captures.values():
                    held.append(obj)

    @staticmethod
    def _mark(stream: CuStream) -> int:
        """The position after the last host object issued to ``stream`` so far.

        Lock-free: ``dropped`` is read before ``len(keep)``, so a release that
        runs in between can only make the mark smaller (keep more), never larger.
        """
        return stream.dropped + len(stream.keep)

    def _release(self, stream: CuStream, mark: int) -> None:
        """Let go of the host objects issued to ``stream`` before ``mark``."""
        if mark <= stream.dropped:
            return
        with self._lock:
            n = mark - stream.dropped
            if n > 0:
                del stream.keep[:n]
                stream.dropped += n

    # -- copies ---------------------------------------------------------------------

    def memset(self, ptr: int, value: int, nbytes: int, stream: object) -> None:
        """``cuMemsetD8Async``. Bound as `bound` binds, written out: a hot path."""
        if THREAD.ctx != self._key:
            self._bind()
        try:
            (err,) = drv.cuMemsetD8Async(ptr, value, nbytes, stream.handle)  # type: ignore[attr-defined]
        except Exception as exc:
            raise foreign_error(exc, "cuMemsetD8Async") from exc
        if err:
            check(err, "cuMemsetD8Async")

    @bound
    def copy_htod(self, dst: int, src: memoryview, stream: object, *, pinned: bool) -> None:
        """``cuMemcpyHtoDAsync`` of all of ``src``; ``src`` stays alive until the stream is idle."""
        s = cast(CuStream, stream)
        call(drv.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync", dst, src, src.nbytes, s.handle)
        self._hold(s, src)

    @bound
    def copy_dtoh(self, dst: memoryview, src: int, stream: object, *, pinned: bool, may_wait: bool = True) -> None:
        """``cuMemcpyDtoHAsync`` filling all of ``dst``; ``dst`` stays alive until the stream is idle.

        Into pageable memory (``pinned`` false) the copy has completed on return: the driver
        does so for memory that really is pageable, and a ``cuStreamSynchronize`` makes it so
        for host memory that someone else page-locked (a pinned tensor passed as a plain
        buffer), where the core allows a wait (``may_wait``: no capture runs in the process;
        measured: the driver allows a pageable copy on another stream during a capture, a
        synchronize not).
        """
        if dst.readonly:
            raise InvalidArgumentError("copy_dtoh: the host destination is read-only")
        s = cast(CuStream, stream)
        call(drv.cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync", dst, src, dst.nbytes, s.handle)
        self._hold(s, dst)
        if not pinned and may_wait:
            self.stream_synchronize(s)

    @bound
    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: object) -> None:
        """``cuMemcpyDtoDAsync``."""
        call(drv.cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync", dst, src, nbytes, cast(CuStream, stream).handle)

    # -- streams and events ---------------------------------------------------------

    @bound_checked
    def stream_create(self) -> object:
        """``cuStreamCreate(CU_STREAM_NON_BLOCKING)``."""
        stream = CuStream(call1(drv.cuStreamCreate, "cuStreamCreate", _d.STREAM_NON_BLOCKING))
        with self._lock:
            self._streams.add(stream)
        return stream

    def foreign_stream(self, stream: int) -> object:
        """Another library's ``CUstream`` (DLPack's numbering: 1 ``CU_STREAM_LEGACY``, 2 ``CU_STREAM_PER_THREAD``,
        else its address) as a stream of this device, borrowed: never destroyed nor captured here, and not one of the
        streams `order_foreign_stream` orders others after (the core fills red zones on it, in its own order). One
        per handle, kept until close; its host objects in flight go at the next ``synchronize``."""
        with self._lock:
            s = self._borrowed.get(stream)
            if s is None:
                s = self._borrowed[stream] = CuStream(drv.CUstream(stream))
            return s

    def _bury(self, s: CuStream) -> None:
        """Before ``s`` is destroyed: the graveyard stream waits for the work ``s`` leaves pending (an event
        recorded on ``s``), so [`order_foreign_stream`][metrale_cuda.CudaDevice.order_foreign_stream] still orders
        foreign streams after it. No query and no wait (a capture may run elsewhere in the process); a capturing stream
        is left alone, and a failure only costs the ordering of what ``s`` left pending (logged)."""
        if s in self._captures:
            return
        event = None
        try:
            with self._lock:
                if self._graveyard is None:
                    self._bind_checked()  # a stream of the current context: make sure it is ours
                    self._graveyard = call1(drv.cuStreamCreate, "cuStreamCreate", _d.STREAM_NON_BLOCKING)
                graveyard = self._graveyard
            event = call1(drv.cuEventCreate, "cuEventCreate", EVENT_ORDER_ONLY)
            call(drv.cuEventRecord, "cuEventRecord", event, s.handle)
            call(drv.cuStreamWaitEvent, "cuStreamWaitEvent", graveyard, event, 0)
        except MetraleError as exc:
            _log.debug("destroy of %r: its pending work is not ordered before foreign streams: %s", s, exc)
        finally:
            if event is not None:
                try:
                    call_teardown(drv.cuEventDestroy, "cuEventDestroy", event)
                except MetraleError as exc:
                    _log.debug("destroy of %r: cuEventDestroy failed: %s", s, exc)

    @bound
    def stream_destroy(self, stream: object) -> None:
        """``cuStreamDestroy``; host objects still in flight wait for the next ``synchronize``, and the work
        still pending on it for foreign streams that
        [`order_foreign_stream`][metrale_cuda.CudaDevice.order_foreign_stream] orders later."""
        s = cast(CuStream, stream)
        self._bury(s)
        call_teardown(drv.cuStreamDestroy, "cuStreamDestroy", s.handle)
        with self._lock:
            self._streams.discard(s)
            self._captures.pop(s, None)
            self._orphans.keep.extend(s.keep)
            s.dropped += len(s.keep)
            s.keep.clear()

    @bound
    def stream_synchronize(self, stream: object) -> None:
        """``cuStreamSynchronize``."""
        s = cast(CuStream, stream)
        mark = self._mark(s)
        call(drv.cuStreamSynchronize, "cuStreamSynchronize", s.handle)
        self._release(s, mark)

    @bound
    def stream_query(self, stream: object) -> bool:
        """``cuStreamQuery``: ``False`` on ``CUDA_ERROR_NOT_READY``."""
        s = cast(CuStream, stream)
        if not s.keep:
            return call_ready(drv.cuStreamQuery, "cuStreamQuery", s.handle)
        mark = self._mark(s)
        if call_ready(drv.cuStreamQuery, "cuStreamQuery", s.handle):
            self._release(s, mark)
            return True
        return False

    @bound
    def stream_wait_event(self, stream: object, event: object) -> None:
        """``cuStreamWaitEvent(stream, event, 0)``."""
        call(drv.cuStreamWaitEvent, "cuStreamWaitEvent", cast(CuStream, stream).handle, event, 0)

    @bound_checked
    def event_create(self) -> object:
        """``cuEventCreate(CU_EVENT_DEFAULT)``: timing enabled."""
        return call1(drv.cuEventCreate, "cuEventCreate", _d.EVENT_DEFAULT)

    @bound
    def event_destroy(self, event: object) -> None:
        """``cuEventDestroy``."""
        call_teardown(drv.cuEventDestroy, "cuEventDestroy", event)

    @bound
    def event_record(self, event: object, stream: object) -> None:
        """``cuEventRecord``."""
        call(drv.cuEventRecord, "cuEventRecord", event, cast(CuStream, stream).handle)

    @bound
    def event_synchronize(self, event: object) -> None:
        """``cuEventSynchronize``."""
        call(drv.cuEventSynchronize, "cuEventSynchronize", event)

    @bound
    def event_query(self, event: object) -> bool:
        """``cuEventQuery``: ``False`` on ``CUDA_ERROR_NOT_READY``."""
        return call_ready(drv.cuEventQuery, "cuEventQuery", event)

    @bound
    def event_elapsed_ms(self, start: object, end: object) -> float:
        """``cuEventElapsedTime`` (``_v2`` where the bindings name it so)."""
        return float(call1(_d.EVENT_ELAPSED_TIME, "cuEventElapsedTime", start, end))

    @bound_checked
    def synchronize(self) -> None:
        """``cuCtxSynchronize``; lets go of every host object issued before it."""
        with self._lock:
            streams = (self._orphans, *self._streams, *self._borrowed.values())
        marks = [(s, self._mark(s)) for s in streams if s.keep]
        call(drv.cuCtxSynchronize, "cuCtxSynchronize")
        for s, mark in marks:
            self._release(s, mark)

    # -- capture and graphs ---------------------------------------------------------

    @bound
    def begin_capture(self, stream: object) -> None:
        """``cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL)``."""
        s = cast(CuStream, stream)
        call(drv.cuStreamBeginCapture, "cuStreamBeginCapture", s.handle, _d.CAPTURE_MODE_GLOBAL)
        with self._lock:
            self._captures[s] = []

    @bound
    def end_capture(self, stream: object) -> object:
        """``cuStreamEndCapture``: the graph, which keeps the host objects its copies touch."""
        s = cast(CuStream, stream)
        with self._lock:
            held = self._captures.pop(s, [])
        graph = call1(drv.cuStreamEndCapture, "cuStreamEndCapture", s.handle)
        return CuGraph(graph, tuple(held))

    @bound
    def is_capturing(self, stream: object) -> bool:
        """``cuStreamIsCapturing``: status other than ``NONE`` (active or invalidated)."""
        status = call1(drv.cuStreamIsCapturing, "cuStreamIsCapturing", cast(CuStream, stream).handle)
        return int(status) != 0  # CU_STREAM_CAPTURE_STATUS_NONE

    def exchange_capture_mode(self, mode: CaptureMode) -> CaptureMode:
        """``cuThreadExchangeStreamCaptureMode``: the calling thread's capture mode set, the one it had returned."""
        modes = _d.CAPTURE_MODES
        if mode not in modes:
            raise error_for_code("CUDA_ERROR_INVALID_VALUE", f"exchange_capture_mode({mode!r})")
        was = call1(drv.cuThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode", modes[mode])
        return next(name for name, value in modes.items() if int(value) == int(was))

    @bound
    def graph_instantiate(self, graph: object) -> object:
        """``cuGraphInstantiate(graph, 0)`` (``...WithFlags`` where the bindings offer it)."""
        g = cast(CuGraph, graph)
        return CuGraphExec(call1(_d.GRAPH_INSTANTIATE, "cuGraphInstantiate", g.handle, 0), g.keep)

    def graph_launch(self, graph_exec: object, stream: object) -> None:
        """``cuGraphLaunch``; the graph's host objects stay alive until the stream is idle. Bound as
        `bound` binds, written out: a hot path."""
        if THREAD.ctx != self._key:
            self._bind()
        e: CuGraphExec = graph_exec  # type: ignore[assignment]  # (no cast(): a call on a hot path)
        s: CuStream = stream  # type: ignore[assignment]
        try:
            (err,) = drv.cuGraphLaunch(e.handle, s.handle)
        except Exception as exc:
            raise foreign_error(exc, "cuGraphLaunch") from exc
        if err:
            check(err, "cuGraphLaunch")
        if e.keep:
            self._hold(s, e.keep)

    @bound
    def graph_destroy(self, graph: object) -> None:
        """``cuGraphDestroy``."""
        call_teardown(drv.cuGraphDestroy, "cuGraphDestroy", cast(CuGraph, graph).handle)

    @bound
    def graph_exec_destroy(self, graph_exec: object) -> None:
        """``cuGraphExecDestroy``."""
        call_teardown(drv.cuGraphExecDestroy, "cuGraphExecDestroy", cast(CuGraphExec, graph_exec).handle)

    # -- kernel modules and launches ------------------------------------------------

    @bound
    def tensor_map_encode(self, encoding: TensorMapEncoding, address: int) -> bytes:
        """``cuTensorMapEncodeTiled``; the descriptor's 128 bytes."""
        e = encoding
        what = "cuTensorMapEncodeTiled"
        if max(e.rank, len(e.global_dim), len(e.box_dim), len(e.element_strides)) > _TENSOR_MAP_RANK:
            # what the driver refuses, and the bindings cannot even pass (their arrays hold five)
            raise error_for_code("CUDA_ERROR_INVALID_VALUE", f"{what} of rank {e.rank}")
        # A rank-1 map has no global strides; the bindings pass an empty list as NULL, which the driver refuses
        # (seen on the H200): give it one stride it does not read.
        strides = e.global_strides if e.global_strides or e.rank != 1 else (0,)
        try:
            args = (
                drv.CUtensorMapDataType(e.data_type), e.rank, address,
                [drv.cuuint64_t(d) for d in e.global_dim], [drv.cuuint64_t(s) for s in strides],
                [drv.cuuint32_t(b) for b in e.box_dim], [drv.cuuint32_t(s) for s in e.element_strides],
                drv.CUtensorMapInterleave(e.interleave), drv.CUtensorMapSwizzle(e.swizzle),
                drv.CUtensorMapL2promotion(e.l2_promotion), drv.CUtensorMapFloatOOBfill(e.oob_fill),
            )
        except Exception as exc:
            raise foreign_error(exc, what) from exc
        tmap = call1(drv.cuTensorMapEncodeTiled, what, *args)
        return _tensor_map_bytes(tmap)

    @bound
    def tensor_map_replace_address(self, image: bytes, address: int) -> bytes:
        """``cuTensorMapReplaceAddress`` on a copy of ``image``."""
        what = "cuTensorMapReplaceAddress"
        try:
            tmap = drv.CUtensorMap()
            ctypes.memmove(int(tmap.getPtr()), bytes(image), _TENSOR_MAP_BYTES)
        except Exception as exc:
            raise foreign_error(exc, what) from exc
        call(drv.cuTensorMapReplaceAddress, what, tmap, address)
        return _tensor_map_bytes(tmap)

    @bound_checked
    def module_load(self, name: str, image: bytes) -> object:
        """``cuModuleLoadData`` of a PTX image (NUL-terminated here, as the driver wants text)."""
        text = image if image.endswith(b"\0") else image + b"\0"
        return call1(drv.cuModuleLoadData, f"cuModuleLoadData of module {name!r}", text)

    @bound
    def module_unload(self, module: object) -> None:
        """``cuModuleUnload``."""
        call_teardown(drv.cuModuleUnload, "cuModuleUnload", module)

    @bound
    def module_function(self, module: object, kernel: str) -> object:
        """``cuModuleGetFunction``: a `CuFunction`."""
        return CuFunction(call1(drv.cuModuleGetFunction, f"cuModuleGetFunction of {kernel!r}", module, kernel.encode()))

    def launch(
        self, function: object, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int,
        stream: object, args: Sequence[LaunchArg],
    ) -> None:
        """``cuLaunchKernel`` with each argument's packed bytes, written into the kernel's slots kept for
        this thread (`ArgSlots`; the driver copies them at the call). Bound as `bound`
        binds, written out: a hot path."""
        if THREAD.ctx != self._key:
            self._bind()
        cache = _PACKING.slots
        slots = cache.get(id(function))
        if slots is None or not slots.fill(args):
            slots = cache[id(function)] = ArgSlots(tuple(len(a.data) for a in args))
            slots.fill(args)
        try:
            (err,) = drv.cuLaunchKernel(
                function.handle,  # type: ignore[attr-defined]  # (no cast(): a call on a hot path)
                grid[0], grid[1], grid[2],
                block[0], block[1], block[2],
                shared_mem,
                stream.handle,  # type: ignore[attr-defined]  # (no cast(): a call on a hot path)
                slots.address,
                0,  # extra: void_ptr, NULL
            )
        except Exception as exc:
            raise foreign_error(exc, "cuLaunchKernel") from exc
        if err:
            check(err, "cuLaunchKernel")
