"""Red zones: when scans run, what a violation does, and who hears of it."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from metrale_core import GpuBackend, RedZoneError, RedZoneViolation, open_backend
from metrale_core.kernels import shipped_modules
from tests._support import SETTINGS, checked_inside, examples, install_distribution


def _planted(gpu: GpuBackend) -> object:
    buf = gpu.alloc(100)
    gpu.memset(buf.ptr + buf.nbytes + 5, 0x00, nbytes=1)  # five bytes past the end: inside the zone
    return buf


#: A freed buffer checked in its own ``free`` (no quarantine): what the quarantine's drains replace.
AT_ONCE = SETTINGS.updated(redzone_quarantine_bytes=0)


def test_free_reports_its_own_zone(backend_name: str, caplog: pytest.LogCaptureFixture) -> None:
    with open_backend(backend_name, settings=AT_ONCE.updated(redzone=64, redzone_action="warn")) as gpu:
        buf = _planted(gpu)
        with caplog.at_level(logging.WARNING, logger="metrale"):
            gpu.free(buf)  # type: ignore[arg-type]
        messages = [r.getMessage() for r in caplog.records]
        assert any("found by free of allocation" in m and "zone offset 5" in m for m in messages), messages
        assert gpu.live_alloc_len() == 0


def test_free_raises_after_releasing(backend_name: str) -> None:
    with open_backend(backend_name, settings=AT_ONCE.updated(redzone=64, redzone_action="raise")) as gpu:
        buf = _planted(gpu)
        with pytest.raises(RedZoneError) as info:
            gpu.free(buf)  # type: ignore[arg-type]
        assert [(v.side, v.offset) for v in info.value.violations] == [("trail", 5)]
        assert gpu.live_alloc_len() == 0, "the record is off and the memory released before the report"
        assert gpu.scan_redzones() == []


def test_scan_after_graph_launch(backend_name: str) -> None:
    settings = SETTINGS.updated(redzone=64, redzone_action="raise", redzone_scan_graphs=True)
    with open_backend(backend_name, settings=settings) as gpu:
        buf = gpu.alloc(100)
        stream = gpu.create_stream()
        gpu.begin_capture(stream)
        gpu.memset(buf.ptr + 100, 0x00, nbytes=2, stream=stream)  # the graph's overrun
        exe = gpu.end_capture(stream).instantiate()
        inside = r"^the check inside graph #1 \(its latest launch\)"
        found_by = inside if checked_inside(gpu) else r"after GraphExec\.launch"
        with pytest.raises(RedZoneError, match=found_by) as info:
            exe.launch(stream)
        assert [(v.index, v.side, v.offset) for v in info.value.violations] == [(buf.index, "trail", 0)]


QUEUED = SETTINGS.updated(redzone=64, redzone_action="raise", redzone_scan_graphs=True, redzone_scan_queued=True)


def _overrunning_graph(gpu: GpuBackend, buf: object, stream: object) -> object:
    gpu.begin_capture(stream)  # type: ignore[arg-type]
    gpu.memset(buf.ptr + 100, 0x00, nbytes=2, stream=stream)  # type: ignore[attr-defined, arg-type]
    graph = gpu.end_capture(stream)  # type: ignore[arg-type]
    exe = graph.instantiate()
    graph.close()
    return exe


@pytest.mark.needs("kernels")
def test_a_queued_scan_is_reported_by_the_next_wait_naming_the_launch(backend_name: str) -> None:
    with open_backend(backend_name, settings=QUEUED) as gpu:
        buf = gpu.alloc(100)
        stream = gpu.create_stream()
        exe = _overrunning_graph(gpu, buf, stream)
        inside = checked_inside(gpu)
        exe.launch(stream)  # type: ignore[attr-defined]  # returns at once: the check is judged later
        first = r"^the check inside graph #1 \(its latest launch\) found" if inside else (
            r"^the scan queued after graph launch #1 of this backend found")
        with pytest.raises(RedZoneError, match=first) as info:
            stream.synchronize()
        assert [(v.index, v.side, v.offset) for v in info.value.violations] == [(buf.index, "trail", 0)]
        stream.synchronize()  # reported once
        event = gpu.create_event()
        for wait in (gpu.synchronize, event.synchronize):
            exe.launch(stream)  # type: ignore[attr-defined]
            event.record(stream)  # behind the check
            later = r"^the check inside graph #1 \(its" if inside else r"queued after graph launch #[23] of"
            with pytest.raises(RedZoneError, match=later):
                wait()
        # in a graph: a check per launch, and the full check each bad verdict earned
        assert gpu.stats().redzone_scans == (6 if inside else 3)


@pytest.mark.needs("kernels")
def test_a_later_launch_reports_an_earlier_launch_s_queued_scan(backend_name: str) -> None:
    with open_backend(backend_name, settings=QUEUED) as gpu:
        buf = gpu.alloc(100)
        stream = gpu.create_stream()
        exe = _overrunning_graph(gpu, buf, stream)
        exe.launch(stream)  # type: ignore[attr-defined]
        while not stream.query():  # done, and not yet judged
            pass
        if checked_inside(gpu):  # the verdict is judged before the next launch, which then is not made
            with pytest.raises(RedZoneError, match=r"^the check inside graph #1 \(its latest launch\)"):
                exe.launch(stream)  # type: ignore[attr-defined]
            assert gpu.stats().graph_launches == 1
            stream.synchronize()  # nothing more: that launch was not made
            return
        with pytest.raises(RedZoneError, match=r"queued after graph launch #1 of"):
            exe.launch(stream)  # type: ignore[attr-defined]  # its own scan is queued all the same
        with pytest.raises(RedZoneError, match=r"queued after graph launch #2 of"):
            stream.synchronize()


@pytest.mark.needs("kernels")
def test_queued_scans_of_a_clean_program_report_nothing_and_keep_up(backend_name: str) -> None:
    with open_backend(backend_name, settings=QUEUED) as gpu:
        bufs = [gpu.alloc(1000) for _ in range(20)]
        kernel = gpu.load_modules(shipped_modules("vector")).kernel("vector", "fill_u32")
        stream = gpu.create_stream()
        gpu.begin_capture(stream)
        gpu.launch(kernel, 2, 128, [bufs[0], np.uint32(250), np.uint32(7)], stream=stream)
        exe = gpu.end_capture(stream).instantiate()
        for i in range(12):  # more launches than scans may be in flight: the oldest is waited for
            exe.launch(stream)
            if i == 5:
                bufs.append(gpu.alloc(64))  # the zone table changes while scans may be in flight
        stream.synchronize()
        assert gpu.scan_redzones() == []
        assert gpu.stats().redzone_scans == 12 + 1


@pytest.mark.needs("kernels")
def test_no_queued_scan_s_find_is_lost(backend_name: str, caplog: pytest.LogCaptureFixture) -> None:
    """Two launches overrun two buffers: each scan's find is heard once, whichever call judges it (on a GPU
    both scans may finish before a wait, and are reported together)."""
    with open_backend(backend_name, settings=QUEUED.updated(redzone_action="warn")) as gpu:
        first, second = gpu.alloc(100), gpu.alloc(100)
        heard: list[tuple[int, int]] = []
        stream = gpu.create_stream()
        graphs = [_overrunning_graph(gpu, buf, stream) for buf in (first, second)]
        gpu.on_redzone_violation(lambda name, v: heard.append((v.index, v.offset)))
        with caplog.at_level(logging.WARNING, logger="metrale"):
            for exe in graphs:
                exe.launch(stream)  # type: ignore[attr-defined]
            stream.synchronize()
        # the first scan sees the first overrun; the second sees both (zones are not refilled)
        assert sorted(heard) == sorted([(first.index, 0), (first.index, 0), (second.index, 0)])
        found = [r.getMessage().rpartition("(found by ")[2] for r in caplog.records]
        named = ("the check inside graph #",) if checked_inside(gpu) else (
            "the scan queued after graph launch #", "the scans queued after")
        assert found and all(f.startswith(named) for f in found), found


@pytest.mark.needs("kernels")
def test_a_freed_buffer_s_overrun_is_reported_by_its_free_only(backend_name: str) -> None:
    with open_backend(backend_name, settings=QUEUED.updated(redzone_quarantine_bytes=0)) as gpu:
        buf = gpu.alloc(100)
        stream = gpu.create_stream()
        exe = _overrunning_graph(gpu, buf, stream)
        exe.launch(stream)  # type: ignore[attr-defined]
        exe.close()  # type: ignore[attr-defined]
        with pytest.raises(RedZoneError, match="free of allocation"):
            gpu.free(buf)
        stream.synchronize()  # the queued scan saw it too, but the buffer is gone: not reported twice


@pytest.mark.needs("kernels")
def test_queued_scans_on_two_streams_while_zones_come_and_go(backend_name: str) -> None:
    """Each queued scan reads its own copy of the zone table, written on its own stream."""
    with open_backend(backend_name, settings=QUEUED) as gpu:
        kernel = gpu.load_modules(shipped_modules("vector")).kernel("vector", "fill_u32")
        streams = [gpu.create_stream(), gpu.create_stream()]
        target = gpu.alloc(1024)
        graphs = []
        for stream in streams:
            gpu.begin_capture(stream)
            gpu.launch(kernel, 2, 128, [target, np.uint32(256), np.uint32(7)], stream=stream)
            graphs.append(gpu.end_capture(stream).instantiate())
        extra = []
        for i in range(10):
            extra.append(gpu.alloc(64 * (i + 1)))  # the zone set changes before every launch
            graphs[i % 2].launch(streams[i % 2])
        victim = extra[3]
        gpu.memset(victim.ptr + victim.nbytes + 1, 0, nbytes=1)  # one planted overrun, on the default stream
        gpu.default_stream.synchronize()
        graphs[0].launch(streams[0])
        with pytest.raises(RedZoneError) as info:
            gpu.synchronize()
        assert [(v.index, v.side, v.offset) for v in info.value.violations] == [(victim.index, "trail", 1)]


@pytest.mark.needs("kernels")
def test_a_full_scan_or_close_reports_a_pending_queued_scan_s_find_once(
    backend_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = QUEUED.updated(redzone_action="warn")
    gpu = open_backend(backend_name, settings=settings)
    buf = gpu.alloc(100)
    stream = gpu.create_stream()
    exe = _overrunning_graph(gpu, buf, stream)
    with caplog.at_level(logging.WARNING, logger="metrale"):
        exe.launch(stream)  # type: ignore[attr-defined]
        assert len(gpu.scan_redzones()) == 1
        exe.launch(stream)  # type: ignore[attr-defined]
        gpu.close()
    found = [r.getMessage().rpartition("(found by ")[2] for r in caplog.records if "red zone trail" in r.getMessage()]
    assert found == ["scan_redzones())", "close())"], found


def test_close_scans(backend_name: str, caplog: pytest.LogCaptureFixture) -> None:
    gpu = open_backend(backend_name, settings=SETTINGS.updated(redzone=64, redzone_action="raise"))
    _planted(gpu)
    with caplog.at_level(logging.WARNING, logger="metrale"):
        gpu.close()  # never raises: logs instead
    assert any("found by close()" in r.getMessage() for r in caplog.records)


def test_observers_hear_first(backend_name: str) -> None:
    heard: list[tuple[str, RedZoneViolation]] = []
    with open_backend(backend_name, settings=SETTINGS.updated(redzone=64, redzone_action="warn")) as gpu:
        gpu.on_redzone_violation(lambda name, v: heard.append((name, v)))
        gpu.on_redzone_violation(lambda name, v: 1 / 0)  # a broken observer is logged and skipped
        buf = _planted(gpu)
        found = gpu.scan_redzones()
        assert [v for _, v in heard] == found and heard[0][0] == backend_name
        assert found[0].index == buf.index  # type: ignore[attr-defined]


OBSERVER = """
    from metrale_core import hookimpl

    SEEN = []

    @hookimpl
    def metrale_redzone_violation(violation):
        SEEN.append(violation.offset)
