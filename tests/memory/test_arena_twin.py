"""The compiled arena (``_memory/bump.py`` compiled as ``_bump``) against the pure `Arena` (the same file as Python):
the same answers to the same random programs over the same block (addresses, errors with their types and messages,
state), across threads, and the same typed errors for numpy integers and bad arguments. Where the twin was not built,
these tests skip, saying so."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

import metrale_core
from metrale_core import ArenaFullError, DeviceBuffer, InvalidBufferError
from metrale_core._memory.arena import MAX_ALIGN
from metrale_core._memory.arena import Arena as PureArena
from metrale_core._twins import pick
from tests._support import SETTINGS, compiled_twin, examples, in_threads


def _twin() -> type[PureArena]:
    twin: type[PureArena] = compiled_twin("arena")  # type: ignore[assignment]
    return twin


class _Refused(Exception):
    """What a refusing ``on_close`` raises (as the allocator refuses during a capture)."""


class _Closer:
    """An ``on_close`` that records what it was given, and refuses while ``refuse`` is set."""

    def __init__(self) -> None:
        self.refuse = False
        self.calls: list[tuple[object, object]] = []

    def __call__(self, arena: PureArena, block: DeviceBuffer) -> None:
        self.calls.append((arena, block))
        if self.refuse:
            raise _Refused("refused: a capture is under way")


def _outcome(call: Any) -> tuple[object, ...]:
    """What a call answered, comparable between the twins: the value, or the error's type, message and fields."""
    try:
        value = call()
    except Exception as exc:
        extra = (exc.requested, exc.capacity, exc.used) if isinstance(exc, ArenaFullError) else ()
        return ("raised", type(exc), str(exc), *extra)
    if isinstance(value, DeviceBuffer):  # (the creation index is the process's next: compared apart)
        return ("buffer", value.ptr, value.nbytes, value.kind, value.site, value._owner)
    return ("returned", value)


def _state(arena: PureArena) -> tuple[object, ...]:
    return (arena.base, arena.capacity, arena.used, arena.closed, arena.allocs, arena.site, repr(arena))


_ALIGNS = st.sampled_from([1 << i for i in range(22)]) | st.sampled_from([256, 256, 4096])
_BAD_SIZES = [-1, -(1 << 70), True, False, 1.0, "5", None, np.int32(-1), np.float64(8.0), [8]]
_GOOD_SIZES = [0, 1, 255, 256, 1 << 20, 1 << 62, 1 << 63, 1 << 64, 1 << 70, np.int64(5), np.uint8(3),
               np.uint64(1 << 63), np.int16(4096)]
_BAD_ALIGNS = [0, -256, 3, 255, 1 << 22, 1 << 64, True, 256.0, None, "256", np.int32(3), np.float32(256.0)]
_GOOD_ALIGNS = [1, 2, 256, MAX_ALIGN, np.int64(64), np.uint16(512), np.uint64(1 << 21)]


def _changed(buf: DeviceBuffer, other: DeviceBuffer, change: str) -> DeviceBuffer:
    """``buf``'s handle, or a copy of it changed as ``change`` says."""
    if change == "nbytes":
        return dataclasses.replace(buf, nbytes=buf.nbytes + 1)
    if change == "ptr":
        return dataclasses.replace(buf, ptr=buf.ptr + 256)
    if change == "owner":
        return DeviceBuffer(buf.ptr, buf.nbytes, buf.kind, buf.index, buf.site, object())
    if change == "index":
        return dataclasses.replace(buf, index=buf.index + 1)
    if change == "float":  # fields that are not plain ints: compared as the pure class compares them
        odd: Any = (float(buf.ptr), np.int64(buf.nbytes), buf.kind, float(buf.index), buf.site, buf._owner)
        return DeviceBuffer(*odd)
    if change == "crossed":  # the other arena's piece: another creation index
        return other
    return buf


