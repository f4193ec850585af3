"""The compiled twins against their pure reference (issue 38): the same interface, and the same answers to the
same random programs.

The twins are compiled where the build found a C compiler (CI's and the GPU machine's); where none was built,
these tests skip, saying so.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_core import BackendClosedError, MetraleSettings, open_backend
from metrale_core._device.buffer import DeviceBuffer
from metrale_core._device.gate import Gate as PureGate
from metrale_core._device.stats import StatsCounter as PureStats
from metrale_core._launch.lane import LaunchLane as PureLaunchLane
from metrale_core._launch.pack import pack_args
from metrale_core._memory.arena import Arena as PureArena
from metrale_core._memory.lane import DeviceLane as PureLane
from metrale_core._memory.ledger import Ledger as PureLedger
from metrale_core._memory.pool import MemoryPool as PurePool
from metrale_core._memory.pools import PoolFront as PurePoolFront
from metrale_core._memory.quarantine import Quarantine as PureQuarantine
from metrale_core._memory.records import next_index
from metrale_core._memory.sites import call_site
from metrale_core._redzones.layout import RedZones as PureRedZones
from metrale_core._streams.graph_lane import GraphLane as PureGraphLane
from metrale_core._streams.lane import StreamLane as PureStreamLane
from metrale_core._twins import TWINS, built, describe, pick
from metrale_core.allocators.door import Door as PureDoor
from metrale_core.allocators.doorfuncs import c_functions
from tests._support import SETTINGS, compiled_twin, examples, in_threads

#: Each twin's pure reference: a class, or a function (the handle's ``DeviceBuffer._make``; the call site,
#: ``tests/memory/test_site_twin.py``).
PURE: dict[str, Any] = {
    "ledger": PureLedger, "stats": PureStats, "handle": DeviceBuffer._make, "arena": PureArena, "gate": PureGate,
    "lane": PureLane, "site": call_site, "stream_lane": PureStreamLane, "graph_lane": PureGraphLane,
    "launch_lane": PureLaunchLane, "pack": pack_args, "zones": PureRedZones, "quarantine": PureQuarantine,
    "doorfuncs": c_functions, "pool": PurePool, "pool_front": PurePoolFront, "door": PureDoor,
}
PURE_CLASSES: dict[str, type] = {name: ref for name, ref in PURE.items() if isinstance(ref, type)}

_BLOCK = DeviceBuffer._make(0x10000, 1 << 20, "arena", 0, "app.py:1", None)

#: An allocator for the lane's parity test to make lanes of (its backend stays open for the module). Compiled, as
#: a backend that runs the compiled lane is: its gate is the compiled one too (one ``pure`` picks both).
_BACKEND = open_backend("fake", settings=SETTINGS.updated(pure=False))
_PARTS = _BACKEND._parts
_ALLOCATOR = _PARTS.memory
#: The same with red zones on (the zone table's and the quarantine's twins are made of its parts).
_ZONED = open_backend("fake", settings=SETTINGS.updated(pure=False, redzone=64, redzone_lead=True))

#: How to make one of each twin's class (as its owner does).
_MAKE: dict[str, Callable[[type], object]] = {
    "ledger": lambda cls: cls(0),
    "stats": lambda cls: cls(),
    "arena": lambda cls: cls(_BLOCK, lambda arena, block: None),
    "gate": lambda cls: cls(lambda: BackendClosedError("closed")),
    "lane": lambda cls: _lane(cls, _BACKEND),
    "pool_front": lambda cls: cls(
        _ALLOCATOR.ctx, _PARTS.holdings, _PARTS.stats, _PARTS.guard, _ALLOCATOR._quarantine, _ALLOCATOR.raw,
        _ALLOCATOR.swept, _ALLOCATOR.site_at,
    ),
    "pool": lambda cls: cls(_ALLOCATOR.pools, 0, _ALLOCATOR.raw.grow),
    "door": lambda cls: cls(_BACKEND, "probe"),
    "stream_lane": lambda cls: cls(_BACKEND._parts.streams, _BACKEND._parts.holdings.ledger),
    "graph_lane": lambda cls: cls(_BACKEND._parts.streams.graphs, _BACKEND._parts.streams.graphs.lane_parts()),
    "launch_lane": lambda cls: cls(_BACKEND._parts.kernels, _BACKEND._parts.kernels.lane_parts()),
    "zones": lambda cls: cls(_ZONED.settings),
    "quarantine": lambda cls: cls(_ZONED._parts.memory.ctx, _ZONED._parts.stats, _ZONED._parts.guard),
}


def _lane(cls: Any, gpu: Any, caller_frames: int = 0) -> Any:
    """A lane of ``cls`` over the parts of backend ``gpu`` (as its allocator makes its own)."""
    parts = gpu._parts
    memory = parts.memory
    return cls(gpu._ctx, parts.holdings, parts.stats, parts.guard, memory._quarantine, memory.raw, memory.pools,
               memory.free_host, caller_frames)


def _twin(name: str) -> Any:
    return compiled_twin(name)


def _parameters(function: object) -> list[tuple[str, object]]:
    """A function's parameters: names and defaults (a compiled function has no annotations)."""
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]  # type: ignore[arg-type]


