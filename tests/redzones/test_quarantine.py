"""Red zones: the quarantine of freed buffers, sampling, and planted overruns found by every kind of check
(inside a graph, in quarantine, at ``scan_redzones()``), on every backend.

The in-graph checks run where the backend maps host memory (the fake and CUDA do); elsewhere the scans
after graph launches stand in, and the tests here expect their words (``gpu.redzone_checks`` says which).
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from metrale_core import (
    CaptureError,
    DeviceBuffer,
    DriverError,
    GpuBackend,
    GraphExec,
    OutOfMemoryError,
    RedZoneError,
    RedZoneViolation,
    Stream,
    open_backend,
)
from metrale_core._memory.quarantine import QUARANTINE_MAX_BUFFERS
from metrale_core.kernels import shipped_modules
from metrale_core.testing import FaultInjecting
from tests._support import MIB, SETTINGS, checked_inside, examples, step

FILL = 0xA5
ZONE = 64  # the trailing zone
LEAD = 256  # the leading band: ZONE rounded up to 256

#: Zones on both sides of every allocation, raised at once; the quarantine at its default bound.
ZONED = SETTINGS.updated(
    redzone=ZONE, redzone_lead=True, redzone_min_idx=0, redzone_sample=1, redzone_fill=FILL,
    redzone_action="raise", redzone_quarantine_bytes=256 * MIB, redzone_scan_graphs=False,
    redzone_scan_queued=False,
)
#: What an allocation of ``n`` bytes holds of the device with ZONED (the quarantine counts it).
HELD = LEAD + ZONE


def _open(backend_name: str, **changes: object) -> GpuBackend:
    return open_backend(backend_name, settings=ZONED.updated(**changes))


def _edge(buf: DeviceBuffer, side: str) -> tuple[int, int]:
    """The address of the byte just past the end (``trail``) or just before the start (``lead``) of ``buf``,
    and its offset in its zone."""
    return (buf.ptr + buf.nbytes, 0) if side == "trail" else (buf.ptr - 1, LEAD - 1)


def _found(violations: list[RedZoneViolation]) -> list[tuple[int, str, int]]:
    return [(v.index, v.side, v.offset) for v in violations]


def _named(violation: RedZoneViolation, buf: DeviceBuffer) -> None:
    """The violation names the allocation as it was handed out: where, how big, and where it was made."""
    assert (violation.index, violation.ptr, violation.nbytes) == (buf.index, buf.ptr, buf.nbytes)
    assert violation.site == buf.site and "test_quarantine.py:" in violation.site, (violation.site, buf.site)


def _quarantine(gpu: GpuBackend) -> tuple[int, int, int]:
    """(buffers, bytes) in quarantine by ``stats()``, and the bytes ``memory_info()`` says are held back
    besides the checked blocks kept for reuse."""
    stats = gpu.stats()
    held = gpu.memory_info().quarantined - stats.redzone_reusable_bytes
    return stats.redzone_quarantined, stats.redzone_quarantined_bytes, held


# -- the quarantine ---------------------------------------------------------------------------------


def test_a_freed_zoned_buffer_waits_in_quarantine_off_the_ledger(backend_name: str) -> None:
    with _open(backend_name) as gpu:
        buf = gpu.alloc(100)
        keep = gpu.alloc(10)
        before = gpu.memory_info()
        assert gpu.stats().current_bytes["device"] == 110 and _quarantine(gpu) == (0, 0, 0)
        gpu.free(buf)
        after = gpu.memory_info()
        assert [r.index for r in gpu.ledger_probe().records()] == [keep.index], "the record is off at once"
        assert gpu.stats().current_bytes["device"] == 10, "and out of current_bytes"
        assert _quarantine(gpu) == (1, 100 + HELD, 100 + HELD), "its memory and zones are still held"
        if backend_name != "cuda":  # the driver's free memory moves by its own granularity, not by bytes
            assert after.free == before.free, "the memory was not released"
            assert after.effective_free == min(after.total, before.effective_free + 100 + HELD)
        assert after.effective_free >= min(after.total, after.free + 100 + HELD), "effective_free counts it"
        assert gpu.scan_redzones() == []  # checked: kept for the next allocation of its size
        assert _quarantine(gpu) == (0, 0, 0)
        stats = gpu.stats()
        assert (stats.redzone_reusable, stats.redzone_reusable_bytes) == (1, 100 + HELD)
        assert gpu.memory_info().quarantined == 100 + HELD, "memory_info counts the block kept for reuse"
        gpu.free(keep)


def test_only_zoned_buffers_go_to_quarantine(backend_name: str) -> None:
    with _open(backend_name) as gpu:
        managed = gpu.alloc_managed(100)  # red zones guard device allocations only
        gpu.free(managed)
        assert _quarantine(gpu) == (0, 0, 0)
    with _open(backend_name, redzone_lead=False) as gpu:
        buf = gpu.alloc(1000)
        gpu.free(buf)
        assert _quarantine(gpu) == (1, 1000 + ZONE, 1000 + ZONE)  # no leading band: the trailing zone only


def test_a_free_into_quarantine_neither_checks_nor_reports(backend_name: str) -> None:
    with _open(backend_name) as gpu:
        heard: list[RedZoneViolation] = []
        gpu.on_redzone_violation(lambda name, v: heard.append(v))
        buf = gpu.alloc(100)
        address, _ = _edge(buf, "trail")
        gpu.memset(address, 0x00, nbytes=1)
        gpu.free(buf)  # redzone_action="raise": it would raise had it checked
        assert heard == [] and gpu.stats().redzone_quarantined == 1
        with pytest.raises(RedZoneError, match=r"^scan_redzones\(\) found 1 red-zone violation"):
            gpu.scan_redzones()


def test_the_quarantine_is_checked_and_released_past_its_bound(backend_name: str) -> None:
    """Past ``redzone_quarantine_bytes``, the free that crossed it checks every quarantined buffer (its own
    too), releases them all, and raises naming each violating allocation's index and site."""
    bound = 3 * (100 + HELD) - 1  # the third free crosses it
    with _open(backend_name, redzone_quarantine_bytes=bound) as gpu:
        a, b, c = gpu.alloc(100), gpu.alloc(100), gpu.alloc(100)
        gpu.free(a)
        gpu.free(b)
        assert _quarantine(gpu)[:2] == (2, 2 * (100 + HELD))
        at_a, _ = _edge(a, "trail")
        at_c, _ = _edge(c, "lead")
        gpu.memset(at_a, 0x00, nbytes=1)  # a waits in quarantine: its memory is still allocated
        gpu.memset(at_c, 0x00, nbytes=1)  # c is live
        with pytest.raises(RedZoneError, match=r"^the check of the quarantine \(freed buffers\) found 2") as info:
            gpu.free(c)
        assert sorted(_found(info.value.violations)) == [(a.index, "trail", 0), (c.index, "lead", LEAD - 1)]
        for violation in info.value.violations:
            _named(violation, a if violation.index == a.index else c)
        message = str(info.value)
        assert f"#{a.index}" in message and f"#{c.index}" in message and a.site in message
        assert _quarantine(gpu) == (0, 0, 0), "the batch was released, the violations' buffers too"
        assert gpu.live_alloc_len() == 0
        assert gpu.scan_redzones() == [], "reported once"


