"""The CUDA raw layer: [`CudaDevice`][metrale_cuda.CudaDevice], one device's primitives over ``cuda.bindings.driver``.

Handles it gives out: streams, graphs and executable graphs are small
wrappers of the bindings' objects (they carry the host objects a copy or a
graph still reads, see below); events are the bindings' ``CUevent``.

**Contexts.** A device works in its ordinal's primary context
(``cuDevicePrimaryCtxRetain``), shared with the CUDA runtime (CuPy, PyTorch)
of the same process. Each method makes it current on the calling thread where
this module did not already, in one place, the decorator it carries:
`_bound` checks a thread-local that records the context this module
last made current on each thread, so a call on the hot path costs one
comparison, not a driver call. Calls that create or size something in "the
current context" (allocations, streams, events, ``synchronize``,
``mem_get_info``) carry `_bound_checked` instead, which also asks
``cuCtxGetCurrent``, so code outside metrale that switched the context on
this thread cannot make them land on another device.

**Host memory in flight.** An asynchronous copy reads or writes its host
buffer after the call returns. The buffer is kept alive on its stream until
the stream is known idle: at ``stream_synchronize``, a ``stream_query`` that
answers true, or ``synchronize``. Work issued while a capture is active is
also kept by the graph the capture makes (and its executable graphs, and
their launches), since a graph reads the host buffer again at each launch.
Whether the raw layer may wait is the core's decision, never this module's:
the core synchronizes before it closes a device whenever no capture runs in
the process, so a device closed with host objects still held is one the core
could not wait for; it hands them to a module-level list kept for the rest of
the process (see [`CudaDevice.close`][metrale_cuda.CudaDevice.close]) rather than let the device read
freed memory.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, Final, ParamSpec, TypeVar, cast

from metrale_core import (
    AllocKind,
    BackendUnavailableError,
    Baseline,
    DeviceFaultError,
    DriverError,
    ForeignMemory,
    InvalidArgumentError,
    LaunchArg,
    MetraleError,
    RawDevice,
    TensorMapEncoding,
    error_for_code,
)

from . import _driver as _d
from ._baseline import DriverBaseline
from ._driver import (
    call,
    call1,
    call_ready,
    call_sized,
    call_teardown,
    check,
    drv,
    foreign_error,
    invoke,
    teardown_failed,
)

__all__ = ["CudaDevice"]

_log = logging.getLogger("metrale.cuda")

_NAME_LENGTH: Final = 256
_CLOSED_KEY: Final = -1  # never a context handle: a closed device always takes the slow path
#: ``CU_EVENT_DISABLE_TIMING``: the events that order foreign streams only order (cheaper to record).
_EVENT_ORDER_ONLY: Final = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING if drv is not None else 0


class _ThreadState(threading.local):
    """Per thread: the context handle (as an int) this module last made current."""

    ctx: int = 0


_THREAD: Final = _ThreadState()


#: The alignment of every argument buffer's start, and of a tensor map's slot in it (CUDA 13's ``CUtensorMap``
#: is declared 128-byte aligned: keep a descriptor's storage so).
_SLOT_BASE_ALIGN: Final = 128


class _ArgSlots:
    """Where a kernel's arguments go for ``cuLaunchKernel``: one buffer with a slot per argument (8-byte
    aligned; a tensor map's 128-byte aligned) and the array of pointers to the slots, built once per kernel
    per thread and reused at every launch (the driver copies the arguments at the call, so the next launch
    may overwrite them)."""

    __slots__ = ("address", "offsets", "pointers", "sizes", "storage", "view")

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


class _Packing(threading.local):
    """Per thread: the argument slots of each kernel it launched (by the function handle's identity;
    a slot's sizes are checked at every launch, so a handle whose identity was reused only costs a
    rebuild)."""

    def __init__(self) -> None:
        self.slots: dict[int, _ArgSlots] = {}


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

#: Host objects that a device closed while they were still held (the core could
#: not wait for it: a capture was running in the process), kept for the rest of
#: the process so that work still queued never reads or writes freed memory. A
#: leak bounded by use: only what was in flight at such a close, and only then.
_KEPT_AFTER_CLOSE: Final[list[object]] = []

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _bound(method: Callable[Concatenate[CudaDevice, _P], _R]) -> Callable[Concatenate[CudaDevice, _P], _R]:
    """Make the device's context current on the calling thread first, where this module did not already.

    The hot path: one comparison of the thread-local against the device's key
    (a closed device's key never matches, so it always takes the slow path,
    which raises).
    """

    @functools.wraps(method)
    def bound(self: CudaDevice, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if _THREAD.ctx != self._key:
            self._bind()
        return method(self, *args, **kwargs)

    return bound


def _bound_checked(method: Callable[Concatenate[CudaDevice, _P], _R]) -> Callable[Concatenate[CudaDevice, _P], _R]:
    """Make the device's context current first, asking the driver (``cuCtxGetCurrent``) what is current now.

    For the calls that create or size something in "the current context".
    """

    @functools.wraps(method)
    def bound_checked(self: CudaDevice, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self._bind_checked()
        return method(self, *args, **kwargs)

    return bound_checked


class _Stream:
    """A ``CUstream`` and the host objects its issued work may still read or write.

    ``keep`` holds them in issue order; ``dropped`` counts those already let
    go, so a synchronization lets go of exactly what was issued before it.
    """

    __slots__ = ("dropped", "handle", "keep")

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.keep: list[object] = []
        self.dropped = 0

    def __repr__(self) -> str:
        return f"<cuda stream {self.handle!r}>"


class _Graph:
    """A ``CUgraph`` and the host objects its nodes read or write."""

    __slots__ = ("handle", "keep")

    def __init__(self, handle: Any, keep: tuple[object, ...]) -> None:
        self.handle = handle
        self.keep = keep


class _GraphExec:
    """A ``CUgraphExec`` and the host objects its nodes read or write."""

    __slots__ = ("handle", "keep")

    def __init__(self, handle: Any, keep: tuple[object, ...]) -> None:
        self.handle = handle
        self.keep = keep


class CudaDevice(RawDevice):
    """One CUDA device's raw primitives, in its primary context.

    Build one with [`open`][metrale_cuda.CudaDevice.open]. Several may be open at once, on several
    ordinals or on one (they then share the primary context, each holding a
    reference to it). Every method may be called from any thread and raises
    only [`MetraleError`][metrale_core.MetraleError].
    """

    def __init__(self, ordinal: int, device: Any, context: Any) -> None:
        """Adopt a retained primary context; use [`open`][metrale_cuda.CudaDevice.open] rather than this."""
        self._ordinal = ordinal
        self._device = device
        self._ctx = context
        self._key = int(context)
        self._closed = False
        self._lock = threading.Lock()
        self._streams: set[_Stream] = set()
        self._orphans = _Stream(None)  # host objects of destroyed streams, until synchronize()
        self._captures: dict[_Stream, list[object]] = {}
        #: A stream of this module's own that no work is issued to, only waits: each stream destroyed since it
        #: was made leaves its pending work here (an event recorded, waited for), so order_foreign_stream
        #: orders a foreign stream after the work of destroyed streams too. Made on the first destroy.
        self._graveyard: Any = None
        self._name: str | None = None
        self._uuid: str | None = None
        self._integrated: bool | None = None

    @classmethod
    def open(cls, ordinal: int) -> CudaDevice:
        """Retain ``ordinal``'s primary context and make it current on this thread.

        Raises [`BackendUnavailableError`][metrale_core.BackendUnavailableError] naming the
        ordinal and the reason when the device cannot be opened.
        """
        try:
            count = _d.init_driver()
        except BackendUnavailableError as exc:
            raise BackendUnavailableError(
                f"CUDA device {ordinal} could not be opened: {exc.args[0]}", code=exc.code, name=exc.name
            ) from exc
        _d.warn_if_driver_older_than_bindings()
        if not 0 <= ordinal < count:
            raise BackendUnavailableError(
                f"CUDA device {ordinal} does not exist: the driver reports {count} device(s), "
                f"ordinals 0..{count - 1} (see nvidia-smi and CUDA_VISIBLE_DEVICES)",
                code=101, name="CUDA_ERROR_INVALID_DEVICE",
            )
        try:
            device = call1(drv.cuDeviceGet, "cuDeviceGet", ordinal)
            context = call1(drv.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", device)
        except MetraleError as exc:
            advice = (
                "; an earlier fault in this process left the device's primary context unusable, and the "
                "context is shared by everything in the process (metrale's backends, PyTorch, CuPy): open the "
                "backend in a new process, and run code that faults on purpose in a subprocess"
                if isinstance(exc, DeviceFaultError) else ""
            )
            raise BackendUnavailableError(
                f"CUDA device {ordinal} could not be opened: {exc.args[0]}{advice}", code=exc.code, name=exc.name
            ) from exc
        opened = cls(ordinal, device, context)
        try:
            opened._bind()
        except MetraleError as exc:
            opened.close()
            reason = exc.args[0]
            raise BackendUnavailableError(
                f"CUDA device {ordinal} could not be made current: {reason}", code=exc.code, name=exc.name
            ) from exc
        _log.debug("opened CUDA device %d (context %#x)", ordinal, opened._key)
        return opened

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"context {self._key:#x}"
        return f"<CudaDevice {self._ordinal} ({state})>"

    # -- the context ----------------------------------------------------------

    def _bind(self) -> None:
        """Make the context current on this thread (the slow path of every method)."""
        if self._closed:
            raise DriverError(f"CUDA device {self._ordinal} is closed")
        call(drv.cuCtxSetCurrent, "cuCtxSetCurrent", self._ctx)
        _THREAD.ctx = self._key

    def _bind_checked(self) -> None:
        """Make the context current, asking the driver what is current now."""
        if self._closed:
            raise DriverError(f"CUDA device {self._ordinal} is closed")
        current = call1(drv.cuCtxGetCurrent, "cuCtxGetCurrent")
        if int(current) != self._key:
            call(drv.cuCtxSetCurrent, "cuCtxSetCurrent", self._ctx)
        _THREAD.ctx = self._key

    def bind_to_thread(self) -> None:
        """Make this device's context current on the calling thread."""
        self._bind()

    # -- host objects in flight -------------------------------------------------

    def _hold(self, stream: _Stream, obj: object) -> None:
        """Keep ``obj`` alive until ``stream`` is known idle (and by any capture in progress)."""
        stream.keep.append(obj)  # atomic; a release only ever deletes from the front
        if self._captures:
            with self._lock:
                for held in self._captures.values():
                    held.append(obj)

    @staticmethod
    def _mark(stream: _Stream) -> int:
        """The position after the last host object issued to ``stream`` so far.

        Lock-free: ``dropped`` is read before ``len(keep)``, so a release that
        runs in between can only make the mark smaller (keep more), never larger.
        """
        return stream.dropped + len(stream.keep)

    def _release(self, stream: _Stream, mark: int) -> None:
        """Let go of the host objects issued to ``stream`` before ``mark``."""
        if mark <= stream.dropped:
            return
        with self._lock:
            n = mark - stream.dropped
            if n > 0:
                del stream.keep[:n]
                stream.dropped += n

    # -- the device -----------------------------------------------------------

    def device_name(self) -> str:
        """The driver's name for the device, e.g. ``"NVIDIA H200"``."""
        if self._name is None:
            raw = call1(drv.cuDeviceGetName, "cuDeviceGetName", _NAME_LENGTH, self._device)
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            self._name = text.split("\x00", 1)[0].strip()
        return self._name

    @_bound_checked
    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes, from ``cuMemGetInfo``."""
        err, free, total = invoke(drv.cuMemGetInfo, "cuMemGetInfo")
        check(err, "cuMemGetInfo")
        return int(free), int(total)

    def is_integrated(self) -> bool | None:
        """``CU_DEVICE_ATTRIBUTE_INTEGRATED``; ``None`` if the query failed."""
        if self._integrated is None:
            try:
                value = call1(drv.cuDeviceGetAttribute, "cuDeviceGetAttribute", _d.ATTRIBUTE_INTEGRATED, self._device)
            except Exception as exc:
                _log.debug("the integrated-device query failed: %s", exc)
                return None
            self._integrated = bool(value)
        return self._integrated

    # -- interop ----------------------------------------------------------------------

    def export_memory(self, ptr: int, nbytes: int) -> ForeignMemory:
        """Device memory of this device: the pointer is what other libraries use."""
        return ForeignMemory("cuda", self._ordinal, ptr, nbytes)

    @_bound_checked
    def import_memory(self, memory: ForeignMemory) -> int:
        """A device pointer of another library, checked to be memory of this device (``cuPointerGetAttribute``)."""
        if memory.device != "cuda":
            raise error_for_code(
                "CUDA_ERROR_INVALID_DEVICE",
                f"import of {memory.nbytes} bytes of {memory.device} memory: the CUDA backend addresses device "
                f"memory only; copy host memory in with copy_to_device",
            )
        ordinal = call1(
            drv.cuPointerGetAttribute, f"cuPointerGetAttribute of {memory.address:#x}",
            _d.POINTER_DEVICE_ORDINAL, memory.address,
        )
        if int(ordinal) != self._ordinal:
            raise error_for_code(
                "CUDA_ERROR_INVALID_DEVICE",
                f"import of memory at {memory.address:#x}: it is on CUDA device {int(ordinal)}, this backend "
                f"drives device {self._ordinal}",
            )
        return memory.address

    def forget_memory(self, ptr: int) -> None:
        """Nothing to undo: the pointer was the other library's all along."""

    @_bound_checked
    def order_foreign_stream(self, stream: int) -> None:
        """``cuStreamWaitEvent(stream, event, 0)`` after ``cuEventRecord(event, s)``, for each stream ``s`` of
        this device (and the stream that holds the pending work of destroyed ones): later work on the
        consumer's ``stream`` (1: the legacy default stream, 2: the per-thread one, else a ``CUstream``'s
        address) runs after everything issued here so far; the host waits for nothing. One event, made for
        the call (``CU_EVENT_DISABLE_TIMING``) and recorded once per stream: a wait takes the record
        just before it, and the driver keeps a destroyed event until the work it marks is done."""
        foreign = drv.CUstream(stream)
        with self._lock:
            handles = [s.handle for s in self._streams]
            if self._graveyard is not None:
                handles.append(self._graveyard)
        what = f"cuStreamWaitEvent of the consumer's stream {stream:#x}"
        event = call1(drv.cuEventCreate, "cuEventCreate", _EVENT_ORDER_ONLY)
        try:
            for handle in handles:
                call(drv.cuEventRecord, "cuEventRecord", event, handle)
                call(drv.cuStreamWaitEvent, what, foreign, event, 0)
        finally:
            call_teardown(drv.cuEventDestroy, "cuEventDestroy", event)

    def _bury(self, s: _Stream) -> None:
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
            event = call1(drv.cuEventCreate, "cuEventCreate", _EVENT_ORDER_ONLY)
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

    @_bound_checked
    def address_range(self, ptr: int) -> tuple[int, int]:
        """``cuMemGetAddressRange``: the base and size of the allocation holding ``ptr``."""
        what = f"cuMemGetAddressRange of {ptr:#x}"
        err, base, size = invoke(drv.cuMemGetAddressRange, what, ptr)
        check(err, what)
        return int(base), int(size)

    @_bound_checked
    def baseline(self) -> Baseline:
        """The driver API called directly (``cuda.bindings``), for ``metrale bench``; in this device's context."""
        return DriverBaseline()

    def close(self) -> None:
        """Release the primary context; never raises, idempotent; never waits.

        Destroys nothing the core owns: the core has destroyed its streams,
        events and graphs and freed its memory before it calls this, and has
        waited for the device ([`synchronize`][metrale_cuda.CudaDevice.synchronize], which lets go of every
        host object in flight) whenever waiting was allowed. Host objects
        still held here mean it was not (a capture was running in the
        process): they are kept for the rest of the process, logged at DEBUG,
        rather than let queued work read or write freed memory.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            held = [*self._orphans.keep, *(obj for s in self._streams for obj in s.keep)]
            self._orphans.keep.clear()
            for stream in self._streams:
                stream.keep.clear()
            self._streams.clear()
            self._captures.clear()
            graveyard, self._graveyard = self._graveyard, None
        if graveyard is not None:  # (it holds only waits: destroying it never cuts work short)
            try:
                call_teardown(drv.cuStreamDestroy, "cuStreamDestroy", graveyard)
            except Exception as exc:
                _log.debug("close of CUDA device %d: destroying its ordering stream failed: %s", self._ordinal, exc)
        key, self._key = self._key, _CLOSED_KEY
        if held:
            _KEPT_AFTER_CLOSE.extend(held)
            _log.debug(
                "close of CUDA device %d without a wait: %d host object(s) still in flight are kept for the rest "
                "of the process (%d in all)", self._ordinal, len(held), len(_KEPT_AFTER_CLOSE),
            )
        try:
            call_teardown(drv.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", self._device)
        except Exception as exc:
            _log.warning("close of CUDA device %d: primary context release failed: %s", self._ordinal, exc)
        if _THREAD.ctx == key:
            _THREAD.ctx = 0
        _log.debug("closed CUDA device %d", self._ordinal)

    # -- memory ---------------------------------------------------------------

    def alloc(self, nbytes: int, kind: AllocKind) -> int:
        """``cuMemAlloc`` (``"device"``, ``"arena"``) or ``cuMemAllocManaged`` (``"managed"``).

        Bound as `_bound_checked` binds (it creates in "the current context"), written out
        here because it is the hot path: one wrapper frame less."""
        try:  # _bind_checked's question, asked here: a frame less on the hot path
            err, current = drv.cuCtxGetCurrent()
        except Exception as exc:
            raise foreign_error(exc, "cuCtxGetCurrent") from exc
        if err or self._closed or int(current) != self._key:
            self._bind_checked()  # (which raises for a failure or a closed device)
        else:
            _THREAD.ctx = self._key
        if kind in {"device", "arena"}:
            try:
                err, ptr = drv.cuMemAlloc(nbytes)
            except Exception as exc:
                raise foreign_error(exc, f"cuMemAlloc of {nbytes} bytes") from exc
            if err:
                check(err, f"cuMemAlloc of {nbytes} bytes", requested=nbytes)
        elif kind == "managed":
            ptr = call_sized(drv.cuMemAllocManaged, "cuMemAllocManaged", nbytes, _d.MEM_ATTACH_GLOBAL)
        else:
            raise InvalidArgumentError(f"alloc: unknown allocation kind {kind!r}")
        return int(ptr)

    def free(self, ptr: int, kind: AllocKind) -> None:
        """``cuMemFree`` (every kind).

        Bound as `_bound` binds, not asking the driver: a free names its memory by address,
        which unified addressing maps to the allocation's own context whichever is current (a
        context switched by foreign code cannot make it land elsewhere)."""
        if _THREAD.ctx != self._key:
            self._bind()
        try:
            (err,) = drv.cuMemFree(ptr)
        except Exception as exc:
            raise foreign_error(exc, "cuMemFree") from exc
        if err:
            teardown_failed(err, "cuMemFree")

    @_bound_checked
    def alloc_host(self, nbytes: int) -> tuple[int, memoryview]:
        """``cuMemAllocHost``: the pinned memory's address and a writable ``'B'`` view of it."""
        raw = call1(drv.cuMemAllocHost, f"cuMemAllocHost of {nbytes} bytes", nbytes, requested=nbytes)
        ptr = int(raw)
        try:
            view = memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")
        except Exception as exc:
            call_teardown(drv.cuMemFreeHost, "cuMemFreeHost", ptr)
            raise InvalidArgumentError(f"alloc_host: cannot view {nbytes} bytes at {ptr:#x}: {exc}") from exc
        return ptr, view

    @_bound_checked
    def alloc_host_mapped(self, nbytes: int) -> tuple[int, memoryview, int]:
        """``cuMemHostAlloc`` with ``CU_MEMHOSTALLOC_DEVICEMAP``, and its ``cuMemHostGetDevicePointer``."""
        raw = call1(drv.cuMemHostAlloc, f"cuMemHostAlloc of {nbytes} bytes (mapped)", nbytes,
                    _d.MEMHOSTALLOC_DEVICEMAP, requested=nbytes)
        ptr = int(raw)
        try:
            device_ptr = int(call1(drv.cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer", ptr, 0))
            view = memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")
        except BaseException as exc:
            call_teardown(drv.cuMemFreeHost, "cuMemFreeHost", ptr)
            if isinstance(exc, MetraleError):
                raise
            raise InvalidArgumentError(f"alloc_host_mapped: cannot view {nbytes} bytes at {ptr:#x}: {exc}") from exc
        return ptr, view, device_ptr

    @_bound_checked
    def free_host(self, ptr: int) -> None:
        """``cuMemFreeHost``."""
        call_teardown(drv.cuMemFreeHost, "cuMemFreeHost", ptr)

    def memset(self, ptr: int, value: int, nbytes: int, stream: object) -> None:
        """``cuMemsetD8Async``. Bound as `_bound` binds, written out: a hot path."""
        if _THREAD.ctx != self._key:
            self._bind()
        try:
            (err,) = drv.cuMemsetD8Async(ptr, value, nbytes, stream.handle)  # type: ignore[attr-defined]
        except Exception as exc:
            raise foreign_error(exc, "cuMemsetD8Async") from exc
        if err:
            check(err, "cuMemsetD8Async")

    @_bound
    def copy_htod(self, dst: int, src: memoryview, stream: object, *, pinned: bool) -> None:
        """``cuMemcpyHtoDAsync`` of all of ``src``; ``src`` stays alive until the stream is idle."""
        s = cast(_Stream, stream)
        call(drv.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync", dst, src, src.nbytes, s.handle)
        self._hold(s, src)

    @_bound
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
        s = cast(_Stream, stream)
        call(drv.cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync", dst, src, dst.nbytes, s.handle)
        self._hold(s, dst)
        if not pinned and may_wait:
            self.stream_synchronize(s)

    @_bound
    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: object) -> None:
        """``cuMemcpyDtoDAsync``."""
        call(drv.cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync", dst, src, nbytes, cast(_Stream, stream).handle)

    @_bound
    def copy_peer(self, dst: int, src_device: RawDevice, src: int, nbytes: int, stream: object) -> None:
        """A copy from ``src_device``'s memory into this one's that a capture can record, which
        ``cuMemcpyPeerAsync`` is not (the H100 refused it in a capture with
        ``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED``): ``cuMemcpyDtoDAsync`` where both are one context (one
        ordinal: the primary context), else ``cuMemcpyAsync``, which unified addressing routes between the
        devices (direct where peer access is enabled, through the host where it is not)."""
        if not isinstance(src_device, CudaDevice) or src_device._closed:
            raise error_for_code(
                "CUDA_ERROR_INVALID_DEVICE", f"copy_peer: the source is not an open CUDA device ({src_device!r})"
            )
        handle = cast(_Stream, stream).handle
        if src_device._key == self._key:
            call(drv.cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync", dst, src, nbytes, handle)
        else:
            call(drv.cuMemcpyAsync, "cuMemcpyAsync", dst, src, nbytes, handle)

    @_bound
    def enable_peer_access(self, peer: RawDevice) -> None:
        """``cuDeviceCanAccessPeer``, then ``cuCtxEnablePeerAccess`` (this device's context current); nothing
        for the same ordinal (one primary context) or where it is already enabled."""
        if not isinstance(peer, CudaDevice) or peer._closed:
            raise error_for_code(
                "CUDA_ERROR_INVALID_DEVICE", f"enable_peer_access: the peer is not an open CUDA device ({peer!r})"
            )
        if peer._ordinal == self._ordinal:
            return
        if not int(call1(drv.cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer", self._device, peer._device)):
            raise error_for_code(
                "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
                f"enable_peer_access: CUDA device {self._ordinal} cannot access device {peer._ordinal}",
            )
        try:
            call(drv.cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess", peer._ctx, 0)
        except MetraleError as exc:
            if exc.name != "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED":
                raise

    def device_uuid(self) -> str:
        """``cuDeviceGetUuid``, written as ``nvidia-smi -L`` writes it: ``GPU-`` and the UUID."""
        if self._uuid is None:
            get = getattr(drv, "cuDeviceGetUuid_v2", None) or drv.cuDeviceGetUuid
            raw = call1(get, "cuDeviceGetUuid", self._device)
            data = getattr(raw, "bytes", raw)
            data = data.encode("latin-1") if isinstance(data, str) else bytes(data)
            self._uuid = f"GPU-{uuid.UUID(bytes=data[:16])}"
        return self._uuid

    # -- streams and events ---------------------------------------------------

    @_bound_checked
    def stream_create(self) -> object:
        """``cuStreamCreate(CU_STREAM_NON_BLOCKING)``."""
        stream = _Stream(call1(drv.cuStreamCreate, "cuStreamCreate", _d.STREAM_NON_BLOCKING))
        with self._lock:
            self._streams.add(stream)
        return stream

    @_bound
    def stream_destroy(self, stream: object) -> None:
        """``cuStreamDestroy``; host objects still in flight wait for the next ``synchronize``, and the work
        still pending on it for foreign streams that
        [`order_foreign_stream`][metrale_cuda.CudaDevice.order_foreign_stream] orders later."""
        s = cast(_Stream, stream)
        self._bury(s)
        call_teardown(drv.cuStreamDestroy, "cuStreamDestroy", s.handle)
        with self._lock:
            self._streams.discard(s)
            self._captures.pop(s, None)
            self._orphans.keep.extend(s.keep)
            s.dropped += len(s.keep)
            s.keep.clear()

    @_bound
    def stream_synchronize(self, stream: object) -> None:
        """``cuStreamSynchronize``."""
        s = cast(_Stream, stream)
        mark = self._mark(s)
        call(drv.cuStreamSynchronize, "cuStreamSynchronize", s.handle)
        self._release(s, mark)

    @_bound
    def stream_query(self, stream: object) -> bool:
        """``cuStreamQuery``: ``False`` on ``CUDA_ERROR_NOT_READY``."""
        s = cast(_Stream, stream)
        if not s.keep:
            return call_ready(drv.cuStreamQuery, "cuStreamQuery", s.handle)
        mark = self._mark(s)
        if call_ready(drv.cuStreamQuery, "cuStreamQuery", s.handle):
            self._release(s, mark)
            return True
        return False

    @_bound
    def stream_wait_event(self, stream: object, event: object) -> None:
        """``cuStreamWaitEvent(stream, event, 0)``."""
        call(drv.cuStreamWaitEvent, "cuStreamWaitEvent", cast(_Stream, stream).handle, event, 0)

    @_bound_checked
    def event_create(self) -> object:
        """``cuEventCreate(CU_EVENT_DEFAULT)``: timing enabled."""
        return call1(drv.cuEventCreate, "cuEventCreate", _d.EVENT_DEFAULT)

    @_bound
    def event_destroy(self, event: object) -> None:
        """``cuEventDestroy``."""
        call_teardown(drv.cuEventDestroy, "cuEventDestroy", event)

    @_bound
    def event_record(self, event: object, stream: object) -> None:
        """``cuEventRecord``."""
        call(drv.cuEventRecord, "cuEventRecord", event, cast(_Stream, stream).handle)

    @_bound
    def event_synchronize(self, event: object) -> None:
        """``cuEventSynchronize``."""
        call(drv.cuEventSynchronize, "cuEventSynchronize", event)

    @_bound
    def event_query(self, event: object) -> bool:
        """``cuEventQuery``: ``False`` on ``CUDA_ERROR_NOT_READY``."""
        return call_ready(drv.cuEventQuery, "cuEventQuery", event)

    @_bound
    def event_elapsed_ms(self, start: object, end: object) -> float:
        """``cuEventElapsedTime`` (``_v2`` where the bindings name it so)."""
        return float(call1(_d.EVENT_ELAPSED_TIME, "cuEventElapsedTime", start, end))

    @_bound_checked
    def synchronize(self) -> None:
        """``cuCtxSynchronize``; lets go of every host object issued before it."""
        with self._lock:
            streams = (self._orphans, *self._streams)
        marks = [(s, self._mark(s)) for s in streams if s.keep]
        call(drv.cuCtxSynchronize, "cuCtxSynchronize")
        for s, mark in marks:
            self._release(s, mark)

    # -- capture and graphs ---------------------------------------------------

    @_bound
    def begin_capture(self, stream: object) -> None:
        """``cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL)``."""
        s = cast(_Stream, stream)
        call(drv.cuStreamBeginCapture, "cuStreamBeginCapture", s.handle, _d.CAPTURE_MODE_GLOBAL)
        with self._lock:
            self._captures[s] = []

    @_bound
    def end_capture(self, stream: object) -> object:
        """``cuStreamEndCapture``: the graph, which keeps the host objects its copies touch."""
        s = cast(_Stream, stream)
        with self._lock:
            held = self._captures.pop(s, [])
        graph = call1(drv.cuStreamEndCapture, "cuStreamEndCapture", s.handle)
        return _Graph(graph, tuple(held))

    @_bound
    def is_capturing(self, stream: object) -> bool:
        """``cuStreamIsCapturing``: status other than ``NONE`` (active or invalidated)."""
        status = call1(drv.cuStreamIsCapturing, "cuStreamIsCapturing", cast(_Stream, stream).handle)
        return int(status) != 0  # CU_STREAM_CAPTURE_STATUS_NONE

    @_bound
    def graph_instantiate(self, graph: object) -> object:
        """``cuGraphInstantiate(graph, 0)`` (``...WithFlags`` where the bindings offer it)."""
        g = cast(_Graph, graph)
        return _GraphExec(call1(_d.GRAPH_INSTANTIATE, "cuGraphInstantiate", g.handle, 0), g.keep)

    def graph_launch(self, graph_exec: object, stream: object) -> None:
        """``cuGraphLaunch``; the graph's host objects stay alive until the stream is idle. Bound as
        `_bound` binds, written out: a hot path."""
        if _THREAD.ctx != self._key:
            self._bind()
        e: _GraphExec = graph_exec  # type: ignore[assignment]  # (no cast(): a call on a hot path)
        s: _Stream = stream  # type: ignore[assignment]
        try:
            (err,) = drv.cuGraphLaunch(e.handle, s.handle)
        except Exception as exc:
            raise foreign_error(exc, "cuGraphLaunch") from exc
        if err:
            check(err, "cuGraphLaunch")
        if e.keep:
            self._hold(s, e.keep)

    @_bound
    def graph_destroy(self, graph: object) -> None:
        """``cuGraphDestroy``."""
        call_teardown(drv.cuGraphDestroy, "cuGraphDestroy", cast(_Graph, graph).handle)

    @_bound
    def graph_exec_destroy(self, graph_exec: object) -> None:
        """``cuGraphExecDestroy``."""
        call_teardown(drv.cuGraphExecDestroy, "cuGraphExecDestroy", cast(_GraphExec, graph_exec).handle)

    # -- kernel modules -------------------------------------------------------

    def compute_capability(self) -> tuple[int, int]:
        """``(major, minor)`` from ``cuDeviceGetAttribute``: no current context needed."""
        major = call1(drv.cuDeviceGetAttribute, "cuDeviceGetAttribute", _d.ATTRIBUTE_CC_MAJOR, self._device)
        minor = call1(drv.cuDeviceGetAttribute, "cuDeviceGetAttribute", _d.ATTRIBUTE_CC_MINOR, self._device)
        return int(major), int(minor)

    def multiprocessors(self) -> tuple[int, int]:
        """``CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`` and ``..._MAX_SHARED_MEMORY_PER_MULTIPROCESSOR``."""
        sms = call1(drv.cuDeviceGetAttribute, "cuDeviceGetAttribute", _d.ATTRIBUTE_SM_COUNT, self._device)
        smem = call1(drv.cuDeviceGetAttribute, "cuDeviceGetAttribute", _d.ATTRIBUTE_SMEM_PER_SM, self._device)
        return int(sms), int(smem)

    @_bound
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

    @_bound
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

    @_bound_checked
    def module_load(self, name: str, image: bytes) -> object:
        """``cuModuleLoadData`` of a PTX image (NUL-terminated here, as the driver wants text)."""
        text = image if image.endswith(b"\0") else image + b"\0"
        return call1(drv.cuModuleLoadData, f"cuModuleLoadData of module {name!r}", text)

    @_bound
    def module_unload(self, module: object) -> None:
        """``cuModuleUnload``."""
        call_teardown(drv.cuModuleUnload, "cuModuleUnload", module)

    @_bound
    def module_function(self, module: object, kernel: str) -> object:
        """``cuModuleGetFunction``."""
        return call1(drv.cuModuleGetFunction, f"cuModuleGetFunction of {kernel!r}", module, kernel.encode())

    def launch(
        self,
        function: object,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: object,
        args: Sequence[LaunchArg],
    ) -> None:
        """``cuLaunchKernel`` with each argument's packed bytes, written into the kernel's slots kept for
        this thread (`_ArgSlots`; the driver copies them at the call). Bound as `_bound`
        binds, written out: a hot path."""
        if _THREAD.ctx != self._key:
            self._bind()
        cache = _PACKING.slots
        slots = cache.get(id(function))
        if slots is None or not slots.fill(args):
            slots = cache[id(function)] = _ArgSlots(tuple(len(a.data) for a in args))
            slots.fill(args)
        try:
            (err,) = drv.cuLaunchKernel(
                function,
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
