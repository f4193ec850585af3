"""The compiled lane's door into a plugin's C functions (``RawDevice.device_calls``, issue 38), on the CPU.

The fake offers no C functions of its own; here each test gives its devices a door built with ``ctypes``: a real
``metrale_core.device_calls.v1`` capsule whose C function pointers call the fake device's own methods. So the lane
runs the same C code it runs over the CUDA plugin's door (``_cdriver.DeviceCalls``, tested on the GPU in
``backends/cuda/tests/test_compiled_gpu.py``): a call done through the door, a call the door declines (the method
then does it or raises), and a door the lane refuses (a wrong name, a short struct, a method that raises).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from metrale_core import (
    BackendClosedError,
    DeviceBuffer,
    GpuBackend,
    GraphExec,
    InvalidArgumentError,
    InvalidBufferError,
    Kernel,
    MetraleError,
    OutOfMemoryError,
    RedZoneError,
    Stream,
    open_backend,
)
from metrale_core.kernels import shipped_modules
from metrale_core.plugin import DEVICE_CALLS, RawDevice
from tests._support import MIB, SETTINGS, TEST_CAPACITY, compiled_twin

ALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64))
FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64)
MEMSET = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_size_t, ctypes.py_object
)
GRAPH_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.py_object, ctypes.py_object)
LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.py_object, ctypes.POINTER(ctypes.c_uint), ctypes.c_uint, ctypes.py_object,
    ctypes.py_object,
)


class Table(ctypes.Structure):
    """``metrale_device_calls_v1``, as ``metrale/device_calls.h`` defines it."""

    _fields_ = (
        ("size", ctypes.c_size_t), ("state", ctypes.c_void_p), ("alloc", ALLOC), ("free", FREE), ("memset", MEMSET),
        ("graph_launch", GRAPH_LAUNCH), ("launch", LAUNCH),
    )


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)

#: A capsule's name is a C string the capsule points at: these live as long as the module.
NAMES = {name: name.encode() for name in (DEVICE_CALLS, "metrale_core.device_calls.v0")}

#: What a door answers where it declines: nothing done, the method then does the work or raises.
DECLINED = 1


@dataclass
class Door:
    """The C functions of one fake device: what they were asked, and whether they decline."""

    device: RawDevice
    decline: bool = False
    allocs: list[int] = field(default_factory=list)
    frees: list[int] = field(default_factory=list)
    memsets: list[tuple[int, int, int]] = field(default_factory=list)
    graph_launches: list[tuple[object, object]] = field(default_factory=list)
    launches: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    keep: list[object] = field(default_factory=list)  # the struct and the callbacks the capsule points at

    def capsule(
        self, name: str = DEVICE_CALLS, size: int | None = None, memset: bool = True, graph_launch: bool = True,
        launch: bool = True,
    ) -> object:
        def alloc(_state: int | None, nbytes: int, out: ctypes._Pointer[ctypes.c_uint64]) -> int:
            if self.decline:
                return DECLINED
            out[0] = self.device.alloc(nbytes, "device")
            self.allocs.append(out[0])
            return 0

        def free(_state: int | None, ptr: int) -> int:
            if self.decline:
                return DECLINED
            self.device.free(ptr, "device")
            self.frees.append(ptr)
            return 0

        def fill(_state: int | None, ptr: int, value: int, nbytes: int, stream: object) -> int:
            if self.decline:
                return DECLINED
            self.device.memset(ptr, value, nbytes, stream)
            self.memsets.append((ptr, value, nbytes))
            return 0

        def replay(_state: int | None, graph_exec: object, stream: object) -> int:
            if self.decline:
                return DECLINED
            self.device.graph_launch(graph_exec, stream)
            self.graph_launches.append((graph_exec, stream))
            return 0

        def run(
            _state: int | None, function: object, shape: ctypes._Pointer[ctypes.c_uint], shared_mem: int,
            stream: object, args: object,
        ) -> int:
            if self.decline:
                return DECLINED
            dims = tuple(shape[i] for i in range(6))
            self.device.launch(function, dims[:3], dims[3:], shared_mem, stream, args)  # type: ignore[arg-type]
            self.launches.append((dims, shared_mem))
            return 0

        table = Table(ctypes.sizeof(Table) if size is None else size, None, ALLOC(alloc), FREE(free))
        if memset:
            table.memset = MEMSET(fill)
        if graph_launch:
            table.graph_launch = GRAPH_LAUNCH(replay)
        if launch:
            table.launch = LAUNCH(run)
        self.keep.append(table)
        return _new_capsule(ctypes.addressof(table), NAMES[name], None)


@pytest.fixture
def doors(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[GpuBackend, Door]]]:
    """Open a compiled fake backend whose device offers a ctypes door: ``doors(**capsule_args)``."""
    compiled_twin("lane")
    opened: list[GpuBackend] = []

    def open_with(
        *, raises: bool = False, settings: dict[str, object] | None = None, **capsule_args: object
    ) -> tuple[GpuBackend, Door]:
        made: list[Door] = []

        capsules: list[object] = []

        def device_calls(device: RawDevice) -> object:  # (each lane asks: the same door for both)
            if raises:
                raise RuntimeError("no door today")
            if not made:
                made.append(Door(device))
                capsules.append(made[0].capsule(**capsule_args))  # type: ignore[arg-type]
            return capsules[0]

        from metrale_fake._device import FakeDevice

        monkeypatch.setattr(FakeDevice, "device_calls", device_calls)
        changes: dict[str, object] = {
            "pure": False, "fake_memory_bytes": TEST_CAPACITY, "redzone": 0, **(settings or {}),
        }
        gpu = open_backend("fake", settings=SETTINGS.updated(**changes))
        opened.append(gpu)
        return gpu, (made[0] if made else Door(gpu.raw))

    yield open_with
    for gpu in opened:
        gpu.close()


def test_a_plain_pair_goes_through_the_door(doors: Callable[..., tuple[GpuBackend, Door]]) -> None:
    gpu, door = doors()
    buf = gpu.alloc(MIB)
    assert door.allocs == [buf.ptr]
    assert gpu.live_alloc_len() == 1
    gpu.memset(buf, 7)
    host = bytearray(4)
    gpu.copy_to_host(host, buf)
    assert host == b"\x07" * 4
    gpu.free(buf)
    assert door.frees == [buf.ptr]
    stats = gpu.stats()
    assert (stats.alloc_count, stats.free_count, stats.current_bytes["device"]) == (1, 1, 0)



def test_managed_memory_never_goes_through_the_door(doors: Callable[..., tuple[GpuBackend, Door]]) -> None:
    """The device calls' alloc and free are of device memory only (device_calls.h): managed memory is the
    methods' both ways (a review found its free taken through the C call)."""
    gpu, door = doors()
    buf = gpu.alloc_managed(MIB)
    gpu.free(buf)
    assert door.allocs == [] and door.frees == []
    assert gpu.live_alloc_len() == 0

