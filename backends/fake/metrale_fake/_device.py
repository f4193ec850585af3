"""The fake device: memory in host arrays, streams as queues, graphs as recorded work.

It speaks CUDA's vocabulary: where the driver fails, it raises the error
[`metrale_core.error_for_code`][metrale_core.error_for_code] gives for the driver's result code. Its
address space (its own window, freed addresses handed out again) is
``_memory``'s.
"""

from __future__ import annotations

import ctypes
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Final, cast, get_args

import numpy as np

from metrale_core import MetraleSettings, parse_ptx
from metrale_core.plugin import (
    AllocKind,
    Baseline,
    CaptureMode,
    ForeignMemory,
    KernelImplementation,
    LaunchArg,
    RawDevice,
    TensorMapEncoding,
    check_tensor_map,
    error_for_code,
    format_bytes,
    is_sticky,
)

from ._baseline import NumpyBaseline
from ._launch import FakeLaunch, MisalignedAddressError, kernel_arg, no_implementation
from ._memory import KEEP_BYTES, AddressSpace, Window, check_importable, check_pinnable, give_back, take_window, zeros
from ._settings import FakeSettings
from ._tensormap import decode_image, encode_image
from ._visible import fake_uuid
from ._work import CAPTURES, FakeEvent, FakeGraph, FakeModule, FakeStream, Work, as_event, as_stream

__all__ = ["FAULT_OPS", "FakeDevice"]

#: The raw operations [`FakeDevice.inject_fault`][metrale_fake.FakeDevice.inject_fault] can make fail.
FAULT_OPS: Final = frozenset(
    {"alloc", "free", "memcpy", "memset", "graph_instantiate", "graph_launch", "synchronize", "is_capturing",
     "launch"}
)

_NOT_FREED: Final = frozenset({"external", "mapped"})  # device memory [`FakeDevice.free`][metrale_fake.FakeDevice.free]
                                                       # refuses


