"""Misuse the driver rejects raises the same error class and CUDA name on every backend as on the fake."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest

from metrale_core import Event, GpuBackend, MetraleError, open_backend
from tests._support import SETTINGS


def _double_free(gpu: GpuBackend) -> None:
    buf = gpu.alloc(256)
    gpu.free(buf)
    gpu.free(buf)


def _raw_memset_outside(gpu: GpuBackend) -> None:
    gpu.memset(0x10, 0, nbytes=1)


def _raw_memset_straddling_end(gpu: GpuBackend) -> None:
    buf = gpu.alloc(1 << 20)
    try:
        gpu.memset(buf.ptr + buf.nbytes + gpu.settings.redzone - 1, 0, nbytes=4096)
    finally:
        gpu.free(buf)


def _alloc_during_capture(gpu: GpuBackend) -> None:
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    try:
        gpu.alloc(64)
    finally:
        with contextlib.suppress(MetraleError):
            gpu.end_capture(stream)


def _end_invalidated_capture(gpu: GpuBackend) -> None:
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    with contextlib.suppress(MetraleError):
        gpu.synchronize()
    gpu.end_capture(stream)


def _sync_capturing_stream(gpu: GpuBackend) -> None:
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    try:
        stream.synchronize()
    finally:
        with contextlib.suppress(MetraleError):
            gpu.end_capture(stream)


def _wait_outside_event(gpu: GpuBackend) -> None:
    stream, event = gpu.create_stream(), gpu.create_event()
    event.record()
    gpu.begin_capture(stream)
    try:
        stream.wait(event)
    finally:
        with contextlib.suppress(MetraleError):
            gpu.end_capture(stream)


def _captured_event(gpu: GpuBackend) -> Event:
    """An event whose last record was inside a capture that has ended."""
    stream, event = gpu.create_stream(), gpu.create_event()
    gpu.begin_capture(stream)
    event.record(stream)
    gpu.end_capture(stream)
    return event


def _query_captured_event(gpu: GpuBackend) -> None:
    _captured_event(gpu).query()


def _sync_captured_event(gpu: GpuBackend) -> None:
    _captured_event(gpu).synchronize()


def _launch_freed_graph(gpu: GpuBackend) -> None:
    buf = gpu.alloc(64)
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    gpu.memset(buf, 1, stream=stream)
    exe = gpu.end_capture(stream).instantiate()
    gpu.free(buf)
    exe.launch(stream)


def _overlapping_copy(gpu: GpuBackend) -> None:
    buf = gpu.alloc(4096)
    try:
        gpu.copy_device(buf, buf, nbytes=4095, dst_offset=1)
    finally:
        gpu.free(buf)


def _oversized_alloc(gpu: GpuBackend) -> None:
    gpu.alloc(gpu.memory_info().total * 4)


CASES: dict[str, Callable[[GpuBackend], None]] = {
    "double free": _double_free,
    "raw memset outside any allocation": _raw_memset_outside,
    "raw memset straddling the end": _raw_memset_straddling_end,
    "alloc during capture": _alloc_during_capture,
    "end of an invalidated capture": _end_invalidated_capture,
    "synchronize a capturing stream": _sync_capturing_stream,
    "wait on an event from outside the capture": _wait_outside_event,
    "query an event last recorded in a capture": _query_captured_event,
    "synchronize an event last recorded in a capture": _sync_captured_event,
    "launch a graph whose buffer was freed": _launch_freed_graph,
    "alloc past the device's memory": _oversized_alloc,
    "an overlapping device copy": _overlapping_copy,
}


def _outcome(name: str, case: Callable[[GpuBackend], None]) -> tuple[str, str | None]:
    with open_backend(name, settings=SETTINGS) as gpu:
        try:
            case(gpu)
        except MetraleError as exc:
            return type(exc).__name__, exc.name
        leaked = gpu.live_alloc_len()
    raise AssertionError(f"{name}: the misuse was not refused (ledger held {leaked})")


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_same_error_as_the_fake(backend_name: str, case: str) -> None:
    expected = _outcome("fake", CASES[case])
    assert _outcome(backend_name, CASES[case]) == expected