ZONED = {"redzone": 64, "redzone_lead": True, "redzone_min_idx": 0, "redzone_sample": 1, "redzone_action": "raise"}


@pytest.mark.parametrize("decline", [False, True])
def test_a_zoned_pair_fills_its_zones_through_the_door(
    doors: Callable[..., tuple[GpuBackend, Door]], decline: bool
) -> None:
    """Red zones on: the lane fills each zone through the door's memset (declined: through the method), a free
    goes to the quarantine, a kept block is zeroed and filled again; the zones hold the fill either way."""
    gpu, door = doors(settings=ZONED)
    door.decline = decline
    buf = gpu.alloc(100)
    fills = [(buf.ptr - 256, 0xA5, 256), (buf.ptr + 100, 0xA5, 64)]
    assert door.memsets == ([] if decline else fills) and door.allocs == []  # (raw memory: the allocator's)
    assert gpu.scan_redzones() == []
    gpu.memset(buf.ptr + 100, 0, nbytes=1)  # one byte past the end
    with pytest.raises(RedZoneError) as info:
        gpu.scan_redzones()
    assert [(v.index, v.side, v.offset) for v in info.value.violations] == [(buf.index, "trail", 0)]
    gpu.memset(buf.ptr + 100, 0xA5, nbytes=1)  # mended: the block can be kept
    gpu.free(buf)
    assert gpu.stats().redzone_quarantined == 1 and door.frees == []
    again = gpu.alloc(100)
    gpu.free(again)
    gpu.scan_redzones()  # the quarantine judged: both blocks intact, kept for reuse
    kept = gpu.alloc(100)  # a kept block: zeroed, its zones filled again
    if not decline:
        assert door.memsets[-3:] == [(kept.ptr - 256, 0xA5, 256), (kept.ptr + 100, 0xA5, 64), (kept.ptr, 0, 100)]
    data = bytearray(100)
    gpu.copy_to_host(data, kept)
    assert data == bytes(100) and gpu.scan_redzones() == []
    gpu.free(kept)