class FakeDevice(RawDevice):
    """The raw layer of the fake backend."""

    def fresh_memory_reads_zeros(self) -> bool:
        return True  # (what the guide promises; the core keeps it for the blocks it recycles)

    def __init__(self, settings: MetraleSettings, ordinal: int, index: int | None = None) -> None:
        """Fake device ``index`` (of all: its UUID's) as this process's ``ordinal`` (``None``: the same)."""
        own = settings.plugin(FakeSettings)
        self._index = ordinal if index is None else index
        self._capacity = own.memory_bytes
        self._integrated = own.integrated
        self._defer = own.defer
        self._ordinal = ordinal
        self._peer_access = own.peer_access
        self._lock = threading.RLock()
        self._used = 0  # bytes of device allocations (imported memory is its owner's)
        self._host_used = 0  # bytes of pinned host memory
        self._window = take_window(self._capacity)
        weakref.finalize(self, give_back, self._window).atexit = False  # its addresses are this device's till then
        self._device = AddressSpace(
            *self._window.device, reuse=own.reuse_addresses, what="device memory",
            keep_bytes=min(self._capacity, KEEP_BYTES),  # freed arrays of zeros kept for reuse (see _memory)
        )
        self._host = AddressSpace(*self._window.host, reuse=True, what="host memory")  # reused always, as ever
        self._mapped: dict[int, int] = {}  # host address of mapped pinned memory -> its device address
        self._streams: set[FakeStream] = set()
        self._foreign: dict[int, FakeStream] = {}  # another library's stream handle -> its stream (`foreign_stream`)
        self._graphs: weakref.WeakSet[FakeGraph] = weakref.WeakSet()
        self._faults: dict[str, list[list[object]]] = {}
        self._sticky: tuple[str, str] | None = None  # (CUDA name, cause) of a sticky fault
        self._implementations: dict[tuple[str, str], KernelImplementation] = {}
        self._shared = np.zeros(0, dtype=np.uint8)  # the shared memory blocks find: what launches left there
        major, minor = own.compute_capability.split(".")
        self._capability = (int(major), int(minor))
        self._multiprocessors = (own.multiprocessors, own.shared_memory_per_multiprocessor)

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
            code = str(fired[1])
            cause = f"{what} (a fault injected into the fake's {op!r})"
            if is_sticky(code):  # as CUDA: a sticky fault stays, and every later call returns it
                self._sticky = (code, cause)
            raise error_for_code(code, cause)

    # -- the device ---------------------------------------------------------------

    def device_name(self) -> str:
        kind = "integrated" if self._integrated else "discrete"
        return f"metrale fake device {self._ordinal} ({format_bytes(self._capacity)}, {kind})"

    def mem_get_info(self) -> tuple[int, int]:
        with self._lock:
            return self._capacity - self._used, self._capacity

    def is_integrated(self) -> bool | None:
        return self._integrated

    def _leftover(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of the device's shared memory as the last launches left it (grown with zeros)."""
        if len(self._shared) < nbytes:
            grown = np.zeros(nbytes, dtype=np.uint8)
            grown[: len(self._shared)] = self._shared
            self._shared = grown
        return self._shared[:nbytes]

    def _faulted(self) -> bool:
        """Whether a sticky fault latched (its captures then bar no other device)."""
        return self._sticky is not None

    def close(self) -> None:
        """Drop everything that holds memory: allocations, host and imported memory, freed ranges, the
        streams' queued work, graphs' recorded work and the kernel implementations, so a closed fake holds
        none even while something still references it. Its addresses stay its own while it lives."""
        with self._lock:
            self._sticky = None
            for s in self._streams:
                s.queue.clear()
                s.capture = None
                CAPTURES.end(s)
            self._streams.clear()
            self._foreign.clear()
            for g in list(self._graphs):
                g.work = ()
            self._graphs.clear()
            self._device.clear()
            self._host.clear()
            self._mapped.clear()
            self._implementations.clear()
            self._shared = np.zeros(0, dtype=np.uint8)
            self._faults.clear()
            self._used = self._host_used = 0

    @property
    def address_window(self) -> Window:
        """This device's own addresses: every address it hands out (host, device or imported memory) lies
        in ``[window.base, window.base + window.size)``, and in no other live fake device's window."""
        return self._window

    # -- memory -------------------------------------------------------------------

    def alloc(self, nbytes: int, kind: AllocKind) -> int:
        lock = self._lock
        lock.acquire()  # (not ``with``: half the cost on this hot path, the same release on every way out)
        try:
            if self._sticky is not None or self._faults.get("alloc"):  # (the message is made only then)
                self._fault("alloc", f"alloc of {nbytes} bytes")
            CAPTURES.bar("alloc")
            used = self._used + nbytes
            if used > self._capacity:
                raise error_for_code("CUDA_ERROR_OUT_OF_MEMORY", f"fake alloc of {nbytes} bytes", requested=nbytes)
            base = self._device.place_zeros(nbytes, kind, "fake alloc")
            self._used = used
            return base
        finally:
            lock.release()

    def free(self, ptr: int, kind: AllocKind) -> None:
        lock = self._lock
        lock.acquire()
        try:
            if self._sticky is not None:
                self._drain_all()  # (which raises it where a stream is open)
            else:
                for s in self._streams:
                    if s.queue:  # pending work runs first, as the driver's free waits for it
                        self._drain_all()
                        break
            if self._sticky is not None or self._faults.get("free"):
                self._fault("free", f"free of {ptr:#x}")
            CAPTURES.bar("free")
            alloc = self._device.remove_unless(ptr, _NOT_FREED)
            if alloc is None:
                raise error_for_code("CUDA_ERROR_INVALID_VALUE", f"fake free of {ptr:#x}")
            self._used -= alloc.size
        finally:
            lock.release()

    def alloc_host(self, nbytes: int) -> tuple[int, memoryview]:
        with self._lock:
            if self._sticky is not None or self._faults.get("alloc"):
                self._fault("alloc", f"alloc_host of {nbytes} bytes")
            CAPTURES.bar("alloc_host")
            check_pinnable(nbytes, self._host_used)
            data = zeros(nbytes, "fake alloc_host")
            ptr = self._host.place(nbytes, "host", data)
            self._host_used += nbytes
            return ptr, data.data

    def alloc_host_mapped(self, nbytes: int) -> tuple[int, memoryview, int]:
        """Pinned host memory that kernels address too: its bytes are also placed among the device's
        addresses (kind ``"mapped"``: never freed by [`free`][metrale_fake.FakeDevice.free]), so a kernel's write shows
        in the view."""
        with self._lock:
            self._fault("alloc", f"alloc_host_mapped of {nbytes} bytes")
            CAPTURES.bar("alloc_host")
            check_pinnable(nbytes, self._host_used)
            data = zeros(nbytes, "fake alloc_host_mapped")
            ptr = self._host.place(nbytes, "host", data)
            try:
                device_ptr = self._device.place(nbytes, "mapped", data)
            except BaseException:
                self._host.remove(ptr)
                raise
            self._mapped[ptr] = device_ptr
            self._host_used += nbytes
            return ptr, data.data, device_ptr

    def free_host(self, ptr: int) -> None:
        with self._lock:
            self._drain_all()
            self._fault("free", f"free_host of {ptr:#x}")
            CAPTURES.bar("free_host")
            alloc = self._host.remove(ptr)
            if alloc is None:
                raise error_for_code("CUDA_ERROR_INVALID_VALUE", f"fake free_host of {ptr:#x}")
            device_ptr = self._mapped.pop(ptr, None)
            if device_ptr is not None:
                self._device.remove(device_ptr)
            self._host_used -= alloc.size

    def address_range(self, ptr: int) -> tuple[int, int]:
        """``(base, nbytes)`` of the allocation holding ``ptr``: device memory, imported memory or pinned
        host memory (an empty allocation holds its own base); ``CUDA_ERROR_NOT_FOUND`` for an address
        inside none, a gap or a freed range among them."""
        with self._lock:
            for space in (self._device, self._host):
                alloc = space.holding(ptr)
                if alloc is not None:
                    return alloc.base, alloc.size
        raise error_for_code("CUDA_ERROR_NOT_FOUND", f"fake address range of {ptr:#x}: no allocation holds it")

    def _resolve(self, ptr: int, nbytes: int, what: str) -> np.ndarray:
        """The bytes ``[ptr, ptr + nbytes)``, which must lie inside one allocation, as the driver checks."""
        found = self._device.find(ptr, nbytes)
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
        """Host memory gets a range of the fake's device addresses, backed by the memory itself.

        The fake cannot know how large the producer's host allocation really is:
        [`address_range`][metrale_fake.FakeDevice.address_range] answers the extent claimed, and only a claim past the
        host's memory is refused."""
        if memory.device != "cpu":
            raise error_for_code(
                "CUDA_ERROR_INVALID_DEVICE",
                f"fake import of {memory.nbytes} bytes of {memory.device} memory: the fake device can only "
                f"address host memory (a numpy array, or a DLPack tensor on the CPU)",
            )
        check_importable(memory.nbytes, memory.address)
        data = np.ctypeslib.as_array((ctypes.c_uint8 * memory.nbytes).from_address(memory.address))
        with self._lock:
            return self._device.place(memory.nbytes, "external", data)

    def order_foreign_stream(self, stream: int) -> None:
        """The consumer of the fake's memory is host code (its tensors are on the CPU), whatever stream it
        names: the work queued on every stream runs now, before it reads."""
        with self._lock:
            self._fault("", "order foreign stream")
            self._drain_all()

    def foreign_stream(self, stream: int) -> object:
        """Another library's stream: on the fake, whose memory other libraries reach from host code, a stream of its
        own (one per handle, kept until close) whose work runs in order with the others' as any fake stream's; no
        handle is refused, as a ``CUstream`` is not checked before use."""
        with self._lock:
            self._fault("", "foreign stream")
            s = self._foreign.get(stream)
            if s is None:
                s = self._foreign[stream] = FakeStream()
                self._streams.add(s)
            return s

    def forget_memory(self, ptr: int) -> None:
        with self._lock:
            self._drain_all()
            alloc = self._device.get(ptr)
            if alloc is None or alloc.kind != "external":
                raise error_for_code("CUDA_ERROR_INVALID_VALUE", f"fake forget of {ptr:#x}")
            self._device.remove(ptr)

    def baseline(self) -> Baseline:
        """numpy, what a program without a GPU would call (``metrale bench`` compares the fake with it)."""
        return NumpyBaseline()

    # -- work on streams ------------------------------------------------------------

    def _submit(self, stream: object, work: Work, *, wait: bool = False) -> None:
        s = as_stream(stream)
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

    def _drain(self, s: FakeStream, upto: int) -> None:
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
            if self._sticky is not None or self._faults.get("memset"):  # (the message is made only then)
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

    def copy_peer(self, dst: int, src_device: RawDevice, src: int, nbytes: int, stream: object) -> None:
        """A real copy from another fake device's memory, ordered on this device's ``stream``.

        Eager, the source's bytes are taken when the copy is issued (with ``defer``, a copy of them waits
        in the queue): a queued copy never reads memory freed or closed meanwhile, and holds nothing of the
        source device. Captured, the graph reads the source when it runs, through a weak reference: a graph
        keeps no closed device's memory (the core refuses its launch once the source is not live)."""
        if not isinstance(src_device, FakeDevice):
            raise error_for_code(
                "CUDA_ERROR_INVALID_DEVICE", f"fake copy_peer: the source is not an open fake device ({src_device!r})"
            )
        with src_device._lock:  # one device's lock at a time: copies both ways on two threads cannot deadlock
            src_device._fault("memcpy", f"peer copy of {nbytes} bytes from {src:#x}")
            source = src_device._resolve(src, nbytes, "copy_peer (source)")
        with self._lock:
            self._fault("memcpy", f"peer copy of {nbytes} bytes to {dst:#x}")
            target = self._resolve(dst, nbytes, "copy_peer")
            if as_stream(stream).capture is None:
                data = source.copy() if self._defer else source

                def work() -> None:
                    target[:] = data

            else:
                ref = weakref.ref(src_device)

                def work() -> None:
                    device = ref()
                    found = None if device is None else device._device.find(src, nbytes)
                    if found is None:
                        raise error_for_code(
                            "CUDA_ERROR_INVALID_VALUE", f"fake copy_peer of [{src:#x}, {src + nbytes:#x}): the source "
                            f"device closed or its memory was freed"
                        )
                    target[:] = found

            self._submit(stream, work)

    def enable_peer_access(self, peer: RawDevice) -> None:
        """Nothing to enable between fake devices; refused where the ``peer_access`` setting says they cannot
        reach each other, as ``cuDeviceCanAccessPeer`` answering 0 is."""
        if not isinstance(peer, FakeDevice):
            raise error_for_code(
                "CUDA_ERROR_INVALID_DEVICE", f"fake enable_peer_access: the peer is not a fake device ({peer!r})"
            )
        if peer._index != self._index and not (self._peer_access and peer._peer_access):
            raise error_for_code(
                "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
                f"fake enable_peer_access: fake device {self._ordinal} cannot access device {peer._ordinal} "
                f"(METRALE_FAKE_PEER_ACCESS is off)",
            )

    def device_uuid(self) -> str:
        """A UUID of this fake device (of its index among all, whatever ordinal ``CUDA_VISIBLE_DEVICES`` gives it
        here), written as ``nvidia-smi -L`` writes a GPU's: ``FAKE-`` and the UUID. As on CUDA, two backends on
        one device report the same one; fakes of two processes do too, and an origin tells them apart by host
        and pid."""
        return fake_uuid(self._index)

    # -- streams and events ------------------------------------------------------------

    def stream_create(self) -> object:
        with self._lock:
            s = FakeStream()
            self._streams.add(s)
            return s

    def stream_destroy(self, stream: object) -> None:
        with self._lock:
            s = as_stream(stream)
            self._drain(s, s.issued)
            self._streams.discard(s)

    def stream_synchronize(self, stream: object) -> None:
        with self._lock:
            self._fault("synchronize", "stream synchronize")
            CAPTURES.bar("stream synchronize")
            s = as_stream(stream)
            self._drain(s, s.issued)

    def stream_query(self, stream: object) -> bool:
        with self._lock:
            self._fault("", "stream query")
            CAPTURES.bar("stream query")
            s = as_stream(stream)
            self._drain(s, s.issued)
            return True

    def stream_wait_event(self, stream: object, event: object) -> None:
        with self._lock:
            self._fault("", "stream wait event")
            e = as_event(event)
            if e.stream is not None and e.stream.capture is None:
                self._drain(e.stream, e.seq)

    def event_create(self) -> object:
        return FakeEvent()

    def event_destroy(self, event: object) -> None:
        as_event(event)

    def event_record(self, event: object, stream: object) -> None:
        with self._lock:
            self._fault("", "event record")
            e = as_event(event)
            s = as_stream(stream)

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
            CAPTURES.bar("event synchronize")
            e = as_event(event)
            if e.stream is not None:
                self._drain(e.stream, e.seq)

    def event_query(self, event: object) -> bool:
        with self._lock:
            self._fault("", "event query")
            CAPTURES.bar("event query")
            e = as_event(event)
            if e.stream is not None:
                self._drain(e.stream, e.seq)
            return True

    def event_elapsed_ms(self, start: object, end: object) -> float:
        with self._lock:
            a, b = as_event(start), as_event(end)
            if a.time is None or b.time is None:
                raise error_for_code("CUDA_ERROR_NOT_READY", "event elapsed time")
            return (b.time - a.time) * 1000.0

    def synchronize(self) -> None:
        with self._lock:
            self._fault("synchronize", "device synchronize")
            CAPTURES.bar("device synchronize")
            self._drain_all()

    # -- capture and graphs ------------------------------------------------------------

    def begin_capture(self, stream: object) -> None:
        with self._lock:
            s = as_stream(stream)
            if s.capture is not None:
                raise error_for_code("CUDA_ERROR_ILLEGAL_STATE", "begin capture")
            s.capture = []
            s.invalidated = ""
            CAPTURES.begin(s, self._faulted)

    def end_capture(self, stream: object) -> object:
        with self._lock:
            s = as_stream(stream)
            if s.capture is None:
                raise error_for_code("CUDA_ERROR_ILLEGAL_STATE", "end capture")
            work, s.capture = s.capture, None
            CAPTURES.end(s)
            if s.invalidated:
                why, s.invalidated = s.invalidated, ""
                raise error_for_code("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", f"fake end capture ({why})")
            return self._graph(work)

    def _graph(self, work: list[Work]) -> FakeGraph:
        graph = FakeGraph(work)
        self._graphs.add(graph)  # close() empties it: its recorded work holds device memory
        return graph

    def is_capturing(self, stream: object) -> bool:
        with self._lock:
            self._fault("is_capturing", "stream capture query")
            return as_stream(stream).capture is not None

    def exchange_capture_mode(self, mode: CaptureMode) -> CaptureMode:
        """The calling thread's capture mode, as CUDA keeps it per thread: a relaxed thread allocates and frees while
        a capture in global mode runs (`GlobalCaptures.exchange`)."""
        if mode not in get_args(CaptureMode):
            raise error_for_code("CUDA_ERROR_INVALID_VALUE", f"fake exchange_capture_mode({mode!r})")
        return cast("CaptureMode", CAPTURES.exchange(mode))

    def graph_instantiate(self, graph: object) -> object:
        with self._lock:
            self._fault("graph_instantiate", "graph instantiate")
            if not isinstance(graph, FakeGraph):
                raise error_for_code("CUDA_ERROR_INVALID_HANDLE", "graph instantiate")
            return self._graph(list(graph.work))

    def graph_launch(self, graph_exec: object, stream: object) -> None:
        with self._lock:
            self._fault("graph_launch", "graph launch")
            if not isinstance(graph_exec, FakeGraph):
                raise error_for_code("CUDA_ERROR_INVALID_HANDLE", "graph launch")
            work = graph_exec.work

            def run() -> None:
                for step in work:
                    step()

            self._submit(stream, run)

    def graph_destroy(self, graph: object) -> None:
        if isinstance(graph, FakeGraph):
            graph.work = ()  # a destroyed graph holds no memory, whoever still references it

    def graph_exec_destroy(self, graph_exec: object) -> None:
        self.graph_destroy(graph_exec)

    # -- kernels ---------------------------------------------------------------------------

    def compute_capability(self) -> tuple[int, int]:
        return self._capability

    def module_load(self, name: str, image: bytes) -> object:
        with self._lock:
            self._fault("", f"module load of {name}")
            return FakeModule(name, frozenset(parse_ptx(name, image).entries))

    def module_unload(self, module: object) -> None:
        if not isinstance(module, FakeModule):
            raise error_for_code("CUDA_ERROR_INVALID_HANDLE", "module unload")

    def module_function(self, module: object, kernel: str) -> object:
        if not isinstance(module, FakeModule) or kernel not in module.kernels:
            raise error_for_code("CUDA_ERROR_NOT_FOUND", f"kernel {kernel!r}")
        return (module.name, kernel)

    def multiprocessors(self) -> tuple[int, int]:
        return self._multiprocessors

    def tensor_map_encode(self, encoding: TensorMapEncoding, address: int) -> bytes:
        """The driver's rules (the core's public checker, as the fake's "driver"), then the fake's image."""
        check_tensor_map(
            encoding.spec(), address, compute_capability=self._capability, smem_per_sm=self._multiprocessors[1]
        )
        return encode_image(encoding, address)

    def tensor_map_replace_address(self, image: bytes, address: int) -> bytes:
        """As ``cuTensorMapReplaceAddress``: an address that breaks the map's alignment, or NULL, is refused."""
        encoding, _ = decode_image(image)
        align = 32 if encoding.interleave == 2 else 16
        if address == 0 or address % align:
            raise error_for_code(
                "CUDA_ERROR_INVALID_VALUE", f"tensor map replace address: {address:#x} is NULL or not a multiple of "
                f"{align}"
            )
        return encode_image(encoding, address)

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
                raise no_implementation(module, kernel)
            launch = FakeLaunch(module, kernel, grid, block, shared_mem, self._device.view, self._leftover,
                                self._device.extent)
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


    def _kernel_arg(self, arg: LaunchArg) -> object:
        return kernel_arg(arg, None if arg.pointer is None else self._device.tail(arg.pointer))
