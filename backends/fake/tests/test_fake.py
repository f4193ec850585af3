"""The fake backend's own promises: deferred streams, its address space, capacity, fault injection."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest

from metrale_core import (
    DeviceFaultError,
    DriverError,
    GpuBackend,
    InvalidArgumentError,
    OutOfMemoryError,
    open_backend,
)
from metrale_core.testing import FaultInjecting
from tests._support import SETTINGS


@pytest.fixture
def deferred() -> Iterator[GpuBackend]:
    # the raw free is what runs pending work: no quarantine in between (METRALE_REDZONE may be set)
    with open_backend("fake", settings=SETTINGS.updated(fake_defer=True, redzone_quarantine_bytes=0)) as gpu:
        yield gpu


def test_defer_forgetting_to_synchronize_reads_stale_pinned_data(deferred: GpuBackend) -> None:
    buf = deferred.alloc(16)
    deferred.memset(buf, 0xAB)
    host = deferred.alloc_host(16)
    deferred.copy_to_host(host, buf)
    assert host.view().tobytes() == bytes(16), "pinned copy ran before anything made it run"
    deferred.default_stream.synchronize()
    assert host.view().tobytes() == b"\xab" * 16


def test_defer_pageable_copy_runs_its_stream(deferred: GpuBackend) -> None:
    buf = deferred.alloc(16)
    deferred.memset(buf, 0x11)
    out = bytearray(16)
    deferred.copy_to_host(out, buf)
    assert out == b"\x11" * 16


def test_defer_event_runs_up_to_itself(deferred: GpuBackend) -> None:
    buf = deferred.alloc(16)
    host = deferred.alloc_host(16)
    stream = deferred.create_stream()
    event = deferred.create_event()
    deferred.memset(buf, 1, stream=stream)
    deferred.copy_to_host(host, buf, stream=stream)
    event.record(stream)
    deferred.memset(buf, 2, stream=stream)
    event.synchronize()
    assert host.view().tobytes() == b"\x01" * 16
    other = deferred.alloc_host(16)
    deferred.copy_to_host(other, buf, stream=stream)
    assert stream.query()
    assert other.view().tobytes() == b"\x02" * 16


def test_defer_free_runs_pending_work_first(deferred: GpuBackend) -> None:
    buf = deferred.alloc(16)
    host = deferred.alloc_host(16)
    deferred.memset(buf, 9)
    deferred.copy_to_host(host, buf)
    deferred.free(buf)
    assert host.view().tobytes() == b"\x09" * 16


def test_pointers_are_aligned_nonzero_and_resolved() -> None:
    with open_backend("fake", settings=SETTINGS.updated(redzone=0)) as fake:
        _check_pointers(fake)


def _check_pointers(fake: GpuBackend) -> None:
    a, b = fake.alloc(1000), fake.alloc_managed(3)
    assert a.ptr % 256 == 0 and b.ptr % 256 == 0 and 0 not in (a.ptr, b.ptr)
    fake.memset(a.ptr + 10, 7, nbytes=990)  # inside: fine
    out = bytearray(4)
    fake.copy_to_host(out, a.ptr + 996)
    assert out == b"\x07" * 4
    for ptr, n in ((a.ptr + 999, 2), (a.ptr + 1000, 1), (a.ptr - 1, 1), (b.ptr + 3, 1)):
        with pytest.raises(InvalidArgumentError) as info:
            fake.memset(ptr, 1, nbytes=n)
        assert info.value.name == "CUDA_ERROR_INVALID_VALUE"


def test_out_of_memory_names_the_holders() -> None:
    settings = SETTINGS.updated(fake_memory_bytes=1 << 20, redzone=0)
    with open_backend("fake", settings=settings) as gpu:
        held = gpu.alloc(600 << 10)
        with pytest.raises(OutOfMemoryError) as info:
            gpu.alloc(600 << 10)
        err = info.value
        assert isinstance(err, MemoryError) and err.requested == 600 << 10
        assert err.name == "CUDA_ERROR_OUT_OF_MEMORY" and err.code == 2
        text = str(err)
        assert "600.0 KiB" in text and "424.0 KiB free" in text and held.site in text
        assert gpu.live_alloc_len() == 1


@pytest.mark.parametrize(
    ("op", "call", "error"),
    [
        ("memcpy", lambda g, b: g.copy_to_device(b, b"x"), DriverError),
        ("memset", lambda g, b: g.memset(b, 0), DriverError),
        ("synchronize", lambda g, b: g.synchronize(), DriverError),
        ("graph_launch", None, DriverError),
    ],
)
def test_injected_faults_land_after_the_core(fake: GpuBackend, op: str, call: object, error: type) -> None:
    buf = fake.alloc(64)
    if call is None:
        stream = fake.create_stream()
        fake.begin_capture(stream)
        fake.memset(buf, 1, stream=stream)
        exe = fake.end_capture(stream).instantiate()
        assert isinstance(fake, FaultInjecting)
        fake.inject_fault(op)
        with pytest.raises(error):
            exe.launch(stream)
        exe.launch(stream)  # once only
        return
    assert isinstance(fake, FaultInjecting)
    fake.inject_fault(op, nth=2)
    call(fake, buf)  # type: ignore[operator]
    with pytest.raises(error) as info:
        call(fake, buf)  # type: ignore[operator]
    assert info.value.name == "CUDA_ERROR_UNKNOWN"
    call(fake, buf)  # type: ignore[operator]


def test_injected_sticky_fault_is_a_device_fault(fake: GpuBackend) -> None:
    assert isinstance(fake, FaultInjecting)
    fake.inject_fault("synchronize", code="CUDA_ERROR_ILLEGAL_ADDRESS")
    with pytest.raises(DeviceFaultError) as info:
        fake.synchronize()
    assert info.value.code == 700


@pytest.mark.parametrize(("op", "nth", "code"), [("kernel", 1, "CUDA_ERROR_UNKNOWN"), ("free", 0, "CUDA_ERROR_UNKNOWN"),
                                                 ("free", 1, "CUDA_SUCCESS"), ("free", 1, "oops")])
def test_inject_fault_rejects_bad_arguments(fake: GpuBackend, op: str, nth: int, code: str) -> None:
    with pytest.raises(InvalidArgumentError):
        assert isinstance(fake, FaultInjecting)
        fake.inject_fault(op, nth=nth, code=code)


def test_large_copies_round_trip(fake: GpuBackend) -> None:
    data = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8)
    buf = fake.alloc(data.nbytes)
    fake.copy_to_device(buf, data)
    out = np.empty_like(data)
    fake.copy_to_host(out, buf)
    assert np.array_equal(out, data)


def test_redzone_trace_logs_the_allocating_stack(caplog: pytest.LogCaptureFixture) -> None:
    with open_backend("fake", settings=SETTINGS) as probe_gpu:
        nxt = probe_gpu.alloc(8).index + 1
    settings = SETTINGS.updated(redzone=64, redzone_trace_idx=nxt)
    with open_backend("fake", settings=settings) as gpu, caplog.at_level(logging.WARNING, logger="metrale"):
        buf = gpu.alloc(8)
        assert buf.index == nxt
        gpu.free(buf)
    traces = [r.getMessage() for r in caplog.records if "redzone_trace_idx" in r.getMessage()]
    assert len(traces) == 1 and "test_redzone_trace_logs_the_allocating_stack" in traces[0]


def test_redzone_lead_and_min_idx(caplog: pytest.LogCaptureFixture) -> None:
    settings = SETTINGS.updated(redzone=100, redzone_lead=True, redzone_action="warn")
    with open_backend("fake", settings=settings) as gpu:
        buf = gpu.alloc(10)
        assert buf.ptr % 256 == 0
        gpu.memset(buf.ptr - 1, 0, nbytes=1)
        gpu.memset(buf.ptr + 10 + 99, 0, nbytes=1)
        with caplog.at_level(logging.WARNING, logger="metrale"):
            found = sorted(gpu.scan_redzones(), key=lambda v: v.side)
        assert [(v.side, v.offset) for v in found] == [("lead", 255), ("trail", 99)]
        assert len(caplog.records) == 2 and "allocation #" in caplog.records[0].getMessage()
        nxt = gpu.alloc(8).index + 1
    later = SETTINGS.updated(redzone=64, redzone_min_idx=nxt + 1, redzone_action="warn")
    with open_backend("fake", settings=later) as gpu:
        early, late = gpu.alloc(8), gpu.alloc(8)
        assert (early.index, late.index) == (nxt, nxt + 1)
        with pytest.raises(InvalidArgumentError):
            gpu.memset(early.ptr + 8, 0, nbytes=1)  # no zone below redzone_min_idx: outside the allocation
        gpu.memset(late.ptr + 8, 0, nbytes=1)
        assert [v.index for v in gpu.scan_redzones()] == [late.index]


def test_host_buffer_close_frees_it(fake: GpuBackend) -> None:
    host = fake.alloc_host(64)
    host.close()
    host.close()
    with pytest.raises(InvalidArgumentError):
        fake.free(host)


def test_no_backend_or_example_imports_a_private_core_module() -> None:
    """Backends are written against ``metrale_core`` and ``metrale_core.plugin`` only (issue 13). A backend's
    ``tools/``, measurement scripts that are not shipped, may run the bench's own steps (issue 53)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    private = re.compile(r"^\s*(from|import)\s+metrale_core\._", re.M)
    offenders = [
        str(path.relative_to(root))
        for folder in ("backends", "examples")
        for path in sorted((root / folder).rglob("*.py"))
        if "tools" not in path.relative_to(root).parts and private.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_fake_settings_are_the_fakes_own_model() -> None:
    from metrale_fake import FakeSettings

    settings = SETTINGS.updated(fake_memory_bytes="3 MiB", fake_compute_capability="8.6")
    assert settings.plugin(FakeSettings).memory_bytes == 3 << 20
    with open_backend("fake", settings=settings) as gpu:
        assert gpu.memory_info().total == 3 << 20
