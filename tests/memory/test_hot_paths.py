"""The hot paths' shortcuts (issue 16) keep every rule of the paths they shortcut, on every backend.

Each shortcut decides something once and reuses it: a graph launch skips the check of its buffers while
no record came off the ledger, a launch reuses a buffer's packed argument and packs a scalar of a known
type with one lookup, a call site is formatted once per call, a raw call's error is turned in one place.
These tests try to make each one answer wrong.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from metrale_core import (
    DeviceBuffer,
    DriverError,
    GpuBackend,
    InvalidArgumentError,
    InvalidBufferError,
    KernelRegistry,
    OutOfMemoryError,
    open_backend,
)
from metrale_core.kernels import shipped_modules
from tests._support import SETTINGS


@pytest.fixture
def modules(gpu: GpuBackend) -> Iterator[KernelRegistry]:
    with gpu.load_modules(shipped_modules("vector")) as registry:
        yield registry


def _graph_of_fill(gpu: GpuBackend, registry: KernelRegistry, buf: DeviceBuffer):  # type: ignore[no-untyped-def]
    fill = registry.kernel("vector", "fill_u32")
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    gpu.launch(fill, 1, 16, [buf, np.uint32(16), np.uint32(7)], stream=stream)
    graph = gpu.end_capture(stream)
    return graph, graph.instantiate(), stream


@pytest.mark.needs("kernels")
def test_a_graph_launch_after_a_free_of_its_buffer_is_refused(gpu: GpuBackend, modules: KernelRegistry) -> None:
    buf, other = gpu.alloc(64), gpu.alloc(64)
    graph, exe, stream = _graph_of_fill(gpu, modules, buf)
    exe.launch(stream)  # its buffers found live, and that remembered
    exe.launch(stream)
    gpu.free(other)  # a record came off: the next launch looks again, and still finds buf
    exe.launch(stream)
    stream.synchronize()
    gpu.free(buf)
    with pytest.raises(InvalidBufferError, match="no longer live"):
        exe.launch(stream)
    gpu.sweep_unreleased()
    with pytest.raises(InvalidBufferError):
        exe.launch(stream)
    exe.close()
    graph.close()


@pytest.mark.needs("kernels")
def test_a_swept_buffer_of_a_graph_is_refused(gpu: GpuBackend, modules: KernelRegistry) -> None:
    buf = gpu.alloc(64)
    graph, exe, stream = _graph_of_fill(gpu, modules, buf)
    exe.launch(stream)
    stream.synchronize()
    assert gpu.sweep_unreleased() == 1
    with pytest.raises(InvalidBufferError, match="no longer live"):
        exe.launch(stream)
    exe.close()
    graph.close()


@pytest.mark.needs("kernels")
def test_a_buffer_packed_before_is_checked_live_at_every_launch(gpu: GpuBackend, modules: KernelRegistry) -> None:
    fill = modules.kernel("vector", "fill_u32")
    buf = gpu.alloc(64)
    for _ in range(3):
        gpu.launch(fill, 1, 16, [buf, np.uint32(16), np.uint32(1)])
    gpu.synchronize()
    gpu.free(buf)
    with pytest.raises(InvalidBufferError):
        gpu.launch(fill, 1, 16, [buf, np.uint32(16), np.uint32(1)])
    copy = DeviceBuffer(buf.ptr, buf.nbytes, buf.kind, buf.index, buf.site)  # a copy, and no owner
    with pytest.raises(InvalidBufferError):
        gpu.launch(fill, 1, 16, [copy, np.uint32(16), np.uint32(1)])


@pytest.mark.needs("kernels")
def test_a_known_scalar_type_is_still_checked_against_its_parameter(gpu: GpuBackend, modules: KernelRegistry) -> None:
    fill = modules.kernel("vector", "fill_u32")  # (.u64 out, .u32 n, .u32 value)
    buf = gpu.alloc(64)
    gpu.launch(fill, 1, 16, [buf, ctypes.c_uint32(16), np.uint32(1)])  # both types known from here on
    for bad in (ctypes.c_uint64(1), ctypes.c_float(1.0), np.float32(1.0), np.uint64(1), np.uint16(1)):
        with pytest.raises(InvalidArgumentError):
            gpu.launch(fill, 1, 16, [buf, bad, np.uint32(1)])
    gpu.launch(fill, 1, 16, [buf, ctypes.c_uint32(16), np.uint32(2)])
    out = np.empty(16, dtype=np.uint32)
    gpu.copy_to_host(out, buf)
    assert (out == 2).all()


@pytest.mark.needs("kernels")
def test_an_array_is_never_taken_for_a_scalar(gpu: GpuBackend, modules: KernelRegistry) -> None:
    """A 0-d array is a scalar to the packer; its type (ndarray) must not make every array one."""
    fill = modules.kernel("vector", "fill_u32")
    buf = gpu.alloc(64)
    gpu.launch(fill, 1, 16, [buf, np.array(16, dtype=np.uint32), np.uint32(1)])
    for bad in (np.arange(4, dtype=np.uint32), np.array(16.0, dtype=np.float32), np.array([1, 2], dtype=np.uint8)):
        with pytest.raises(InvalidArgumentError):
            gpu.launch(fill, 1, 16, [buf, bad, np.uint32(1)])
    gpu.synchronize()
    assert gpu.faulted is None


def test_a_user_wrapper_of_a_metrale_method_is_the_call_site(gpu: GpuBackend) -> None:
    @functools.wraps(gpu.alloc)  # copies metrale's __module__ onto the wrapper: it is still the user's frame
    def wrapper(nbytes: int) -> DeviceBuffer:
        return gpu.alloc(nbytes)  # the call site

    line = sys._getframe().f_lineno - 2
    buf = wrapper(64)
    assert buf.site == f"{__file__}:{line}"
    direct = gpu.alloc(64)
    assert direct.site == f"{__file__}:{sys._getframe().f_lineno - 1}"
    gpu.free(buf)
    gpu.free(direct)


def test_call_sites_of_one_line_reached_twice_are_the_same(gpu: GpuBackend) -> None:
    bufs = [gpu.alloc(64) for _ in range(3)]
    assert len({b.site for b in bufs}) == 1
    assert bufs[0].site.endswith(f":{sys._getframe().f_lineno - 2}")
    for b in bufs:
        gpu.free(b)


class _Broken(Exception):
    pass


def _fails_with_a_cause(nbytes: int, kind: str) -> int:
    try:
        raise _Broken("the plugin's own cause")
    except _Broken as cause:
        raise DriverError("the plugin's error") from cause


def _fails_foreign(nbytes: int, kind: str) -> int:
    raise KeyError("a plugin bug")


@pytest.mark.parametrize("redzone", [0, 256], ids=["fast path", "zoned path"])
def test_a_plugin_error_keeps_its_cause_and_a_foreign_one_becomes_a_driver_error(redzone: int) -> None:
    """Both ways to the plugin: straight (the hot path, no red zones) and through the guarded raw layer."""
    for fails, expected, match in (
        (_fails_with_a_cause, _Broken, "the plugin's error"),
        (_fails_foreign, KeyError, r"raw alloc.*KeyError.*bug in that backend"),
    ):
        with open_backend("fake", settings=SETTINGS.updated(redzone=redzone)) as fake:
            fake._ctx.plugin.alloc = fails  # type: ignore[method-assign]  # before the first alloc looks it up
            records = fake.ledger_probe().records()
            with pytest.raises(DriverError, match=match) as info:
                fake.alloc(64)
            assert isinstance(info.value.__cause__, expected)
            assert fake.ledger_probe().records() == records, "a refused alloc changed the ledger"


def test_an_out_of_memory_on_the_fast_path_still_asks_the_callbacks(fake: GpuBackend) -> None:
    asked: list[int] = []
    hog = [fake.alloc(fake.memory_info().total // 2)]

    def reclaim(nbytes: int) -> bool:
        asked.append(nbytes)
        if hog:
            fake.free(hog.pop())
            return True
        return False

    fake.on_out_of_memory(reclaim)
    big = fake.alloc(fake.memory_info().total * 3 // 4)  # fails once, the callback frees, the retry succeeds
    assert len(asked) == 1 and fake.stats().oom_retries == 1
    fake.free(big)
    records = fake.ledger_probe().records()
    with pytest.raises(OutOfMemoryError):
        fake.alloc(fake.memory_info().total * 2)
    assert fake.ledger_probe().records() == records


@pytest.mark.parametrize("zones", [0, 64])
@pytest.mark.parametrize("kind", ["device", "pool"])
def test_a_commit_that_fails_leaves_nothing_of_its_allocation(zones: int, kind: str) -> None:
    """The ledger's history event of an allocation cannot be made (its stack walk fails): the error reaches the
    caller, and nothing of the allocation remains: not on the stats, its zones not watched, its memory given back
    (a review found the stats and zones left behind). The same source runs in both builds: the pure one lets the
    ledger's stack walker be replaced."""
    settings = SETTINGS.updated(pure=True, memory_history=16, memory_history_frames=4, redzone=zones,
                                redzone_min_idx=0, redzone_sample=1)
    with open_backend("fake", settings=settings) as gpu:
        ledger = gpu._parts.holdings.ledger
        pool = gpu.create_pool() if kind == "pool" else None
        before = gpu.stats().current_bytes[kind]

        def broken() -> tuple[str, ...]:
            raise RuntimeError("the stack walk failed")

        ledger._stack = broken
        with pytest.raises(RuntimeError, match="the stack walk failed"):
            gpu.alloc(4096) if pool is None else pool.alloc(4096)
        assert gpu.live_alloc_len() == 0 and gpu.stats().current_bytes[kind] == before
        assert len(gpu._parts.guard.zones.live()) == 0
