"""Memory pressure: stats, out-of-memory errors, reclaim-and-retry, the watchdog, arenas, snapshots.

Each test runs on every available backend (a real OOM on the GPU asks for more
than the card has), except where it needs the fake's small capacity.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from metrale_core import (
    Arena,
    ArenaFullError,
    DeviceBuffer,
    GpuBackend,
    InvalidArgumentError,
    InvalidBufferError,
    MemoryInfo,
    OutOfMemoryError,
    open_backend,
)
from tests._support import GIB, MIB, SETTINGS, step


@pytest.fixture
def mem(backend_name: str) -> Iterator[GpuBackend]:
    """A backend whose memory is small on the fake (64 MiB) and the whole card on a GPU."""
    with open_backend(backend_name, settings=SETTINGS.updated(fake_memory_bytes=64 * MIB)) as gpu:
        yield gpu


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _hog(gpu: GpuBackend) -> DeviceBuffer:
    """One allocation that leaves about three units of effective free memory."""
    unit = step(gpu)
    return gpu.alloc(gpu.memory_info().effective_free - 3 * unit)


# -- stats ------------------------------------------------------------------------------


def test_stats_follow_allocations(mem: GpuBackend) -> None:
    base = mem.stats()
    a = mem.alloc(1000)
    m = mem.alloc_managed(3000)
    r = mem.alloc_arena(5000)
    stats = mem.stats()
    assert stats.alloc_count - base.alloc_count == 3
    assert stats.current_bytes["device"] - base.current_bytes["device"] == 1000
    assert stats.current_bytes["managed"] - base.current_bytes["managed"] == 3000
    assert stats.current_bytes["arena"] - base.current_bytes["arena"] == 5000
    mem.free(a)
    mem.free_arena(r)
    mem.sweep_unreleased()  # takes m
    stats = mem.stats()
    assert stats.free_count - base.free_count == 3
    assert stats.current_total_bytes == base.current_total_bytes
    assert stats.peak_total_bytes >= base.current_total_bytes + 9000
    mem.reset_peak()
    assert mem.stats().peak_total_bytes == stats.current_total_bytes
    del m


# -- out of memory -------------------------------------------------------------------------


def test_a_real_oom_names_who_holds_the_memory(mem: GpuBackend) -> None:
    held = mem.alloc(MIB)  # this line is the largest call site
    info = mem.memory_info()
    before = mem.ledger_probe().records()
    with pytest.raises(OutOfMemoryError) as caught:
        mem.alloc(info.total + GIB)
    err = caught.value
    text = str(err)
    assert err.requested == info.total + GIB and err.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "effective" in text and " of " in text and "live on the ledger" in text, text
    assert f"{Path(__file__).name}:" in text, text  # the call site of `held`
    assert "on_out_of_memory" in text, text  # says what to do
    assert mem.ledger_probe().records() == before, "a failed alloc changed the ledger"
    assert mem.stats().oom_count == 1
    mem.free(held)


@pytest.mark.needs("capacity")
def test_reclaim_and_retry(mem: GpuBackend) -> None:
    hog = _hog(mem)
    unit = step(mem)
    asked: list[int] = []

    def release_the_hog(nbytes: int) -> bool:
        asked.append(nbytes)
        if mem.ledger_probe().live_count() and hog.index in {r.index for r in mem.ledger_probe().records()}:
            mem.free(hog)
            return True
        return False

    mem.on_out_of_memory(release_the_hog)
    buf = mem.alloc(5 * unit)  # more than is left: the callback frees the hog and the retry succeeds
    assert len(asked) == 1 and asked[0] >= 5 * unit
    assert mem.stats().oom_retries == 1 and mem.stats().oom_count == 0
    mem.free(buf)


def test_reclaim_is_bounded(mem: GpuBackend) -> None:
    calls: list[int] = []
    mem.on_out_of_memory(lambda n: calls.append(n) or True)  # says it freed memory, never does
    with pytest.raises(OutOfMemoryError, match="tried 4 times"):
        mem.alloc(mem.memory_info().total + GIB)
    assert len(calls) == SETTINGS.oom_retries == 3


def test_a_callback_that_frees_nothing_gets_no_retry(mem: GpuBackend) -> None:
    calls: list[int] = []
    mem.on_out_of_memory(calls.append)  # returns None: freed nothing
    mem.on_out_of_memory(lambda n: 1 // 0)  # a broken callback is logged, not raised
    with pytest.raises(OutOfMemoryError):
        mem.alloc(mem.memory_info().total + GIB)
    assert len(calls) == 1


def test_oom_saves_a_snapshot(backend_name: str, tmp_path: Path) -> None:
    settings = SETTINGS.updated(fake_memory_bytes=64 * MIB, oom_snapshot_dir=tmp_path / "oom", memory_history=100)
    with open_backend(backend_name, settings=settings) as gpu:
        held = gpu.alloc(MIB)
        with pytest.raises(OutOfMemoryError) as caught:
            gpu.alloc(gpu.memory_info().total + GIB)
        files = list((tmp_path / "oom").glob("metrale-oom-*.json"))
        assert len(files) == 1 and str(files[0]) in str(caught.value)
        doc = json.loads(files[0].read_text())
        assert [e["index"] for e in doc["events"]] == [held.index]
        assert [r["index"] for r in doc["live"]] == [held.index]
        gpu.free(held)


# -- the watchdog ------------------------------------------------------------------------------


@pytest.mark.needs("capacity")
def test_watchdog_warns_once_and_recovers(mem: GpuBackend, caplog: pytest.LogCaptureFixture) -> None:
    unit = step(mem)
    threshold = mem.memory_info().effective_free - unit
    # On a GPU the driver takes the memory a moment before alloc returns and the record is on the ledger,
    # and the watchdog may poll in between: this smaller allocation, on the ledger first, is the largest
    # call site the warning can name then (both are this file's).
    anchor = mem.alloc(unit // 4)
    lows: list[MemoryInfo] = []
    went_low = threading.Event()

    def on_low(info: MemoryInfo) -> None:
        lows.append(info)
        went_low.set()

    with caplog.at_level(logging.INFO, logger="metrale.memory"):
        watchdog = mem.spawn_oom_watchdog(interval_s=0.01, min_free_bytes=threshold, on_low=on_low)
        try:
            assert watchdog.running and not watchdog.low
            buf = mem.alloc(2 * unit)  # crosses the threshold
            assert went_low.wait(10), "the watchdog did not notice"
            time.sleep(0.1)  # many more polls, still low: no more warnings
            mem.free(buf)
            assert _wait_for(lambda: not watchdog.low), "the watchdog did not notice the recovery"
        finally:
            watchdog.stop()
    mem.free(anchor)
    assert not watchdog.running
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "memory low" in r.getMessage()]
    infos = [r for r in caplog.records if r.levelno == logging.INFO and "memory recovered" in r.getMessage()]
    assert len(warnings) == 1 and len(infos) == 1 and len(lows) == 1, [r.getMessage() for r in caplog.records]
    assert f"{Path(__file__).name}:" in warnings[0].getMessage()  # names the largest call site
    assert lows[0].effective_free < threshold


def test_close_stops_the_watchdog(backend_name: str) -> None:
    with open_backend(backend_name, settings=SETTINGS) as gpu:
        watchdog = gpu.spawn_oom_watchdog(interval_s=0.01, min_free_bytes=0)
        assert watchdog.running
    assert _wait_for(lambda: not watchdog.running, 5)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"interval_s": 0, "min_free_bytes": 0}, "interval_s"),
        ({"interval_s": "1", "min_free_bytes": 0}, "interval_s"),
        ({"interval_s": 1, "min_free_bytes": -1}, "min_free_bytes"),
        ({"interval_s": 1, "min_free_bytes": 1.5}, "min_free_bytes"),
        ({"interval_s": 1, "min_free_bytes": 0, "on_low": 3}, "on_low"),
    ],
)
def test_watchdog_refuses_bad_arguments(fake: GpuBackend, kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidArgumentError, match=needle):
        fake.spawn_oom_watchdog(**kwargs)  # type: ignore[arg-type]


def test_on_out_of_memory_refuses_a_non_callable(fake: GpuBackend) -> None:
    with pytest.raises(InvalidArgumentError, match="on_out_of_memory"):
        fake.on_out_of_memory(3)  # type: ignore[arg-type]


# -- arenas -------------------------------------------------------------------------------------


def test_arena_pieces_work_like_buffers(gpu: GpuBackend) -> None:
    with gpu.create_arena(64 * 1024) as arena:
        assert isinstance(arena, Arena) and arena.capacity == 64 * 1024 and arena.used == 0
        a = arena.alloc(100)
        b = arena.alloc(1000, align=4096)
        c = arena.alloc(3, align=1)
        assert a.kind == b.kind == "arena" and a.ptr % 256 == 0 and b.ptr % 4096 == 0 and c.ptr == b.ptr + 1000
        assert len({a.index, b.index, c.index}) == 3
        gpu.memset(a, 7)
        gpu.copy_to_device(b, bytes(range(256)) * 3 + bytes(232))
        gpu.copy_device(a, b, nbytes=100)
        out = bytearray(100)
        gpu.copy_to_host(out, a)
        assert bytes(out) == bytes(range(100))
        assert gpu.live_alloc_len() == 0, "arena pieces are never on the ledger"
        stats = gpu.stats()
        assert (stats.arena_capacity, stats.arena_used) == (64 * 1024, arena.used)
        assert stats.arena_allocs == 3


def test_each_arena_piece_carries_the_site_of_its_own_alloc(gpu: GpuBackend) -> None:
    arena = gpu.create_arena(MIB)
    first = arena.alloc(100)
    second = arena.alloc(100)
    line = test_each_arena_piece_carries_the_site_of_its_own_alloc.__code__.co_firstlineno
    assert arena.site.endswith(f"test_memory.py:{line + 1}")
    assert (first.site, second.site) == (f"{__file__}:{line + 2}", f"{__file__}:{line + 3}")
    arena.close()


def test_arena_full_reset_close(gpu: GpuBackend) -> None:
    arena = gpu.create_arena(4096)
    first = arena.alloc(4000)
    with pytest.raises(ArenaFullError) as caught:
        arena.alloc(200)
    assert (caught.value.requested, caught.value.capacity, caught.value.used) == (200, 4096, 4000)
    assert "reset()" in str(caught.value) and arena.used == 4000
    with pytest.raises(InvalidBufferError, match="Arena"):
        gpu.free_arena(first)
    with pytest.raises(InvalidBufferError):
        gpu.free(first)
    arena.reset()
    assert arena.used == 0
    with pytest.raises(InvalidBufferError, match="not live"):
        gpu.memset(first, 0)  # a piece from before the reset is no longer live
    again = arena.alloc(4096)
    gpu.memset(again, 1)
    before = gpu.stats().current_bytes["arena"]
    arena.close()
    arena.close()  # idempotent
    assert gpu.stats().current_bytes["arena"] == before - 4096
    with pytest.raises(InvalidBufferError):
        gpu.memset(again, 0)
    with pytest.raises(InvalidBufferError, match="closed"):
        arena.alloc(1)


@pytest.mark.parametrize(("nbytes", "align"), [(-1, 256), (1.5, 256), (10, 3), (10, 0), (10, 1 << 30)])
def test_arena_refuses_bad_arguments(fake: GpuBackend, nbytes: object, align: object) -> None:
    arena = fake.create_arena(4096)
    with pytest.raises(InvalidArgumentError):
        arena.alloc(nbytes, align=align)  # type: ignore[arg-type]
    assert arena.used == 0


def test_create_arena_refuses_bad_capacity(fake: GpuBackend) -> None:
    with pytest.raises(InvalidArgumentError):
        fake.create_arena(-5)
    assert fake.stats().arena_capacity == 0


# -- snapshots -----------------------------------------------------------------------------------


def test_snapshot_keeps_a_bounded_history(tmp_path: Path) -> None:
    with open_backend("fake", settings=SETTINGS.updated(memory_history=4, redzone=0)) as gpu:
        a, b, c = gpu.alloc(10), gpu.alloc(20), gpu.alloc_managed(30)
        gpu.free(a)
        gpu.free(b)
        path = gpu.save_snapshot(tmp_path / "snap.json")
        doc = json.loads(path.read_text())
    assert doc["format"] == "metrale-memory-snapshot" and doc["version"] == 1 and doc["backend"] == "fake"
    assert doc["history_limit"] == 4 and doc["dropped"] == 1
    assert [(e["op"], e["index"]) for e in doc["events"]] == [
        ("alloc", b.index), ("alloc", c.index), ("free", a.index), ("free", b.index)]
    times = [e["t"] for e in doc["events"]]
    assert times == sorted(times) and all(t >= 0 for t in times)
    assert [(r["index"], r["nbytes"], r["kind"]) for r in doc["live"]] == [(c.index, 30, "managed")]
    assert doc["stats"]["current_bytes"]["managed"] == 30 and doc["total"] > 0


def test_history_is_off_by_default(fake: GpuBackend, tmp_path: Path) -> None:
    fake.free(fake.alloc(10))
    doc = json.loads(fake.save_snapshot(tmp_path / "s.json").read_text())
    assert doc["events"] == [] and doc["history_limit"] == 0 and doc["dropped"] == 0


# -- honest free memory --------------------------------------------------------------------------


@pytest.mark.needs("capacity")
def test_memory_info_is_honest(gpu: GpuBackend) -> None:
    """Discrete: the device's own reading. Integrated: the host's MemAvailable, capped at the total."""
    from metrale_core._memory.meminfo import read_mem_available

    info = gpu.memory_info()
    assert 0 <= info.free <= info.total and info.total > 0
    host = read_mem_available()
    if info.integrated and host is not None:
        assert info.effective_free == min(host, info.total)
    else:
        assert info.effective_free == info.free
    unit = step(gpu) if info.total > 64 * MIB else MIB
    buf = gpu.alloc(unit)
    after = gpu.memory_info()
    if not info.integrated:
        assert after.free <= info.free - unit + (2 << 20), (info, after)  # the driver rounds to 2 MiB pages
    gpu.free(buf)