def test_every_twin_has_a_pure_reference() -> None:
    assert set(PURE) == set(TWINS)


@pytest.mark.parametrize("name", sorted(TWINS))
def test_a_twin_built_here_loads(name: str) -> None:
    """A compiled module on disk that fails to load is a failure, not the pure code running quietly: a module
    compiled against an older .pxd of another (its C not made again) once left two lanes pure in every test."""
    module = TWINS[name][0]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not built here")
    importlib.import_module(module)


@pytest.mark.parametrize("name", sorted(set(TWINS) - set(PURE_CLASSES)))
def test_a_function_twin_has_its_pure_function_s_signature(name: str) -> None:
    twin, pure = _twin(name), PURE[name]
    assert twin.__name__.lstrip("_") == pure.__name__.lstrip("_") and not isinstance(twin, type)
    assert _parameters(twin) == _parameters(pure)


@pytest.mark.parametrize("name", sorted(PURE_CLASSES))
def test_a_twin_has_its_pure_class_s_interface(name: str) -> None:
    twin, pure = _twin(name), PURE_CLASSES[name]
    if not isinstance(pure, type):  # a function's twin: the same parameters
        assert _parameters(twin) == _parameters(pure)
        return
    assert twin.__name__ == pure.__name__

    def public(cls: type) -> dict[str, list[tuple[str, object]]]:
        """Each public method's parameters (the properties are attributes, below)."""
        names = {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}
        return {n: _parameters(getattr(cls, n)) for n in names}

    assert public(twin) == public(pure)
    make = _MAKE[name]
    attributes = {n for n in dir(make(pure)) if not n.startswith("_") and not callable(getattr(make(pure), n))}
    assert attributes <= set(dir(make(twin))), attributes - set(dir(make(twin)))


def test_the_ledger_twin_takes_its_history_keyword() -> None:
    twin = _twin("ledger")
    assert len(twin(history=3)) == 0 and twin(history=3).history == 3


@pytest.mark.parametrize("pure", [False, True])
@pytest.mark.parametrize("name", sorted(TWINS))
def test_pick_takes_the_twin_unless_pure(name: str, pure: bool) -> None:
    chosen = pick(name, PURE[name], pure)
    assert chosen is PURE[name] if pure or not built()[name] else chosen is not PURE[name]


def test_the_pure_setting_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_PURE", "1")
    assert MetraleSettings().pure is True
    monkeypatch.setenv("METRALE_PURE", "0")
    assert MetraleSettings().pure is False


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 7), st.integers(1, 4)),
        st.tuples(st.just("take"), st.integers(0, 7), st.integers(0, 4)),
        st.tuples(st.just("holds"), st.integers(0, 7), st.integers(0, 4)),
        st.tuples(st.just("drain"), st.just(0), st.just(0)),
        st.tuples(st.just("snapshot"), st.just(0), st.just(0)),
    ),
    max_size=40,
)


