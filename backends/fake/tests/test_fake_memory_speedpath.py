"""The fake's raw alloc/free fast path (issue 16): a freed device array no view was ever taken of is
kept, within a bound, for the next allocation of its size; nothing else about alloc and free changes:
fresh memory reads as zeros, a freed buffer's views and recorded work keep their own bytes, and
faults, out of memory, capture bars and pending work behave as before."""

from __future__ import annotations

import gc
import tracemalloc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

from metrale_core import MetraleError, MetraleSettings, OutOfMemoryError
from metrale_fake import FakeDevice
from metrale_fake._memory import GAP, KEEP_BYTES, AddressSpace, span
from tests._support import SETTINGS

PLAIN = SETTINGS.updated(redzone=0, fake_reuse_addresses=True)
LO = 1 << 40


def _space(keep_bytes: int = 1 << 20, *, reuse: bool = True) -> AddressSpace:
    return AddressSpace(LO, LO + (1 << 30), reuse=reuse, what="device memory", keep_bytes=keep_bytes)


@pytest.fixture
def raw() -> Iterator[FakeDevice]:
    device = FakeDevice(PLAIN, 0)
    yield device
    device.close()


def _device(settings: MetraleSettings = PLAIN) -> FakeDevice:
    return FakeDevice(settings, 0)


def _read(raw: FakeDevice, ptr: int, nbytes: int) -> bytes:
    out = bytearray(nbytes)
    stream = raw.stream_create()
    raw.copy_dtoh(memoryview(out), ptr, stream, pinned=False)
    raw.stream_destroy(stream)
    return bytes(out)


def _name(exc: pytest.ExceptionInfo[MetraleError]) -> str | None:
    return exc.value.name


# -- the space: what it keeps ------------------------------------------------------------------------


def test_an_untouched_freed_array_comes_back_for_its_size_only() -> None:
    space = _space()
    a = space.place_zeros(1000, "device", "fake alloc")
    record = space.get(a)
    assert record is not None and record.zeroed
    array = record.data
    space.remove(a)
    assert space.kept_bytes == span(1000)
    other = space.place_zeros(1001, "device", "fake alloc")  # the same size class, another size
    assert other == a  # (its freed range)
    assert space.get(other) is not None and space.get(other).data is not array  # type: ignore[union-attr]
    assert space.kept_bytes == span(1000)
    b = space.place_zeros(1000, "managed", "fake alloc")
    again = space.get(b)
    assert again is not None and again.data is array and again.kind == "managed" and again.size == 1000
    assert again.base == b and space.holding(b + 999) is again
    assert space.kept_bytes == 0
    assert not array.any()


def test_an_array_a_view_was_taken_of_goes_with_its_allocation() -> None:
    space = _space()
    a = space.place_zeros(1000, "device", "fake alloc")
    view = space.find(a, 10)
    assert view is not None
    view[:] = 7
    space.remove(a)
    assert space.kept_bytes == 0
    b = space.place_zeros(1000, "device", "fake alloc")
    assert b == a and space.find(b, 1000) is not None
    assert not space.find(b, 1000).any()  # type: ignore[union-attr]
    assert view.tolist() == [7] * 10  # the freed allocation's view keeps its own bytes
    given = np.zeros(1000, dtype=np.uint8)
    space.remove(space.place(1000, "device", given))  # memory given to the space is never kept
    assert space.kept_bytes == 0


def test_the_kept_arrays_stay_within_keep_bytes_and_the_first_sizes_go_first() -> None:
    space = _space(3 * span(1000))
    bases = [space.place_zeros(1000, "device", "fake alloc") for _ in range(5)]
    for base in bases:
        space.remove(base)
    assert space.kept_bytes == 3 * span(1000)
    big = space.place_zeros(2000, "device", "fake alloc")
    space.remove(big)  # room for it: two of the 1000-byte arrays go
    assert space.kept_bytes == span(1000) + span(2000) <= 3 * span(1000)
    huge = space.place_zeros(3 * span(1000), "device", "fake alloc")
    space.remove(huge)  # larger than the bound alone: not kept, nothing let go for it
    assert space.kept_bytes == span(1000) + span(2000)
    space.remove(space.place_zeros(0, "device", "fake alloc"))  # an empty one is never kept
    assert space.kept_bytes == span(1000) + span(2000)
    space.clear()
    assert space.kept_bytes == 0
    none = _space(0)
    none.remove(none.place_zeros(1000, "device", "fake alloc"))
    assert none.kept_bytes == 0


def test_many_tiny_arrays_are_bounded_by_their_spans() -> None:
    space = _space(100 * (GAP + 256))
    bases = [space.place_zeros(1, "device", "fake alloc") for _ in range(500)]
    for base in bases:
        space.remove(base)
    assert space.kept_bytes == 100 * span(1)


