"""Red zones on a memory pool's pieces: filled at the allocation, judged with the quarantine's batches, the scans
and the in-graph checks like any zoned buffer; a piece goes back to its pool only once its zones were judged.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale_core import DeviceBuffer, DriverError, GpuBackend, RedZoneError, RedZoneViolation, open_backend
from metrale_core._memory.pool import size_class
from metrale_core._redzones.zone import Layout, refill
from metrale_core.kernels import shipped_modules
from metrale_core.testing import FaultInjecting
from tests.redzones.test_quarantine import HELD, LEAD, ZONE, ZONED, _edge, _found, _graph, _launch_expecting, _open


def _named(violation: RedZoneViolation, piece: DeviceBuffer) -> None:
    """The violation names the piece as it was handed out, with its own site."""
    assert (violation.index, violation.ptr, violation.nbytes, violation.site) == (
        piece.index, piece.ptr, piece.nbytes, piece.site)
    assert "test_pool_zones.py:" in violation.site


def _overrun_found(gpu: GpuBackend, piece: DeviceBuffer, side: str) -> list[RedZoneViolation]:
    """One byte written just past ``piece`` on ``side``: the next scan finds exactly it, naming the piece."""
    address, offset = _edge(piece, side)
    gpu.memset(address, 0x00, nbytes=1)
    with pytest.raises(RedZoneError) as info:
        gpu.scan_redzones()
    assert _found(info.value.violations) == [(piece.index, side, offset)]
    _named(info.value.violations[0], piece)
    return info.value.violations


@pytest.mark.parametrize("side", ["trail", "lead"])
def test_a_piece_s_overrun_is_found_by_a_scan_with_its_site(backend_name: str, side: str) -> None:
    with _open(backend_name) as gpu:
        pool = gpu.create_pool()
        neighbour, piece = pool.alloc(100), pool.alloc(1000)
        line = test_a_piece_s_overrun_is_found_by_a_scan_with_its_site.__code__.co_firstlineno + 4
        assert piece.site.endswith(f"test_pool_zones.py:{line}")
        assert pool.stats().piece_bytes == size_class(100 + HELD) + size_class(1000 + HELD)
        found = _overrun_found(gpu, piece, side)
        assert neighbour.index not in {v.index for v in found}
        pool.free(piece)
        pool.free(neighbour)
        pool.close()


def test_a_freed_piece_waits_for_its_check_then_goes_back_to_its_pool(backend_name: str) -> None:
    with _open(backend_name) as gpu:
        pool = gpu.create_pool()
        piece = pool.alloc(1000)
        pool.free(piece)
        stats = gpu.stats()
        assert (stats.redzone_quarantined, stats.redzone_quarantined_bytes) == (1, 1000 + HELD)
        assert pool.stats().pieces == 1 and pool.stats().cached_bytes == 0  # not back yet
        gpu.memset(piece.ptr + piece.nbytes, 0x00, nbytes=1)  # a late write through a stale pointer
        with pytest.raises(RedZoneError) as info:
            gpu.scan_redzones()
        assert _found(info.value.violations) == [(piece.index, "trail", 0)]
        assert pool.stats().pieces == 0 and pool.stats().cached_bytes == size_class(1000 + HELD)
        again = pool.alloc(1000)  # the judged piece, its zones filled again: no blame for the old owner
        assert again.ptr == piece.ptr and gpu.scan_redzones() == []
        pool.close()


def test_without_a_quarantine_a_free_judges_the_piece_at_once(backend_name: str) -> None:
    with _open(backend_name, redzone_quarantine_bytes=0) as gpu:
        pool = gpu.create_pool()
        piece = pool.alloc(100)
        gpu.memset(piece.ptr - 1, 0x00, nbytes=1)
        with pytest.raises(RedZoneError) as info:
            pool.free(piece)
        assert _found(info.value.violations) == [(piece.index, "lead", LEAD - 1)]
        assert gpu.live_alloc_len() == 0 and pool.stats().cached_bytes == size_class(100 + HELD)
        assert pool.alloc(100).ptr == piece.ptr
        pool.close()


def test_one_piece_in_n_is_zoned(backend_name: str) -> None:
    with _open(backend_name, redzone_sample=4) as gpu:
        pool = gpu.create_pool()
        pieces = [pool.alloc(512) for _ in range(16)]
        zoned = [p for p in pieces if p.index % 4 == 0]
        assert len(zoned) == 4
        expected = sum(size_class(512 + HELD) if p.index % 4 == 0 else 512 for p in pieces)
        assert pool.stats().piece_bytes == expected
        pool.close()


def test_one_piece_in_n_for_a_foreign_stream_is_zoned_and_watched(backend_name: str) -> None:
    """A door's allocations (``alloc_on``) with ``redzone_sample``: the sampled ones get zones (the compiled lane
    hands them to the allocator), the rest take the lane's own path; an overrun of a zoned one is found, the plain
    ones go back to their pool at once."""
    with _open(backend_name, redzone_sample=4) as gpu:
        pool = gpu.create_pool()
        pieces = [pool.alloc_on(512, 2) for _ in range(8)]  # (2: the per-thread default stream, a real handle)
        zoned = [p for p in pieces if p.index % 4 == 0]
        plain = [p for p in pieces if p.index % 4]
        assert len(zoned) == 2
        assert pool.stats().piece_bytes == 2 * size_class(512 + HELD) + 6 * 512
        gpu.memset(zoned[0].ptr + zoned[0].nbytes, 0x00, nbytes=1)
        with pytest.raises(RedZoneError) as info:
            gpu.scan_redzones()
        assert [(v.index, v.site) for v in info.value.violations] == [(zoned[0].index, zoned[0].site)]
        for piece in plain:
            pool.free(piece)
        assert gpu.live_alloc_len() == 2 and pool.stats().cached_bytes == 6 * 512
        for piece in zoned:
            pool.free(piece)
        pool.close()


def test_closing_a_pool_judges_its_quarantined_pieces_first(backend_name: str) -> None:
    with _open(backend_name, redzone_action="warn") as gpu:
        heard: list[int] = []
        gpu.on_redzone_violation(lambda when, v: heard.append(v.index))
        pool = gpu.create_pool()
        piece = pool.alloc(300)
        pool.free(piece)
        gpu.memset(piece.ptr + piece.nbytes + ZONE - 1, 0x00, nbytes=1)
        pool.close()
        assert heard == [piece.index] and gpu.stats().redzone_quarantined == 0


@pytest.mark.needs("kernels")
def test_a_kernel_s_overrun_of_a_piece_inside_a_graph_is_found(backend_name: str) -> None:
    with _open(backend_name, redzone_scan_graphs=True) as gpu:
        write = gpu.load_modules(shipped_modules("fault")).kernel("fault", "write_u8")
        pool = gpu.create_pool()
        stream = gpu.create_stream()
        piece = pool.alloc(100, stream=stream)
        address, offset = _edge(piece, "trail")
        exe = _graph(gpu, stream, lambda: gpu.launch(write, 1, 1, [address, np.uint32(0x3C)], stream=stream))
        error = _launch_expecting(gpu, exe, stream, False)
        assert _found(error.violations) == [(piece.index, "trail", offset)]
        _named(error.violations[0], piece)
        exe.close()
        pool.free(piece)
        pool.close()


def test_a_zoned_piece_never_takes_memory_another_stream_may_still_use() -> None:
    """A piece freed without zones on a stream is cached for that stream, whose work may still run; a zoned
    allocation fills its zones on the default stream, which follows no other: it takes another piece."""
    settings = ZONED.updated(redzone_sample=2, redzone_quarantine_bytes=0, redzone_action="warn", fake_defer=True)
    with open_backend("fake", settings=settings) as gpu:
        pool = gpu.create_pool()
        stream = gpu.create_stream()
        plain = pool.alloc(4096, stream=stream)
        while plain.index % 2 == 0:  # one in two zoned: the even indexes
            plain = pool.alloc(4096, stream=stream)
        gpu.memset(plain, 7, stream=stream)  # queued, not yet run (fake_defer)
        pool.free(plain)
        zoned = pool.alloc(4096 - HELD, stream=stream)  # the same size class
        assert zoned.index % 2 == 0 and zoned.ptr - LEAD != plain.ptr
        assert gpu.scan_redzones() == []
        pool.close()


def test_a_close_that_cannot_read_the_zones_keeps_them_watched_and_the_memory_held() -> None:
    """``MemoryPool.close`` judges its freed and leaked pieces' zones before their memory goes. Where the read
    fails, nothing is released under a watched zone: later scans still find the leak's overrun, and the segments
    go at the backend's close, after its final scan."""
    with open_backend("fake", settings=ZONED.updated(redzone_action="warn")) as gpu:
        heard: list[int] = []
        gpu.on_redzone_violation(lambda backend, v: heard.append(v.index))
        pool = gpu.create_pool()
        freed, leak = pool.alloc(4000), pool.alloc(4000)
        gpu.memset(leak.ptr + leak.nbytes, 0, nbytes=1)
        pool.free(freed)
        gpu.inject_fault("memcpy")  # the check's read of the zones
        pool.close()
        assert pool.closed and pool.stats().segments == 1 and heard == []
        assert leak.index in {v.index for v in gpu.scan_redzones()}
        assert pool.stats().segments == 1
    assert pool.stats().segments == 0


