"""Capture rules beyond the state machine: events, isolation, the scale variant, graph liveness."""

from __future__ import annotations

import logging

import pytest

from metrale_core import CaptureError, GpuBackend, InvalidBufferError, MetraleError, open_backend
from metrale_core.testing import FaultInjecting
from tests._support import SETTINGS


def test_event_recorded_in_capture_may_be_waited_on(gpu: GpuBackend) -> None:
    buf = gpu.alloc(256)
    gpu.memset(buf, 0)
    gpu.synchronize()  # the default stream does not order with other streams
    stream = gpu.create_stream()
    event = gpu.create_event()
    gpu.begin_capture(stream)
    gpu.memset(buf, 3, stream=stream)
    event.record(stream)
    stream.wait(event)
    graph = gpu.end_capture(stream)
    exe = graph.instantiate()
    exe.launch(stream)
    stream.synchronize()
    out = bytearray(256)
    gpu.copy_to_host(out, buf)
    assert out == b"\x03" * 256


def test_wait_on_outside_event_is_isolation(gpu: GpuBackend) -> None:
    stream = gpu.create_stream()
    outside = gpu.create_event()
    outside.record()
    gpu.begin_capture(stream)
    with pytest.raises(CaptureError) as info:
        stream.wait(outside)
    assert info.value.name == "CUDA_ERROR_STREAM_CAPTURE_ISOLATION"
    with pytest.raises(CaptureError):
        gpu.end_capture(stream)


def test_event_sync_and_query_refused_during_capture(gpu: GpuBackend) -> None:
    stream = gpu.create_stream()
    event = gpu.create_event()
    event.record()
    gpu.begin_capture(stream)
    for call in (event.synchronize, event.query):
        with pytest.raises(CaptureError) as info:
            call()
        assert info.value.name == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    with pytest.raises(CaptureError) as info:
        gpu.end_capture(stream)
    assert info.value.name == "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"


def test_capture_is_process_wide(backend_name: str) -> None:
    """Global mode: a capture on one backend bars allocations on another."""
    with open_backend(backend_name, settings=SETTINGS) as a, open_backend("fake", settings=SETTINGS) as b:
        stream = a.create_stream()
        a.begin_capture(stream)
        with pytest.raises(CaptureError):
            b.alloc(64)
        assert b.live_alloc_len() == 0
        with pytest.raises(CaptureError):
            a.end_capture(stream)
        b.free(b.alloc(64))


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_host_copies_are_recorded(gpu: GpuBackend, pinned: bool) -> None:
    """CUDA records host copies in a capture, from pinned and (measured on an H200) pageable memory."""
    buf = gpu.alloc(64)
    gpu.memset(buf, 0)
    gpu.synchronize()  # the default stream does not order with other streams
    source: object
    if pinned:
        host = gpu.alloc_host(64)
        host.view()[:] = b"\x07" * 64
        source = host
    else:
        source = b"\x07" * 64
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    gpu.copy_to_device(buf, source, stream=stream)
    exe = gpu.end_capture(stream).instantiate()
    out = bytearray(64)
    gpu.copy_to_host(out, buf)
    assert out == bytes(64), "the captured copy ran before launch"
    exe.launch(stream)
    stream.synchronize()
    gpu.copy_to_host(out, buf)
    assert out == b"\x07" * 64


def test_graph_of_freed_buffer_warns_and_refuses_launch(gpu: GpuBackend, caplog: pytest.LogCaptureFixture) -> None:
    buf = gpu.alloc(128)
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    gpu.memset(buf, 1, stream=stream)
    exe = gpu.end_capture(stream).instantiate()
    assert buf in exe.buffers
    with caplog.at_level(logging.WARNING, logger="metrale"):
        gpu.free(buf)
    assert any("executable graph" in r.getMessage() for r in caplog.records)
    with pytest.raises(InvalidBufferError, match="no longer live"):
        exe.launch(stream)