def test_a_plain_memset_goes_through_the_door(doors: Callable[..., tuple[GpuBackend, Door]]) -> None:
    gpu, door = doors()
    buf = gpu.alloc(4096)
    gpu.memset(buf, 7)
    gpu.memset(buf, 9, offset=100, nbytes=8)
    assert door.memsets == [(buf.ptr, 7, 4096), (buf.ptr + 100, 9, 8)]
    stream = gpu.create_stream()
    gpu.memset(buf, 1, nbytes=4, stream=stream)  # another stream of this backend: the door too
    stream.synchronize()
    host = bytearray(4096)
    gpu.copy_to_host(host, buf)
    assert host[:4] == b"\x01" * 4 and host[4:100] == b"\x07" * 96 and host[100:108] == b"\x09" * 8
    assert len(door.memsets) == 3
    gpu.memset(buf, 1, offset=4096)  # nothing to set: the front's (a no-op there too)
    for bad in [lambda: gpu.memset(buf, 256), lambda: gpu.memset(buf, 1, offset=4097),
                lambda: gpu.memset(buf, 1, nbytes=4097), lambda: gpu.memset(buf, 1, nbytes=0)]:
        with pytest.raises(MetraleError):  # the front's errors, the door never asked
            bad()
    gpu.free(buf)
    with pytest.raises(InvalidBufferError):
        gpu.memset(buf, 1)
    assert len(door.memsets) == 3


@pytest.mark.parametrize(
    ("offset", "nbytes"),
    [(2**63 - 1, 1), (2**63, None), (2**64 + 5, 1), (4000, 2**63 - 1), (1, 2**64), (-1, 4), (4097, None)],
)
def test_a_memset_past_the_buffer_is_the_front_s_error_whatever_the_numbers(
    doors: Callable[..., tuple[GpuBackend, Door]], offset: int, nbytes: int | None
) -> None:
    """The review's case: an offset near 2**63 must not wrap past the bounds check (the door is never asked)."""
    gpu, door = doors()
    buf = gpu.alloc(4096)
    with pytest.raises((InvalidBufferError, InvalidArgumentError)):
        gpu.memset(buf, 1, offset=offset, nbytes=nbytes)
    assert door.memsets == []
    gpu.free(buf)


def test_an_alloc_and_free_door_of_the_short_struct_is_used(doors: Callable[..., tuple[GpuBackend, Door]]) -> None:
    """A struct up to ``free`` (no ``memset``: it is optional) serves alloc and free; memset goes to the front."""
    gpu, door = doors(size=3 * 8 + 8)  # size, state, alloc, free (64-bit)
    buf = gpu.alloc(4096)
    gpu.memset(buf, 3)
    gpu.free(buf)
    assert (door.allocs, door.frees, door.memsets) == ([buf.ptr], [buf.ptr], [])


def test_a_door_without_memset_leaves_it_to_the_front(doors: Callable[..., tuple[GpuBackend, Door]]) -> None:
    gpu, door = doors(memset=False)
    buf = gpu.alloc(4096)
    gpu.memset(buf, 7)
    assert door.memsets == [] and door.allocs == [buf.ptr]
    gpu.free(buf)


def test_a_declined_call_is_made_through_the_method(doors: Callable[..., tuple[GpuBackend, Door]]) -> None:
    gpu, door = doors()
    door.decline = True
    buf = gpu.alloc(MIB)
    gpu.memset(buf, 5)
    host = bytearray(4)
    gpu.copy_to_host(host, buf)
    assert host == b"\x05" * 4
    gpu.free(buf)
    assert (door.allocs, door.frees, door.memsets) == ([], [], [])
    assert gpu.live_alloc_len() == 0
    with pytest.raises(OutOfMemoryError):  # the method's own error, with its report
        gpu.alloc(2 * TEST_CAPACITY)
    with pytest.raises(InvalidBufferError):  # a second free is the allocator's error: the door is never asked
        gpu.free(buf)
    stats = gpu.stats()
    assert (stats.alloc_count, stats.free_count, stats.current_bytes["device"]) == (1, 1, 0)


def _vector_add(gpu: GpuBackend, n: int = 1000) -> tuple[Kernel, list[DeviceBuffer]]:
    """The shipped ``vector_add`` and three buffers of ``n`` float32: a = i, b = 2i, out = 0."""
    kernel = gpu.load_modules(shipped_modules("vector")).kernel("vector", "vector_add")
    bufs = [gpu.alloc(4 * n) for _ in range(3)]
    gpu.copy_to_device(bufs[0], np.arange(n, dtype=np.float32))
    gpu.copy_to_device(bufs[1], 2 * np.arange(n, dtype=np.float32))
    gpu.memset(bufs[2], 0)
    return kernel, bufs