def _buf(index: int, size: int) -> DeviceBuffer:
    return DeviceBuffer._make(0x1000 * (index + 1), 256 * size, "device", index, f"app.py:{index}", None)


def _run(ledger: object, ops: list[tuple[str, int, int]]) -> list[object]:
    """Apply ``ops`` to ``ledger``; what each answered, and the state after each."""
    out: list[object] = []
    for op, index, size in ops:
        if op == "add":
            ledger.add(_buf(index, size))  # type: ignore[attr-defined]
            got: object = None
        elif op == "take":
            taken = ledger.take(index, 0x1000 * (index + 1), 256 * size)  # type: ignore[attr-defined]
            got = None if taken is None else (taken.index, taken.nbytes)
        elif op == "holds":
            got = ledger.holds(index, 0x1000 * (index + 1), 256 * size)  # type: ignore[attr-defined]
        elif op == "drain":
            got = ledger.drain()  # type: ignore[attr-defined]
        else:
            got = ledger.snapshot()  # type: ignore[attr-defined]
        out.append((op, got, len(ledger), ledger.live_bytes(), ledger.taken))  # type: ignore[arg-type, attr-defined]
    events = [(e.op, e.record) for e in ledger.events()]  # type: ignore[attr-defined]
    out.append((events, ledger.dropped))  # type: ignore[attr-defined]
    return out


@settings(max_examples=examples(200), deadline=None)
@given(ops=_OPS, history=st.integers(0, 5))
def test_the_ledger_twin_answers_as_the_pure_ledger(ops: list[tuple[str, int, int]], history: int) -> None:
    twin = _twin("ledger")
    assert _run(twin(history), ops) == _run(PureLedger(history), ops)


def test_the_ledger_twin_is_thread_safe() -> None:
    """Four threads add and take their own allocations: every one is counted, none lost."""
    ledger = _twin("ledger")(0)

    def work(t: int) -> None:
        for i in range(2000):
            index = t * 10_000 + i
            ledger.add(_buf(index, 1))
            assert ledger.take(index, 0x1000 * (index + 1), 256) is not None

    in_threads(work)
    assert len(ledger) == 0 and ledger.taken == 8000


@pytest.mark.parametrize("pure", [False, True])
def test_a_backend_runs_the_same_on_both(pure: bool) -> None:
    """The public ledger of a backend, pure or compiled, through a leak and a sweep."""
    with open_backend("fake", settings=SETTINGS.updated(pure=pure, memory_history=8)) as gpu:
        kept, gone = gpu.alloc(1024), gpu.alloc(2048)
        gpu.free(gone)
        assert [(r.index, r.nbytes) for r in gpu.ledger_probe().records()] == [(kept.index, 1024)]
        assert gpu.sweep_unreleased() == 1
        report = gpu.ledger_report()
        assert [(r.index, r.nbytes) for r in report.swept] == [(kept.index, 1024)] and report.live == ()


def test_describe_says_which_code_runs() -> None:
    assert describe(True) == "pure Python (the setting pure, METRALE_PURE=1)"
    names = [name for name, ok in built().items() if ok]  # (a twin whose C failed leaves the others built)
    if names:
        assert describe(False).startswith(f"compiled twins: {', '.join(names)}")
    else:
        assert describe(False).startswith("pure Python (no compiled twins were built here")


_STATS_OPS = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["allocated", "released"]), st.sampled_from(["device", "managed", "arena"]),
                  st.integers(0, 1 << 40)),
        st.tuples(st.sampled_from(["quarantined", "reusable"]), st.integers(-3, 3), st.integers(-(1 << 30), 1 << 30)),
        st.tuples(st.just("reset_peak"), st.just(0), st.just(0)),
        st.tuples(st.sampled_from(["arena_allocs", "graph_launches", "oom_count", "redzone_scans"]), st.just(0),
                  st.just(0)),
    ),
    max_size=40,
)


