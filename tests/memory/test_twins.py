"""The compiled twins against their pure reference (issue 38): the same interface, and the same answers to the
same random programs.

The twins are compiled where the build found a C compiler (CI's and the GPU machine's); where none was built,
these tests skip, saying so.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_core import MetraleSettings, open_backend
from metrale_core._device.buffer import DeviceBuffer
from metrale_core._device.stats import StatsCounter as PureStats
from metrale_core._memory.ledger import Ledger as PureLedger
from metrale_core._memory.ledger import call_site
from metrale_core._twins import TWINS, built, describe, pick
from tests._support import SETTINGS

#: Each twin's pure reference: a class, or a function (the call site, ``tests/memory/test_site_twin.py``).
PURE: dict[str, Any] = {"ledger": PureLedger, "stats": PureStats, "site": call_site}
PURE_CLASSES: dict[str, type] = {name: ref for name, ref in PURE.items() if isinstance(ref, type)}


def _twin(name: str) -> Any:
    if not built()[name]:
        pytest.skip(f"the {name} twin was not compiled here (no C compiler at install): the pure code runs")
    module, attr = TWINS[name]
    return getattr(importlib.import_module(module), attr)


def _parameters(fn: Any) -> list[tuple[str, object, object]]:
    """A function's parameters: names, kinds and defaults (a compiled function has no annotations)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_twin_has_a_pure_reference() -> None:
    assert set(PURE) == set(TWINS)


@pytest.mark.parametrize("name", sorted(set(TWINS) - set(PURE_CLASSES)))
def test_a_function_twin_has_its_pure_function_s_signature(name: str) -> None:
    twin, pure = _twin(name), PURE[name]
    assert twin.__name__ == pure.__name__ and not isinstance(twin, type)
    assert _parameters(twin) == _parameters(pure)


@pytest.mark.parametrize("name", sorted(PURE_CLASSES))
def test_a_twin_has_its_pure_class_s_interface(name: str) -> None:
    twin, pure = _twin(name), PURE_CLASSES[name]
    assert twin.__name__ == pure.__name__

    def public(cls: type) -> dict[str, list[tuple[str, object]]]:
        """Each public method's parameters: names, kinds and defaults (a compiled method has no annotations)."""
        names = {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}
        return {
            n: [(p.name, p.default) for p in inspect.signature(getattr(cls, n)).parameters.values()] for n in names
        }

    assert public(twin) == public(pure)
    make = (lambda cls: cls(0)) if name == "ledger" else (lambda cls: cls())
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


@settings(max_examples=200, deadline=None)
@given(ops=_OPS, history=st.integers(0, 5))
def test_the_ledger_twin_answers_as_the_pure_ledger(ops: list[tuple[str, int, int]], history: int) -> None:
    twin = _twin("ledger")
    assert _run(twin(history), ops) == _run(PureLedger(history), ops)


def test_the_ledger_twin_is_thread_safe() -> None:
    """Four threads add and take their own allocations: every one is counted, none lost."""
    ledger = _twin("ledger")(0)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(2000):
                index = t * 10_000 + i
                ledger.add(_buf(index, 1))
                assert ledger.take(index, 0x1000 * (index + 1), 256) is not None
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(ledger) == 0 and ledger.taken == 8000


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
        assert names != list(TWINS) or describe(False).startswith("compiled twins: ledger, stats, site")
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


@settings(max_examples=200, deadline=None)
@given(ops=_STATS_OPS)
def test_the_stats_twin_counts_as_the_pure_counter(ops: list[tuple[str, object, int]]) -> None:
    twin = _twin("stats")
    assert _run_stats(twin(), ops) == _run_stats(PureStats(), ops)