def test_the_quarantine_is_checked_past_its_count_bound(backend_name: str) -> None:
    with _open(backend_name, redzone_lead=False) as gpu:
        bufs = [gpu.alloc(1) for _ in range(QUARANTINE_MAX_BUFFERS + 1)]
        for buf in bufs[:-1]:
            gpu.free(buf)
        assert _quarantine(gpu)[:2] == (QUARANTINE_MAX_BUFFERS, QUARANTINE_MAX_BUFFERS * (1 + ZONE))
        gpu.free(bufs[-1])  # one more than the quarantine holds
        assert _quarantine(gpu) == (0, 0, 0)


@pytest.mark.parametrize("side", ["trail", "lead"])
def test_an_overrun_into_a_quarantined_buffer_is_reported_by_the_next_scan(backend_name: str, side: str) -> None:
    with _open(backend_name) as gpu:
        buf = gpu.alloc(100)
        gpu.free(buf)
        address, offset = _edge(buf, side)
        gpu.memset(address, 0x5A, nbytes=1)  # a late write through a stale pointer
        with pytest.raises(RedZoneError) as info:
            gpu.scan_redzones()
        assert _found(info.value.violations) == [(buf.index, side, offset)]
        _named(info.value.violations[0], buf)
        assert _quarantine(gpu) == (0, 0, 0)


def test_a_scan_reports_live_and_quarantined_zones_together(backend_name: str) -> None:
    with _open(backend_name, redzone_action="warn") as gpu:
        live, freed = gpu.alloc(100), gpu.alloc(200)
        gpu.free(freed)
        for buf, side in ((live, "lead"), (freed, "trail")):
            gpu.memset(_edge(buf, side)[0], 0x00, nbytes=1)
        found = gpu.scan_redzones()
        assert sorted(_found(found)) == sorted([(live.index, "lead", LEAD - 1), (freed.index, "trail", 0)])
        assert _quarantine(gpu) == (0, 0, 0)
        assert _found(gpu.scan_redzones()) == [(live.index, "lead", LEAD - 1)], "live zones stay watched"


def test_no_quarantine_checks_each_free_at_once(backend_name: str) -> None:
    with _open(backend_name, redzone_quarantine_bytes=0) as gpu:
        buf = gpu.alloc(100)
        gpu.memset(_edge(buf, "trail")[0], 0x00, nbytes=1)
        with pytest.raises(RedZoneError, match=rf"^free of allocation #{buf.index} found 1"):
            gpu.free(buf)
        assert _quarantine(gpu) == (0, 0, 0) and gpu.live_alloc_len() == 0


# -- checked blocks kept for reuse ---------------------------------------------------------------------


def _kept(gpu: GpuBackend) -> tuple[int, int]:
    stats = gpu.stats()
    return stats.redzone_reusable, stats.redzone_reusable_bytes


def test_a_checked_block_serves_the_next_allocation_of_its_size_with_its_zones_watched(backend_name: str) -> None:
    with _open(backend_name) as gpu:
        old = gpu.alloc(100)
        gpu.free(old)
        assert gpu.scan_redzones() == [] and _kept(gpu) == (1, 100 + HELD)
        other = gpu.alloc(200)  # another size: another layout, from the driver
        assert _kept(gpu) == (1, 100 + HELD)
        new = gpu.alloc(100)
        assert new.ptr == old.ptr and new.index != old.index, "the kept block, under a new record"
        assert _kept(gpu) == (0, 0) and gpu.memory_info().quarantined == 0
        assert [r.index for r in gpu.ledger_probe().records()] == [other.index, new.index]
        assert gpu.scan_redzones() == [], "its zones hold the fill"
        gpu.memset(_edge(new, "trail")[0], 0x00, nbytes=1)
        with pytest.raises(RedZoneError) as info:
            gpu.scan_redzones()
        assert _found(info.value.violations) == [(new.index, "trail", 0)]
        _named(info.value.violations[0], new)
        gpu.memset(_edge(new, "trail")[0], FILL, nbytes=1)
        gpu.free(new)
        gpu.free(other)