# -- zones laid once per block, kept across its reuse (issue 54) ------------------------------------------------------


@given(lead=st.sampled_from([0, 256, 4096]), trail=st.integers(1, 5000), laid=st.integers(1, 20_000),
       nbytes=st.integers(1, 20_000))
def test_a_refill_lays_exactly_the_new_zones_and_never_touches_the_new_data(
    lead: int, trail: int, laid: int, nbytes: int
) -> None:
    layout = Layout(lead + nbytes + trail, lead, trail)
    size = max(lead + laid + trail, layout.raw_bytes)
    block = bytearray(b"D" * size)  # what the old owner left: data everywhere...
    block[:lead] = b"Z" * lead  # ...but its zones, judged intact
    block[lead + laid : lead + laid + trail] = b"Z" * trail
    start, length = refill(layout, laid, nbytes)
    assert length <= max(min(abs(nbytes - laid), trail), 0)
    assert not (start < lead + nbytes and start + length > lead) or length == 0  # never into the new data
    block[start : start + length] = b"Z" * length
    assert block[:lead] == b"Z" * lead and block[lead + nbytes : lead + nbytes + trail] == b"Z" * trail


@pytest.mark.parametrize("side", ["trail", "lead"])
@pytest.mark.parametrize("change", [0, -1, -ZONE - 8, 1, ZONE + 8])
@pytest.mark.parametrize("foreign", [False, True], ids=["own", "foreign"])
def test_a_piece_reused_with_its_zones_in_place_finds_a_one_byte_overrun_with_its_site(
    backend_name: str, side: str, change: int, foreign: bool
) -> None:
    """A piece judged intact goes back with its zones in place; the next zoned piece of its size class fills only the
    bytes its size moves, and its zones are as exact as fresh ones: no false finding, and a one-byte overrun on either
    side found with the new owner's site."""
    with _open(backend_name, redzone_quarantine_bytes=0) as gpu:  # (each free judged at once)
        pool = gpu.create_pool()

        def take(n: int) -> DeviceBuffer:
            return pool.alloc_on(n, 0x1234) if foreign else pool.alloc(n)

        old = take(1000)
        pool.free(old)
        piece = take(1000 + change)
        assert piece.ptr == old.ptr and gpu.scan_redzones() == []  # the same block, its zones right for its size
        _overrun_found(gpu, piece, side)
        with pytest.raises(RedZoneError):  # (judged again at its free: no quarantine)
            pool.free(piece)
        again = take(1000)  # its zones were found changed: laid afresh, nothing blamed on the next owner
        assert again.ptr == old.ptr and gpu.scan_redzones() == []
        pool.free(again)
        pool.close()