def _run_stats(stats: object, ops: list[tuple[str, object, int]]) -> list[object]:
    out: list[object] = []
    for op, a, b in ops:
        if op in ("allocated", "released", "quarantined", "reusable"):
            getattr(stats, op)(a, b)
        elif op == "reset_peak":
            stats.reset_peak()  # type: ignore[attr-defined]
        else:
            setattr(stats, op, getattr(stats, op) + 1)
        out.append(stats.freeze(7, 3, 2))  # type: ignore[attr-defined]
    return out


@settings(max_examples=examples(200), deadline=None)
@given(ops=_STATS_OPS)
def test_the_stats_twin_counts_as_the_pure_counter(ops: list[tuple[str, object, int]]) -> None:
    twin = _twin("stats")
    assert _run_stats(twin(), ops) == _run_stats(PureStats(), ops)


_GATE_OPS = st.lists(st.sampled_from(["enter", "enter_ok", "leave", "fault", "shut", "outside"]), max_size=30)


def _run_gate(gate: object, ops: list[str]) -> list[object]:
    """Apply ``ops`` to ``gate`` on this thread; what each answered or raised, and whether it is closed."""
    out: list[object] = []
    depth = 0
    for op in ops:
        try:
            if op == "enter":
                gate.enter()  # type: ignore[attr-defined]
                depth += 1
            elif op == "enter_ok":
                gate.enter(faulted_ok=True)  # type: ignore[attr-defined]
                depth += 1
            elif op == "leave":
                if not depth:
                    continue
                gate.leave()  # type: ignore[attr-defined]
                depth -= 1
            elif op == "fault":
                gate.fault()  # type: ignore[attr-defined]
            elif op == "shut":
                out.append(gate.shut(0.0))  # type: ignore[attr-defined]
            else:
                with gate.outside():  # type: ignore[attr-defined]
                    out.append("outside")
            out.append((op, "ok", gate.closed))  # type: ignore[attr-defined]
        except BackendClosedError as exc:
            out.append((op, str(exc), gate.closed))  # type: ignore[attr-defined]
    for _ in range(depth):
        gate.leave()  # type: ignore[attr-defined]
    return out


@settings(max_examples=examples(200), deadline=None)
@given(ops=_GATE_OPS)
def test_the_gate_twin_answers_as_the_pure_gate(ops: list[str]) -> None:
    twin = _twin("gate")

    def refusal() -> Callable[[], BackendClosedError]:
        counted = iter(range(1000))
        return lambda: BackendClosedError(f"refused {next(counted)}")

    assert _run_gate(twin(refusal()), ops) == _run_gate(PureGate(refusal()), ops)


def test_the_gate_twin_waits_for_another_thread_s_call() -> None:
    """A shut waits for a call of another thread inside, and refuses the next."""
    gate = _twin("gate")(lambda: BackendClosedError("closed"))
    inside, release = threading.Event(), threading.Event()

    def call() -> None:
        gate.enter()
        inside.set()
        release.wait(5)
        gate.leave()

    worker = threading.Thread(target=call)
    worker.start()
    inside.wait(5)
    assert gate.shut(0.05) == 1  # the other thread's call is still inside
    release.set()
    worker.join()
    assert gate.shut(1.0) is None and gate.closed
    with pytest.raises(BackendClosedError, match="closed"):
        gate.enter()


@pytest.mark.parametrize("build", ["pure", "compiled"])
def test_each_thread_keeps_its_own_count_when_threads_take_turns(build: str) -> None:
    """A thread's depth is its own, whichever thread called last (the twin keeps the last thread's cell at hand)."""
    gate = (PureGate if build == "pure" else _twin("gate"))(lambda: BackendClosedError("closed"))
    turn = [threading.Event() for _ in range(4)]

    def other() -> None:  # enters while the main thread is inside, then leaves after the main thread has left
        turn[0].wait(5)
        gate.enter()
        turn[1].set()
        turn[2].wait(5)
        gate.leave()
        turn[3].set()

    worker = threading.Thread(target=other)
    worker.start()
    gate.enter()
    turn[0].set()
    turn[1].wait(5)
    gate.leave()  # the main thread's count, not the worker's: the worker is still inside
    assert gate.shut(0.05) == 1
    turn[2].set()
    turn[3].wait(5)
    worker.join()
    assert gate.shut(1.0) is None