_CHANGES = st.sampled_from(["none", "none", "nbytes", "ptr", "owner", "index", "float", "crossed"])


class ArenaTwins(RuleBasedStateMachine):
    """The pure arena and its twin over the same block, driven by the same steps."""

    buffers = Bundle("buffers")

    def __init__(self) -> None:
        super().__init__()
        self.twin_class = _twin()
        self.owner = object()
        self.last_index: dict[str, int] = {}

    @initialize(base=st.integers(0, 1 << 48) | st.sampled_from([0x10000, 0x7F00_0000_0001, (1 << 64) - 4096]),
                capacity=st.integers(0, 1 << 14) | st.sampled_from([1 << 30, 4096]),
                site=st.sampled_from(["app.py:12", "train.py:7"]))
    def open(self, base: int, capacity: int, site: str) -> None:
        self.block = DeviceBuffer._make(base, capacity, "arena", 1, site, self.owner)
        self.closers = (_Closer(), _Closer())
        self.arenas = (PureArena(self.block, self.closers[0]), self.twin_class(self.block, self.closers[1]))

    def _both(self, step: Any) -> tuple[tuple[object, ...], tuple[object, ...]]:
        pure, twin = (_outcome(lambda arena=arena: step(arena)) for arena in self.arenas)
        assert pure == twin
        return pure, twin

    @rule(target=buffers, nbytes=st.integers(0, 1 << 15) | st.sampled_from([1 << 30, 1 << 64, 1 << 70]),
          align=_ALIGNS)
    def alloc(self, nbytes: int, align: int) -> MultipleResults[tuple[DeviceBuffer, DeviceBuffer]]:
        made: list[DeviceBuffer] = []

        def alloc(arena: PureArena) -> DeviceBuffer:
            made.append(arena.alloc(nbytes, align))
            return made[-1]

        self._both(alloc)
        if len(made) < 2:  # refused by both (the same error): no piece
            return multiple()
        for name, buf in zip(("pure", "twin"), made, strict=True):
            assert type(buf) is DeviceBuffer and buf.kind == "arena"
            assert buf.index > self.last_index.get(name, -1)  # the process's sequence, rising
            self.last_index[name] = buf.index
        return multiple((made[0], made[1]))

    @rule(nbytes=st.sampled_from(_GOOD_SIZES + _BAD_SIZES), align=st.sampled_from(_GOOD_ALIGNS + _BAD_ALIGNS))
    def alloc_odd(self, nbytes: object, align: object) -> None:
        self._both(lambda arena: arena.alloc(nbytes, align))

    @rule()
    def reset(self) -> None:
        self._both(lambda arena: arena.reset())

    @rule(refuse=st.booleans(), with_block=st.booleans())
    def close(self, refuse: bool, with_block: bool) -> None:
        for closer in self.closers:
            closer.refuse = refuse
        calls = [len(closer.calls) for closer in self.closers]
        if with_block:  # the context manager's exit closes
            self._both(lambda arena: arena.__exit__(None, None, None))
        else:
            self._both(lambda arena: arena.close())
        for arena, closer, before in zip(self.arenas, self.closers, calls, strict=True):
            assert closer.calls[before:] in ([], [(arena, self.block)])
        assert [len(c.calls) - n for c, n in zip(self.closers, calls, strict=True)] in ([0, 0], [1, 1])

    @rule()
    def take_block(self) -> None:
        pure, _ = self._both(lambda arena: arena._take_block())
        assert pure in (("returned", None), ("buffer", *_outcome(lambda: self.block)[1:]))

    @rule(pair=buffers, change=_CHANGES)
    def holds(self, pair: tuple[DeviceBuffer, DeviceBuffer], change: str) -> None:
        """Whether a piece (or a changed copy of its handle) is held, asked of both; perhaps long after a reset."""
        self._holds(pair, change)

    @rule(nbytes=st.integers(0, 1 << 12), align=_ALIGNS, change=_CHANGES)
    def alloc_and_ask(self, nbytes: int, align: int, change: str) -> None:
        """A piece asked after at once: a live one, most often."""
        for pair in self.alloc(nbytes, align).values:
            self._holds(pair, change)

    def _holds(self, pair: tuple[DeviceBuffer, DeviceBuffer], change: str) -> None:
        bufs = [_changed(buf, other, change) for buf, other in (pair, pair[::-1])]
        held = [arena.holds(buf) for arena, buf in zip(self.arenas, bufs, strict=True)]
        assert held[0] == held[1], (change, held)

    @invariant()
    def same_state(self) -> None:
        if hasattr(self, "arenas"):
            assert _state(self.arenas[0]) == _state(self.arenas[1])