def _floats(gpu: GpuBackend, buf: DeviceBuffer) -> np.ndarray:
    host = np.zeros(buf.nbytes // 4, dtype=np.float32)
    gpu.copy_to_host(host, buf)
    return host


def test_a_plain_launch_goes_through_the_door(doors: Callable[..., tuple[GpuBackend, Door]]) -> None:
    """A launch of an int grid and block, live buffers and a typed scalar is the door's; its work is done, counted
    and kept among the recent launches; a freed buffer is the front's error, the door never asked."""
    gpu, door = doors()
    n = 1000
    kernel, (a, b, out) = _vector_add(gpu, n)
    gpu.launch(kernel, 4, 256, (a, out, out, ctypes.c_uint32(n)))  # (scalar types met once: the front's)
    gpu.launch(kernel, 4, 256, (a, out, out, np.uint32(n)))
    door.launches.clear()
    gpu.memset(out, 0)
    gpu.launch(kernel, 4, 256, (a, b, out, np.uint32(n)))
    gpu.synchronize()
    assert door.launches == [((4, 1, 1, 256, 1, 1), 0)]
    assert np.array_equal(_floats(gpu, out), 3 * np.arange(n, dtype=np.float32))
    assert gpu.run_metrics().launches[("vector", "vector_add")] == 3
    stream = gpu.create_stream()
    gpu.launch(kernel, (4, 1), 256, (a, b, out, np.uint32(n)), stream=stream)  # a tuple: the front's
    gpu.launch(kernel, 4, 256, [a, b, out, ctypes.c_uint32(n)], stream=stream, shared_mem=16)
    stream.synchronize()
    assert door.launches[1:] == [((4, 1, 1, 256, 1, 1), 16)]
    assert gpu.run_metrics().launches[("vector", "vector_add")] == 5
    gpu.free(b)
    with pytest.raises(InvalidBufferError):
        gpu.launch(kernel, 4, 256, (a, b, out, np.uint32(n)))
    with pytest.raises(InvalidArgumentError, match="takes 4 argument"):
        gpu.launch(kernel, 4, 256, (a, out, np.uint32(n)))
    with pytest.raises(InvalidArgumentError):
        gpu.launch(kernel, 4, 2048, (a, a, out, np.uint32(n)))  # more threads than a block holds
    assert len(door.launches) == 2 and gpu.run_metrics().launches[("vector", "vector_add")] == 5
    stream.close()
    for buf in (a, out):
        gpu.free(buf)


def test_a_launch_the_door_declines_is_the_method_s(doors: Callable[..., tuple[GpuBackend, Door]]) -> None:
    gpu, door = doors()
    kernel, (a, b, out) = _vector_add(gpu, 256)
    door.decline = True
    for _ in range(2):  # (the second with the scalar's type met)
        gpu.launch(kernel, 1, 256, (a, b, out, np.uint32(256)))
    gpu.synchronize()
    assert door.launches == [] and gpu.run_metrics().launches[("vector", "vector_add")] == 2
    assert np.array_equal(_floats(gpu, out), 3 * np.arange(256, dtype=np.float32))
    for buf in (a, b, out):
        gpu.free(buf)


def test_a_launch_into_a_capture_is_the_front_s(doors: Callable[..., tuple[GpuBackend, Door]]) -> None:
    gpu, door = doors()
    kernel, (a, b, out) = _vector_add(gpu, 256)
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    gpu.launch(kernel, 1, 256, (a, b, out, np.uint32(256)), stream=stream)
    graph = gpu.end_capture(stream)
    assert door.launches == [] and out in graph.buffers
    graph.close()
    stream.close()
    for buf in (a, b, out):
        gpu.free(buf)


def test_timed_launches_are_the_front_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``kernel_timing`` the lane hands every launch to the front, which times it."""
    compiled_twin("launch_lane")
    with open_backend("fake", settings=SETTINGS.updated(pure=False, kernel_timing=True)) as gpu:
        kernel, (a, b, out) = _vector_add(gpu, 256)
        gpu.launch(kernel, 1, 256, (a, b, out, np.uint32(256)))
        assert gpu.run_metrics().gpu_ms.get(("vector", "vector_add")) is not None
        for buf in (a, b, out):
            gpu.free(buf)


def _graph_of_memsets(gpu: GpuBackend, bufs: list[DeviceBuffer], stream: Stream) -> GraphExec:
    """An executable graph that sets each of ``bufs`` to its position plus one."""
    gpu.begin_capture(stream)
    for i, buf in enumerate(bufs):
        gpu.memset(buf, i + 1, stream=stream)
    graph = gpu.end_capture(stream)
    try:
        return graph.instantiate()
    finally:
        graph.close()


def _bytes_of(gpu: GpuBackend, buf: DeviceBuffer) -> bytes:
    host = bytearray(buf.nbytes)
    gpu.copy_to_host(host, buf)
    return bytes(host)


def test_a_plain_graph_launch_goes_through_the_door(doors: Callable[..., tuple[GpuBackend, Door]]) -> None:
    """A replay on a stream of the backend, or on the default one, is the door's; its work is done; a graph whose
    buffer was freed is the front's error, the door never asked."""
    gpu, door = doors()
    stream = gpu.create_stream()
    bufs = [gpu.alloc(4096) for _ in range(3)]
    exe = _graph_of_memsets(gpu, bufs, stream)
    exe.launch(stream)
    exe.launch()
    stream.synchronize()
    gpu.synchronize()
    assert door.graph_launches == [(exe.raw, stream.raw), (exe.raw, gpu.default_stream.raw)]
    assert [_bytes_of(gpu, b) for b in bufs] == [bytes([i + 1]) * 4096 for i in range(3)]
    assert gpu.stats().graph_launches == 2
    gpu.free(bufs[1])
    with pytest.raises(InvalidBufferError, match="no longer live"):
        exe.launch(stream)
    assert len(door.graph_launches) == 2 and gpu.stats().graph_launches == 2
    exe.close()
    with pytest.raises(BackendClosedError, match="executable graph was closed"):
        exe.launch(stream)
    stream.close()
    for buf in (bufs[0], bufs[2]):
        gpu.free(buf)


def test_a_graph_launch_the_door_declines_is_the_method_s(doors: Callable[..., tuple[GpuBackend, Door]]) -> None:
    gpu, door = doors()
    stream = gpu.create_stream()
    bufs = [gpu.alloc(4096) for _ in range(2)]
    exe = _graph_of_memsets(gpu, bufs, stream)
    door.decline = True
    exe.launch(stream)
    stream.synchronize()
    assert door.graph_launches == [] and gpu.stats().graph_launches == 1
    assert [_bytes_of(gpu, b) for b in bufs] == [b"\x01" * 4096, b"\x02" * 4096]
    exe.close()
    stream.close()
    for buf in bufs:
        gpu.free(buf)


def test_a_graph_launched_into_a_capture_is_the_front_s(doors: Callable[..., tuple[GpuBackend, Door]]) -> None:
    """A replay into a stream being captured is recorded by the front (the door is for plain launches only)."""
    gpu, door = doors()
    stream, other = gpu.create_stream(), gpu.create_stream()
    buf = gpu.alloc(4096)
    exe = _graph_of_memsets(gpu, [buf], stream)
    gpu.begin_capture(other)
    exe.launch(other)
    outer = gpu.end_capture(other)
    assert door.graph_launches == []
    assert buf in outer.buffers
    outer.close()
    exe.close()
    for s in (stream, other):
        s.close()
    gpu.free(buf)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"name": "metrale_core.device_calls.v0"}, "not a capsule named metrale_core.device_calls.v1"),
        ({"size": 8}, "a struct of 8 bytes"),
        ({"raises": True}, "device_calls() failed, its methods are called: RuntimeError: no door today"),
    ],
)
def test_a_door_the_lane_cannot_use_is_said_and_left(
    doors: Callable[..., tuple[GpuBackend, Door]], caplog: pytest.LogCaptureFixture, kwargs: dict[str, object],
    said: str,
) -> None:
    with caplog.at_level(logging.WARNING, logger="metrale"):
        gpu, door = doors(**kwargs)
    assert said in caplog.text
    gpu.free(gpu.alloc(MIB))  # through the methods
    assert (door.allocs, door.frees) == ([], [])  # (a door made and refused was never called)
    assert gpu.live_alloc_len() == 0


def test_the_pure_lane_never_asks_for_a_door(monkeypatch: pytest.MonkeyPatch) -> None:
    from metrale_fake._device import FakeDevice

    def device_calls(device: RawDevice) -> object:
        raise AssertionError("the pure lane calls the methods")

    monkeypatch.setattr(FakeDevice, "device_calls", device_calls)
    with open_backend("fake", settings=SETTINGS.updated(pure=True)) as gpu:
        gpu.free(gpu.alloc(MIB))