def test_close_aborts_capture_and_handles_refuse_use(backend_name: str) -> None:
    gpu = open_backend(backend_name, settings=SETTINGS)
    stream = gpu.create_stream()
    event = gpu.create_event()
    gpu.begin_capture(stream)
    gpu.close()
    with open_backend("fake", settings=SETTINGS) as other:
        other.free(other.alloc(8))  # no capture left behind
    for call in (stream.synchronize, event.query, lambda: gpu.alloc(8), gpu.live_alloc_len):
        with pytest.raises(MetraleError, match="closed"):
            call()


def test_double_begin_and_end_without_begin(gpu: GpuBackend) -> None:
    stream = gpu.create_stream()
    with pytest.raises(CaptureError):
        gpu.end_capture(stream)
    gpu.begin_capture(stream)
    with pytest.raises(CaptureError):
        gpu.begin_capture(stream)
    gpu.end_capture(stream).close()


def test_scale_variant_never_asks_the_driver() -> None:
    settings = SETTINGS.updated(target_hw="strix-halo")
    with open_backend("fake", settings=settings) as gpu:
        stream = gpu.create_stream()
        assert isinstance(gpu, FaultInjecting)
        gpu.inject_fault("is_capturing", code="CUDA_ERROR_NOT_SUPPORTED")
        assert not gpu.stream_is_capturing(stream)
        gpu.begin_capture(stream)
        assert gpu.stream_is_capturing(stream)
        gpu.end_capture(stream).close()
        assert not gpu.stream_is_capturing(stream)
    with open_backend("fake", settings=SETTINGS.updated(target_hw="")) as gpu:
        assert isinstance(gpu, FaultInjecting)
        gpu.inject_fault("is_capturing", code="CUDA_ERROR_NOT_SUPPORTED")
        with pytest.raises(MetraleError) as info:
            gpu.stream_is_capturing()
        assert info.value.name == "CUDA_ERROR_NOT_SUPPORTED", "outside the scale variant the driver is asked"


def test_events_time_work(gpu: GpuBackend) -> None:
    start, end = gpu.create_event(), gpu.create_event()
    buf = gpu.alloc(1 << 20)
    start.record()
    gpu.memset(buf, 1)
    end.record()
    end.synchronize()
    assert end.query() and start.elapsed_ms(end) >= 0.0


def test_host_memory_of_an_async_copy_stays_alive(gpu: GpuBackend) -> None:
    import gc

    buf = gpu.alloc(1 << 20)
    stream = gpu.create_stream()
    gpu.copy_to_device(buf, bytes([5]) * (1 << 20), stream=stream)  # the only reference is the copy's
    gc.collect()
    stream.synchronize()
    out = bytearray(1 << 20)
    gpu.copy_to_host(out, buf, stream=stream)
    assert out == bytes([5]) * (1 << 20)


def test_work_from_another_thread(gpu: GpuBackend) -> None:
    import threading

    buf = gpu.alloc(256)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            gpu.memset(buf, 0x42)
            gpu.synchronize()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors, errors
    out = bytearray(256)
    gpu.copy_to_host(out, buf)
    assert out == b"\x42" * 256


def test_event_recorded_again_outside_capture_is_usable(gpu: GpuBackend) -> None:
    stream, event = gpu.create_stream(), gpu.create_event()
    gpu.begin_capture(stream)
    event.record(stream)
    gpu.end_capture(stream)
    with pytest.raises(CaptureError) as info:
        event.query()
    assert info.value.name == "CUDA_ERROR_CAPTURED_EVENT"
    event.record(stream)
    event.synchronize()
    assert event.query()


def test_unknown_variables_warn(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from metrale_core import MetraleSettings

    monkeypatch.setenv("METRALE_REDZONES", "64")
    with caplog.at_level(logging.WARNING, logger="metrale"):
        MetraleSettings()
    assert any("did you mean METRALE_REDZONE?" in r.getMessage() for r in caplog.records)