# -- the lane: whole backends, pure and compiled, through the same random programs ---------------------------

_SIZES = st.one_of(st.integers(-2, 5000), st.sampled_from([1 << 64, 1.5, "64", None, True]))
_LANE_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), _SIZES),
        st.tuples(st.just("free"), st.integers(0, 9)),
        st.tuples(st.just("write"), st.integers(0, 9)),
        st.tuples(st.just("free_foreign"), st.just(0)),
        st.tuples(st.just("free_other"), st.just(0)),
        st.tuples(st.just("sweep"), st.just(0)),
        st.tuples(st.just("overrun"), st.integers(0, 9)),
        st.tuples(st.just("scan"), st.just(0)),
    ),
    max_size=30,
)
#: Red zones for the lane's parity test: none, or (leading band, quarantine bound, sampling).
_ZONES = st.one_of(
    st.none(), st.tuples(st.booleans(), st.sampled_from([0, 3000, 256 << 20]), st.sampled_from([1, 2])),
)


def _plain(text: str) -> str:
    """An error message without what differs between two backends: addresses, indexes, line numbers."""
    import re

    return re.sub(r"0x[0-9a-f]+|#\d+|:\d+\b", "N", text)


def _run_lane(pure: bool, ops: list[tuple[str, object]], zones: tuple[bool, int, int] | None) -> list[object]:
    """Apply ``ops`` to a fresh backend; what each answered or raised, the ledger, the stats and the bytes after."""
    out: list[object] = []
    while next_index() % 4 != 3:  # creation indexes are shared by every backend: both runs start at a multiple of 4
        pass
    extra: dict[str, object] = {}
    if zones is not None:
        lead, bound, sample = zones
        extra = {"redzone": 64, "redzone_lead": lead, "redzone_quarantine_bytes": bound, "redzone_sample": sample}
    with open_backend("fake", settings=SETTINGS.updated(pure=pure, **extra)) as gpu, \
            open_backend("fake", settings=SETTINGS.updated(pure=pure)) as other:
        held: list[DeviceBuffer] = []
        stranger = other.alloc(64)
        for op, arg in ops:
            try:
                if op == "alloc":
                    held.append(gpu.alloc(arg))  # type: ignore[arg-type]
                    got: object = (held[-1].nbytes, held[-1].kind)
                elif op == "free":
                    got = None
                    if held:
                        gpu.free(held[arg % len(held)])  # type: ignore[operator]
                elif op == "write":
                    got = None
                    if held:
                        buf = held[arg % len(held)]  # type: ignore[operator]
                        gpu.copy_to_device(buf, bytes([len(out) % 256]) * buf.nbytes)
                elif op == "free_foreign":
                    gpu.free(stranger)
                elif op == "free_other":
                    gpu.free(object())  # type: ignore[arg-type]
                elif op == "overrun":  # one byte past the end of a live buffer
                    got = None
                    live = {r.index for r in gpu.ledger_probe().records()}
                    if held and held[arg % len(held)].index in live:  # type: ignore[operator]
                        buf = held[arg % len(held)]  # type: ignore[operator]
                        gpu.memset(buf.ptr + buf.nbytes, 0x00, nbytes=1)
                elif op == "scan":
                    got = [(v.side, v.offset, v.nbytes) for v in gpu.scan_redzones()]
                else:
                    got = gpu.sweep_unreleased()
                    held.clear()
                out.append((op, got))
            except Exception as exc:
                out.append((op, type(exc).__name__, _plain(str(exc))))
        ledger = [(r.nbytes, r.kind, r.site.rpartition(":")[0]) for r in gpu.ledger_probe().records()]
        contents = []
        for buf in held:
            if any(r.index == buf.index for r in gpu.ledger_probe().records()):
                data = bytearray(buf.nbytes)
                gpu.copy_to_host(data, buf)
                contents.append(bytes(data))
        stats = dataclasses.asdict(gpu.stats())
        out.append((ledger, contents, stats))
        other.free(stranger)
    return out


