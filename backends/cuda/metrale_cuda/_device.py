"""The CUDA raw layer: [`CudaDevice`][metrale_cuda.CudaDevice], one device's primitives over ``cuda.bindings.driver``.

- here: the context (open, bind, close), memory, the device's attributes, interop and peer copies;
- ``_launch``: the work a device issues (copies, streams, events, graphs, launches and their argument
  slots), in `CudaWork`, the base of `CudaDevice`;
- ``_driver``: every driver call, and the decorators that make the context current.

Handles it gives out: streams, graphs and executable graphs are small
wrappers of the bindings' objects (they carry the host objects a copy or a
graph still reads, see ``_launch``); events are the bindings' ``CUevent``.

**Contexts.** A device works in its ordinal's primary context
(``cuDevicePrimaryCtxRetain``), shared with the CUDA runtime (CuPy, PyTorch)
of the same process. Each method makes it current on the calling thread where
this package did not already, in one place, the decorator it carries:
`bound` checks a thread-local that records the context this package
last made current on each thread, so a call on the hot path costs one
comparison, not a driver call. Calls that create or size something in "the
current context" (allocations, streams, events, ``synchronize``,
``mem_get_info``) carry `bound_checked` instead, which also asks
``cuCtxGetCurrent``, so code outside metrale that switched the context on
this thread cannot make them land on another device.

**Closing without a wait.** The core synchronizes before it closes a device whenever no capture runs
in the process, so a device closed with host objects still held is one the core could not wait for; it
hands them to a module-level list kept for the rest of the process (see
[`CudaDevice.close`][metrale_cuda.CudaDevice.close]) rather than let the device read freed memory.
"""

from __future__ import annotations

import ctypes
import logging
import uuid
from typing import Any, ClassVar, Final, cast

from metrale_core import (
    BackendUnavailableError,
    Baseline,
    DeviceFaultError,
    DriverError,
    ForeignMemory,
    InvalidArgumentError,
    MetraleError,
    RawDevice,
    error_for_code,
)
from metrale_core.plugin import AllocKind

from . import _driver as _d
from ._baseline import DriverBaseline
from ._driver import (
    THREAD,
    bound,
    bound_checked,
    call,
    call1,
    call_sized,
    call_teardown,
    check,
    drv,
    foreign_error,
    invoke,
    teardown_failed,
)
from ._launch import EVENT_ORDER_ONLY, CudaWork, CuStream

__all__ = ["CudaDevice"]

_log = logging.getLogger("metrale.cuda")

_NAME_LENGTH: Final = 256
_CLOSED_KEY: Final = -1  # never a context handle: a closed device always takes the slow path

#: Host objects that a device closed while they were still held (the core could
#: not wait for it: a capture was running in the process), kept for the rest of
#: the process so that work still queued never reads or writes freed memory. A
#: leak bounded by use: only what was in flight at such a close, and only then.
_KEPT_AFTER_CLOSE: Final[list[object]] = []