def test_the_arena_twin_answers_as_the_pure_arena() -> None:
    _twin()
    chosen = settings(max_examples=examples(150), stateful_step_count=examples(40), deadline=None)
    run_state_machine_as_test(ArenaTwins, settings=chosen)


@settings(max_examples=examples(100), deadline=None)
@given(nbytes=st.sampled_from(_GOOD_SIZES + _BAD_SIZES), align=st.sampled_from(_GOOD_ALIGNS + _BAD_ALIGNS),
       closed=st.booleans())
def test_numpy_integers_and_bad_arguments_give_the_same_errors(nbytes: object, align: object, closed: bool) -> None:
    twin = _twin()
    block = DeviceBuffer._make(0x10000, 1 << 20, "arena", 1, "app.py:1", None)
    arenas = [cls(block, lambda arena, block: None) for cls in (PureArena, twin)]
    if closed:
        for arena in arenas:
            arena.close()
    pure, compiled = (_outcome(lambda arena=arena: arena.alloc(nbytes, align)) for arena in arenas)
    assert pure == compiled
    assert _state(arenas[0]) == _state(arenas[1])


def test_the_twin_is_an_arena_by_name_and_by_isinstance() -> None:
    twin = _twin()
    arena = twin(DeviceBuffer._make(0x10000, 4096, "arena", 1, "app.py:1", None), lambda arena, block: None)
    assert isinstance(arena, metrale_core.Arena) and issubclass(twin, metrale_core.Arena)
    assert type(arena).__name__ == type(arena).__qualname__ == "Arena"
    assert metrale_core.Arena is PureArena
    with pytest.raises(AttributeError):
        arena.extra = 1  # type: ignore[attr-defined]
    with arena as entered:
        assert entered is arena
    assert arena.closed
    with pytest.raises(InvalidBufferError, match=r"Arena.reset: this arena \(from app.py:1\) is closed"):
        arena.reset()


@pytest.mark.parametrize("pure", [False, True])
def test_pick_takes_the_arena_twin_unless_pure(pure: bool) -> None:
    twin = _twin()
    assert pick("arena", PureArena, pure) is (PureArena if pure else twin)


def test_the_arena_twin_is_thread_safe() -> None:
    """Four threads take pieces of one arena, asking as they go whether each is held: every piece is its own,
    none overlaps another, each is counted."""
    twin = _twin()
    arena = twin(DeviceBuffer._make(0x10000, 1 << 30, "arena", 1, "app.py:1", None), lambda arena, block: None)
    taken: list[list[DeviceBuffer]] = [[] for _ in range(4)]

    def work(t: int) -> None:
        for i in range(2000):
            buf = arena.alloc(1 + (i * 37 + t) % 5000, 1 << ((i + t) % 10))
            assert arena.holds(buf) and buf.ptr % (1 << ((i + t) % 10)) == 0
            taken[t].append(buf)

    in_threads(work)
    pieces = sorted((b for bufs in taken for b in bufs), key=lambda b: b.ptr)
    assert len(pieces) == arena.allocs == 8000 and len({b.index for b in pieces}) == 8000
    assert all(a.ptr + a.nbytes <= b.ptr for a, b in itertools.pairwise(pieces))
    assert pieces[-1].ptr + pieces[-1].nbytes - arena.base <= arena.used
    assert all(arena.holds(b) for b in pieces)
    arena.reset()
    assert not any(arena.holds(b) for b in pieces) and arena.used == 0