@pytest.mark.parametrize("side", ["trail", "lead"])
def test_a_stale_write_into_a_kept_block_is_never_blamed_on_its_next_owner(backend_name: str, side: str) -> None:
    """Issue 37, item 2: the old buffer's stale pointer writes into its zone after the check kept the block;
    the next allocation of its size takes the block and must not be reported for that write."""
    with _open(backend_name) as gpu:
        old = gpu.alloc(100)
        gpu.free(old)
        assert gpu.scan_redzones() == [] and _kept(gpu) == (1, 100 + HELD)
        gpu.memset(_edge(old, side)[0], 0x00, nbytes=1)  # old's stale pointer, after its check
        new = gpu.alloc(100)
        assert new.ptr == old.ptr, "the kept block"
        assert gpu.scan_redzones() == [], "a write made before the new allocation existed was blamed on it"
        gpu.memset(_edge(new, side)[0], 0x00, nbytes=1)  # the new owner's own overrun is still found
        with pytest.raises(RedZoneError) as info:
            gpu.scan_redzones()
        assert _found(info.value.violations) == [(new.index, side, _edge(new, side)[1])]
        gpu.memset(_edge(new, side)[0], FILL, nbytes=1)
        gpu.free(new)


@pytest.mark.parametrize("name", ["fake", "tracing"])
def test_a_kept_block_reads_as_fresh_memory_on_the_fake(name: str) -> None:
    """Issue 37, item 3: the fake promises that fresh memory reads as zeros; a recycled block keeps it (and
    so does a backend that wraps the fake and forwards its promise)."""
    with _open(name) as gpu:
        old = gpu.alloc(1000)
        gpu.memset(old, 0xAB)
        gpu.free(old)
        assert gpu.scan_redzones() == [] and _kept(gpu)[0] == 1
        new = gpu.alloc(1000)
        assert new.ptr == old.ptr, "the kept block"
        host = np.zeros(1000, dtype=np.uint8)
        gpu.copy_to_host(host, new)
        assert not host.any(), f"the previous allocation's bytes reached the next: {bytes(host[:4]).hex()}"
        gpu.free(new)


def test_a_peer_copy_from_a_recycled_block_reads_zeros_on_the_fake() -> None:
    """The zeroing runs on the owner's default stream; a peer copy on another backend's stream waits for it
    (a fresh review read the previous owner's bytes through copy_peer with fake_defer)."""
    settings = ZONED.updated(fake_defer=True)
    with open_backend("fake", settings=settings) as a, open_backend("fake", settings=settings) as b:
        old = a.alloc(1000)
        a.memset(old, 0xAB)
        a.free(old)
        a.scan_redzones()
        new = a.alloc(1000)
        assert new.ptr == old.ptr
        dst = b.alloc(1000)
        stream = b.create_stream()
        b.copy_peer(dst, new, stream=stream)
        b.synchronize()
        host = np.empty(1000, dtype=np.uint8)
        b.copy_to_host(host, dst)
        assert not host.any(), bytes(host[:4]).hex()
        stream.close()
        a.free(new)
        b.free(dst)


@pytest.mark.parametrize("nth", [1, 3])
def test_a_kept_block_whose_fill_fails_goes_back_to_the_driver(nth: int) -> None:
    """Its zones are filled again at reuse; a fill that fails fails the allocation and releases the block."""
    with _open("fake") as gpu:
        assert isinstance(gpu, FaultInjecting)
        old = gpu.alloc(100)
        gpu.free(old)
        assert gpu.scan_redzones() == [] and _kept(gpu)[0] == 1
        records = gpu.ledger_probe().records()
        gpu.inject_fault("memset", nth=nth)  # the lead zone's fill (1), or the zeroing after both fills (3)
        with pytest.raises(DriverError):
            gpu.alloc(100)
        assert gpu.ledger_probe().records() == records and _kept(gpu) == (0, 0)
        assert gpu.memory_info().quarantined == 0


def test_a_block_whose_zones_were_changed_is_released_not_kept(backend_name: str) -> None:
    with _open(backend_name, redzone_action="warn") as gpu:
        bad, good = gpu.alloc(100), gpu.alloc(300)
        gpu.free(bad)
        gpu.free(good)
        gpu.memset(_edge(bad, "lead")[0], 0x00, nbytes=1)
        assert _found(gpu.scan_redzones()) == [(bad.index, "lead", LEAD - 1)]
        assert _kept(gpu) == (1, 300 + HELD), "only the intact block is kept"
        assert gpu.scan_redzones() == []


def test_kept_blocks_and_the_quarantine_share_the_bound(backend_name: str) -> None:
    bound = 4 * (1000 + HELD)
    with _open(backend_name, redzone_quarantine_bytes=bound) as gpu:
        for n in (1000, 999, 998):  # three layouts
            gpu.free(gpu.alloc(n))
        assert gpu.scan_redzones() == [] and _kept(gpu)[0] == 3
        gpu.free(gpu.alloc(2000))  # into quarantine: the oldest kept layout (1000) gives way
        stats = gpu.stats()
        assert stats.redzone_reusable_bytes + stats.redzone_quarantined_bytes <= bound
        assert _kept(gpu) == (2, 999 + 998 + 2 * HELD)
        assert gpu.memory_info().quarantined == stats.redzone_reusable_bytes + stats.redzone_quarantined_bytes


