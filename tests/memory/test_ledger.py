"""The ledger: call sites, the sweep report, probes after close, and many threads at once."""

from __future__ import annotations

import logging
import threading

import pytest

from metrale_core import GpuBackend, InvalidBufferError, open_backend
from tests._support import SETTINGS


def test_site_is_the_callers_line(gpu: GpuBackend) -> None:
    buf = gpu.alloc(64)
    line = test_site_is_the_callers_line.__code__.co_firstlineno + 1
    assert buf.site == f"{__file__}:{line}"
    assert gpu.ledger_probe().records()[0].site == buf.site
    gpu.free(buf)


def test_sweep_reports_count_total_and_largest_sites(gpu: GpuBackend, caplog: pytest.LogCaptureFixture) -> None:
    def big() -> object:
        return gpu.alloc(3 << 20)

    for _ in range(2):
        big()
    gpu.alloc_managed(1 << 20)
    arena = gpu.alloc_arena(4096)
    with caplog.at_level(logging.WARNING, logger="metrale"):
        assert gpu.sweep_unreleased() == 3
    reports = [r for r in caplog.records if r.name == "metrale" and "sweep" in r.getMessage()]
    assert len(reports) == 1, "one WARNING per sweep"
    message = reports[0].getMessage()
    assert "3 allocation(s) totalling 7.0 MiB" in message
    assert message.index("(6.0 MiB x2)") < message.index("(1.0 MiB x1)"), message
    assert gpu.live_alloc_len() == 0
    gpu.free_arena(arena)  # sweeps never touch arena memory


def test_quiet_sweep_logs_nothing(gpu: GpuBackend, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="metrale"):
        assert gpu.sweep_unreleased() == 0
    assert not caplog.records


def test_probe_outlives_backend_and_close_sweeps(backend_name: str, caplog: pytest.LogCaptureFixture) -> None:
    gpu = open_backend(backend_name, settings=SETTINGS)
    probe = gpu.ledger_probe()
    gpu.alloc(100)
    gpu.alloc(200)
    assert (probe.live_count(), probe.live_bytes()) == (2, 300)
    with caplog.at_level(logging.WARNING, logger="metrale"):
        gpu.close()
        gpu.close()  # idempotent
    assert (probe.live_count(), probe.live_bytes(), probe.records()) == (0, 0, [])
    assert any("2 allocation(s)" in r.getMessage() for r in caplog.records)


def test_indexes_increase_across_backends() -> None:
    with open_backend("fake", settings=SETTINGS) as a, open_backend("fake", settings=SETTINGS) as b:
        x, y, z = a.alloc(8), b.alloc(8), a.alloc_arena(8)
        assert x.index < y.index < z.index
        assert a.live_alloc_len() == 1 and b.live_alloc_len() == 1, "each backend has its own ledger"
        a.free_arena(z)


def test_many_threads(gpu: GpuBackend) -> None:
    threads, rounds = 8, 150
    seen: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            mine = []
            for i in range(rounds):
                buf = gpu.alloc(64 + (seed * 7 + i) % 512)
                mine.append(buf)
                if i % 3 == 2:
                    gpu.free(mine.pop(0))
            with lock:
                seen.extend(b.index for b in mine)
            for buf in mine:
                gpu.copy_to_device(buf, b"\x01" * buf.nbytes)
                gpu.free(buf)
        except BaseException as exc:  # reported below
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors
    assert len(seen) == len(set(seen)) == threads * (rounds - rounds // 3)
    assert gpu.live_alloc_len() == 0


def test_two_backends_keep_separate_ledgers(backend_name: str) -> None:
    with open_backend(backend_name, settings=SETTINGS) as a, open_backend(backend_name, settings=SETTINGS) as b:
        x = a.alloc(64)
        y = b.alloc(64)
        assert (a.live_alloc_len(), b.live_alloc_len()) == (1, 1)
        with pytest.raises(InvalidBufferError):
            a.free(y)  # not on a's ledger
        a.free(x)
        assert (a.live_alloc_len(), b.live_alloc_len()) == (0, 1)