def test_resets_and_a_close_race_pieces_safely() -> None:
    """Threads alloc and ask while one resets and then closes: no crash; after the close, every alloc is refused
    and no piece is held."""
    twin = _twin()
    arena = twin(DeviceBuffer._make(0x10000, 1 << 20, "arena", 1, "app.py:1", None), lambda arena, block: None)
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: list[DeviceBuffer] = []

    def work() -> None:
        try:
            while not stop.is_set():
                try:
                    buf = arena.alloc(64)
                except ArenaFullError:
                    continue
                except InvalidBufferError:
                    return
                seen.append(buf)
                arena.holds(buf)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for th in threads:
        th.start()
    for _ in range(200):
        arena.reset()
    arena.close()
    stop.set()
    for th in threads:
        th.join()
    assert arena.closed and seen
    assert not any(arena.holds(b) for b in seen)
    with pytest.raises(InvalidBufferError):
        arena.alloc(64)


@pytest.mark.parametrize("compiled", [False, True])
def test_holds_answers_while_a_close_waits_on_the_holdings_lock(compiled: bool) -> None:
    """``close()`` calls ``on_close`` under the arena's lock, and the allocator's takes the holdings' lock; the
    holdings ask ``holds`` under theirs. So ``holds`` takes no lock of the arena's, in either class: no deadlock."""
    cls = _twin() if compiled else PureArena
    holdings = threading.Lock()
    closing = threading.Event()

    def on_close(arena: PureArena, block: DeviceBuffer) -> None:
        closing.set()
        with holdings:
            pass

    arena = cls(DeviceBuffer._make(0x10000, 4096, "arena", 1, "app.py:1", None), on_close)
    buf = arena.alloc(64)
    answers: list[bool] = []
    with holdings:
        closer = threading.Thread(target=arena.close)
        closer.start()
        assert closing.wait(10)
        asker = threading.Thread(target=lambda: answers.append(arena.holds(buf)))
        asker.start()
        asker.join(10)
        assert not asker.is_alive(), "holds() waited for the arena's lock"
    closer.join(10)
    assert answers == [True] and arena.closed and not arena.holds(buf)


@pytest.mark.parametrize("pure", [False, True])
def test_an_arena_of_a_backend_runs_the_same_on_both(pure: bool) -> None:
    """Pieces of a backend's arena, compiled or pure: written, read, refused after a reset, the stats counted."""
    from metrale_core import open_backend

    with open_backend("fake", settings=SETTINGS.updated(pure=pure)) as gpu:
        arena = gpu.create_arena(1 << 16)
        assert isinstance(arena, metrale_core.Arena) and type(arena).__name__ == "Arena"
        a, b = arena.alloc(1000), arena.alloc(24, 4096)
        gpu.memset(a, 7)
        host = bytearray(1000)
        gpu.copy_to_host(host, a)
        assert host == b"\x07" * 1000
        assert (b.ptr - arena.base) % 4096 == 0 and arena.used == b.ptr - arena.base + 24
        assert gpu.stats().arena_used == arena.used
        arena.reset()
        with pytest.raises(InvalidBufferError):
            gpu.memset(a, 0)
        arena.close()
        assert gpu.stats().arena_allocs == 2


@pytest.mark.parametrize("pure", [False, True])
def test_a_backend_picks_the_arena_twin_unless_pure(pure: bool) -> None:
    """The allocator's wiring: ``create_arena`` makes the twin where built, the pure class where ``pure`` is set."""
    from metrale_core import open_backend

    twin = _twin()
    with open_backend("fake", settings=SETTINGS.updated(pure=pure)) as gpu:
        assert type(gpu.create_arena(4096)) is (PureArena if pure else twin)