"""


def test_plugins_observe_through_the_hook(site: Path) -> None:
    install_distribution(site, "mtp-observer", "mtp_observer", OBSERVER, {"observer": "mtp_observer"})
    import mtp_observer  # type: ignore[import-not-found]

    with open_backend("fake", settings=SETTINGS.updated(redzone=64, redzone_action="warn")) as gpu:
        _planted(gpu)
        gpu.scan_redzones()
    assert mtp_observer.SEEN == [5, 5], "once by the scan, once by close()"


def test_many_zones_are_read_in_one_batch(backend_name: str) -> None:
    with open_backend(backend_name, settings=SETTINGS.updated(redzone=256, redzone_action="warn")) as gpu:
        bufs = [gpu.alloc(1000) for _ in range(300)]
        for buf in bufs[::50]:
            gpu.memset(buf.ptr + buf.nbytes + 255, 0x01, nbytes=1)
        found = gpu.scan_redzones()
        assert sorted(v.index for v in found) == [b.index for b in bufs[::50]]
        assert {v.offset for v in found} == {255}


PLANTS = st.lists(
    st.tuples(
        st.sampled_from(["memset", "copy", "kernel", "underrun"]),
        st.integers(0, 7),  # which buffer
        st.integers(0, 63),  # offset into the zone
        st.integers(0, 255).filter(lambda v: v != 0xA5),
    ),
    max_size=6,
)


@pytest.mark.needs("kernels")
@given(plants=PLANTS)
@hyp_settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_planted_overruns_and_underruns_are_found(backend_name: str, plants: list[tuple[str, int, int, int]]) -> None:
    """Every backend finds exactly the planted violations: the same answers on fake and cuda."""
    settings = SETTINGS.updated(redzone=64, redzone_lead=True, redzone_action="warn", redzone_fill=0xA5)
    with open_backend(backend_name, settings=settings) as gpu:
        fill = gpu.load_modules(shipped_modules("vector")).kernel("vector", "fill_u32")
        bufs = [gpu.alloc(4 * (10 + i)) for i in range(8)]
        expected: dict[tuple[int, str], int] = {}
        for how, which, at, value in plants:
            buf = bufs[which]
            offset = at
            if how == "underrun":  # the leading zone is 256 bytes (64 rounded up): offset from its start
                gpu.memset(buf.ptr - 256 + at, value, nbytes=1)
                key = (buf.index, "lead")
            elif how == "kernel":  # fill_u32 with n one past the end writes 4 bytes at zone offset 0
                gpu.launch(fill, 1, 64, [buf, np.uint32(buf.nbytes // 4 + 1), np.uint32(value | 0x01000000)])
                key, offset = (buf.index, "trail"), 0
            elif how == "copy":
                gpu.copy_to_device(buf.ptr + buf.nbytes + at, bytes([value]))
                key = (buf.index, "trail")
            else:
                gpu.memset(buf.ptr + buf.nbytes + at, value, nbytes=1)
                key = (buf.index, "trail")
            expected[key] = min(offset, expected.get(key, offset))
        found = {(v.index, v.side): v.offset for v in gpu.scan_redzones()}
        assert found == expected


@given(
    n=st.integers(8, 40),
    data=st.data(),
)
@hyp_settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_scans_follow_allocations_as_they_come_and_go(backend_name: str, n: int, data: st.DataObject) -> None:
    """The scan's zone table is kept as allocations come and go (a freed zone's slot takes
    the last one): scans between frees and allocations find exactly the planted zones still live."""
    settings = AT_ONCE.updated(redzone=64, redzone_lead=True, redzone_action="warn")
    with open_backend(backend_name, settings=settings) as gpu:
        live = {b.index: b for b in (gpu.alloc(8 * (i + 1)) for i in range(n))}
        planted: dict[tuple[int, str], int] = {}
        for _ in range(data.draw(st.integers(1, 6), label="rounds")):
            for index in data.draw(st.lists(st.sampled_from(sorted(live)), max_size=4, unique=True), label="plant"):
                side = data.draw(st.sampled_from(["lead", "trail"]), label="side")
                buf = live[index]
                at = data.draw(st.integers(0, 63), label="at")
                gpu.memset((buf.ptr - 256 if side == "lead" else buf.ptr + buf.nbytes) + at, 0x00, nbytes=1)
                planted[(index, side)] = min(at, planted.get((index, side), at))
            for index in data.draw(st.lists(st.sampled_from(sorted(live)), max_size=len(live) - 1, unique=True),
                                   label="free"):
                gpu.free(live.pop(index))
                planted = {k: v for k, v in planted.items() if k[0] != index}
            for _ in range(data.draw(st.integers(0, 5), label="new")):
                buf = gpu.alloc(24)
                live[buf.index] = buf
            found = {(v.index, v.side): v.offset for v in gpu.scan_redzones()}
            assert found == planted


def test_a_late_fill_never_erases_an_overrun(backend_name: str) -> None:
    """A zone's fill is queued on the default stream and alloc does not wait for it; work on
    another stream waits for it first, so an overrun there is never erased by the fill (on the
    fake with ``fake_defer`` the fill would otherwise run at the scan, after the overrun)."""
    settings = SETTINGS.updated(redzone=64, redzone_action="warn", fake_defer=True)
    with open_backend(backend_name, settings=settings) as gpu:
        other = gpu.create_stream()
        buf = gpu.alloc(100)
        gpu.memset(buf.ptr + buf.nbytes + 3, 0x00, nbytes=1, stream=other)
        other.synchronize()
        assert [(v.side, v.offset) for v in gpu.scan_redzones()] == [("trail", 3)]
        other.close()


def test_a_wait_for_the_fills_never_meets_another_thread_s_capture(backend_name: str) -> None:
    """Work on a non-default stream waits for the zones' fills first; a capture begun on another thread
    meanwhile must wait for that wait (as for any barred call in flight), not be invalidated by it."""
    import threading

    with open_backend(backend_name, settings=SETTINGS.updated(redzone=64)) as gpu:
        raw = gpu.raw
        original = raw.stream_synchronize
        in_wait, captured = threading.Event(), threading.Event()
        waiter: list[threading.Thread] = []

        def stream_synchronize(stream: object) -> None:
            if threading.current_thread() in waiter and not in_wait.is_set():
                in_wait.set()  # past the check that no capture runs
                captured.wait(0.5)  # the capture begins now, unless it waits for this call
            original(stream)

        raw.stream_synchronize = stream_synchronize  # type: ignore[method-assign]  # before the core's first use
        capturing, side = gpu.create_stream(), gpu.create_stream()
        buf = gpu.alloc(100)  # its fill is queued on the default stream and not waited for
        errors: list[BaseException] = []

        def memset() -> None:
            try:
                gpu.memset(buf, 1, stream=side)
            except BaseException as exc:  # reported below
                errors.append(exc)

        thread = threading.Thread(target=memset)
        waiter.append(thread)
        thread.start()
        assert in_wait.wait(5)
        gpu.begin_capture(capturing)
        captured.set()
        thread.join(10)
        graph = gpu.end_capture(capturing)  # raises CaptureError (invalidated) with the bug
        graph.close()
        assert errors == []