def test_a_piece_reused_for_its_size_lays_no_fill() -> None:
    """The same size again: its zones are in place, so no fill is issued (a memset armed to fail is never reached)."""
    with _open("fake", redzone_quarantine_bytes=0) as gpu:
        assert isinstance(gpu, FaultInjecting)
        pool = gpu.create_pool()
        old = pool.alloc_on(4096, 0x1234)
        pool.free(old)
        gpu.inject_fault("memset", nth=1)
        piece = pool.alloc_on(4096, 0x1234)  # no memset: the armed fault stays armed
        assert piece.ptr == old.ptr
        pool.free(piece)
        with pytest.raises(DriverError):  # the next fill meets it: a piece of another size class, laid afresh
            pool.alloc_on(64 << 10, 0x1234)
        pool.close()


@pytest.mark.parametrize("name", ["fake", "tracing"])
def test_another_library_s_stream_is_lent_once_per_handle(name: str) -> None:
    """`RawDevice.foreign_stream`: the fake lends one stream per handle (the tracing backend forwards it)."""
    with _open(name) as gpu:
        pool = gpu.create_pool()
        pieces = [pool.alloc_on(100, handle) for handle in (0x1234, 0x1234, 0x5678)]
        lent = gpu._parts.guard.borrowed_streams.lent  # (the guard's record of what the backend lent)
        assert sorted(lent) == [0x1234, 0x5678]
        assert gpu.scan_redzones() == []
        for piece in pieces:
            pool.free(piece)
        pool.close()


def test_fills_pending_on_a_borrowed_stream_are_waited_for_before_a_check_on_another_stream() -> None:
    """A piece for another library's stream is filled there; a check that reads its zones from another stream (the
    queued scan of a graph launch) must wait for that fill first: a wait for the whole device, never for the borrowed
    handle (its library may have destroyed the stream since). (The fake runs queued work at the check's own copies
    too, so this holds the contract, no false finding and nothing left pending, more than it isolates the wait.)"""
    with _open("fake", fake_defer=True, redzone_scan_graphs=True, redzone_scan_queued=True) as gpu:
        pool, stream, other = gpu.create_pool(), gpu.create_stream(), gpu.alloc(256)
        gpu.begin_capture(stream)  # (a capture settles first: the graph is made before the piece)
        gpu.memset(other, 0x11, stream=stream)
        graph = gpu.end_capture(stream).instantiate()
        piece = pool.alloc_on(1000, 0x1234)
        borrowed = gpu._parts.guard.borrowed_streams
        assert borrowed.pending  # its fill is queued on the borrowed stream
        graph.launch(stream)  # its check reads every zone, the piece's too
        stream.synchronize()
        assert not borrowed.pending and gpu.scan_redzones() == []
        graph.close()
        stream.close()
        gpu.free(other)
        pool.free(piece)
        pool.close()
