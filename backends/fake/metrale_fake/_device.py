"""The fake device: memory in host arrays, streams as queues, graphs as recorded work.

It speaks CUDA's vocabulary: where the driver fails, it raises the error
:func:`metrale_core.error_for_code` gives for the driver's result code.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Final, cast

import numpy as np

from metrale_core import AllocKind, MetraleSettings, parse_ptx
from metrale_core.plugin import (
    Baseline,
    ForeignMemory,
    KernelImplementation,
    LaunchArg,
    RawDevice,
    error_for_code,
    format_bytes,
)

from ._baseline import NumpyBaseline
from ._settings import FakeSettings

__all__ = ["FAULT_OPS", "FakeDevice"]

#: The raw operations :meth:`FakeDevice.inject_fault` can make fail.
FAULT_OPS: Final = frozenset(
    {"alloc", "free", "memcpy", "memset", "graph_instantiate", "graph_launch", "synchronize", "is_capturing",
     "launch"}
)

_DEVICE_BASE: Final = 0x7F00_0000_0000
_HOST_BASE: Final = 0x5500_0000_0000
_ALIGN: Final = 256
_GAP: Final = 4096  # unmapped bytes between allocations, as a real address space has

Work = Callable[[], None]

_DTYPES: Final = {
    ("u", 1): np.uint8, ("u", 2): np.uint16, ("u", 4): np.uint32, ("u", 8): np.uint64,
    ("b", 1): np.uint8, ("b", 2): np.uint16, ("b", 4): np.uint32, ("b", 8): np.uint64,
    ("s", 1): np.int8, ("s", 2): np.int16, ("s", 4): np.int32, ("s", 8): np.int64,
    ("f", 2): np.float16, ("f", 4): np.float32, ("f", 8): np.float64,
}


class MisalignedAddressError(Exception):
    """Raised by a fake kernel implementation for a typed access at a misaligned address; the
    launch then faults the fake device with ``CUDA_ERROR_MISALIGNED_ADDRESS``, as a GPU does."""


@dataclasses.dataclass(frozen=True, slots=True)
class FakeLaunch:
    """What a fake kernel implementation learns about its launch."""

    module: str
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    memory: Callable[[int, int], np.ndarray]

    def read(self, address: int, nbytes: int) -> np.ndarray:
        """The device bytes ``[address, address + nbytes)``, for a kernel that follows a pointer it read.

        Bytes outside one allocation raise ``IndexError``: an illegal address.
        """
        return self.memory(address, nbytes)

    @staticmethod
    def elements(view: np.ndarray, count: int, dtype: type[np.generic]) -> np.ndarray:
        """The first ``count`` elements of ``dtype`` at a pointer argument's ``view``, as a kernel's typed
        loads and stores see them: past the allocation (and its red zone) is an illegal address
        (``IndexError``), and a pointer not aligned to the element size is a misaligned address
        (:class:`MisalignedAddressError`), as on a GPU, where both fault the context."""
        size = np.dtype(dtype).itemsize
        nbytes = count * size
        if len(view) < nbytes:
            raise IndexError(f"{nbytes} bytes from this pointer run past its allocation ({len(view)} bytes)")
        # Allocations start 256-byte aligned on the fake device and numpy's buffers at least 16-byte aligned
        # on the host, so a view's host address has the device address's alignment.
        if view.ctypes.data % size:
            raise MisalignedAddressError(f"a {np.dtype(dtype).name} access at an address that is not a multiple "
                                         f"of {size}")
        return view[:nbytes].view(dtype)

    @property
    def threads(self) -> int:
        """Threads in the whole launch."""
        g, b = self.grid, self.block
        return g[0] * g[1] * g[2] * b[0] * b[1] * b[2]


@dataclasses.dataclass(frozen=True, slots=True)
class _FakeModule:
    name: str
    kernels: frozenset[str]


@dataclasses.dataclass(slots=True)
class _Allocation:
    base: int
    size: int
    kind: str
    data: np.ndarray


class _FakeStream:
    __slots__ = ("capture", "done", "issued", "queue")

    def __init__(self) -> None:
        self.queue: deque[tuple[int, Work]] = deque()
        self.issued = 0  # sequence number of the last work issued
        self.done = 0  # sequence number of the last work run
        self.capture: list[Work] | None = None


class _FakeEvent:
    __slots__ = ("seq", "stream", "time")

    def __init__(self) -> None:
        self.stream: _FakeStream | None = None
        self.seq = 0
        self.time: float | None = None


class _FakeGraph:
    __slots__ = ("work",)

    def __init__(self, work: list[Work]) -> None:
        self.work = tuple(work)


class FakeDevice(RawDevice):
    """The raw layer of the fake backend."""

    def __init__(self, settings: MetraleSettings, ordinal: int) -> None:
        own = settings.plugin(FakeSettings)
        self._capacity = own.memory_bytes
        self._integrated = own.integrated
        self._defer = own.defer
        self._ordinal = ordinal
        self._lock = threading.RLock()
        self._used = 0
        self._next_device = _DEVICE_BASE
        self._next_host = _HOST_BASE
        self._bases: list[int] = []
        self._allocs: dict[int, _Allocation] = {}
        self._host: dict[int, np.ndarray] = {}
        self._host_free: dict[int, list[int]] = {}  # rounded size -> freed host addresses, handed out again
        self._streams: set[_FakeStream] = set()
        self._faults: dict[str, list[list[object]]] = {}
        self._sticky: tuple[str, str] | None = None  # (CUDA name, cause) of a sticky fault
        self._implementations: dict[tuple[str, str], KernelImplementation] = {}
        major, minor = own.compute_capability.split(".")
        self._capability = (int(major), int(minor))

    # -- fault injection ----------------------------------------------------------

    def inject_fault(self, op: str, nth: int, code: str) -> None:
        """Make the ``nth`` next call of raw ``op`` fail once with ``code``."""
        with self._lock:
            self._faults.setdefault(op, []).append([nth, code])

    def _fault(self, op: str, what: str) -> None:
        if self._sticky is not None:  # as CUDA: after a sticky fault every call returns it
            self._raise_sticky(what)
        pending = self._faults.get(op)
        if not pending:
            return
        fired = None
        for entry in pending:
            entry[0] = int(entry[0]) - 1  # type: ignore[call-overload]
            if entry[0] == 0:
                fired = entry
        pending[:] = [e for e in pending if int(e[0]) > 0]  # type: ignore[call-overload]
        if fired is not None:
            raise error_for_code(str(fired[1]), f"{what} (a fault injected into the fake's {op!r})")

    # -- the device ---------------------------------------------------------------

    def device_name(self) -> str:
        kind = "integrated" if self._integrated else "discrete"
        return f"metrale fake device {self._ordinal} ({format_bytes(self._capacity)}, {kind})"

    def mem_get_info(self) -> tuple[int, int]:
        with self._lock:
            return self._capacity - self._used, self._capacity

    def is_integrated(self) -> bool | None:
        return self._integrated

    def close(self) -> None:
        with self._lock:
            self._sticky = None
            self._allocs.clear()
            self._bases.clear()
            self._host.clear()
            self._streams.clear()
            self._used = 0

    # -- memory -------------------------------------------------------------------

    def alloc(self, nbytes: int, kind: AllocKind) -> int:
        with self._lock:
            self._fault("alloc", f"alloc of {nbytes} bytes")
            if self._used + nbytes > self._capacity:
                raise error_for_code("CUDA_ERROR_OUT_OF_MEMORY", f"fake alloc of {nbytes} bytes", requested=nbytes)
            base = self._next_device
            self._next_device = base + (nbytes + _GAP + _ALIGN - 1) // _ALIGN * _ALIGN
            self._allocs[base] = _Allocation(base, nbytes, kind, np.zeros(nbytes, dtype=np.uint8))
            bisect.insort(self._bases, base)
            self._used += nbytes
            return base

    def free(self, ptr: int, kind: AllocKind) -> None:
        with self._lock:
            self._drain_all()
            self._fault("free", f"free of {ptr:#x}")
            alloc = self._allocs.pop(ptr, None)
            if alloc is None:
                raise error_for_code("CUDA_ERROR_INVALID_VALUE", f"fake free of {ptr:#x}")
            self._bases.remove(ptr)
            self._used -= alloc.size

    def alloc_host(self, nbytes: int) -> tuple[int, memoryview]:
        with self._lock:
            self._fault("alloc", f"alloc_host of {nbytes} bytes")
            span = (nbytes + _GAP + _ALIGN - 1) // _ALIGN * _ALIGN
            reuse = self._host_free.get(span)
            if reuse:  # as a driver does: a freed address comes back, latest first
                ptr = reuse.pop()
            else:
                ptr = self._next_host
                self._next_host = ptr + span
            data = np.zeros(nbytes, dtype=np.uint8)
            self._host[ptr] = data
            return ptr, data.data

    def free_host(self, ptr: int) -> None:
        with self._lock:
            self._drain_all()
            self._fault("free", f"free_host of {ptr:#x}")
            data = self._host.pop(ptr, None)
            if data is None:
                raise error_for_code("CUDA_ERROR_INVALID_VALUE", f"fake free_host of {ptr:#x}")
            self._host_free.setdefault((len(data) + _GAP + _ALIGN - 1) // _ALIGN * _ALIGN, []).append(ptr)

    def _tail(self, ptr: int) -> np.ndarray | None:
        """The bytes from ``ptr`` to the end of the allocation holding it (empty at its end), else ``None``."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            alloc = self._allocs[self._bases[i]]
            if ptr - alloc.base <= alloc.size:
                return alloc.data[ptr - alloc.base :]
        return None

    def _find(self, ptr: int, nbytes: int) -> np.ndarray | None:
        """The bytes ``[ptr, ptr + nbytes)`` if they lie inside one allocation, else ``None``."""
        tail = self._tail(ptr)
        return None if tail is None or len(tail) < nbytes else tail[:nbytes]

    def _resolve(self, ptr: int, nbytes: int, what: str) -> np.ndarray:
        """The bytes ``[ptr, ptr + nbytes)``, which must lie inside one allocation, as the driver checks."""
        found = self._find(ptr, nbytes)
        if found is None:
            raise error_for_code("CUDA_ERROR_INVALID_VALUE", f"fake {what} of [{ptr:#x}, {ptr + nbytes:#x})")
        return found

    # -- interop ----------------------------------------------------------------------

    def export_memory(self, ptr: int, nbytes: int) -> ForeignMemory:
        """The fake's device memory is host memory: a numpy view of it, which keeps it alive."""
        with self._lock:
            view = self._resolve(ptr, nbytes, "export")
            return ForeignMemory("cpu", 0, int(view.ctypes.data), nbytes, view)

    def import_memory(self, memory: ForeignMemory) -> int:
        """Host memory gets a range of the fake's address space, backed by the memory itself."""
        if memory.device != "cpu":
            raise error_for_code(
                "CUDA_ERROR_INVALID_DEVICE",
                f"fake import of {memory.nbytes} bytes of {memory.device} memory: the fake device can only "
                f"address host memory (a numpy array, or a DLPack tensor on the CPU)",
            )
        data = np.ctypeslib.as_array((ctypes.c_uint8 * memory.nbytes).from_address(memory.address))
        with self._lock:
            base = self._next_device
            self._next_device = base + (memory.nbytes + _GAP + _ALIGN - 1) // _ALIGN * _ALIGN
            self._allocs[base] = _Allocation(base, memory.nbytes, "external", data)
            bisect.insort(self._bases, base)
            return base

    def forget_memory(self, ptr: int) -> None:
        with self._lock:
            self._drain_all()
            alloc = self._allocs.get(ptr)
            if alloc is None or alloc.kind != "external":
                raise error_for_code("CUDA_ERROR_INVALID_VALUE", f"fake forget of {ptr:#x}")
            del self._allocs[ptr]
            self._bases.remove(ptr)

    def baseline(self) -> Baseline:
        """numpy, what a program without a GPU would call (``metrale bench`` compares the fake with it)."""
        return NumpyBaseline()

    # -- work on streams ------------------------------------------------------------

    def _submit(self, stream: object, work: Work, *, wait: bool = False) -> None:
        s = _as_stream(stream)
        if s.capture is not None:
            s.capture.append(work)
            return
        if not self._defer:
            work()
            return
        s.issued += 1
        s.queue.append((s.issued, work))
        if wait:
            self._drain(s, s.issued)

    def _drain(self, s: _FakeStream, upto: int) -> None:
        while s.queue and s.queue[0][0] <= upto:
            seq, work = s.queue.popleft()
            s.done = seq
            work()
        if self._sticky is not None:  # a kernel that ran just now faulted: this call reports it
            self._raise_sticky("synchronization")

    def _raise_sticky(self, what: str) -> None:
        assert self._sticky is not None
        name, cause = self._sticky
        raise error_for_code(name, f"{what} (the device faulted: {cause})")

    def _drain_all(self) -> None:
        for s in list(self._streams):
            self._drain(s, s.issued)

    def memset(self, ptr: int, value: int, nbytes: int, stream: object) -> None:
        with self._lock:
            self._fault("memset", f"memset of {nbytes} bytes at {ptr:#x}")
            target = self._resolve(ptr, nbytes, "memset")

            def work() -> None:
                target[:] = value

            self._submit(stream, work)

    def copy_htod(self, dst: int, src: memoryview, stream: object, *, pinned: bool) -> None:
        with self._lock:
            self._fault("memcpy", f"copy of {src.nbytes} bytes to {dst:#x}")
            target = self._resolve(dst, src.nbytes, "copy_htod")
            source = np.frombuffer(src, dtype=np.uint8)

            def work() -> None:
                target[:] = source

            self._submit(stream, work, wait=not pinned)

    def copy_dtoh(self, dst: memoryview, src: int, stream: object, *, pinned: bool, may_wait: bool = True) -> None:
        with self._lock:
            self._fault("memcpy", f"copy of {dst.nbytes} bytes from {src:#x}")
            source = self._resolve(src, dst.nbytes, "copy_dtoh")
            target = np.frombuffer(dst, dtype=np.uint8)

            def work() -> None:
                target[:] = source

            self._submit(stream, work, wait=not pinned)

    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: object) -> None:
        with self._lock:
            self._fault("memcpy", f"copy of {nbytes} bytes from {src:#x} to {dst:#x}")
            source = self._resolve(src, nbytes, "copy_dtod")
            target = self._resolve(dst, nbytes, "copy_dtod")

            def work() -> None:
                target[:] = source  # numpy handles overlap as memmove does

            self._submit(stream, work)

    # -- streams and events ------------------------------------------------------------

    def stream_create(self) -> object:
        with self._lock:
            s = _FakeStream()
            self._streams.add(s)
            return s

    def stream_destroy(self, stream: object) -> None:
        with self._lock:
            s = _as_stream(stream)
            self._drain(s, s.issued)
            self._streams.discard(s)

    def stream_synchronize(self, stream: object) -> None:
        with self._lock:
            self._fault("synchronize", "stream synchronize")
            s = _as_stream(stream)
            self._drain(s, s.issued)

    def stream_query(self, stream: object) -> bool:
        with self._lock:
            self._fault("", "stream query")
            s = _as_stream(stream)
            self._drain(s, s.issued)
            return True

    def stream_wait_event(self, stream: object, event: object) -> None:
        with self._lock:
            self._fault("", "stream wait event")
            e = _as_event(event)
            if e.stream is not None and e.stream.capture is None:
                self._drain(e.stream, e.seq)

    def event_create(self) -> object:
        return _FakeEvent()

    def event_destroy(self, event: object) -> None:
        _as_event(event)

    def event_record(self, event: object, stream: object) -> None:
        with self._lock:
            self._fault("", "event record")
            e = _as_event(event)
            s = _as_stream(stream)

            def work() -> None:
                e.time = time.perf_counter()

            if s.capture is None:
                e.time = None
            self._submit(s, work)
            e.stream = s
            e.seq = s.issued

    def event_synchronize(self, event: object) -> None:
        with self._lock:
            self._fault("synchronize", "event synchronize")
            e = _as_event(event)
            if e.stream is not None:
                self._drain(e.stream, e.seq)

    def event_query(self, event: object) -> bool:
        with self._lock:
            self._fault("", "event query")
            e = _as_event(event)
            if e.stream is not None:
                self._drain(e.stream, e.seq)
            return True

    def event_elapsed_ms(self, start: object, end: object) -> float:
        with self._lock:
            a, b = _as_event(start), _as_event(end)
            if a.time is None or b.time is None:
                raise error_for_code("CUDA_ERROR_NOT_READY", "event elapsed time")
            return (b.time - a.time) * 1000.0

    def synchronize(self) -> None:
        with self._lock:
            self._fault("synchronize", "device synchronize")
            self._drain_all()

    # -- capture and graphs ------------------------------------------------------------

    def begin_capture(self, stream: object) -> None:
        with self._lock:
            s = _as_stream(stream)
            if s.capture is not None:
                raise error_for_code("CUDA_ERROR_ILLEGAL_STATE", "begin capture")
            s.capture = []

    def end_capture(self, stream: object) -> object:
        with self._lock:
            s = _as_stream(stream)
            if s.capture is None:
                raise error_for_code("CUDA_ERROR_ILLEGAL_STATE", "end capture")
            work, s.capture = s.capture, None
            return _FakeGraph(work)

    def is_capturing(self, stream: object) -> bool:
        with self._lock:
            self._fault("is_capturing", "stream capture query")
            return _as_stream(stream).capture is not None

    def graph_instantiate(self, graph: object) -> object:
        with self._lock:
            self._fault("graph_instantiate", "graph instantiate")
            if not isinstance(graph, _FakeGraph):
                raise error_for_code("CUDA_ERROR_INVALID_HANDLE", "graph instantiate")
            return _FakeGraph(list(graph.work))

    def graph_launch(self, graph_exec: object, stream: object) -> None:
        with self._lock:
            self._fault("graph_launch", "graph launch")
            if not isinstance(graph_exec, _FakeGraph):
                raise error_for_code("CUDA_ERROR_INVALID_HANDLE", "graph launch")
            work = graph_exec.work

            def run() -> None:
                for step in work:
                    step()

            self._submit(stream, run)

    def graph_destroy(self, graph: object) -> None:
        pass

    def graph_exec_destroy(self, graph_exec: object) -> None:
        pass


    # -- kernels ---------------------------------------------------------------------------

    def compute_capability(self) -> tuple[int, int]:
        return self._capability

    def module_load(self, name: str, image: bytes) -> object:
        with self._lock:
            self._fault("", f"module load of {name}")
            return _FakeModule(name, frozenset(parse_ptx(name, image).entries))

    def module_unload(self, module: object) -> None:
        if not isinstance(module, _FakeModule):
            raise error_for_code("CUDA_ERROR_INVALID_HANDLE", "module unload")

    def module_function(self, module: object, kernel: str) -> object:
        if not isinstance(module, _FakeModule) or kernel not in module.kernels:
            raise error_for_code("CUDA_ERROR_NOT_FOUND", f"kernel {kernel!r}")
        return (module.name, kernel)

    def add_kernel_implementations(self, implementations: Iterable[KernelImplementation]) -> None:
        with self._lock:
            for impl in implementations:
                self._implementations[(impl.module, impl.kernel)] = impl

    def launch(
        self,
        function: object,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: object,
        args: Sequence[LaunchArg],
    ) -> None:
        with self._lock:
            self._fault("launch", "kernel launch")
            if not isinstance(function, tuple):
                raise error_for_code("CUDA_ERROR_INVALID_HANDLE", "kernel launch")
            module, kernel = cast(tuple[str, str], function)
            impl = self._implementations.get((module, kernel))
            if impl is None:
                err = error_for_code("CUDA_ERROR_NOT_SUPPORTED", f"fake launch of {module}.{kernel}")
                raise type(err)(
                    f"the fake backend has no Python implementation of kernel {kernel!r} of module "
                    f"{module!r}: decorate one with @metrale_core.kernel_implementation({module!r}, "
                    f"{kernel!r}) and register it with backend.add_kernel_implementations(...), or "
                    f"return it from a plugin's metrale_kernel_implementations hook",
                    code=err.code,
                    name=err.name,
                )
            launch = FakeLaunch(module, kernel, grid, block, shared_mem, self._device_bytes)
            frozen = tuple(args)

            def work() -> None:
                if self._sticky is not None:
                    return
                try:
                    impl.function(launch, *(self._kernel_arg(a) for a in frozen))
                except MisalignedAddressError as exc:
                    self._sticky = ("CUDA_ERROR_MISALIGNED_ADDRESS", f"kernel {module}.{kernel}: {exc}")
                except (IndexError, ValueError) as exc:
                    self._sticky = ("CUDA_ERROR_ILLEGAL_ADDRESS", f"kernel {module}.{kernel} accessed memory "
                                    f"outside any allocation ({exc})")
                except Exception as exc:
                    self._sticky = ("CUDA_ERROR_LAUNCH_FAILED", f"kernel {module}.{kernel} raised "
                                    f"{type(exc).__name__}: {exc}")

            self._submit(stream, work)

    def _device_bytes(self, address: int, nbytes: int) -> np.ndarray:
        found = self._find(address, nbytes)
        if found is None:
            raise IndexError(f"[{address:#x}, {address + nbytes:#x}) is not inside one allocation")
        return found

    def _kernel_arg(self, arg: LaunchArg) -> object:
        if arg.pointer is not None:
            tail = self._tail(arg.pointer)
            return np.empty(0, dtype=np.uint8) if tail is None else tail  # empty: any access faults
        if arg.param.count > 1:
            return arg.data
        return np.frombuffer(arg.data, dtype=_DTYPES[(arg.param.kind, arg.param.size)])[0]


def _as_stream(stream: object) -> _FakeStream:
    if not isinstance(stream, _FakeStream):
        raise error_for_code("CUDA_ERROR_INVALID_HANDLE", f"stream {stream!r}")
    return stream


def _as_event(event: object) -> _FakeEvent:
    if not isinstance(event, _FakeEvent):
        raise error_for_code("CUDA_ERROR_INVALID_HANDLE", f"event {event!r}")
    return event
