"""The fake's address space (issue 14): freed addresses come back as CUDA's allocator hands them out
again, each fake device has its own window, ``address_range`` answers from the allocation table,
memory the host cannot give is ``CUDA_ERROR_OUT_OF_MEMORY``, and a closed fake holds no memory."""

from __future__ import annotations

import gc
import itertools
import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest

from metrale_core import (
    DriverError,
    GpuBackend,
    InvalidArgumentError,
    InvalidBufferError,
    MetraleSettings,
    OutOfMemoryError,
    open_backend,
)
from metrale_core.plugin import ForeignMemory
from metrale_fake import FakeDevice
from tests._support import SETTINGS

PLAIN = SETTINGS.updated(redzone=0, fake_reuse_addresses=True)  # a buffer's address is its allocation's


@pytest.fixture
def plain() -> Iterator[GpuBackend]:
    with open_backend("fake", settings=PLAIN) as gpu:
        yield gpu


@pytest.fixture
def raw() -> Iterator[FakeDevice]:
    device = FakeDevice(PLAIN, 0)
    yield device
    device.close()


def _window(gpu: GpuBackend) -> range:
    raw = gpu.raw
    assert isinstance(raw, FakeDevice)
    w = raw.address_window
    return range(w.base, w.base + w.size)


# -- 10: a freed address comes back --------------------------------------------------------------


def test_a_freed_device_address_comes_back_most_recently_freed_first(plain: GpuBackend) -> None:
    a, b = plain.alloc(1000), plain.alloc(1000)
    plain.free(a)
    plain.free(b)
    c = plain.alloc(1000)
    d = plain.alloc(1024)  # the same size class: 1000 and 1024 bytes, each with its gap, round to one span
    assert (c.ptr, d.ptr) == (b.ptr, a.ptr)
    e = plain.alloc(1000)
    assert e.ptr not in (a.ptr, b.ptr)
    plain.free(e)
    assert plain.alloc(1025).ptr != e.ptr, "1025 bytes are another size class"
    assert plain.alloc_managed(1000).ptr == e.ptr, "managed memory shares the device's ranges"


def test_a_stale_handle_over_a_reused_address_is_refused(plain: GpuBackend) -> None:
    old = plain.alloc(4096)
    plain.memset(old, 1)
    plain.free(old)
    new = plain.alloc(4096)
    assert new.ptr == old.ptr  # the address came back, as on CUDA
    plain.memset(new, 2)
    for call in (lambda: plain.memset(old, 3), lambda: plain.copy_to_device(old, b"x" * 16),
                 lambda: plain.copy_to_host(bytearray(16), old), lambda: plain.free(old)):
        with pytest.raises(InvalidBufferError):
            call()
    out = bytearray(4096)
    plain.copy_to_host(out, new)
    assert out == b"\x02" * 4096 and plain.live_alloc_len() == 1


def test_a_stale_pointer_reaches_whatever_took_its_address(plain: GpuBackend) -> None:
    """A raw integer pointer is not checked for liveness (CUDA cannot either): it writes the new allocation."""
    old = plain.alloc(64)
    ptr = old.ptr
    plain.free(old)
    new = plain.alloc(64)
    plain.memset(ptr, 7, nbytes=64)
    out = bytearray(64)
    plain.copy_to_host(out, new)
    assert out == b"\x07" * 64


def test_reuse_off_hands_every_device_allocation_a_fresh_address() -> None:
    settings = PLAIN.updated(fake_reuse_addresses=False)
    assert not settings.fake_reuse_addresses
    with open_backend("fake", settings=settings) as gpu:
        seen: set[int] = set()
        hosts: set[int] = set()
        for i in range(5):
            bufs = [gpu.alloc(1000), gpu.alloc_managed(1000), gpu.wrap(np.zeros(1000, dtype=np.uint8))]
            host = gpu.alloc_host(1000)
            assert not {b.ptr for b in bufs} & seen
            seen |= {b.ptr for b in bufs}
            hosts.add(host.ptr)
            gpu.free(bufs[0])
            gpu.free(bufs[1])
            gpu.unwrap(bufs[2])
            gpu.free(host)
        assert len(hosts) == 1, "pinned host addresses come back either way, as before the setting"


def test_reuse_addresses_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from metrale_fake import FakeSettings

    monkeypatch.delenv("METRALE_FAKE_REUSE_ADDRESSES", raising=False)
    assert MetraleSettings().fake_reuse_addresses
    monkeypatch.setenv("METRALE_FAKE_REUSE_ADDRESSES", "off")
    assert not MetraleSettings().fake_reuse_addresses
    assert not MetraleSettings().plugin(FakeSettings).reuse_addresses


def test_host_addresses_come_back_latest_first(plain: GpuBackend) -> None:
    a, b = plain.alloc_host(100), plain.alloc_host(100)
    plain.free(a)
    plain.free(b)
    assert [plain.alloc_host(100).ptr, plain.alloc_host(100).ptr] == [b.ptr, a.ptr]