class CudaDevice(CudaWork):
    """One CUDA device's raw primitives, in its primary context.

    Build one with [`open`][metrale_cuda.CudaDevice.open]. Several may be open at once, on several
    ordinals or on one (they then share the primary context, each holding a
    reference to it). Every method may be called from any thread and raises
    only [`MetraleError`][metrale_core.MetraleError].

    Its driver calls are ``cuda.bindings.driver``'s, the reference; the plugin opens a
    ``CompiledCudaDevice`` (``_compiled``) instead where the compiled calls were built.
    """

    #: Which driver calls this class makes, in words (``metrale bench`` and ``metrale --version`` say it).
    DRIVER_CALLS: ClassVar[str] = "pure Python: cuda.bindings.driver"

    def __init__(self, ordinal: int, device: Any, context: Any) -> None:
        """Adopt a retained primary context; use [`open`][metrale_cuda.CudaDevice.open] rather than this."""
        super().__init__()
        self._ordinal = ordinal
        self._device = device
        self._ctx = context
        self._key = int(context)
        self._closed = False
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

    # -- the context ----------------------------------------------------------------

    def _bind(self) -> None:
        """Make the context current on this thread (the slow path of every method)."""
        if self._closed:
            raise DriverError(f"CUDA device {self._ordinal} is closed")
        call(drv.cuCtxSetCurrent, "cuCtxSetCurrent", self._ctx)
        THREAD.ctx = self._key

    def _bind_checked(self) -> None:
        """Make the context current, asking the driver what is current now."""
        if self._closed:
            raise DriverError(f"CUDA device {self._ordinal} is closed")
        current = call1(drv.cuCtxGetCurrent, "cuCtxGetCurrent")
        if int(current) != self._key:
            call(drv.cuCtxSetCurrent, "cuCtxSetCurrent", self._ctx)
        THREAD.ctx = self._key

    def bind_to_thread(self) -> None:
        """Make this device's context current on the calling thread."""
        self._bind()

    # -- the device -----------------------------------------------------------------

    def device_name(self) -> str:
        """The driver's name for the device, e.g. ``"NVIDIA H200"``."""
        if self._name is None:
            raw = call1(drv.cuDeviceGetName, "cuDeviceGetName", _NAME_LENGTH, self._device)
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            self._name = text.split("\x00", 1)[0].strip()
        return self._name

    @bound_checked
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

    def device_uuid(self) -> str:
        """``cuDeviceGetUuid``, written as ``nvidia-smi -L`` writes it: ``GPU-`` and the UUID."""
        if self._uuid is None:
            get = getattr(drv, "cuDeviceGetUuid_v2", None) or drv.cuDeviceGetUuid
            raw = call1(get, "cuDeviceGetUuid", self._device)
            data = getattr(raw, "bytes", raw)
            data = data.encode("latin-1") if isinstance(data, str) else bytes(data)
            self._uuid = f"GPU-{uuid.UUID(bytes=data[:16])}"
        return self._uuid

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

    # -- interop --------------------------------------------------------------------

    def export_memory(self, ptr: int, nbytes: int) -> ForeignMemory:
        """Device memory of this device: the pointer is what other libraries use."""
        return ForeignMemory("cuda", self._ordinal, ptr, nbytes)

    @bound_checked
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

    @bound_checked
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
        event = call1(drv.cuEventCreate, "cuEventCreate", EVENT_ORDER_ONLY)
        try:
            for handle in handles:
                call(drv.cuEventRecord, "cuEventRecord", event, handle)
                call(drv.cuStreamWaitEvent, what, foreign, event, 0)
        finally:
            call_teardown(drv.cuEventDestroy, "cuEventDestroy", event)

    @bound_checked
    def address_range(self, ptr: int) -> tuple[int, int]:
        """``cuMemGetAddressRange``: the base and size of the allocation holding ``ptr``."""
        what = f"cuMemGetAddressRange of {ptr:#x}"
        err, base, size = invoke(drv.cuMemGetAddressRange, what, ptr)
        check(err, what)
        return int(base), int(size)

    @bound_checked
    def baseline(self) -> Baseline:
        """The driver API called directly (``cuda.bindings``), for ``metrale bench``; in this device's context."""
        return DriverBaseline(driver_calls=self.DRIVER_CALLS)

    @bound
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
        handle = cast(CuStream, stream).handle
        if src_device._key == self._key:
            call(drv.cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync", dst, src, nbytes, handle)
        else:
            call(drv.cuMemcpyAsync, "cuMemcpyAsync", dst, src, nbytes, handle)

    @bound
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

    # -- memory ---------------------------------------------------------------------

    def alloc(self, nbytes: int, kind: AllocKind) -> int:
        """``cuMemAlloc`` (``"device"``, ``"arena"``) or ``cuMemAllocManaged`` (``"managed"``).

        Bound as `bound_checked` binds (it creates in "the current context"), written out
        here because it is the hot path: one wrapper frame less."""
        try:  # _bind_checked's question, asked here: a frame less on the hot path
            err, current = drv.cuCtxGetCurrent()
        except Exception as exc:
            raise foreign_error(exc, "cuCtxGetCurrent") from exc
        if err or self._closed or int(current) != self._key:
            self._bind_checked()  # (which raises for a failure or a closed device)
        else:
            THREAD.ctx = self._key
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

        Bound as `bound` binds, not asking the driver: a free names its memory by address,
        which unified addressing maps to the allocation's own context whichever is current (a
        context switched by foreign code cannot make it land elsewhere)."""
        if THREAD.ctx != self._key:
            self._bind()
        try:
            (err,) = drv.cuMemFree(ptr)
        except Exception as exc:
            raise foreign_error(exc, "cuMemFree") from exc
        if err:
            teardown_failed(err, "cuMemFree")

    @bound_checked
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

    @bound_checked
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

    @bound_checked
    def free_host(self, ptr: int) -> None:
        """``cuMemFreeHost``."""
        call_teardown(drv.cuMemFreeHost, "cuMemFreeHost", ptr)

    # -- closing --------------------------------------------------------------------

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
            streams = [*self._streams, *self._borrowed.values()]
            held = [*self._orphans.keep, *(obj for s in streams for obj in s.keep)]
            self._orphans.keep.clear()
            for stream in streams:
                stream.keep.clear()
            self._streams.clear()
            self._borrowed.clear()
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
        if THREAD.ctx == key:
            THREAD.ctx = 0
        _log.debug("closed CUDA device %d", self._ordinal)