@settings(max_examples=examples(80), deadline=None)
@given(ops=_LANE_OPS, zones=_ZONES)
def test_the_lane_twin_runs_a_backend_as_the_pure_lane(
    ops: list[tuple[str, object]], zones: tuple[bool, int, int] | None
) -> None:
    """The same random program on a compiled backend and a pure one: the same answers, errors, ledger, stats
    and bytes."""
    _twin("lane")
    assert _run_lane(False, ops, zones) == _run_lane(True, ops, zones)


def test_the_lane_twin_names_the_user_s_line() -> None:
    _twin("lane")
    for pure in (False, True):
        with open_backend("fake", settings=SETTINGS.updated(pure=pure)) as gpu:
            buf = gpu.alloc(16); line = inspect.currentframe().f_lineno  # type: ignore[union-attr]  # noqa: E702
            assert buf.site == f"{__file__}:{line}"
            gpu.free(buf)


@pytest.mark.parametrize("caller_frames", [0, 1])
def test_the_lane_twin_names_the_user_s_line_whatever_frames_the_facade_has(caller_frames: int) -> None:
    """The call site passes over as many frames as the facade says are its own, no more: a facade compiled (no
    frame of its own, ``0``) still names the user's line, called straight from it (the review's case)."""
    cls = _twin("lane")
    with open_backend("fake", settings=SETTINGS.updated(pure=False)) as gpu:
        lane = _lane(cls, gpu, caller_frames)

        def facade(n: int) -> DeviceBuffer:
            return lane.alloc(n)  # type: ignore[no-any-return]

        buf = facade(16) if caller_frames else lane.alloc(16); line = inspect.currentframe().f_lineno  # type: ignore[union-attr]  # noqa: E702
        assert buf.site == f"{__file__}:{line}"
        lane.free(buf)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