def test_wrapped_memory_takes_and_gives_back_device_addresses(plain: GpuBackend) -> None:
    raw = plain.raw
    assert isinstance(raw, FakeDevice)
    first = plain.wrap(np.zeros(512, dtype=np.uint8))
    lo, hi = raw.address_window.device
    assert lo <= first.ptr < hi
    plain.unwrap(first)
    again = plain.wrap(np.ones(512, dtype=np.uint8))
    assert again.ptr == first.ptr
    buf = plain.alloc(512)  # the same size class as the wrap: a freed wrap's range would come back here
    plain.unwrap(again)
    assert plain.alloc(512).ptr == again.ptr and buf.ptr != again.ptr


def test_allocations_keep_an_unmapped_gap_between_them(raw: FakeDevice) -> None:
    a = raw.alloc(1000, "device")
    b = raw.alloc(1000, "device")
    raw.free(a, "device")
    c = raw.alloc(1000, "device")
    assert c == a and b - (a + 1000) >= 4096
    for ptr in (a + 1000, a + 1000 + 4095, b - 1):
        with pytest.raises(DriverError) as info:
            raw.address_range(ptr)
        assert info.value.name == "CUDA_ERROR_NOT_FOUND"
        with pytest.raises(InvalidArgumentError):
            raw.memset(ptr, 0, 1, raw.stream_create())


def test_a_window_out_of_fresh_ranges_takes_a_larger_freed_one() -> None:
    from metrale_fake._memory import AddressSpace, span

    lo = 1 << 40
    space = AddressSpace(lo, lo + span(1000) + span(0), reuse=True, what="device memory")
    data = np.zeros(1000, dtype=np.uint8)
    a = space.place(1000, "device", data)
    space.place(0, "device", data[:0])
    with pytest.raises(OutOfMemoryError):
        space.place(10, "device", data[:10])
    space.remove(a)
    assert space.place(500, "device", data[:500]) == a  # no fresh range: a larger class's freed one
    space.remove(a)
    assert space.place(1000, "device", data) == a  # it kept its own span
    off = AddressSpace(lo, lo + span(1000), reuse=False, what="device memory")
    off.remove(off.place(1000, "device", data))
    with pytest.raises(OutOfMemoryError):
        off.place(1000, "device", data)


# -- 11: each fake device has its own window -----------------------------------------------------


def test_two_fakes_have_their_own_addresses() -> None:
    with open_backend("fake", settings=PLAIN) as one, open_backend("fake", settings=PLAIN) as two:
        ours: dict[int, list[int]] = {}
        arrays = [np.zeros(256, dtype=np.uint8) for _ in range(2)]
        for i, gpu in enumerate((one, two)):
            bufs = [gpu.alloc(1000), gpu.alloc_managed(64), gpu.wrap(arrays[i])]
            ours[i] = [b.ptr for b in bufs] + [b.ptr + b.nbytes - 1 for b in bufs] + [gpu.alloc_host(128).ptr]
        windows = [_window(one), _window(two)]
        assert windows[0].stop <= windows[1].start or windows[1].stop <= windows[0].start
        for i in (0, 1):
            for ptr in ours[i]:
                assert ptr in windows[i] and ptr not in windows[1 - i]
                assert 0 < ptr < 2**63
        assert not set(ours[0]) & set(ours[1])
        # With reuse on, a freed address comes back on its own backend only.
        freed = one.alloc(3000)
        one.free(freed)
        assert two.alloc(3000).ptr != freed.ptr
        assert one.alloc(3000).ptr == freed.ptr


def test_many_fake_devices_stay_aligned_positive_and_below_2_to_the_63() -> None:
    devices = [FakeDevice(PLAIN, 0) for _ in range(8)]
    huge = FakeDevice(PLAIN.updated(fake_memory_bytes=1 << 60), 0)
    try:
        windows = sorted((d.address_window for d in [*devices, huge]), key=lambda w: w.base)
        for w, nxt in itertools.pairwise(windows):
            assert w.base + w.size <= nxt.base
        for d in [*devices, huge]:
            w = d.address_window
            assert w.base % 256 == 0 and w.size % 512 == 0 and w.base > 0 and w.base + w.size <= 2**63
            assert w.size // 2 >= min(2 * d.mem_get_info()[1], 1 << 59)  # room for its capacity and the gaps
            ptr = d.alloc(100, "device")
            host, _ = d.alloc_host(100)
            assert ptr % 256 == 0 and host % 256 == 0
            assert w.base <= host < w.base + w.size // 2 <= ptr < w.base + w.size
    finally:
        for d in [*devices, huge]:
            d.close()


# -- 1 (fake side): address_range ------------------------------------------------------------------


