"""``close()`` lets go of what holds device memory: a closed backend is freed by reference counting, with the
garbage collector off, and nothing the core keeps after close (callbacks, observers, handles) keeps its raw
device alive. (A conformance run opens hundreds of backends; each waiting for the collector, a broken
plugin's run once grew to 24 GB.)"""

from __future__ import annotations

import ctypes
import gc
import weakref
from collections.abc import Iterator

import pytest

from metrale_core import GpuBackend, MetraleError, open_backend, testing
from metrale_core.kernels import shipped_modules
from tests._support import SETTINGS


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The garbage collector off (what is freed is freed by reference counting), on again after."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _workload(gpu: GpuBackend) -> list[object]:
    """Something of everything a backend hands out and keeps; returns the handles (the caller drops them)."""
    capabilities = testing.backend_capabilities(gpu.name, SETTINGS)
    buf = gpu.alloc(4096)
    gpu.memset(buf, 0x5A)
    arena = gpu.create_arena(8192)
    handles: list[object] = [
        buf, gpu.alloc_managed(512), gpu.alloc_arena(1024), gpu.alloc_host(256), arena, arena.alloc(64),
        gpu.create_event(), gpu.ledger_probe(),
    ]
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    gpu.memset(buf, 0x11, stream=stream)
    graph = gpu.end_capture(stream)
    exe = graph.instantiate()
    exe.launch(stream)
    stream.synchronize()
    handles += [stream, graph, exe]
    # user callbacks that hold the backend: cycles through user code, which close() must break
    gpu.on_out_of_memory(lambda nbytes: gpu.live_alloc_len() > 0)
    gpu.on_redzone_violation(lambda name, violation: gpu.name == name)
    if capabilities.has("kernels"):
        registry = gpu.load_modules(shipped_modules("vector"))
        kernel = registry.kernel("vector", "fill_u32")
        gpu.launch(kernel, 1, 128, [buf, ctypes.c_uint32(16), ctypes.c_uint32(7)])
        handles += [registry, kernel]
    if capabilities.has("interop"):
        handles.append(gpu.wrap(buf.view()))
    gpu.synchronize()
    return handles


def test_a_closed_backend_is_freed_without_the_garbage_collector(backend_name: str, no_collector: None) -> None:
    gpu = open_backend(backend_name, settings=SETTINGS)
    handles = _workload(gpu)
    raw, facade = weakref.ref(gpu.raw), weakref.ref(gpu)
    gpu.close()
    del gpu, handles
    assert facade() is None, f"the closed backend is kept alive: {gc.get_referrers(facade())}"
    assert raw() is None, f"its raw device is kept alive: {gc.get_referrers(raw())}"


def test_a_closed_backend_s_handles_do_not_keep_its_raw_device(backend_name: str, no_collector: None) -> None:
    """The handles of a closed backend outlive it: they keep neither the backend nor its raw device (nor the
    memory that holds), and still refuse every use."""
    gpu = open_backend(backend_name, settings=SETTINGS)
    handles = _workload(gpu)
    raw = weakref.ref(gpu.raw)
    gpu.close()
    assert gpu.raw is raw()  # the closed backend itself still answers for its raw layer
    del gpu
    assert raw() is None, f"the raw device is kept alive: {gc.get_referrers(raw())}"
    stream = next(h for h in handles if type(h).__name__ == "Stream")
    assert stream.backend is None  # type: ignore[attr-defined]
    with pytest.raises(MetraleError):
        stream.synchronize()  # type: ignore[attr-defined]


def test_close_lets_go_of_callbacks_and_observers(fake: GpuBackend) -> None:
    """What a user registered is not kept by a closed backend that is still referenced."""

    class Callback:
        def __call__(self, *args: object) -> bool:
            return False

    oom, observer = Callback(), Callback()
    refs = [weakref.ref(oom), weakref.ref(observer)]
    fake.on_out_of_memory(oom)
    fake.on_redzone_violation(observer)
    del oom, observer
    assert all(ref() is not None for ref in refs)
    fake.close()
    assert [ref() for ref in refs] == [None, None]
