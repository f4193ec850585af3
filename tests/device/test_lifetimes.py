"""Lifetime bugs of issue 13: each ownership rule the core's parts keep, tried where it used to break."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from metrale_core import (
    BackendClosedError,
    CaptureError,
    DeviceFaultError,
    GpuBackend,
    InvalidBufferError,
    open_backend,
)
from metrale_core.plugin import RawDevice
from metrale_core.testing import FaultInjecting
from tests._support import MIB, SETTINGS


def _open_spied(backend_name: str, monkeypatch: pytest.MonkeyPatch) -> GpuBackend:
    """The backend, opened with no C door into its raw layer (``RawDevice.device_calls``): every alloc and free then
    calls the raw methods, where `_RawSpy` sees them (a door's C calls pass no spy)."""
    classes, seen = [RawDevice], set()
    while classes:
        cls = classes.pop()
        if cls not in seen:
            seen.add(cls)
            classes.extend(cls.__subclasses__())
            if "device_calls" in vars(cls) and cls is not RawDevice:
                monkeypatch.setattr(cls, "device_calls", RawDevice.device_calls)
    return open_backend(backend_name, settings=SETTINGS)


class _RawSpy:
    """Wraps one raw method of a backend's raw layer (as an instance attribute: the core looks it up there)."""

    def __init__(self, gpu: GpuBackend, name: str, before: Callable[[], None] = lambda: None) -> None:
        self.inner = getattr(gpu.raw, name)
        self.before = before
        self.calls: list[Any] = []
        setattr(gpu.raw, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.before()
        result = self.inner(*args, **kwargs)
        self.calls.append(result if result is not None else args[0])
        return result


def test_close_from_another_thread_during_an_alloc_leaves_nothing(
    backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug 1: close() while another thread's alloc is inside the raw call. After close() returns nothing
    of that alloc is on the ledger or in device memory, and the alloc raises BackendClosedError."""
    gpu = _open_spied(backend_name, monkeypatch)
    probe = gpu.ledger_probe()
    inside, go_on = threading.Event(), threading.Event()

    def slow() -> None:
        inside.set()
        go_on.wait(5)

    allocs = _RawSpy(gpu, "alloc", slow)
    frees = _RawSpy(gpu, "free")
    outcome: list[object] = []

    def allocate() -> None:
        try:
            outcome.append(gpu.alloc(MIB))
        except Exception as exc:  # the test looks at what it was
            outcome.append(exc)

    worker = threading.Thread(target=allocate)
    worker.start()
    assert inside.wait(5)
    closer = threading.Thread(target=gpu.close)
    closer.start()
    time.sleep(0.05)  # close() is now waiting for the alloc in flight
    go_on.set()
    closer.join(10)
    worker.join(10)
    assert not closer.is_alive() and not worker.is_alive()
    assert gpu.closed
    assert len(outcome) == 1 and isinstance(outcome[0], BackendClosedError), outcome
    assert probe.live_count() == 0
    assert sorted(allocs.calls) == sorted(frees.calls), "device memory of the alloc was never released"


def test_an_oom_callback_that_closes_the_backend(fake: GpuBackend) -> None:
    """Bug 1, deterministically: the on_out_of_memory callback closes the backend in the middle of an alloc."""
    with open_backend("fake", settings=SETTINGS.updated(fake_memory_bytes=4 * MIB)) as gpu:
        probe = gpu.ledger_probe()
        held = gpu.alloc(3 * MIB)

        def reclaim(nbytes: int) -> bool:
            gpu.free(held)  # the retry would succeed now...
            gpu.close()  # ...but the backend is gone
            return True

        gpu.on_out_of_memory(reclaim)
        with pytest.raises(BackendClosedError):
            gpu.alloc(2 * MIB)
        assert gpu.closed and probe.live_count() == 0
        with pytest.raises(BackendClosedError):
            gpu.alloc(MIB)


def test_another_backends_arena_piece_is_not_live_here() -> None:
    """Bug 2: two fakes' address spaces coincide; a piece of one's arena is not live on the other."""
    with open_backend("fake", settings=SETTINGS) as one, open_backend("fake", settings=SETTINGS) as two:
        mine, theirs = two.create_arena(4096), one.create_arena(4096)
        own = mine.alloc(256)
        two.memset(own, 0x11)
        foreign = theirs.alloc(256)
        with pytest.raises(InvalidBufferError, match="not live"):
            two.memset(foreign, 0xFF)
        back = bytearray(256)
        two.copy_to_host(back, own)
        assert back == b"\x11" * 256


def test_a_freed_host_buffer_whose_address_came_back_is_refused(backend_name: str) -> None:
    """Bug 3: a freed HostBuffer whose pinned address the driver handed out again is not live."""
    with open_backend(backend_name, settings=SETTINGS) as gpu:
        buf = gpu.alloc(4096)
        gpu.memset(buf, 0x22)
        for _ in range(16):  # the driver hands the address out again, soon if not at once
            old = gpu.alloc_host(4096)
            gpu.free(old)
            new = gpu.alloc_host(4096)
            if new.ptr == old.ptr:
                break
            gpu.free(new)
        else:
            pytest.fail("the backend never handed a freed pinned address out again")
        new.view()[:] = b"\x33" * 4096
        with pytest.raises(InvalidBufferError, match="not a live host buffer"):
            gpu.copy_to_host(old, buf)
        with pytest.raises(InvalidBufferError, match="not a live host buffer"):
            gpu.copy_to_device(buf, old)
        gpu.synchronize()
        assert bytes(new.view()) == b"\x33" * 4096
        back = bytearray(4096)
        gpu.copy_to_host(back, buf)
        assert back == b"\x22" * 4096
        gpu.free(new)
        gpu.free(buf)


def test_an_arena_close_refused_during_a_capture_changes_nothing(gpu: GpuBackend) -> None:
    """Bug 4: Arena.close() refused (CaptureError) leaves the arena open, its block allocated and reachable."""
    arena = gpu.create_arena(4096)
    piece = arena.alloc(256)
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    with pytest.raises(CaptureError):
        arena.close()
    with pytest.raises(CaptureError):
        gpu.end_capture(stream)  # the refused call invalidated the capture, as on CUDA
    assert not arena.closed
    gpu.memset(piece, 1)
    assert arena.alloc(256) is not None
    assert gpu.stats().current_bytes["arena"] == 4096
    arena.close()
    assert arena.closed and gpu.stats().current_bytes["arena"] == 0


def test_a_fault_during_a_capture_stays_with_its_backend() -> None:
    """Bug 5: a fake that faults with a capture in progress does not bar every other backend."""
    other = open_backend("fake", settings=SETTINGS)
    try:
        with open_backend("fake", settings=SETTINGS) as faulty:
            buf = faulty.alloc(256)
            stream = faulty.create_stream()
            faulty.begin_capture(stream)
            assert isinstance(faulty, FaultInjecting)
            faulty.inject_fault("memset", code="CUDA_ERROR_ILLEGAL_ADDRESS")
            with pytest.raises(DeviceFaultError):
                faulty.memset(buf, 1, stream=stream)
            other.free(other.alloc(64))  # no CaptureError: the faulted backend's capture is gone
            with open_backend("fake", settings=SETTINGS) as new:
                new.free(new.alloc(64))
    finally:
        other.close()


def test_a_copy_of_a_handle_with_a_larger_size_is_not_live(gpu: GpuBackend) -> None:
    """Bug 6: bounds come from what the backend recorded, not from the caller's copy of the handle."""
    buf = gpu.alloc(256)
    arena = gpu.create_arena(4096)
    first, second = arena.alloc(256), arena.alloc(256)
    gpu.memset(second, 0x44)
    for handle in (buf, first):
        wide = dataclasses.replace(handle, nbytes=handle.nbytes + 256)
        with pytest.raises(InvalidBufferError, match="not live"):
            gpu.memset(wide, 0xFF)
    assert gpu.scan_redzones() == []
    back = bytearray(256)
    gpu.copy_to_host(back, second)
    assert back == b"\x44" * 256
    with pytest.raises(InvalidBufferError):
        gpu.free(dataclasses.replace(buf, nbytes=512))
    gpu.free(buf)
    arena.close()


def test_close_under_load_from_four_threads(backend_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug 1 under load: four threads allocate, memset and free until close() from a fifth refuses them;
    every call either works or raises BackendClosedError, and nothing outlives close()."""
    gpu = _open_spied(backend_name, monkeypatch)
    probe = gpu.ledger_probe()
    allocs, frees = _RawSpy(gpu, "alloc"), _RawSpy(gpu, "free")
    started = threading.Barrier(5)
    errors: list[BaseException] = []

    def work() -> None:
        started.wait(5)
        try:
            while True:
                buf = gpu.alloc(4096)
                gpu.memset(buf, 7)
                gpu.free(buf)
        except BackendClosedError:
            return
        except BaseException as exc:  # the test looks at what it was
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    started.wait(5)
    time.sleep(0.05)
    gpu.close()
    for thread in threads:
        thread.join(10)
    assert not errors, errors
    assert probe.live_count() == 0
    assert sorted(allocs.calls) == sorted(frees.calls)