def test_address_range_names_the_allocation_holding_an_address(raw: FakeDevice) -> None:
    dev = raw.alloc(1000, "device")
    host, _ = raw.alloc_host(300)
    array = np.zeros(77, dtype=np.uint8)
    imported = raw.import_memory(ForeignMemory("cpu", 0, array.ctypes.data, 77, array))
    empty = np.zeros(0, dtype=np.uint8)
    nothing = raw.import_memory(ForeignMemory("cpu", 0, empty.ctypes.data, 0, empty))
    for base, size in ((dev, 1000), (host, 300), (imported, 77)):
        for ptr in (base, base + 1, base + size - 1):
            assert raw.address_range(ptr) == (base, size)
    assert raw.address_range(nothing) == (nothing, 0)
    raw.free(dev, "device")
    raw.forget_memory(imported)
    for ptr in (dev, dev + 10, imported, host + 300, host - 1, 0, 16):
        with pytest.raises(DriverError) as info:
            raw.address_range(ptr)
        assert info.value.name == "CUDA_ERROR_NOT_FOUND"


def test_free_refuses_imported_memory(raw: FakeDevice) -> None:
    array = np.zeros(64, dtype=np.uint8)
    ptr = raw.import_memory(ForeignMemory("cpu", 0, array.ctypes.data, 64, array))
    with pytest.raises(InvalidArgumentError):
        raw.free(ptr, "device")
    assert raw.address_range(ptr) == (ptr, 64) and raw.mem_get_info()[0] == raw.mem_get_info()[1]
    raw.forget_memory(ptr)


def test_tracing_delegates_address_range() -> None:
    pytest.importorskip("metrale_tracing")
    with open_backend("tracing", settings=PLAIN) as gpu:
        buf = gpu.alloc(100)
        assert gpu.raw.address_range(buf.ptr + 5) == (buf.ptr, 100)
        assert "address_range" in gpu.raw_calls()  # type: ignore[attr-defined]


# -- 5 (fake side): device memory cannot be imported -------------------------------------------------


def test_import_of_device_memory_is_invalid_device(raw: FakeDevice) -> None:
    with pytest.raises(DriverError) as info:
        raw.import_memory(ForeignMemory("cuda", 0, 0x7F00_0000_0000, 64))
    assert info.value.name == "CUDA_ERROR_INVALID_DEVICE"


# -- 8 (fake side): memory the host cannot give ----------------------------------------------------


@pytest.mark.parametrize("nbytes", [1 << 62, (1 << 63) - 1])
def test_host_memory_the_host_cannot_give_is_out_of_memory(plain: GpuBackend, nbytes: int) -> None:
    before = plain.stats()
    with pytest.raises(OutOfMemoryError) as info:
        plain.alloc_host(nbytes)
    assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY" and info.value.requested == nbytes
    assert "bug" not in str(info.value)
    assert plain.stats() == before
    assert plain.alloc_host(64).nbytes == 64  # and nothing broke


@pytest.mark.parametrize("nbytes", [1 << 62, (1 << 63) - 1])
def test_raw_alloc_host_past_the_host_is_out_of_memory(raw: FakeDevice, nbytes: int) -> None:
    with pytest.raises(OutOfMemoryError) as info:
        raw.alloc_host(nbytes)
    assert info.value.requested == nbytes


def test_device_memory_numpy_cannot_give_is_out_of_memory() -> None:
    """A capacity larger than the host has: the allocation numpy cannot make is out of memory."""
    with open_backend("fake", settings=PLAIN.updated(fake_memory_bytes=1 << 62)) as gpu:
        with pytest.raises(OutOfMemoryError) as info:
            gpu.alloc(1 << 61)
        assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY" and info.value.requested >= 1 << 61
        assert gpu.live_alloc_len() == 0 and gpu.memory_info().free == 1 << 62


# -- close() drops what holds memory ------------------------------------------------------------------


def test_a_closed_fake_holds_no_memory_though_referenced() -> None:
    big = 32 << 20
    tracemalloc.start()
    try:
        gpu = open_backend("fake", settings=PLAIN.updated(fake_defer=True))
        raw = gpu.raw
        buf = gpu.alloc(big)
        gpu.alloc_host(big // 4)  # (a HostBuffer still referenced keeps its view, and so its bytes)
        stream = gpu.create_stream()
        gpu.begin_capture(stream)
        gpu.memset(buf, 1, stream=stream)
        graph = gpu.end_capture(stream)
        exe = graph.instantiate()
        gpu.memset(buf, 2, stream=stream)  # queued: deferred
        held = tracemalloc.get_traced_memory()[0]
        gpu.close()
        gc.collect()
        left = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert (raw, buf, stream, graph, exe) is not None  # all still referenced
    slack = 1 << 20  # what else the process allocated meanwhile (the sweep's log record, ...)
    assert held - left >= big + big // 4 - slack, f"close() let go of {held - left} bytes of {big + big // 4}"


@pytest.mark.parametrize("nbytes", [1 << 62, 1 << 63, (1 << 64) - 1])
def test_an_import_claiming_more_than_the_host_has_is_invalid(raw: FakeDevice, nbytes: int) -> None:
    array = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(InvalidArgumentError) as info:
        raw.import_memory(ForeignMemory("cpu", 0, array.ctypes.data, nbytes, array))
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(DriverError):
        raw.address_range(raw.address_window.device[0])  # nothing was imported