def test_a_freed_range_holds_nothing_while_its_base_is_remembered() -> None:
    for reuse in (True, False):
        space = _space(reuse=reuse)
        a = space.place_zeros(1000, "device", "fake alloc")
        b = space.place_zeros(1000, "device", "fake alloc")
        space.remove(a)
        for ptr in (a, a + 1, a + 999, a + span(1000) - 1):
            assert space.holding(ptr) is None and space.tail(ptr) is None
        assert space.holding(b) is not None and space.find(b + 10, 990) is not None
        assert space.remove(a) is None
        c = space.place_zeros(1000, "device", "fake alloc")
        assert (c == a) is reuse and space.holding(c + 999) is space.get(c)


def test_remove_unless_refuses_the_kinds_named_and_changes_nothing() -> None:
    space = _space()
    given = np.zeros(100, dtype=np.uint8)
    ext = space.place(100, "external", given)
    assert space.remove_unless(ext, frozenset({"external"})) is None
    assert space.get(ext) is not None and space.holding(ext + 99) is space.get(ext)
    assert space.remove_unless(ext + 1, frozenset()) is None
    removed = space.remove_unless(ext, frozenset({"mapped"}))
    assert removed is not None and removed.data is given and space.get(ext) is None


# -- the device: nothing else changes -----------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1, 64 << 10, 1 << 20])
def test_fresh_device_memory_reads_as_zeros_whatever_the_last_of_its_size_held(
    raw: FakeDevice, nbytes: int
) -> None:
    stream = raw.stream_create()
    a = raw.alloc(nbytes, "device")
    raw.free(a, "device")  # untouched: its array is kept
    b = raw.alloc(nbytes, "device")
    assert b == a and _read(raw, b, nbytes) == bytes(nbytes)
    raw.memset(b, 0xAB, nbytes, stream)
    raw.stream_synchronize(stream)
    raw.free(b, "device")
    c = raw.alloc(nbytes, "device")
    assert c == a and _read(raw, c, nbytes) == bytes(nbytes)
    raw.free(c, "device")


def test_an_exported_view_of_a_freed_buffer_is_not_the_next_buffer(raw: FakeDevice) -> None:
    n = 4096
    stream = raw.stream_create()
    a = raw.alloc(n, "device")
    exported = raw.export_memory(a, n)
    old = exported.keepalive
    assert isinstance(old, np.ndarray)
    raw.free(a, "device")
    b = raw.alloc(n, "device")
    assert b == a
    raw.memset(b, 7, n, stream)
    raw.stream_synchronize(stream)
    assert not old.any()
    old[:] = 3
    assert _read(raw, b, n) == b"\x07" * n


def test_a_graph_of_a_freed_buffer_writes_no_later_buffer(raw: FakeDevice) -> None:
    n = 4096
    stream = raw.stream_create()
    a = raw.alloc(n, "device")
    raw.begin_capture(stream)
    raw.memset(a, 5, n, stream)
    graph = raw.end_capture(stream)
    exe = raw.graph_instantiate(graph)
    raw.free(a, "device")
    b = raw.alloc(n, "device")
    assert b == a
    raw.graph_launch(exe, stream)
    raw.stream_synchronize(stream)
    assert _read(raw, b, n) == bytes(n)


def test_injected_faults_fire_on_the_fast_path_and_change_nothing(raw: FakeDevice) -> None:
    n = 1 << 20
    raw.free(raw.alloc(n, "device"), "device")  # one array kept
    raw.inject_fault("alloc", 2, "CUDA_ERROR_OUT_OF_MEMORY")
    a = raw.alloc(n, "device")
    with pytest.raises(OutOfMemoryError) as oom:
        raw.alloc(n, "device")
    assert "a fault injected" in str(oom.value)
    assert raw.mem_get_info()[0] == raw.mem_get_info()[1] - n
    raw.inject_fault("free", 1, "CUDA_ERROR_INVALID_VALUE")
    with pytest.raises(MetraleError) as failed:
        raw.free(a, "device")
    assert _name(failed) == "CUDA_ERROR_INVALID_VALUE" and "a fault injected" in str(failed.value)
    assert raw.address_range(a) == (a, n)  # still live
    raw.free(a, "device")
    assert raw.mem_get_info()[0] == raw.mem_get_info()[1]
    b = raw.alloc(n, "device")
    assert b == a and _read(raw, b, n) == bytes(n)


def test_a_sticky_fault_reaches_alloc_and_free(raw: FakeDevice) -> None:
    a = raw.alloc(4096, "device")
    raw.inject_fault("alloc", 1, "CUDA_ERROR_ILLEGAL_ADDRESS")
    with pytest.raises(MetraleError) as first:
        raw.alloc(4096, "device")
    assert _name(first) == "CUDA_ERROR_ILLEGAL_ADDRESS"
    with pytest.raises(MetraleError) as again:
        raw.alloc(4096, "device")
    assert _name(again) == "CUDA_ERROR_ILLEGAL_ADDRESS" and "alloc of 4096 bytes" in str(again.value)
    with pytest.raises(MetraleError) as no_stream:
        raw.free(a, "device")
    assert _name(no_stream) == "CUDA_ERROR_ILLEGAL_ADDRESS" and f"free of {a:#x}" in str(no_stream.value)
    raw.stream_create()
    with pytest.raises(MetraleError) as with_stream:
        raw.free(a, "device")  # a stream open: the drain before the free reports it, as before
    assert _name(with_stream) == "CUDA_ERROR_ILLEGAL_ADDRESS" and "synchronization" in str(with_stream.value)


