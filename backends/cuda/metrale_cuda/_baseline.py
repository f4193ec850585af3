"""The CUDA backend's baseline for ``metrale bench``: the driver API through ``cuda.bindings``, called
the way a user without metrale would call it (each call's result checked, nothing else).

It lives here, beside the backend, so that no ``cuda.bindings`` type reaches ``metrale_core``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from typing import Any

from metrale_core import InvalidArgumentError
from metrale_core.kernels import shipped_modules
from metrale_core.plugin import Baseline, CopyDirection

from . import _driver as _d
from ._driver import call, call1, call_teardown, check, drv

__all__ = ["DriverBaseline"]

_BLOCK = 256


class DriverBaseline(Baseline):
    """``cuMemAlloc``/``cuMemFree``, ``cuMemsetD8Async``, ``cuMemcpy*Async`` and ``cuLaunchKernel`` on a
    stream of its own, in the context the device made current."""

    __slots__ = ("_device_ptrs", "_driver_calls", "_host_ptrs", "_module", "_peers", "_stream")

    def __init__(self, driver_calls: str = "") -> None:
        self._driver_calls = driver_calls  # which calls the device measured against it makes, for the versions
        self._stream: Any = call1(drv.cuStreamCreate, "cuStreamCreate", _d.STREAM_NON_BLOCKING)
        self._device_ptrs: list[int] = []
        self._host_ptrs: list[int] = []
        self._module: Any = None
        self._peers: list[tuple[Any, Any, int]] = []  # (device, retained primary context, pointer) of peer memory

    @property
    def label(self) -> str:
        return f"cuda.bindings {_d.bindings_version()}"

    @property
    def versions(self) -> Mapping[str, str]:
        out = {"cuda-bindings": _d.bindings_version()}
        err, version = drv.cuDriverGetVersion()
        if not err:
            out["CUDA driver API"] = f"{int(version) // 1000}.{int(version) % 1000 // 10}"
        if self._driver_calls:
            out["driver calls"] = self._driver_calls
        return out

    def _device(self, nbytes: int) -> int:
        ptr = int(call1(drv.cuMemAlloc, f"cuMemAlloc of {nbytes} bytes", nbytes, requested=nbytes))
        self._device_ptrs.append(ptr)
        return ptr

    def _host(self, nbytes: int) -> int:
        ptr = int(call1(drv.cuMemAllocHost, f"cuMemAllocHost of {nbytes} bytes", nbytes, requested=nbytes))
        self._host_ptrs.append(ptr)
        return ptr

    def alloc_free(self, nbytes: int) -> Callable[[], None]:
        alloc, free = drv.cuMemAlloc, drv.cuMemFree

        def pair() -> None:
            err, ptr = alloc(nbytes)
            check(err, "cuMemAlloc")
            (err,) = free(ptr)
            check(err, "cuMemFree")

        return pair

    def memset(self, nbytes: int) -> Callable[[], None]:
        ptr, stream, memset = self._device(nbytes), self._stream, drv.cuMemsetD8Async

        def op() -> None:
            (err,) = memset(ptr, 0, nbytes, stream)
            check(err, "cuMemsetD8Async")

        return op

    def copy(self, direction: CopyDirection, nbytes: int) -> Callable[[], None]:
        stream = self._stream
        fn: Any
        if direction == "dtod":
            dst, src, fn = self._device(nbytes), self._device(nbytes), drv.cuMemcpyDtoDAsync
        elif direction == "htod":
            dst, src, fn = self._device(nbytes), self._host(nbytes), drv.cuMemcpyHtoDAsync
        elif direction == "dtoh":
            dst, src, fn = self._host(nbytes), self._device(nbytes), drv.cuMemcpyDtoHAsync
        else:
            raise InvalidArgumentError(f"baseline copy: direction must be 'dtod', 'htod' or 'dtoh', not {direction!r}")

        def op() -> None:
            (err,) = fn(dst, src, nbytes, stream)
            check(err, "cuMemcpyAsync")

        return op

    def vector_add(self, n: int) -> Callable[[], None]:
        if self._module is None:
            image = shipped_modules("vector")["vector"] + b"\0"
            self._module = call1(drv.cuModuleLoadData, "cuModuleLoadData of the shipped vector module", image)
        function = call1(drv.cuModuleGetFunction, "cuModuleGetFunction of vector_add", self._module, b"vector_add")
        a, b, out = (self._device(4 * n) for _ in range(3))
        grid, stream, launch = (n + _BLOCK - 1) // _BLOCK, self._stream, drv.cuLaunchKernel
        types = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32)

        def op() -> None:  # the arguments packed at each launch, as cuda.bindings' examples do
            (err,) = launch(function, grid, 1, 1, _BLOCK, 1, 1, 0, stream, ((a, b, out, n), types), 0)
            check(err, "cuLaunchKernel")

        return op

    def copy_peer(self, nbytes: int, peer_ordinal: int) -> Callable[[], None]:
        own = call1(drv.cuCtxGetCurrent, "cuCtxGetCurrent")
        device = call1(drv.cuDeviceGet, "cuDeviceGet", peer_ordinal)
        peer = call1(drv.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", device)
        try:
            call(drv.cuCtxSetCurrent, "cuCtxSetCurrent", peer)
            src = int(call1(drv.cuMemAlloc, f"cuMemAlloc of {nbytes} bytes", nbytes, requested=nbytes))
        except BaseException:
            call_teardown(drv.cuCtxSetCurrent, "cuCtxSetCurrent", own)
            call_teardown(drv.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", device)
            raise
        call(drv.cuCtxSetCurrent, "cuCtxSetCurrent", own)
        self._peers.append((device, peer, src))
        dst, stream, fn = self._device(nbytes), self._stream, drv.cuMemcpyPeerAsync

        def op() -> None:
            (err,) = fn(dst, own, src, peer, nbytes, stream)
            check(err, "cuMemcpyPeerAsync")

        return op

    def synchronize(self) -> None:
        call(drv.cuStreamSynchronize, "cuStreamSynchronize", self._stream)

    def close(self) -> None:
        if self._stream is None:
            return
        call_teardown(drv.cuStreamSynchronize, "cuStreamSynchronize", self._stream)
        for ptr in self._device_ptrs:
            call_teardown(drv.cuMemFree, "cuMemFree", ptr)
        for ptr in self._host_ptrs:
            call_teardown(drv.cuMemFreeHost, "cuMemFreeHost", ptr)
        for device, _context, ptr in self._peers:  # (cuMemFree finds the allocation's context by its address)
            call_teardown(drv.cuMemFree, "cuMemFree", ptr)
            call_teardown(drv.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", device)
        self._peers.clear()
        if self._module is not None:
            call_teardown(drv.cuModuleUnload, "cuModuleUnload", self._module)
        call_teardown(drv.cuStreamDestroy, "cuStreamDestroy", self._stream)
        self._stream = self._module = None
        self._device_ptrs.clear()
        self._host_ptrs.clear()
