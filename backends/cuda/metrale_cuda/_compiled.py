"""The CUDA device whose hot path calls the driver at C speed: `CompiledCudaDevice`, over ``_cdriver`` (issue 38).

- ``_cdriver`` (``_cdriver.pyx``, Cython): the driver calls of the hot path through ``cuda.bindings.cydriver``, plain
  ints in and out, without the GIL where a call may wait; and the argument slots of a launch, filled by ``memcpy``.
  Its return convention: a ``CUresult`` (``0``: success); or, for a call that gives a value back, the value
  (``>= 0``) and ``-CUresult`` on a failure; ``REPACK`` where a launch's arguments do not fit their slots.
- `CompiledCudaDevice`: [`CudaDevice`][metrale_cuda.CudaDevice] with alloc, free, memset, the three copies, launch,
  graph launch and the current-context check over ``_cdriver``. Each binds the context, holds host objects and raises
  as the pure method does: a nonzero code goes through `check` (the one table), an exception through `foreign_error`.
- `device_class` is how the plugin chooses, once per device, at open: the compiled device where ``_cdriver`` was built
  and loads and the setting ``pure`` (``METRALE_PURE=1``) is off, else the pure `CudaDevice`, the reference.
- `describe` says which runs, for ``metrale --version`` and ``metrale bench``.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, Final

from metrale_core import BackendUnavailableError, InvalidArgumentError, LaunchArg
from metrale_core.plugin import AllocKind

from . import _driver as _d
from ._device import CudaDevice
from ._driver import THREAD, check, foreign_error, teardown_failed
from ._launch import CuGraphExec, CuStream

__all__ = ["MODULE", "CompiledCudaDevice", "describe", "device_class", "load"]

_log = logging.getLogger("metrale.cuda")

#: The compiled module's name.
MODULE: Final = "metrale_cuda._cdriver"

_loaded: dict[str, ModuleType | None] = {}
_why_not: dict[str, str] = {}


def load() -> ModuleType | None:
    """``_cdriver``, or ``None`` where it was not built or does not load here (loaded once; a failure is logged)."""
    if MODULE not in _loaded:
        try:
            _loaded[MODULE] = importlib.import_module(MODULE)
        except ImportError as exc:
            if getattr(exc, "name", None) == MODULE:  # not built here: the pure calls run
                _why_not[MODULE] = ("the compiled driver calls were not built here: the install found no cuda.h, no "
                                    "C++ compiler or no Cython")
            elif _d.drv is None:  # no cuda-bindings: the backend says so where it is probed or opened
                _why_not[MODULE] = f"cuda-bindings is not importable ({_d.IMPORT_ERROR})"
            else:  # built, and cannot load (a cydriver whose signatures differ, say): logged
                _why_not[MODULE] = f"the compiled driver calls failed to load: {type(exc).__name__}: {exc}"
                _log.warning("%s: the pure calls run", _why_not[MODULE])
            _loaded[MODULE] = None
        except Exception as exc:
            _why_not[MODULE] = f"the compiled driver calls failed to load: {type(exc).__name__}: {exc}"
            _log.warning("%s: the pure calls run", _why_not[MODULE])
            _loaded[MODULE] = None
    return _loaded[MODULE]


def _stale() -> bool:
    """Whether the loaded ``_cdriver`` is older than its ``.pyx`` beside it (an in-tree build not redone); ``False``
    where there is none (an installed wheel carries no ``.pyx``)."""
    built_at = Path(getattr(sys.modules.get(MODULE), "__file__", None) or "")
    source = built_at.with_name(built_at.name.partition(".")[0] + ".pyx")
    try:
        return source.stat().st_mtime > built_at.stat().st_mtime
    except OSError:
        return False


def device_class(pure: bool) -> type[CudaDevice]:
    """The class a device opens as: `CompiledCudaDevice` where ``_cdriver`` loads and ``pure`` is off, else
    `CudaDevice`."""
    if pure or load() is None:
        return CudaDevice
    return CompiledCudaDevice


def describe(pure: bool) -> str:
    """Which driver calls a device opened with this ``pure`` setting makes, in words."""
    if pure:
        return f"{CudaDevice.DRIVER_CALLS} (the setting pure, METRALE_PURE=1)"
    if load() is None:
        return f"{CudaDevice.DRIVER_CALLS} ({_why_not.get(MODULE, 'not built')})"
    note = "; STALE, older than its .pyx (reinstall to rebuild)" if _stale() else ""
    return f"{CompiledCudaDevice.DRIVER_CALLS}{note}"


def _alloc_failed(err: int, nbytes: int) -> None:
    """The device calls' ``cuMemAlloc`` failed with ``err``: the error `alloc` raises."""
    check(err, f"cuMemAlloc of {nbytes} bytes", requested=nbytes)


def _memset_failed(err: int) -> None:
    """The device calls' ``cuMemsetD8Async`` failed with ``err``: the error `memset` raises."""
    check(err, "cuMemsetD8Async")


def _graph_launch_failed(err: int) -> None:
    """The device calls' ``cuGraphLaunch`` failed with ``err``: the error `graph_launch` raises."""
    check(err, "cuGraphLaunch")