def test_without_a_quarantine_nothing_is_kept(backend_name: str) -> None:
    with _open(backend_name, redzone_quarantine_bytes=0) as gpu:
        gpu.free(gpu.alloc(100))
        assert gpu.scan_redzones() == [] and _kept(gpu) == (0, 0) and gpu.memory_info().quarantined == 0


def test_sweep_and_close_give_kept_blocks_back(backend_name: str) -> None:
    with _open(backend_name) as gpu:
        gpu.free(gpu.alloc(100))
        gpu.scan_redzones()
        assert _kept(gpu)[0] == 1
        assert gpu.sweep_unreleased() == 0
        assert _kept(gpu) == (0, 0) and gpu.memory_info().quarantined == 0


def test_sweep_releases_the_quarantine_and_counts_only_the_ledger(backend_name: str) -> None:
    with _open(backend_name, redzone_action="warn") as gpu:
        kept = [gpu.alloc(100), gpu.alloc(200)]
        freed = [gpu.alloc(300), gpu.alloc(400)]
        for buf in freed:
            gpu.free(buf)
        assert gpu.stats().redzone_quarantined == 2
        assert gpu.sweep_unreleased() == len(kept)
        assert _quarantine(gpu) == (0, 0, 0) and gpu.live_alloc_len() == 0


