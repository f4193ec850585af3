"""Memory pools: pieces on the ledger, stream-ordered reuse, trims, thresholds, reclaim, close, bad input.

Each test runs on every available backend; the state machine (``metrale_core.testing``) drives pools at random too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metrale_core import (
    DeviceBuffer,
    GpuBackend,
    InvalidArgumentError,
    InvalidBufferError,
    MemoryPool,
    OutOfMemoryError,
    PoolStats,
    load_snapshot,
    open_backend,
)
from metrale_core._memory.pool import LARGE, SEGMENT, size_class
from tests._support import MIB, SETTINGS, read_bytes

#: These tests count bytes and reuse exactly: no red zones (zoned pieces: ``tests/redzones/test_pool_zones.py``).
PLAIN = SETTINGS.updated(redzone=0)


@pytest.fixture
def gpu(unzoned_gpu: GpuBackend) -> GpuBackend:
    return unzoned_gpu


@pytest.fixture
def fake() -> Iterator[GpuBackend]:
    with open_backend("fake", settings=PLAIN) as backend:
        yield backend


def test_a_piece_is_an_allocation_of_its_own(gpu: GpuBackend) -> None:
    pool = gpu.create_pool()
    a, b = pool.alloc(1000), pool.alloc(3000)
    assert (a.kind, a.nbytes, b.nbytes) == ("pool", 1000, 3000)
    line = test_a_piece_is_an_allocation_of_its_own.__code__.co_firstlineno + 2
    assert a.index != b.index and a.site.endswith(f"test_pool.py:{line}")
    assert {r.index: r.kind for r in gpu.ledger_probe().records()} == {a.index: "pool", b.index: "pool"}
    assert gpu.stats().current_bytes["pool"] == 4000
    gpu.memset(b, 7)
    assert read_bytes(gpu, b, 3000) == b"\x07" * 3000
    assert pool.stats() == PoolStats(segments=1, segment_bytes=SEGMENT, pieces=2, piece_bytes=1024 + 3072,
                                     cached_bytes=0, hits=0, misses=2, given_back=0, release_threshold=0)
    pool.free(a)
    gpu.free(b)  # GpuBackend.free takes a piece too
    assert gpu.live_alloc_len() == 0 and pool.stats().cached_bytes == 1024 + 3072
    pool.close()


def test_a_freed_piece_is_reused_by_its_stream_and_the_old_handle_is_refused(gpu: GpuBackend) -> None:
    pool = gpu.create_pool()
    old = pool.alloc(5000)
    pool.free(old)
    new = pool.alloc(4700)  # the same size class, the same (default) stream: the same piece
    assert new.ptr == old.ptr and new.index != old.index and pool.stats().hits == 1
    gpu.memset(new, 1)
    for op in (lambda: gpu.memset(old, 0), lambda: gpu.free(old), lambda: pool.free(old)):
        with pytest.raises(InvalidBufferError):
            op()
    assert read_bytes(gpu, new, 4700) == b"\x01" * 4700
    pool.close()


def test_reuse_is_stream_ordered(gpu: GpuBackend) -> None:
    """A piece freed on one stream serves that stream at once; another stream only once the device went idle."""
    pool = gpu.create_pool()
    s1, s2 = gpu.create_stream(), gpu.create_stream()
    piece = pool.alloc(1 << 16, stream=s1)
    pool.free(piece)  # cached for s1, the stream it was allocated on
    other = pool.alloc(1 << 16, stream=s2)
    assert other.ptr != piece.ptr
    again = pool.alloc(1 << 16, stream=s1)
    assert again.ptr == piece.ptr
    pool.free(again, stream=s2)  # cached for s2 now
    assert pool.alloc(1 << 16, stream=s1).ptr != piece.ptr
    assert pool.alloc(1 << 16, stream=s2).ptr == piece.ptr
    freed = pool.alloc(1 << 16, stream=s1)
    pool.free(freed)
    gpu.synchronize()  # idle: any stream takes it (the threshold trims only segments with nothing out)
    assert pool.alloc(1 << 16, stream=s2).ptr == freed.ptr
    pool.close()


def test_large_pieces_are_segments_of_their_own_and_trim_gives_back_free_segments(gpu: GpuBackend) -> None:
    pool = gpu.create_pool()
    big = pool.alloc(LARGE + 1)
    small = pool.alloc(100)
    assert pool.stats().segments == 2
    assert pool.stats().segment_bytes == size_class(LARGE + 1) + SEGMENT
    pool.free(big)
    assert pool.trim() == size_class(LARGE + 1)  # the shared segment has a piece out: it stays
    pool.free(small)
    assert pool.trim(keep_bytes=1 << 30) == 0
    assert pool.trim() == SEGMENT
    stats = pool.stats()
    assert (stats.segments, stats.cached_bytes, stats.given_back) == (0, 0, size_class(LARGE + 1) + SEGMENT)
    pool.close()


def test_synchronize_keeps_the_release_threshold(gpu: GpuBackend) -> None:
    keep = gpu.create_pool(release_threshold=1 << 30)
    drop = gpu.create_pool()
    for pool in (keep, drop):
        pool.free(pool.alloc(LARGE * 2))
    gpu.synchronize()
    assert keep.stats().cached_bytes == LARGE * 2 and drop.stats().cached_bytes == 0
    assert drop.stats().given_back == LARGE * 2
    keep.close()
    drop.close()


def test_out_of_memory_trims_the_pools_before_the_callbacks() -> None:
    with open_backend("fake", settings=PLAIN.updated(fake_memory_bytes=64 * MIB)) as gpu:
        asked: list[int] = []
        gpu.on_out_of_memory(lambda n: asked.append(n) or False)
        pool = gpu.create_pool()
        pool.free(pool.alloc(48 * MIB))  # cached: the driver's memory is mostly the pool's
        buf = gpu.alloc(40 * MIB)
        assert asked == [] and pool.stats().cached_bytes == 0 and pool.stats().given_back == 48 * MIB
        gpu.free(buf)


def test_close_sweeps_the_pieces_still_out(gpu: GpuBackend, caplog: pytest.LogCaptureFixture) -> None:
    pool = gpu.create_pool()
    kept = pool.alloc(777)
    with caplog.at_level(logging.WARNING, logger="metrale"):
        pool.close()
    assert "1 piece(s)" in caplog.text and kept.site in caplog.text
    assert gpu.live_alloc_len() == 0 and pool.closed
    assert [r.index for r in gpu.ledger_report().swept] == [kept.index]
    with pytest.raises(InvalidBufferError):
        gpu.free(kept)
    with pytest.raises(InvalidArgumentError, match="closed"):
        pool.alloc(1)
    pool.close()  # idempotent


def test_backend_close_releases_pools_and_sweeps_their_pieces() -> None:
    gpu = open_backend("fake", settings=PLAIN)
    pool = gpu.create_pool()
    pool.alloc(10)
    pool.free(pool.alloc(20))
    gpu.close()
    assert pool.closed and pool.stats().segments == 0


def test_a_piece_of_another_pool_or_no_piece_is_refused_and_nothing_changes(gpu: GpuBackend) -> None:
    one, two = gpu.create_pool(), gpu.create_pool()
    piece = one.alloc(64)
    plain = gpu.alloc(64)
    for bad in (lambda: two.free(piece), lambda: one.free(plain), lambda: one.free("x")):  # type: ignore[arg-type]
        with pytest.raises(InvalidBufferError):
            bad()
    assert gpu.live_alloc_len() == 2 and one.stats().pieces == 1
    stranger = DeviceBuffer(piece.ptr, piece.nbytes, "pool", piece.index + 10_000, piece.site)
    with pytest.raises(InvalidBufferError):
        gpu.free(stranger)
    one.free(piece)
    gpu.free(plain)
    one.close()
    two.close()


def test_an_equal_handle_of_a_piece_frees_it_back_to_its_pool(gpu: GpuBackend) -> None:
    """A handle equal to a piece's (same index, address and size; here of kind "device") frees the piece into its
    pool, never to the driver: the pool still owns the segment."""
    pool = gpu.create_pool()
    piece = pool.alloc(300)
    twin = DeviceBuffer(piece.ptr, piece.nbytes, "device", piece.index, piece.site, piece._owner)
    gpu.free(twin)
    assert gpu.live_alloc_len() == 0 and pool.stats().cached_bytes == 512
    assert pool.alloc(300).ptr == piece.ptr
    pool.close()


@pytest.mark.parametrize(("call", "error"), [
    (lambda gpu, pool: pool.alloc(0), InvalidBufferError),
    (lambda gpu, pool: pool.alloc(-1), InvalidBufferError),
    (lambda gpu, pool: pool.alloc("8"), InvalidBufferError),
    (lambda gpu, pool: pool.alloc(8, stream="s"), InvalidArgumentError),
    (lambda gpu, pool: pool.trim(-1), InvalidArgumentError),
    (lambda gpu, pool: pool.trim("all"), InvalidArgumentError),
    (lambda gpu, pool: gpu.create_pool(release_threshold=-1), InvalidArgumentError),
    (lambda gpu, pool: gpu.create_pool(release_threshold=1.5), InvalidArgumentError),
])
def test_bad_input_is_refused_and_changes_nothing(gpu: GpuBackend, call: object, error: type[Exception]) -> None:
    pool = gpu.create_pool()
    before = pool.stats()
    with pytest.raises(error):
        call(gpu, pool)  # type: ignore[operator]
    assert pool.stats() == before and gpu.live_alloc_len() == 0
    pool.close()


def test_a_piece_used_on_another_stream_too_waits_for_the_device_before_any_reuse(gpu: GpuBackend) -> None:
    """``record_stream`` (torch's ``Tensor.record_stream`` through the door): the piece is cached for no stream at
    its free, so its own stream does not take it back; after a wait for the device any stream may."""
    pool = gpu.create_pool(release_threshold=1 << 30)
    piece = pool.alloc_on(4096, 0x77)
    pool.record_stream(piece, 0x77)  # its own stream: nothing changes
    pool.free(piece)
    again = pool.alloc_on(4096, 0x77)
    assert again.ptr == piece.ptr
    pool.record_stream(again, 0x99)
    pool.free(again)
    other = pool.alloc_on(4096, 0x77)
    assert other.ptr != again.ptr, "a piece used on another stream too was reused before a wait for the device"
    pool.free(other)
    gpu.synchronize()  # (the pool's wait: what was cached before it serves any stream)
    assert {pool.alloc_on(4096, 0x77).ptr for _ in range(2)} == {again.ptr, other.ptr}
    pool.close()


@pytest.mark.parametrize("pure", [False, True])
def test_out_of_memory_asks_the_pool_again_after_its_wait(pure: bool) -> None:
    """The review's case: the device full, the pool's cached pieces all used on another stream too (or cached for
    another stream). The out-of-memory reclaim waits for the device, which makes them any stream's: the allocation
    takes one instead of failing."""
    with open_backend("fake", settings=PLAIN.updated(pure=pure, fake_memory_bytes=4 * MIB)) as gpu:
        pool = gpu.create_pool(release_threshold=1 << 30)
        pieces = [pool.alloc_on(512 * 1024, 7) for _ in range(8)]  # two segments: the whole device
        shared = pieces[::2]
        for piece in shared:
            pool.record_stream(piece, 8)
            pool.free(piece)
        again = pool.alloc_on(512 * 1024, 7)
        assert again.ptr in {piece.ptr for piece in shared}
        assert gpu.stats().oom_count == 0
        pool.close()


def test_record_stream_on_a_closed_pool_says_it_is_closed(gpu: GpuBackend) -> None:
    pool = gpu.create_pool()
    piece = pool.alloc_on(64, 5)
    gpu.free(piece)
    pool.close()
    with pytest.raises(InvalidArgumentError, match="is closed; create another"):
        pool.record_stream(piece, 9)


@pytest.mark.parametrize(("call", "error"), [
    (lambda pool, piece, freed, other: pool.record_stream(freed, 9), InvalidBufferError),
    (lambda pool, piece, freed, other: other.record_stream(piece, 9), InvalidBufferError),
    (lambda pool, piece, freed, other: pool.record_stream("piece", 9), InvalidBufferError),
    (lambda pool, piece, freed, other: pool.record_stream(piece, -1), InvalidArgumentError),
    (lambda pool, piece, freed, other: pool.record_stream(piece, 2**64), InvalidArgumentError),
    (lambda pool, piece, freed, other: pool.record_stream(piece, "s"), InvalidArgumentError),
])
def test_record_stream_refuses_bad_input_and_changes_nothing(gpu: GpuBackend, call: object, error: type) -> None:
    pool, other = gpu.create_pool(release_threshold=1 << 30), gpu.create_pool()
    piece, freed = pool.alloc_on(4096, 5), pool.alloc_on(4096, 5)
    pool.free(freed)
    with pytest.raises(error):
        call(pool, piece, freed, other)  # type: ignore[operator]
    pool.free(piece)
    assert pool.alloc_on(4096, 5).ptr == piece.ptr  # not marked as used elsewhere
    pool.close()
    other.close()


@pytest.mark.parametrize("pure", [False, True])
@pytest.mark.parametrize("nbytes", [2**62, 2**63 - 1, 2**63, 2**64 - 1])
def test_a_size_no_driver_serves_is_out_of_memory_in_each_build(pure: bool, nbytes: int) -> None:
    """The review's overflow: sizes past a C ``long long`` once rounded go to the allocator in the compiled build
    too, and are refused there with the driver's out-of-memory error; nothing is handed out."""
    with open_backend("fake", settings=PLAIN.updated(pure=pure)) as gpu:
        pool = gpu.create_pool()
        kept = pool.alloc_on(1024, 7)
        before = pool.stats()
        for call in (lambda: pool.alloc_on(nbytes, 7), lambda: pool.alloc(nbytes)):
            with pytest.raises(OutOfMemoryError):
                call()
        after = pool.stats()
        assert (after.pieces, after.piece_bytes, after.cached_bytes) == (before.pieces, before.piece_bytes, 0)
        assert pool.alloc_on(512, 7).ptr != kept.ptr and gpu.live_alloc_len() == 2
        pool.close()


def test_pool_calls_are_refused_during_a_capture(gpu: GpuBackend) -> None:
    from metrale_core import CaptureError

    pool = gpu.create_pool()
    piece = pool.alloc(64)
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    for call in (lambda: pool.alloc(64), lambda: pool.free(piece), pool.trim, gpu.create_pool,
                 lambda: pool.record_stream(piece, 5)):
        with pytest.raises(CaptureError):
            call()
    with pytest.raises(CaptureError, match="invalidated"):  # as CUDA: a forbidden call invalidates the capture
        gpu.end_capture(stream)
    assert pool.stats().pieces == 1
    pool.free(piece)
    pool.close()


def test_the_pool_is_a_context_manager(gpu: GpuBackend) -> None:
    with gpu.create_pool() as pool:
        assert isinstance(pool, MemoryPool)
        pool.free(pool.alloc(8))
    assert pool.closed and "closed" in repr(pool)


def test_a_wait_counts_only_for_the_pieces_cached_before_it_began(fake: GpuBackend) -> None:
    """A piece freed on a stream while a trim waits for the device (after its mark) stays that stream's: work
    queued on it after the wait began may still use it."""
    pool = fake.create_pool()
    s1, s2 = fake.create_stream(), fake.create_stream()
    before, after = pool.alloc(4096, stream=s1), pool.alloc(4096, stream=s1)
    pool.free(before)
    mark = pool.mark()  # a wait begins here
    pool.free(after)  # freed during the wait
    pool.idle(mark)
    assert pool.alloc(4096, stream=s2).ptr == before.ptr
    assert pool.alloc(4096, stream=s2).ptr != after.ptr
    assert pool.release(0, mark) == []  # its segment holds a piece cached after the mark (and pieces out)
    pool.close()


def test_close_racing_an_allocation_that_needs_a_segment_leaves_nothing(
    fake: GpuBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's race: ``close()`` runs while another thread's allocation fetches a new segment; the allocation
    is refused and its segment goes back to the driver. (Raw memory's step is held up: the pool and its front may
    be compiled, whose methods cannot be patched.)"""
    import threading

    from metrale_core._memory.rawmem import RawMemory

    pool = fake.create_pool()
    inside, go = threading.Event(), threading.Event()
    alloc = RawMemory.alloc

    def late(self: RawMemory, *args: Any, **kwargs: Any) -> int:
        inside.set()
        go.wait(10)
        return alloc(self, *args, **kwargs)

    monkeypatch.setattr(RawMemory, "alloc", late)
    errors: list[BaseException] = []

    def allocate() -> None:
        try:
            pool.alloc(LARGE + 1)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=allocate)
    thread.start()
    assert inside.wait(10)
    pool.close()
    go.set()
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], InvalidArgumentError), errors
    assert fake.live_alloc_len() == 0 and fake.stats().current_bytes["pool"] == 0
    assert fake.memory_info().free == fake.memory_info().total  # the segment went back


def test_a_segment_whose_release_fails_is_not_counted_as_given_back(fake: GpuBackend) -> None:
    pool = fake.create_pool()
    pool.free(pool.alloc(100))
    fake.inject_fault("free")  # type: ignore[attr-defined]
    assert pool.trim() == 0 and pool.stats().given_back == 0
    pool.close()


def test_the_summary_and_a_snapshot_count_what_the_pools_hold(fake: GpuBackend, tmp_path: Path) -> None:
    pool = fake.create_pool()
    kept = pool.alloc(1000)
    pool.free(pool.alloc(5000))
    line = "memory pools    1 open: 2.0 MiB in segments, 1.0 KiB in pieces out, 5.0 KiB cached"
    assert line in fake.memory_summary()
    path = fake.save_snapshot(tmp_path / "snap.json")
    snapshot = load_snapshot(path)
    assert snapshot.stats["pools"] == {"open": 1, "segment_bytes": SEGMENT, "piece_bytes": 1024, "cached_bytes": 5120}
    from metrale_core._memory.pressure import memory_summary
    from metrale_core._reports.summary import snapshot_pools, snapshot_stats

    assert line in memory_summary("s", snapshot_stats(snapshot), list(snapshot.live), pools=snapshot_pools(snapshot))
    pool.free(kept)
    pool.close()
    assert "memory pools" not in fake.memory_summary()


@pytest.mark.parametrize("pure", [False, True])
def test_sweeps_racing_allocations_leave_no_piece_out(pure: bool) -> None:
    """The review's race (each build): sweeps on one thread while another allocates and frees, and a third holds
    the pool's lock while a collection lets go of the GIL. Once all stop and a last sweep ran, no piece is out, and
    a trim gives every segment back (the compiled lane commits without the context's lock: a sweep between its
    ledger record and its hand-out must leave the piece as the sweep would)."""
    import contextlib
    import gc
    import sys
    import threading
    import time

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    gpu = open_backend("fake", settings=PLAIN.updated(pure=pure, memory_history=100))
    pool = gpu.create_pool()
    stop = threading.Event()
    holder: list[int] = []

    def slow_collection(phase: str, info: object) -> None:
        if phase == "start" and holder and threading.get_ident() == holder[0]:
            time.sleep(0.002)

    def hold() -> None:
        holder.append(threading.get_ident())
        while not stop.is_set():
            pool.out()

    def sweep() -> None:
        while not stop.is_set():
            gpu.sweep_unreleased()
            time.sleep(0)

    def churn() -> None:
        while not stop.is_set():
            piece = pool.alloc_on(1024, 7)
            with contextlib.suppress(InvalidBufferError):  # swept meanwhile
                pool.free(piece)

    gc.callbacks.append(slow_collection)
    threshold = gc.get_threshold()
    gc.set_threshold(5, 1000, 1000)
    threads = [threading.Thread(target=f) for f in (churn, sweep, hold)]
    try:
        with caplog_off():
            for thread in threads:
                thread.start()
            time.sleep(1.0)
            stop.set()
            for thread in threads:
                thread.join(10)
            gpu.sweep_unreleased()
    finally:
        gc.callbacks.remove(slow_collection)
        gc.set_threshold(*threshold)
        sys.setswitchinterval(interval)
    assert gpu.live_alloc_len() == 0 and pool.stats().pieces == 0, pool.stats()
    assert pool.trim(0) == SEGMENT and pool.stats().segments == 0
    gpu.close()


def caplog_off() -> Any:
    """The sweeps' warnings (one per piece swept) off while the threads run."""
    import contextlib

    @contextlib.contextmanager
    def off() -> Iterator[None]:
        logging.disable(logging.CRITICAL)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)

    return off()
