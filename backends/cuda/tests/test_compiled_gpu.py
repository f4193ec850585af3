"""The compiled driver calls (``_cdriver``, issue 38) on a GPU: every primitive they carry works through them, and a
driver error raises the same metrale error, with the same message, as through the pure calls.

Each test runs the backend opened both ways in one process: compiled (where built; the setting ``pure`` off) and
pure (``pure=True``, what ``METRALE_PURE=1`` sets). Skipped where no CUDA driver and device answer; CPU tests of the
same code are in ``test_compiled_calls.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from metrale_core import (
    GpuBackend,
    InvalidArgumentError,
    LaunchArg,
    MetraleError,
    MetraleSettings,
    OutOfMemoryError,
    Param,
    open_backend,
)
from metrale_core.kernels import shipped_modules
from metrale_cuda._compiled import CompiledCudaDevice, describe, load
from metrale_cuda._device import CudaDevice
from metrale_cuda._plugin import probe
from tests._support import DeviceCallsTable, device_calls_table

SETTINGS = MetraleSettings()
_REASON = probe(SETTINGS)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=f"no CUDA device: {_REASON}")]

N = 4099  # not a multiple of the block


@pytest.fixture(params=["compiled", "pure"])
def gpu(request: pytest.FixtureRequest) -> Iterator[GpuBackend]:
    pure = request.param == "pure"
    if not pure and load() is None:
        pytest.skip(f"no compiled driver calls here: {describe(False)}")
    with open_backend("cuda", settings=SETTINGS.updated(pure=pure)) as backend:
        assert type(backend.raw) is (CudaDevice if pure else CompiledCudaDevice)
        yield backend


def _read(gpu: GpuBackend, buf: object, n: int = N, dtype: type = np.float32) -> np.ndarray:
    out = np.empty(n, dtype=dtype)
    gpu.copy_to_host(out, buf)  # type: ignore[arg-type]
    return out


def test_alloc_memset_and_free(gpu: GpuBackend) -> None:
    live = gpu.live_alloc_len()
    for alloc in (gpu.alloc, gpu.alloc_managed):
        buf = alloc(N)
        gpu.memset(buf, 0xA5)
        gpu.memset(buf, 0x11, offset=7, nbytes=9)
        expected = np.full(N, 0xA5, dtype=np.uint8)
        expected[7:16] = 0x11
        np.testing.assert_array_equal(_read(gpu, buf, N, np.uint8), expected)
        gpu.free(buf)
    assert gpu.live_alloc_len() == live


def test_the_three_copies_pageable_and_pinned(gpu: GpuBackend) -> None:
    data = np.random.default_rng(3).standard_normal(N).astype(np.float32)
    a, b = gpu.alloc(4 * N), gpu.alloc(4 * N)
    gpu.copy_to_device(a, data)  # pageable
    gpu.copy_device(b, a)
    np.testing.assert_array_equal(_read(gpu, b), data)
    host = gpu.alloc_host(4 * N)  # pinned, both ways, on a stream of its own
    stream = gpu.create_stream()
    view = host.view()
    np.frombuffer(view, dtype=np.float32)[:] = data[::-1]
    del view
    gpu.copy_to_device(a, host, stream=stream)
    gpu.copy_device(b, a, stream=stream)
    out = gpu.alloc_host(4 * N)
    gpu.copy_to_host(out, b, stream=stream)
    gpu.synchronize()
    view = out.view()
    np.testing.assert_array_equal(np.frombuffer(view, dtype=np.float32), data[::-1])
    del view
    for buf in (a, b, host, out):
        gpu.free(buf)


def test_launch_and_graph_launch(gpu: GpuBackend) -> None:
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    da, db, dout = (gpu.alloc(4 * N) for _ in range(3))
    gpu.copy_to_device(da, x)
    gpu.copy_to_device(db, y)
    with gpu.load_modules(shipped_modules()) as modules:
        add = modules.kernel("vector", "vector_add")
        gpu.launch(add, (N + 255) // 256, 256, [da, db, dout, np.uint32(N)])
        np.testing.assert_array_equal(_read(gpu, dout), x + y)
        expected = x + y
        for _ in range(3):  # the slots kept for the kernel, filled anew at each launch
            gpu.launch(add, (N + 255) // 256, 256, [dout, db, dout, np.uint32(N)])
            expected = expected + y
        np.testing.assert_array_equal(_read(gpu, dout), expected)
        stream = gpu.create_stream()
        gpu.memset(dout, 0)
        gpu.synchronize()
        gpu.begin_capture(stream)
        gpu.launch(add, (N + 255) // 256, 256, [da, db, dout, np.uint32(N)], stream=stream)
        gpu.launch(add, (N + 255) // 256, 256, [dout, db, dout, np.uint32(N)], stream=stream)
        graph = gpu.end_capture(stream).instantiate()
        assert not _read(gpu, dout).any(), "a captured launch ran before the graph was launched"
        graph.launch(stream)
        graph.launch(stream)
        gpu.synchronize()
        np.testing.assert_array_equal(_read(gpu, dout), (x + y) + y)
        graph.close()
    for buf in (da, db, dout):
        gpu.free(buf)


def _failure(pure: bool, attempt: str) -> tuple[object, ...]:
    """What ``attempt`` raises on a backend opened compiled or pure: the class, message, code, name, requested."""
    with open_backend("cuda", settings=SETTINGS.updated(pure=pure)) as gpu:
        raw = gpu.raw
        stream = raw.stream_create()
        try:
            if attempt == "alloc":
                raw.alloc(1 << 60, "device")
            elif attempt == "memset":
                raw.memset(0x10, 0, 64, stream)  # not device memory
            elif attempt == "copy_dtod":
                raw.copy_dtod(0x10, 0x20, 64, stream)
            elif attempt == "free_twice":
                ptr = raw.alloc(4096, "device")
                raw.free(ptr, "device")
                raw.free(ptr, "device")
            elif attempt == "launch":
                module = raw.module_load("vector", shipped_modules("vector")["vector"])
                function = raw.module_function(module, "vector_add")
                ptr = (0).to_bytes(8, "little")
                args = [LaunchArg(Param(name, "u", 8), ptr, 0) for name in ("a", "b", "out")]
                args.append(LaunchArg(Param("n", "u", 4), (0).to_bytes(4, "little")))
                try:
                    raw.launch(function, (0, 1, 1), (256, 1, 1), 0, stream, args)  # no blocks: refused
                finally:
                    raw.module_unload(module)
            else:
                raise AssertionError(attempt)
        except MetraleError as exc:
            return type(exc), str(exc), exc.code, exc.name, getattr(exc, "requested", None)
        finally:
            raw.stream_destroy(stream)
    raise AssertionError(f"{attempt} did not fail")


@pytest.mark.parametrize("attempt", ["alloc", "memset", "copy_dtod", "free_twice", "launch"])
def test_a_driver_error_raises_the_same_error_on_both_paths(attempt: str) -> None:
    if load() is None:
        pytest.skip(f"no compiled driver calls here: {describe(False)}")
    compiled, pure = _failure(False, attempt), _failure(True, attempt)
    assert compiled == pure
    if attempt == "alloc":
        assert compiled[0] is OutOfMemoryError
        assert compiled[4] == 1 << 60
        assert str(compiled[1]).startswith(f"cuMemAlloc of {1 << 60} bytes failed")
    else:
        assert compiled[0] is InvalidArgumentError, compiled


# -- the device calls (``RawDevice.device_calls``) -----------------------------------------------------------------


def test_the_device_calls_allocate_where_their_context_is_current_and_decline_elsewhere() -> None:
    """``DeviceCalls``'s C functions, called through ``ctypes``: a pair where the context is current; declined
    (nonzero, nothing done) on a thread where none is current, and once shut."""
    import ctypes
    import threading

    if load() is None:
        pytest.skip(f"no compiled driver calls here: {describe(False)}")
    with open_backend("cuda", settings=SETTINGS.updated(pure=False)) as backend:
        device = backend.raw
        assert isinstance(device, CompiledCudaDevice)
        capsule = device.device_calls()
        table = device_calls_table(capsule)
        assert table.size == ctypes.sizeof(DeviceCallsTable)

        def pair() -> tuple[int, int, int]:
            out = ctypes.c_uint64(0)
            got = table.alloc(table.state, 1 << 20, ctypes.byref(out))
            freed = table.free(table.state, out.value) if got == 0 else -99
            return got, out.value, freed

        backend.bind_to_thread()
        got, ptr, freed = pair()
        assert (got, freed) == (0, 0) and ptr > 0 and ptr % 256 == 0
        elsewhere: list[tuple[int, int, int]] = []
        worker = threading.Thread(target=lambda: elsewhere.append(pair()))  # no context current there
        worker.start()
        worker.join()
        assert elsewhere == [(1, 0, -99)]  # declined: nothing done
        made: list[object] = []  # there, the backend's alloc still works: the lane asks the method, which binds
        worker = threading.Thread(target=lambda: made.append(backend.alloc(1 << 20)))
        worker.start()
        worker.join()
        backend.free(made[0])  # type: ignore[arg-type]
    assert pair()[0] == 1  # declined: shut as the device closed (the capsule kept the struct alive)


def test_the_lane_over_the_device_calls_keeps_the_ledger_stats_and_errors() -> None:
    """Through the compiled lane and the CUDA device calls: a thousand pairs leave the ledger and the stats exact, a
    too-large allocation raises the typed out-of-memory error, and a closed backend refuses the next call."""
    if load() is None:
        pytest.skip(f"no compiled driver calls here: {describe(False)}")
    backend = open_backend("cuda", settings=SETTINGS.updated(pure=False))
    try:
        live, before = backend.live_alloc_len(), backend.stats()
        for size in (256, 4096, 1 << 20, (1 << 20) + 1):
            bufs = [backend.alloc(size) for _ in range(250)]
            assert len({b.ptr for b in bufs}) == 250
            for buf in bufs:
                backend.free(buf)
        after = backend.stats()
        assert backend.live_alloc_len() == live
        assert (after.alloc_count - before.alloc_count, after.free_count - before.free_count) == (1000, 1000)
        assert after.current_bytes["device"] == before.current_bytes["device"]
        with pytest.raises(OutOfMemoryError):
            backend.alloc(1 << 50)
        buf = backend.alloc(4096)
    finally:
        backend.close()
    with pytest.raises(MetraleError):
        backend.free(buf)


def test_graph_replays_through_the_lane_and_the_device_calls() -> None:
    """A graph of memsets replayed through the compiled graph lane and the CUDA device calls' ``graph_launch``: its
    work is done, counted, and a graph whose buffer was freed is refused; the C function launches where the context
    is current and declines on a thread where none is."""
    import ctypes
    import threading

    if load() is None:
        pytest.skip(f"no compiled driver calls here: {describe(False)}")
    with open_backend("cuda", settings=SETTINGS.updated(pure=False, redzone=0)) as backend:
        stream = backend.create_stream()
        bufs = [backend.alloc(4096) for _ in range(2)]
        backend.begin_capture(stream)
        for i, buf in enumerate(bufs):
            backend.memset(buf, i + 1, stream=stream)
        graph = backend.end_capture(stream)
        exe = graph.instantiate()
        graph.close()
        before = backend.stats().graph_launches
        for _ in range(100):
            exe.launch(stream)
        exe.launch()
        backend.synchronize()
        assert backend.stats().graph_launches - before == 101
        for i, buf in enumerate(bufs):
            host = bytearray(4096)
            backend.copy_to_host(host, buf)
            assert host == bytes([i + 1]) * 4096
        table = device_calls_table(backend.raw.device_calls())
        assert table.graph_launch(table.state, exe.raw, stream.raw) == 0
        elsewhere: list[int] = []
        worker = threading.Thread(target=lambda: elsewhere.append(table.graph_launch(table.state, exe.raw, stream.raw)))
        worker.start()
        worker.join()
        assert elsewhere == [1]  # declined: no context current there
        stream.synchronize()
        backend.free(bufs[1])
        with pytest.raises(MetraleError, match="no longer live"):
            exe.launch(stream)
        exe.close()
        stream.close()
        backend.free(bufs[0])
        assert ctypes.sizeof(DeviceCallsTable) == table.size


def test_launches_through_the_lane_and_the_device_calls() -> None:
    """``vector_add`` launched through the compiled launch lane and the CUDA device calls' ``launch`` computes what
    the pure build computes; a launch the driver refuses raises the same error, naming the launch, in both builds."""
    import re

    if load() is None:
        pytest.skip(f"no compiled driver calls here: {describe(False)}")
    failures = []
    for pure in (False, True):
        with open_backend("cuda", settings=SETTINGS.updated(pure=pure, redzone=0)) as backend:
            kernel = backend.load_modules(shipped_modules("vector")).kernel("vector", "vector_add")
            a, b, out = (backend.alloc(4 * N) for _ in range(3))
            backend.copy_to_device(a, np.arange(N, dtype=np.float32))
            backend.copy_to_device(b, 2 * np.arange(N, dtype=np.float32))
            grid = (N + 255) // 256
            for _ in range(3):
                backend.launch(kernel, grid, 256, (a, b, out, np.uint32(N)))
            stream = backend.create_stream()
            backend.launch(kernel, grid, 256, [a, b, out, np.uint32(N)], stream=stream)
            stream.synchronize()
            host = np.zeros(N, dtype=np.float32)
            backend.copy_to_host(host, out)
            assert np.array_equal(host, 3 * np.arange(N, dtype=np.float32))
            assert backend.run_metrics().launches[("vector", "vector_add")] == 4
            with pytest.raises(MetraleError) as caught:  # more shared memory than any block has
                backend.launch(kernel, grid, 256, (a, b, out, np.uint32(N)), shared_mem=1 << 30)
            failures.append((type(caught.value), re.sub(r"0x[0-9a-f]+", "ADDR", str(caught.value))))
            assert backend.run_metrics().launches[("vector", "vector_add")] == 4
            stream.close()
            for buf in (a, b, out):
                backend.free(buf)
    assert failures[0] == failures[1], failures
    assert "launch of vector.vector_add" in failures[0][1]