def _launch_failed(err: int) -> None:
    """The device calls' ``cuLaunchKernel`` failed with ``err``: the error `launch` raises."""
    check(err, "cuLaunchKernel")


def _free_failed(err: int) -> None:
    """The device calls' ``cuMemFree`` failed with ``err``: what `free` does (raise, or log where nothing was left)."""
    teardown_failed(err, "cuMemFree")


class _Slots(threading.local):
    """Per thread, of one device: the compiled argument slots of each kernel it launched, by the `CuFunction`'s
    identity (as the pure launch keeps its own: a slot's sizes are checked at every launch)."""

    def __init__(self) -> None:
        self.slots: dict[int, Any] = {}


class CompiledCudaDevice(CudaDevice):
    """A [`CudaDevice`][metrale_cuda.CudaDevice] whose hot path calls ``cuda.bindings.cydriver`` through ``_cdriver``.

    The same methods, bindings of the context, host objects held and errors as the pure device's: only the calls
    differ. Open one through the plugin (or ``CompiledCudaDevice.open``) where `device_class` gives it.
    """

    DRIVER_CALLS: ClassVar[str] = "compiled: cuda.bindings.cydriver"

    def __init__(self, ordinal: int, device: Any, context: Any) -> None:
        super().__init__(ordinal, device, context)
        self._c: Any = load()  # the module of the calls (a test may stand one in)
        self._slots = _Slots()
        calls = getattr(self._c, "DeviceCalls", None)
        #: The device calls of the core's lanes (``device_calls``), shut as the device closes.
        self._calls: Any = None if calls is None else calls(
            self._key, _alloc_failed, _free_failed, _memset_failed, _graph_launch_failed, _launch_failed
        )

    @classmethod
    def open(cls, ordinal: int) -> CudaDevice:
        """As [`CudaDevice.open`][metrale_cuda.CudaDevice.open]; refused before anything is retained where
        ``_cdriver`` does not load here (`device_class` then gives `CudaDevice`)."""
        if load() is None:
            raise BackendUnavailableError(f"CUDA device {ordinal} could not be opened compiled: {describe(False)}")
        return super().open(ordinal)

    # -- the context ----------------------------------------------------------------

    def _bind(self) -> None:
        """Make the context current on this thread (``cuCtxSetCurrent``)."""
        if self._closed:
            return super()._bind()  # (which raises: the device is closed)
        try:
            err = self._c.ctx_set(self._key)
        except Exception as exc:
            raise foreign_error(exc, "cuCtxSetCurrent") from exc
        if err:
            check(err, "cuCtxSetCurrent")
        THREAD.ctx = self._key

    def _bind_checked(self) -> None:
        """Make the context current, asking the driver (``cuCtxGetCurrent``) what is current now."""
        if self._closed:
            return super()._bind_checked()  # (which raises: the device is closed)
        c = self._c
        try:
            current = c.ctx_current()
        except Exception as exc:
            raise foreign_error(exc, "cuCtxGetCurrent") from exc
        if current < 0:
            check(-current, "cuCtxGetCurrent")
        if current != self._key:
            try:
                err = c.ctx_set(self._key)
            except Exception as exc:
                raise foreign_error(exc, "cuCtxSetCurrent") from exc
            if err:
                check(err, "cuCtxSetCurrent")
        THREAD.ctx = self._key

    # -- memory ---------------------------------------------------------------------

    def alloc(self, nbytes: int, kind: AllocKind) -> int:
        """``cuMemAlloc`` (``"device"``, ``"arena"``) or ``cuMemAllocManaged`` (``"managed"``), as
        [`CudaDevice.alloc`][metrale_cuda.CudaDevice.alloc]: ``cuCtxGetCurrent`` first."""
        c = self._c
        try:
            current = c.ctx_current()
        except Exception as exc:
            raise foreign_error(exc, "cuCtxGetCurrent") from exc
        if current < 0 or self._closed or current != self._key:
            self._bind_checked()  # (which raises for a failure or a closed device)
        else:
            THREAD.ctx = self._key
        if kind in {"device", "arena"}:
            try:
                ptr: int = c.mem_alloc(nbytes)
            except Exception as exc:
                raise foreign_error(exc, f"cuMemAlloc of {nbytes} bytes") from exc
            if ptr < 0:
                check(-ptr, f"cuMemAlloc of {nbytes} bytes", requested=nbytes)
        elif kind == "managed":
            try:
                ptr = c.mem_alloc_managed(nbytes, int(_d.MEM_ATTACH_GLOBAL))
            except Exception as exc:
                raise foreign_error(exc, f"cuMemAllocManaged of {nbytes} bytes") from exc
            if ptr < 0:
                check(-ptr, f"cuMemAllocManaged of {nbytes} bytes", requested=nbytes)
        else:
            raise InvalidArgumentError(f"alloc: unknown allocation kind {kind!r}")
        return ptr

    def device_calls(self) -> object | None:
        """``alloc``, ``free``, ``memset``, ``graph_launch`` and ``launch`` as C functions (``_cdriver.DeviceCalls``),
        for the core's compiled lanes: each works where this device's context is current on the calling thread and
        it is open, and leaves every other case to the method (which binds the context, or raises)."""
        return None if self._calls is None else self._calls.capsule()

    def close(self) -> None:
        """As [`CudaDevice.close`][metrale_cuda.CudaDevice.close]; the device calls are shut first."""
        if self._calls is not None:
            self._calls.close()
        super().close()

    def free(self, ptr: int, kind: AllocKind) -> None:
        """``cuMemFree`` (every kind), as [`CudaDevice.free`][metrale_cuda.CudaDevice.free]."""
        if THREAD.ctx != self._key:
            self._bind()
        try:
            err = self._c.mem_free(ptr)
        except Exception as exc:
            raise foreign_error(exc, "cuMemFree") from exc
        if err:
            teardown_failed(err, "cuMemFree")

    # -- copies ---------------------------------------------------------------------

    def memset(self, ptr: int, value: int, nbytes: int, stream: object) -> None:
        """``cuMemsetD8Async``."""
        if THREAD.ctx != self._key:
            self._bind()
        try:
            err = self._c.memset_d8(ptr, value, nbytes, stream.raw)  # type: ignore[attr-defined]
        except Exception as exc:
            raise foreign_error(exc, "cuMemsetD8Async") from exc
        if err:
            check(err, "cuMemsetD8Async")

    def copy_htod(self, dst: int, src: memoryview, stream: object, *, pinned: bool) -> None:
        """``cuMemcpyHtoDAsync`` of all of ``src``; ``src`` stays alive until the stream is idle."""
        if THREAD.ctx != self._key:
            self._bind()
        s: CuStream = stream  # type: ignore[assignment]  # (no cast(): a call on a hot path)
        try:
            err = self._c.copy_htod(dst, src, s.raw)
        except Exception as exc:
            raise foreign_error(exc, "cuMemcpyHtoDAsync") from exc
        if err:
            check(err, "cuMemcpyHtoDAsync")
        self._hold(s, src)

    def copy_dtoh(self, dst: memoryview, src: int, stream: object, *, pinned: bool, may_wait: bool = True) -> None:
        """``cuMemcpyDtoHAsync`` filling all of ``dst``, as [`CudaDevice.copy_dtoh`][metrale_cuda.CudaDevice.copy_dtoh]
        (into pageable memory, complete on return where the core allows a wait)."""
        if THREAD.ctx != self._key:
            self._bind()
        if dst.readonly:
            raise InvalidArgumentError("copy_dtoh: the host destination is read-only")
        s: CuStream = stream  # type: ignore[assignment]
        try:
            err = self._c.copy_dtoh(dst, src, s.raw)
        except Exception as exc:
            raise foreign_error(exc, "cuMemcpyDtoHAsync") from exc
        if err:
            check(err, "cuMemcpyDtoHAsync")
        self._hold(s, dst)
        if not pinned and may_wait:
            self.stream_synchronize(s)

    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: object) -> None:
        """``cuMemcpyDtoDAsync``."""
        if THREAD.ctx != self._key:
            self._bind()
        try:
            err = self._c.copy_dtod(dst, src, nbytes, stream.raw)  # type: ignore[attr-defined]
        except Exception as exc:
            raise foreign_error(exc, "cuMemcpyDtoDAsync") from exc
        if err:
            check(err, "cuMemcpyDtoDAsync")

    # -- graphs and launches --------------------------------------------------------

    def graph_launch(self, graph_exec: object, stream: object) -> None:
        """``cuGraphLaunch``; the graph's host objects stay alive until the stream is idle."""
        if THREAD.ctx != self._key:
            self._bind()
        e: CuGraphExec = graph_exec  # type: ignore[assignment]
        s: CuStream = stream  # type: ignore[assignment]
        try:
            err = self._c.graph_launch(e.raw, s.raw)
        except Exception as exc:
            raise foreign_error(exc, "cuGraphLaunch") from exc
        if err:
            check(err, "cuGraphLaunch")
        if e.keep:
            self._hold(s, e.keep)

    def launch(
        self, function: object, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int,
        stream: object, args: Sequence[LaunchArg],
    ) -> None:
        """``cuLaunchKernel`` with each argument's bytes copied into the kernel's compiled slots kept for this
        thread (``_cdriver.ArgSlots``; new slots where the sizes changed), as the pure launch packs its own."""
        if THREAD.ctx != self._key:
            self._bind()
        c, cache, key = self._c, self._slots.slots, id(function)
        slots = cache.get(key)
        if slots is None:
            slots = cache[key] = c.ArgSlots(tuple(len(a.data) for a in args))
        f, s = function.raw, stream.raw  # type: ignore[attr-defined]
        try:
            err = c.launch(slots, args, f, grid, block, shared_mem, s)
            if err == c.REPACK:  # the sizes changed (another kernel at a reused identity, say): new slots
                slots = cache[key] = c.ArgSlots(tuple(len(a.data) for a in args))
                err = c.launch(slots, args, f, grid, block, shared_mem, s)
        except Exception as exc:
            raise foreign_error(exc, "cuLaunchKernel") from exc
        if err:
            check(err, "cuLaunchKernel")