def test_out_of_memory_is_at_the_capacity_kept_arrays_counting_nothing() -> None:
    raw = _device(PLAIN.updated(fake_memory_bytes=1 << 20))
    try:
        a = raw.alloc(1 << 20, "device")
        with pytest.raises(OutOfMemoryError) as oom:
            raw.alloc(1, "device")
        assert oom.value.requested == 1
        raw.free(a, "device")
        assert raw.mem_get_info() == (1 << 20, 1 << 20)
        half = [raw.alloc(1 << 19, "device") for _ in range(2)]
        with pytest.raises(OutOfMemoryError):
            raw.alloc(1, "device")
        for ptr in half:
            raw.free(ptr, "device")
        assert raw.mem_get_info() == (1 << 20, 1 << 20)
    finally:
        raw.close()


def test_alloc_and_free_are_barred_during_a_capture(raw: FakeDevice) -> None:
    a = raw.alloc(4096, "device")
    stream = raw.stream_create()
    raw.begin_capture(stream)
    for call in (lambda: raw.alloc(4096, "device"), lambda: raw.free(a, "device")):
        with pytest.raises(MetraleError) as barred:
            call()
        assert _name(barred) == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    with pytest.raises(MetraleError) as ended:
        raw.end_capture(stream)
    assert _name(ended) == "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"
    assert raw.address_range(a) == (a, 4096) and raw.mem_get_info()[0] == raw.mem_get_info()[1] - 4096
    raw.free(a, "device")


def test_free_runs_pending_work_first() -> None:
    raw = _device(PLAIN.updated(fake_defer=True))
    try:
        stream = raw.stream_create()
        raw.stream_create()  # another, idle
        a = raw.alloc(64, "device")
        _, host = raw.alloc_host(64)
        raw.memset(a, 9, 64, stream)
        raw.copy_dtoh(host, a, stream, pinned=True)
        assert host.tobytes() == bytes(64)  # deferred: nothing ran yet
        raw.free(a, "device")
        assert host.tobytes() == b"\x09" * 64
    finally:
        raw.close()


def test_free_refuses_what_it_does_not_free(raw: FakeDevice) -> None:
    a = raw.alloc(4096, "device")
    raw.free(a, "device")
    for ptr in (a, a + 256, 12345):
        with pytest.raises(MetraleError) as bad:
            raw.free(ptr, "device")
        assert _name(bad) == "CUDA_ERROR_INVALID_VALUE"
    host_ptr, _, mapped = raw.alloc_host_mapped(4096)
    theirs = np.zeros(256, dtype=np.uint8)
    from metrale_core.plugin import ForeignMemory

    imported = raw.import_memory(ForeignMemory("cpu", 0, int(theirs.ctypes.data), 256, theirs))
    for ptr in (mapped, imported):
        with pytest.raises(MetraleError) as refused:
            raw.free(ptr, "device")
        assert _name(refused) == "CUDA_ERROR_INVALID_VALUE" and raw.address_range(ptr)[0] == ptr
    raw.forget_memory(imported)
    raw.free_host(host_ptr)


def test_pinned_host_memory_is_zeros_and_never_kept(raw: FakeDevice) -> None:
    ptr, view = raw.alloc_host(4096)
    assert view.tobytes() == bytes(4096)
    view[:] = b"\x01" * 4096
    array = weakref.ref(view.obj)  # type: ignore[arg-type]
    del view
    raw.free_host(ptr)
    assert array() is None
    again, fresh = raw.alloc_host(4096)
    assert again == ptr and fresh.tobytes() == bytes(4096)
    raw.free_host(again)


def test_kept_arrays_are_bounded_and_let_go_at_close() -> None:
    capacity, n = 8 << 20, 2 << 20
    tracemalloc.start()
    try:
        raw = _device(PLAIN.updated(fake_memory_bytes=capacity))
        start = tracemalloc.get_traced_memory()[0]
        ptrs = [raw.alloc(n, "device") for _ in range(4)]
        for ptr in ptrs:
            raw.free(ptr, "device")
        kept = tracemalloc.get_traced_memory()[0] - start
        again = [raw.alloc(n, "device") for _ in range(4)]  # the kept ones come back, one more fresh
        for ptr in again:
            raw.free(ptr, "device")
        kept_again = tracemalloc.get_traced_memory()[0] - start
        raw.close()
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    slack = 1 << 20
    assert n <= kept <= min(capacity, KEEP_BYTES) + slack, kept
    assert kept_again <= min(capacity, KEEP_BYTES) + slack, kept_again
    assert left < slack, f"close() kept {left} bytes"