def test_sweep_sweeps_then_raises_the_quarantine_s_violations(
    backend_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``redzone_action="raise"``, a violation in the quarantine is raised after the ledger was swept,
    as ``free`` raises after its release (issue 37, item 4)."""
    with _open(backend_name) as gpu:
        leaked, freed = gpu.alloc(100), gpu.alloc(100)
        gpu.free(freed)
        gpu.memset(_edge(freed, "trail")[0], 0x00, nbytes=1)
        with caplog.at_level(logging.WARNING, logger="metrale"), pytest.raises(
            RedZoneError, match=r"^the check of the quarantine \(freed buffers\) at sweep_unreleased"
        ) as info:
            gpu.sweep_unreleased()
        assert _found(info.value.violations) == [(freed.index, "trail", 0)]
        assert _quarantine(gpu) == (0, 0, 0)
        assert gpu.ledger_probe().records() == [] and gpu.live_alloc_len() == 0, "the leak was swept first"
        assert [r.index for r in gpu.ledger_report().swept] == [leaked.index]
        assert any("sweep on" in r.getMessage() for r in caplog.records), "the sweep's report was logged"
        assert gpu.sweep_unreleased() == 0


def test_sweep_judges_the_zones_of_the_allocations_it_sweeps(backend_name: str) -> None:
    """A leaked buffer's overrun is reported by the sweep that frees it, with the quarantine's in one check, as
    ``close()`` scans before it releases (issue 37)."""
    with _open(backend_name) as gpu:
        leaked, freed, clean = gpu.alloc(100), gpu.alloc(100), gpu.alloc(100)
        gpu.free(freed)
        gpu.memset(_edge(leaked, "lead")[0], 0x00, nbytes=1)
        gpu.memset(_edge(freed, "trail")[0], 0x00, nbytes=1)
        with pytest.raises(RedZoneError, match=r"sweep_unreleased\(\)") as info:
            gpu.sweep_unreleased()
        assert sorted(_found(info.value.violations)) == sorted(
            [(leaked.index, "lead", LEAD - 1), (freed.index, "trail", 0)])
        _named(next(v for v in info.value.violations if v.index == leaked.index), leaked)
        assert gpu.live_alloc_len() == 0 and _quarantine(gpu) == (0, 0, 0)
        assert {r.index for r in gpu.ledger_report().swept} == {leaked.index, clean.index}
        assert gpu.scan_redzones() == [], "the swept zones are no longer watched"


def test_close_releases_the_quarantine_and_logs_what_it_found(
    backend_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = _open(backend_name)
    buf = gpu.alloc(100)
    gpu.free(buf)
    gpu.memset(_edge(buf, "trail")[0], 0x00, nbytes=1)
    with caplog.at_level(logging.WARNING, logger="metrale"):
        gpu.close()  # never raises
    messages = [r.getMessage() for r in caplog.records if "red zone trail" in r.getMessage()]
    assert len(messages) == 1 and f"allocation #{buf.index}" in messages[0] and "close()" in messages[0], messages


def test_a_free_into_quarantine_leaves_an_injected_free_failure_for_the_next_raw_free() -> None:
    """The raw free of a quarantined buffer happens at the drain: its ``free`` never meets the fault."""
    with open_backend("fake", settings=ZONED) as gpu:
        zoned, plain = gpu.alloc(100), gpu.alloc_managed(100)
        assert isinstance(gpu, FaultInjecting)
        gpu.inject_fault("free")
        gpu.free(zoned)  # into quarantine: no raw free yet
        with pytest.raises(DriverError, match="a fault injected into the fake's 'free'"):
            gpu.free(plain)  # the next raw free meets it
        assert gpu.scan_redzones() == [] and _quarantine(gpu) == (0, 0, 0)


def test_a_failed_release_at_a_drain_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with open_backend("fake", settings=ZONED.updated(redzone_action="warn")) as gpu:
        buf = gpu.alloc(100)
        gpu.free(buf)
        gpu.memset(_edge(buf, "trail")[0], 0x00, nbytes=1)  # a bad zone: the drain releases it, not keeps it
        assert isinstance(gpu, FaultInjecting)
        gpu.inject_fault("free")
        with caplog.at_level(logging.WARNING, logger="metrale"):
            assert len(gpu.scan_redzones()) == 1  # the drain's release fails: it belongs to a free long returned
        assert _quarantine(gpu) == (0, 0, 0) and gpu.stats().redzone_reusable == 0
        assert any(f"releasing quarantined allocation #{buf.index} failed" in r.getMessage() for r in caplog.records)


def test_a_failed_release_of_a_block_kept_for_reuse_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with open_backend("fake", settings=ZONED) as gpu:
        gpu.free(gpu.alloc(100))
        assert gpu.scan_redzones() == [] and gpu.stats().redzone_reusable == 1
        assert isinstance(gpu, FaultInjecting)
        gpu.inject_fault("free")
        with caplog.at_level(logging.WARNING, logger="metrale"):
            assert gpu.sweep_unreleased() == 0  # gives the kept block back: its release fails, logged
        assert gpu.stats().redzone_reusable == 0 and gpu.memory_info().quarantined == 0
        assert any("release a red-zoned block kept for reuse failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("check", ["scan_redzones", "free past the bound", "sweep_unreleased"])
def test_a_check_that_cannot_read_the_zones_keeps_the_quarantine_for_the_next(check: str) -> None:
    """A batch check whose read of the zones fails (a transient driver error) raises it, releases nothing,
    and leaves every quarantined buffer watched: the next check judges them (issue 37, item 1)."""
    bound = 2 * (100 + HELD) - 1  # the second free crosses it
    with open_backend("fake", settings=ZONED.updated(redzone_action="warn", redzone_quarantine_bytes=bound)) as gpu:
        victim, other = gpu.alloc(100), gpu.alloc(100)
        gpu.free(victim)
        gpu.memset(_edge(victim, "trail")[0] + 3, 0x00, nbytes=1)  # a late write into the quarantined zone
        assert isinstance(gpu, FaultInjecting)
        gpu.inject_fault("memcpy")  # the check's read fails once
        with pytest.raises(DriverError, match="a fault injected into the fake's 'memcpy'"):
            if check == "scan_redzones":
                gpu.scan_redzones()
            elif check == "free past the bound":
                gpu.free(other)
            else:
                gpu.sweep_unreleased()
        held = 2 if check == "free past the bound" else 1
        assert _quarantine(gpu) == (held, held * (100 + HELD), held * (100 + HELD)), "nothing left unjudged"
        assert gpu.stats().redzone_reusable == 0
        assert _found(gpu.scan_redzones()) == [(victim.index, "trail", 3)], "the next check judges them"
        assert _quarantine(gpu) == (0, 0, 0)


@pytest.fixture
def small(backend_name: str) -> Iterator[GpuBackend]:
    """A backend of 64 MiB on the fake (the whole card on a GPU), with a quarantine that never fills."""
    with _open(backend_name, fake_memory_bytes=64 * MIB, redzone_quarantine_bytes=1 << 50) as gpu:
        yield gpu


@pytest.mark.needs("capacity")
def test_an_allocation_out_of_memory_releases_the_quarantine_first(
    small: GpuBackend, caplog: pytest.LogCaptureFixture
) -> None:
    unit = step(small)
    asked: list[int] = []
    small.on_out_of_memory(asked.append)  # returns None: frees nothing
    hog = small.alloc(small.memory_info().effective_free - 3 * unit)  # about three units left
    small.free(hog)  # into quarantine: still held
    assert small.stats().redzone_quarantined == 1
    info = small.memory_info()
    assert info.quarantined == hog.nbytes + HELD
    assert info.effective_free >= min(info.total, info.free + hog.nbytes), "what the quarantine holds counts as free"
    small.memset(_edge(hog, "trail")[0], 0x00, nbytes=1)
    with caplog.at_level(logging.WARNING, logger="metrale"):
        buf = small.alloc(5 * unit)  # needs the hog's memory: the quarantine is checked and released
    assert _quarantine(small) == (0, 0, 0)
    assert asked == [], "no on_out_of_memory callback was asked"
    assert small.stats().oom_count == 0
    found = [r.getMessage() for r in caplog.records if f"allocation #{hog.index}" in r.getMessage()]
    assert len(found) == 1 and "out of memory" in found[0], found  # logged: the allocation went on
    small.free(buf)


@pytest.mark.needs("capacity")
def test_an_allocation_out_of_memory_gives_kept_blocks_back_first(small: GpuBackend) -> None:
    unit = step(small)
    asked: list[int] = []
    small.on_out_of_memory(asked.append)
    hog = small.alloc(small.memory_info().effective_free - 3 * unit)
    small.free(hog)
    assert small.scan_redzones() == [] and _kept(small)[0] == 1, "checked: kept for reuse"
    assert small.memory_info().quarantined == hog.nbytes + HELD
    buf = small.alloc(5 * unit)  # needs the hog's memory: the kept block goes back to the driver
    assert _kept(small) == (0, 0) and asked == [] and small.stats().oom_count == 0
    small.free(buf)


@pytest.mark.needs("capacity")
def test_an_out_of_memory_drain_that_cannot_read_the_zones_keeps_them_and_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Out of memory, a check of the quarantine whose read fails is logged; the quarantine stays (watched,
    judged at the next check), the kept blocks go back, and the allocation goes on (callbacks, then
    ``OutOfMemoryError``): one drain per allocation, never a loop (issue 37, item 1)."""
    with _open("fake", fake_memory_bytes=64 * MIB, redzone_quarantine_bytes=1 << 50) as small:
        unit = step(small)
        asked: list[int] = []
        small.on_out_of_memory(asked.append)  # frees nothing
        hog = small.alloc(small.memory_info().effective_free - 3 * unit)
        small.free(hog)
        small.memset(_edge(hog, "trail")[0], 0x00, nbytes=1)
        assert isinstance(small, FaultInjecting)
        small.inject_fault("memcpy")  # the drain's read fails once
        with caplog.at_level(logging.WARNING, logger="metrale"), pytest.raises(OutOfMemoryError):
            small.alloc(5 * unit)
        assert len(asked) == 1, "the callbacks were asked once: the allocation went on"
        assert _quarantine(small)[:2] == (1, hog.nbytes + HELD), "the quarantine was kept"
        assert any("could not read" in r.getMessage() for r in caplog.records), caplog.text
        with pytest.raises(RedZoneError) as info:
            small.scan_redzones()
        assert _found(info.value.violations) == [(hog.index, "trail", 0)]
        assert _quarantine(small) == (0, 0, 0)


# -- sampling --------------------------------------------------------------------------------------


@pytest.mark.parametrize("sample", [1, 3, 7])
def test_sampling_zones_exactly_the_indices_it_names(backend_name: str, sample: int) -> None:
    with _open(backend_name, redzone_sample=sample, redzone_lead=False) as gpu:
        assert gpu.stats().redzone_sample == sample
        zoned = []
        for _ in range(3 * sample + 2):
            buf = gpu.alloc(16)
            before = gpu.stats().redzone_quarantined
            gpu.free(buf)
            went = gpu.stats().redzone_quarantined - before
            assert went == (buf.index % sample == 0), (buf.index, sample, went)
            if went:
                zoned.append(buf.index)
        assert zoned and all(index % sample == 0 for index in zoned)


def test_sampling_follows_redzone_min_idx_too(backend_name: str) -> None:
    with _open(backend_name) as probe:
        start = probe.alloc_managed(1).index
    with _open(backend_name, redzone_sample=2, redzone_min_idx=start + 6, redzone_lead=False) as gpu:
        bufs = [gpu.alloc(8) for _ in range(12)]
        for buf in bufs:
            gpu.free(buf)
        want = [b.index for b in bufs if b.index >= start + 6 and b.index % 2 == 0]
        assert want and gpu.stats().redzone_quarantined == len(want)


def test_a_sampled_report_says_so(backend_name: str) -> None:
    with _open(backend_name, redzone_sample=4) as gpu:
        bufs = [gpu.alloc(32) for _ in range(4)]
        (zoned,) = [b for b in bufs if b.index % 4 == 0]
        gpu.memset(_edge(zoned, "trail")[0], 0x00, nbytes=1)
        with pytest.raises(RedZoneError) as info:
            gpu.scan_redzones()
        assert str(info.value).startswith(
            "scan_redzones() (red zones on 1 in 4 allocations: redzone_sample=4) found 1 red-zone violation")
        assert _found(info.value.violations) == [(zoned.index, "trail", 0)]


# -- graphs ------------------------------------------------------------------------------------------


def _graph(gpu: GpuBackend, stream: Stream, record: Callable[[], None]) -> GraphExec:
    gpu.begin_capture(stream)
    record()
    graph = gpu.end_capture(stream)
    exe = graph.instantiate()
    graph.close()
    return exe


def _launch_expecting(gpu: GpuBackend, exe: GraphExec, stream: Stream, queued: bool) -> RedZoneError:
    """Launch ``exe``: the check of the launch raises at the launch, or (queued) at the stream's wait."""
    if checked_inside(gpu):
        found_by = r"^the check inside graph #\d+ \(its latest launch\) found"
    elif queued:
        found_by = r"^the scan queued after graph launch #\d+ of this backend found"
    else:
        found_by = r"^the scan after GraphExec\.launch found"
    with pytest.raises(RedZoneError, match=found_by) as info:
        exe.launch(stream)
        if queued:
            stream.synchronize()
    return info.value


def test_close_during_another_backend_s_capture_says_its_zones_go_unchecked(
    backend_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 37: close() while another backend of the process captures cannot wait for the device, so it
    releases the zones unchecked; its warning now says so, how many, and what to do."""
    with _open(backend_name) as other:
        gpu = _open(backend_name)
        gpu.free(gpu.alloc(100))
        kept = gpu.alloc(200)
        stream = other.create_stream()
        other.synchronize()
        other.begin_capture(stream)
        with caplog.at_level(logging.WARNING, logger="metrale"):
            gpu.close()
        with contextlib.suppress(CaptureError):  # (closing during the capture may invalidate it: the warning says)
            other.end_capture(stream).close()
        stream.close()
    said = [r.getMessage() for r in caplog.records if "released unchecked" in r.getMessage()]
    assert len(said) == 1 and "4 red zone(s) of live or freed buffers released unchecked" in said[0], said
    assert "capture(s) run in this process" in said[0] and "close after its end_capture" in said[0]
    del kept


def test_redzone_checks_says_how_graphs_are_checked(backend_name: str) -> None:
    with _open(backend_name, redzone=0) as gpu:
        assert gpu.redzone_checks == "off"
        assert (gpu.redzone_checks.mode, gpu.redzone_checks.reason) == ("off", "red zones are off")
    with _open(backend_name) as gpu:
        assert gpu.redzone_checks.endswith("(redzone_scan_graphs is off)")
        assert (gpu.redzone_checks.mode, gpu.redzone_checks.reason) == ("off", "redzone_scan_graphs is off")
        # issue 37: the quarantine checks nothing at free; the sentence said "at free"
        assert gpu.redzone_checks.startswith("when the quarantine of freed buffers passes redzone_quarantine_bytes")
    with _open(backend_name, redzone_quarantine_bytes=0) as gpu:
        assert gpu.redzone_checks.startswith("at each free, at scan_redzones() and close()")
    for queued in (False, True):
        with _open(backend_name, redzone_scan_graphs=True, redzone_scan_queued=queued) as gpu:
            checks = gpu.redzone_checks
            wait = "queued" if queued else "waited for"
            assert checks.startswith((
                f"inside every captured graph (its last node), verdicts in mapped host memory, {wait}",
                f"by a scan {wait} after every graph launch (", "after every graph launch, zones read back",
            )), checks
            if checks.mode == "inside":
                assert checks.startswith("inside every captured graph") and checks.reason == ""
            elif checks.startswith("after every graph launch, zones read back"):  # no kernels: always waited for
                assert checks.mode == "waited" and checks.endswith(f"({checks.reason})") and checks.reason
            else:
                assert checks.mode == ("queued" if queued else "waited"), checks
                assert checks.endswith(f"({checks.reason})") and checks.reason


def test_redzone_checks_is_a_string_with_a_mode(backend_name: str) -> None:
    """Printed, compared, formatted, written as JSON, pickled: what a plain string did, it still does."""
    with _open(backend_name, redzone_scan_graphs=True) as gpu:
        checks = gpu.redzone_checks
        text = str(checks)
        assert isinstance(checks, str) and checks == text and f"{checks}" == text and repr(checks) == repr(text)
        assert json.loads(json.dumps({"graph_checks": checks})) == {"graph_checks": text}
        again = pickle.loads(pickle.dumps(checks))
        assert (again, again.mode, again.reason) == (text, checks.mode, checks.reason)
        assert checks.mode in ("inside", "queued", "waited")


def test_the_fake_checks_graphs_inside() -> None:
    with open_backend("fake", settings=ZONED.updated(redzone_scan_graphs=True)) as gpu:
        assert checked_inside(gpu), gpu.redzone_checks


@pytest.mark.needs("kernels")
@pytest.mark.parametrize("queued", [False, True], ids=["waited", "queued"])
@pytest.mark.parametrize("side", ["trail", "lead"])
def test_a_kernel_s_overrun_inside_a_graph_is_found(backend_name: str, side: str, queued: bool) -> None:
    with _open(backend_name, redzone_scan_graphs=True, redzone_scan_queued=queued) as gpu:
        write = gpu.load_modules(shipped_modules("fault")).kernel("fault", "write_u8")
        bystander, buf = gpu.alloc(64), gpu.alloc(100)
        address, offset = _edge(buf, side)
        stream = gpu.create_stream()
        exe = _graph(gpu, stream, lambda: gpu.launch(write, 1, 1, [address, np.uint32(0x3C)], stream=stream))
        error = _launch_expecting(gpu, exe, stream, queued)
        assert _found(error.violations) == [(buf.index, side, offset)]
        _named(error.violations[0], buf)
        assert bystander.index not in {v.index for v in error.violations}


@pytest.mark.parametrize("queued", [False, True], ids=["waited", "queued"])
@pytest.mark.parametrize("side", ["trail", "lead"])
def test_a_captured_memset_s_overrun_is_found(backend_name: str, side: str, queued: bool) -> None:
    with _open(backend_name, redzone_scan_graphs=True, redzone_scan_queued=queued) as gpu:
        buf = gpu.alloc(100)
        address, offset = _edge(buf, side)
        stream = gpu.create_stream()
        exe = _graph(gpu, stream, lambda: gpu.memset(address, 0x00, nbytes=1, stream=stream))
        error = _launch_expecting(gpu, exe, stream, queued)
        assert _found(error.violations) == [(buf.index, side, offset)]
        _named(error.violations[0], buf)


def test_a_graph_s_check_reports_the_quarantine_too_and_releases_it(backend_name: str) -> None:
    """The verdict scans every watched zone, the quarantined ones too; a bad one earns a full check, which
    releases the quarantine (so does the scan waiting after a launch where graphs are not checked inside)."""
    with _open(backend_name, redzone_scan_graphs=True) as gpu:
        target, freed = gpu.alloc(64), gpu.alloc(100)
        gpu.free(freed)
        gpu.memset(_edge(freed, "lead")[0], 0x00, nbytes=1)
        stream = gpu.create_stream()
        exe = _graph(gpu, stream, lambda: gpu.memset(target, 0x11, stream=stream))  # a clean graph
        error = _launch_expecting(gpu, exe, stream, queued=False)
        assert _found(error.violations) == [(freed.index, "lead", LEAD - 1)]
        _named(error.violations[0], freed)
        assert _quarantine(gpu) == (0, 0, 0)
        exe.launch(stream)  # clean now
        stream.synchronize()


def test_a_clean_graph_leaves_the_quarantine_alone(backend_name: str) -> None:
    with _open(backend_name, redzone_scan_graphs=True, redzone_scan_queued=True) as gpu:
        target, freed = gpu.alloc(64), gpu.alloc(100)
        gpu.free(freed)
        stream = gpu.create_stream()
        exe = _graph(gpu, stream, lambda: gpu.memset(target, 0x11, stream=stream))
        for _ in range(3):
            exe.launch(stream)
        stream.synchronize()
        if checked_inside(gpu):  # clean verdicts: no full check, so no drain
            assert gpu.stats().redzone_quarantined == 1


@pytest.mark.needs("kernels")
def test_a_queued_verdict_is_judged_at_the_next_checked_launch_before_it(backend_name: str) -> None:
    with _open(backend_name, redzone_scan_graphs=True, redzone_scan_queued=True) as gpu:
        if not checked_inside(gpu):
            pytest.skip(f"graphs are not checked inside on {backend_name}: {gpu.redzone_checks}")
        victim, target = gpu.alloc(100), gpu.alloc(64)
        stream = gpu.create_stream()
        bad = _graph(gpu, stream, lambda: gpu.memset(victim.ptr + victim.nbytes + 7, 0x00, nbytes=1, stream=stream))
        clean = _graph(gpu, stream, lambda: gpu.memset(target, 0x22, stream=stream))
        bad.launch(stream)  # returns at once: judged later
        while not stream.query():
            pass
        launches = gpu.stats().graph_launches
        with pytest.raises(RedZoneError, match=r"^the check inside graph #1 \(its latest launch\)") as info:
            clean.launch(stream)
        assert _found(info.value.violations) == [(victim.index, "trail", 7)]
        assert gpu.stats().graph_launches == launches, "the launch that judged it was not made"
        clean.launch(stream)  # #1's verdict is judged: nothing pending
        with pytest.raises(RedZoneError, match=r"^the check inside graph #2 \(its latest launch\)") as info:
            stream.synchronize()  # the zone is still changed (zones are never refilled): #2 saw it too
        assert _found(info.value.violations) == [(victim.index, "trail", 7)]
        stream.synchronize()  # judged once


def test_a_launch_s_find_is_reported_by_the_next_wait_though_its_graph_was_closed(
    backend_name: str, request: pytest.FixtureRequest
) -> None:
    """Closing an executable graph right after its launch must not lose what that launch's check finds: the
    next wait reports it, as it does for the scans queued behind launches."""
    with _open(backend_name, redzone_scan_graphs=True, redzone_scan_queued=True) as gpu:
        del request
        buf = gpu.alloc(100)
        stream = gpu.create_stream()
        exe = _graph(gpu, stream, lambda: gpu.memset(buf.ptr + buf.nbytes, 0x00, nbytes=1, stream=stream))
        exe.launch(stream)
        exe.close()  # its check's verdict is not judged yet
        with pytest.raises(RedZoneError) as info:
            stream.synchronize()
        assert _found(info.value.violations) == [(buf.index, "trail", 0)]


# -- the property ------------------------------------------------------------------------------------


@given(data=st.data())
@hyp_settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_exactly_the_planted_overruns_are_reported_once(backend_name: str, data: st.DataObject) -> None:
    """Random allocations, frees and one-byte overruns into live and quarantined buffers' zones, with a
    quarantine small enough that frees drain it in between: every planted zone is reported exactly once,
    with its first changed offset, by a drain or by the final ``scan_redzones()``, and nothing else is."""
    bound = data.draw(st.integers(1, 12000), label="quarantine bound")
    with _open(backend_name, redzone_action="warn", redzone_quarantine_bytes=bound) as gpu:
        heard: list[tuple[int, str, int]] = []
        gpu.on_redzone_violation(lambda name, v: heard.append((v.index, v.side, v.offset)))
        live: dict[int, DeviceBuffer] = {}
        held: dict[int, DeviceBuffer] = {}  # the model of the quarantine
        planted: dict[tuple[int, str], int] = {}  # (index, side) -> first changed offset
        reported: list[tuple[int, str, int]] = []  # the model's expectation of what was heard so far
        for _ in range(data.draw(st.integers(1, 40), label="steps")):
            op = data.draw(st.sampled_from(["alloc", "free", "plant"]), label="op")
            if op == "alloc" or not (live or held):
                buf = gpu.alloc(data.draw(st.integers(1, 5000), label="nbytes"))
                live[buf.index] = buf
            elif op == "free" and live:
                buf = live.pop(data.draw(st.sampled_from(sorted(live)), label="free"))
                gpu.free(buf)
                held[buf.index] = buf
                if sum(b.nbytes + HELD for b in held.values()) > bound:  # this free drained the quarantine
                    for index in held:
                        reported += [(index, side, planted.pop((index, side)))
                                     for side in ("lead", "trail") if (index, side) in planted]
                    held = {}
                assert gpu.stats().redzone_quarantined_bytes == sum(b.nbytes + HELD for b in held.values())
            else:
                pool = {**live, **held}
                buf = pool[data.draw(st.sampled_from(sorted(pool)), label="plant in")]
                side = data.draw(st.sampled_from(["lead", "trail"]), label="side")
                offset = data.draw(st.integers(0, (LEAD if side == "lead" else ZONE) - 1), label="offset")
                value = data.draw(st.integers(0, 255).filter(lambda v: v != FILL), label="value")
                start = buf.ptr - LEAD if side == "lead" else buf.ptr + buf.nbytes
                gpu.memset(start + offset, value, nbytes=1)
                key = (buf.index, side)
                planted[key] = min(offset, planted.get(key, offset))
            assert sorted(heard) == sorted(reported), "a drain reported other zones than the ones planted"
        between = len(heard)
        final = [(v.index, v.side, v.offset) for v in gpu.scan_redzones()]
        assert heard[between:] == final
        assert sorted(final) == sorted((index, side, offset) for (index, side), offset in planted.items())
        assert len(set(heard)) == len(heard), f"a zone was reported twice: {heard}"
        assert _quarantine(gpu) == (0, 0, 0)
