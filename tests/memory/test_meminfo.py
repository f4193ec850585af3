"""Honest free memory: effective_free_bytes and the /proc/meminfo reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale_core import effective_free_bytes, open_backend
from metrale_core._memory.meminfo import parse_mem_available, read_mem_available
from tests._support import GIB, SETTINGS

# Recorded from a Strix Halo APU (128 GiB, 96 GiB carved for the GPU) and a discrete-GPU server.
STRIX = """MemTotal:       32614400 kB
MemFree:          812344 kB
MemAvailable:   27316544 kB
Buffers:          101236 kB
Cached:         25802012 kB
"""
NO_AVAILABLE = """MemTotal:       16314400 kB
MemFree:         8123440 kB
"""


def test_parse() -> None:
    assert parse_mem_available(STRIX) == 27316544 * 1024
    assert parse_mem_available(NO_AVAILABLE) is None
    assert parse_mem_available("MemAvailable: lots kB") is None


def test_read_missing_file(tmp_path: Path) -> None:
    assert read_mem_available(tmp_path / "nope") is None
    path = tmp_path / "meminfo"
    path.write_text(STRIX)
    assert read_mem_available(path) == 27316544 * 1024


@pytest.mark.parametrize(
    ("cu_free", "available", "integrated", "total", "want"),
    [
        (1 * GIB, 26 * GIB, True, 96 * GIB, 26 * GIB),  # integrated: the host's available memory
        (1 * GIB, 200 * GIB, True, 96 * GIB, 96 * GIB),  # capped at the device total
        (1 * GIB, None, True, 96 * GIB, 1 * GIB),  # meminfo unreadable: the device's reading stands
        (1 * GIB, 26 * GIB, None, 96 * GIB, 1 * GIB),  # integrated query failed: never add host memory
        (40 * GIB, 26 * GIB, False, 80 * GIB, 40 * GIB),  # discrete: the driver's free
    ],
)
def test_effective_free(cu_free: int, available: int | None, integrated: bool | None, total: int, want: int) -> None:
    assert effective_free_bytes(cu_free, available, integrated, total) == want


def test_fake_integrated_reports_host_available() -> None:
    settings = SETTINGS.updated(fake_integrated=True, fake_memory_bytes=1 << 60)
    with open_backend("fake", settings=settings) as gpu:
        info = gpu.memory_info()
        assert info.integrated
        host = read_mem_available()
        if host is not None:
            assert info.effective_free == min(host, info.total)
    with open_backend("fake", settings=SETTINGS.updated(fake_memory_bytes=1 << 20, redzone=0)) as gpu:
        gpu.alloc(1 << 10)
        info = gpu.memory_info()
        assert (info.free, info.total, info.effective_free, info.integrated) == (
            (1 << 20) - (1 << 10), 1 << 20, (1 << 20) - (1 << 10), False)