@pytest.mark.parametrize("build", ["pure", "compiled"])
def test_a_forked_child_s_gate_waits_for_no_thread_of_its_parent(build: str) -> None:
    """A thread inside a call as the process forks does not exist in the child: the child's shut waits for nothing
    (the twin's cell kept at hand was that thread's; the review's case)."""
    gate = (PureGate if build == "pure" else _twin("gate"))(lambda: BackendClosedError("closed"))
    inside, done = threading.Event(), threading.Event()

    def call() -> None:
        gate.enter()
        inside.set()
        done.wait(5)
        gate.leave()

    worker = threading.Thread(target=call)
    worker.start()
    inside.wait(5)
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (fork with threads: this test's point)
        pid = os.fork()
    if pid == 0:  # the child: report and leave at once
        try:
            os.write(write, repr(gate.shut(0.5)).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    answer = os.read(read, 64).decode()
    os.close(read)
    done.set()
    worker.join()
    assert answer == "0"


def test_the_lane_twin_refuses_after_close_and_during_a_capture() -> None:
    _twin("lane")
    for pure in (False, True):
        gpu = open_backend("fake", settings=SETTINGS.updated(pure=pure))
        kept = gpu.alloc(64)
        stream = gpu.create_stream()
        gpu.begin_capture(stream)
        with pytest.raises(Exception, match="not allowed while a stream is capturing") as caught:
            gpu.alloc(64)
        assert type(caught.value).__name__ == "CaptureError"
        with pytest.raises(Exception, match="not allowed while a stream is capturing"):
            gpu.free(kept)
        with pytest.raises(Exception, match="invalidated"):
            gpu.end_capture(stream)
        gpu.free(kept)
        gpu.close()
        with pytest.raises(BackendClosedError):
            gpu.alloc(64)
        with pytest.raises(BackendClosedError):
            gpu.free(kept)


def test_the_lane_twin_refuses_parts_of_the_pure_build() -> None:
    """A compiled lane runs only over the compiled gate (one ``pure`` setting picks both): it says so."""
    twin = _twin("lane")
    with open_backend("fake", settings=SETTINGS.updated(pure=True)) as gpu, \
            pytest.raises(TypeError, match="the compiled lane needs the compiled gate"):
        _lane(twin, gpu)


@pytest.mark.parametrize("pure", [False, True])
def test_a_capture_starting_during_the_locked_check_waits_for_the_call(pure: bool) -> None:
    """A barred call whose check saw a capture starting keeps its flag set while it judges under the lock, on
    both builds: the capture waits for it, and the call succeeds (found by review: the compiled check put the
    flag down first, and a capture that began in that gap was invalidated by the alloc)."""
    import sys
    import time

    from metrale_core._device import capture

    with open_backend("fake", settings=SETTINGS.updated(pure=pure)) as gpu, \
            open_backend("fake", settings=SETTINGS.updated(pure=pure)) as other:
        stream = gpu.create_stream()
        inside = threading.Event()
        real = other._ctx.plugin.alloc

        def slow_alloc(n: int, kind: str) -> int:  # keeps a barred call of another thread inside for a while
            inside.set()
            time.sleep(0.3)
            return real(n, kind)  # type: ignore[arg-type]

        other._ctx.plugin.alloc = slow_alloc  # type: ignore[method-assign]
        out: dict[str, object] = {}

        def judged(frame: Any, event: str, arg: object) -> Any:
            if event == "call" and frame.f_code is capture.judge_under_capture.__code__ and "slept" not in out:
                out["slept"] = True  # the gap: the check saw the capture starting, the lock not yet taken
                time.sleep(0.5)
            return None

        def allocate() -> None:
            sys.settrace(judged)
            try:
                out["buf"] = gpu.alloc(256)
            finally:
                sys.settrace(None)
                out["returned"] = time.monotonic()

        def begin() -> None:
            gpu.begin_capture(stream)
            out["began"] = time.monotonic()

        held = threading.Thread(target=lambda: other.free(other.alloc(256)))
        held.start()
        inside.wait(5)
        starter = threading.Thread(target=begin)
        starter.start()
        while not capture._STARTING.count and "began" not in out:
            time.sleep(0.001)
        allocating = threading.Thread(target=allocate)
        allocating.start()
        for thread in (allocating, starter, held):
            thread.join()
        graph = gpu.end_capture(stream)
        assert out.get("slept") and isinstance(out["buf"], DeviceBuffer)
        assert out["began"] >= out["returned"]  # type: ignore[operator]
        graph.close()
        gpu.free(out["buf"])  # type: ignore[arg-type]


def test_the_capture_twin_reads_the_flag_in_place_where_the_gil_is_on() -> None:
    """Its flag's slots read in place, their layout checked at import (a changed ``_Flag`` fails it: the loader
    says so and the pure code runs)."""
    import sys

    twin = compiled_twin("gate") and importlib.import_module("metrale_core._device._capture")
    assert twin.SLOTS is getattr(sys, "_is_gil_enabled", lambda: True)()


@settings(max_examples=examples(100), deadline=None)
@given(calls=st.integers(-2, 4), inside=st.booleans(), leaves=st.integers(1, 4))
def test_the_capture_twin_leaves_a_call_as_the_pure_rule(calls: int, inside: bool, leaves: int) -> None:
    """``leave_call``'s twin (which the compiled gate calls) leaves a thread's flag as the pure one does."""
    from metrale_core._device import capture

    twin = compiled_twin("gate") and importlib.import_module("metrale_core._device._capture")
    states = []
    for leave in (twin.leave_call, capture.leave_call):
        flag = capture._Flag()
        flag.calls, flag.inside = calls, inside
        seen = []
        for _ in range(leaves):
            leave(flag)
            seen.append((flag.calls, flag.inside))
        states.append(seen)
    assert states[0] == states[1]


@pytest.mark.parametrize("pure", [False, True])
def test_a_half_built_buffer_freed_during_a_capture_meets_the_capture_rule_first(pure: bool) -> None:
    """The capture rule comes before anything of the argument is read, on both builds (found by review: the
    compiled lane read ``buf.kind`` first, and a bare ``DeviceBuffer`` got an ``AttributeError``)."""
    with open_backend("fake", settings=SETTINGS.updated(pure=pure)) as gpu:
        stream = gpu.create_stream()
        gpu.begin_capture(stream)
        with pytest.raises(Exception, match="not allowed while a stream is capturing") as caught:
            gpu.free(DeviceBuffer.__new__(DeviceBuffer))
        assert type(caught.value).__name__ == "CaptureError"
        with pytest.raises(Exception, match="invalidated"):
            gpu.end_capture(stream)


# -- the zone table: the same random adds and removes through both ------------------------------------------------

_ZONE_OPS = st.lists(
    st.one_of(st.tuples(st.just("add"), st.integers(1, 5000)), st.tuples(st.just("remove"), st.integers(0, 40))),
    max_size=60,
)


@settings(max_examples=examples(60), deadline=None)
@given(ops=_ZONE_OPS, lead=st.booleans())
def test_the_zone_table_twin_keeps_the_pure_table_s_slots(ops: list[tuple[str, int]], lead: bool) -> None:
    """Zones added and removed in any order: the same zones, in the same slots, the same table bytes, versions and
    fill counts. (The lane's C-level add is compared through whole backends: the lane's parity test scans.)"""
    twin_class = _twin("zones")
    settings_ = SETTINGS.updated(redzone=64, redzone_lead=lead)
    twin, pure = twin_class(settings_), PureRedZones(settings_)
    live: list[int] = []
    for step, (op, arg) in enumerate(ops):
        if op == "add":
            index = step + 1
            buf = DeviceBuffer._make(0x100000 * index + 256, arg, "device", index, f"app.py:{index}", None)
            layout = pure.layout(arg, index)
            assert layout == twin.layout(arg, index) and layout is not None
            pure.add(pure.zones_for(buf, layout))
            twin.add(twin.zones_for(buf, layout))
            live.append(index)
        elif live:
            index = live.pop(arg % len(live))
            assert twin.remove(index) == pure.remove(index)
        assert twin.live() == pure.live() and twin.table() == pure.table()
        assert (twin.version, twin.filled) == (pure.version, pure.filled)
        (tv, tz, tt), (pv, pz, pt) = twin.snapshot(twin.version), pure.snapshot(pure.version)
        assert (tv, list(tz), tt) == (pv, list(pz), pt)  # (the twin's zones: a sequence made when asked for)
        assert len(tz) == len(pz) and all(tz[i] == pz[i] for i in range(-len(pz), len(pz)))
        (tv, tz, tt), (pv, pz, pt) = twin.snapshot(-1), pure.snapshot(-1)  # (again: the twin's kept snapshot)
        assert (tv, list(tz), tt) == (pv, list(pz), pt)
        assert all(twin.zones_of(i) == pure.zones_of(i) and twin.watched(i) for i in live)


_COLLECTED_INSIDE = """
import gc, logging, sys
from metrale_core import MetraleSettings, open_backend
logging.disable(logging.CRITICAL)
gpu = open_backend("fake", settings=MetraleSettings(redzone=64, pure=False, redzone_quarantine_bytes=1 << 20))
zones = gpu._parts.guard.zones
class Owner:  # in a cycle: only a collection frees it, and its finalizer frees a zoned buffer
    def __init__(self, buf):
        self.buf, self.me = buf, self
    def __del__(self):
        gpu.free(self.buf)
keep = [gpu.alloc(100) for _ in range(4)]
for read in (zones.live, lambda: zones.snapshot(-1), zones.table, gpu.scan_redzones):
    gc.collect(); gc.disable()
    Owner(gpu.alloc(100))
    gc.set_threshold(1); gc.enable()
    read()  # its first container collects the cycle: never inside the table's lock
    gc.set_threshold(700)
print("done")
"""


def test_a_collection_while_the_zone_table_is_read_frees_a_zoned_buffer() -> None:
    """The review's case: a finalizer that frees a zoned buffer runs in a collection that reading the zone table's
    twin starts; it must not run while the table's lock is held (the lock is not reentrant: it would hang)."""
    import subprocess
    import sys

    _twin("zones")
    done = subprocess.run(
        [sys.executable, "-c", _COLLECTED_INSIDE], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]
