"""The compiled call site (``_memory/_site.pyx``) against the pure `call_site` (issue 38): the same site for the
same stack, whatever the modules' names, the internal packages and ``skip``.

Each stack is built at run time: one module a level (``types.ModuleType`` or bare globals, ``exec``), each
level's function calling the next, the innermost calling the function under test. Both functions run through
the very same frames, called from one line, so their answers must be equal strings. The tests skip, saying
why, where the twin was not compiled.
"""

from __future__ import annotations

import _thread
import collections
import functools
import itertools
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from metrale_core import open_backend
from metrale_core._device.buffer import DeviceBuffer
from metrale_core._memory import ledger
from metrale_core._memory.sites import _SITES, _SITES_MAX, CallSite, call_site, call_site_for
from metrale_core._twins import built, pick
from tests._support import SETTINGS, examples

Fn = Callable[..., Any]


@pytest.fixture(scope="module")
def twin() -> CallSite:
    if not built()["site"]:
        pytest.skip("the call-site twin was not compiled here (no C compiler at install): the pure function runs")
    chosen = pick("site", call_site, False)
    assert chosen is not call_site
    return chosen


class _Str(str):
    """A str subclass: a ``__name__`` of this type is not a str to the walk (it counts as ``""``)."""


class _LyingGlobals(dict[str, Any]):
    """Globals whose ``get`` names another module: the walk calls it, as ``frame.f_globals.get`` does."""

    def get(self, key: str, default: Any = None) -> Any:
        return "metrale_core.hidden" if key == "__name__" else super().get(key, default)


_counter = itertools.count()  # (next on it is atomic under the GIL)


def _globals(kind: str, name: object, **names: object) -> dict[str, Any]:
    """A module's globals: ``kind`` "module" (a ``types.ModuleType``'s), "dict" (a bare dict with ``__name__``),
    "missing" (no ``__name__``), "lying" (a dict subclass with its own ``get``)."""
    if kind == "module":
        g: dict[str, Any] = vars(types.ModuleType(str(name)))
        g["__name__"] = name  # (a non-str name too)
    elif kind == "dict":
        g = {"__name__": name}
    elif kind == "missing":
        g = {}
    else:
        g = _LyingGlobals(__name__=name)
    g.update(names)
    return g


def _level(kind: str, name: object, nxt: Fn | None, generator: bool = False) -> Fn:
    """One level of a stack: a function in fresh globals calling ``nxt`` (the function under test where ``None``),
    from a file of its own (each site names its level); ``generator``: through a generator's frame too."""
    call = "cs(internal, skip)" if nxt is None else "nxt(cs, internal, skip, alt)"
    body = f"    if alt:\n        return {call}\n    return {call}\n"  # two sites in one code object
    if generator:
        src = f"def g(cs, internal, skip, alt):\n{body.replace('return', 'yield')}\n" \
              "def f(cs, internal, skip, alt=False):\n    return next(g(cs, internal, skip, alt))\n"
    else:
        src = f"def f(cs, internal, skip, alt=False):\n{body}"
    g = _globals(kind, name, nxt=nxt)
    exec(compile(src, f"/generated/level{next(_counter)}.py", "exec"), g)
    return g["f"]  # type: ignore[no-any-return]


def _stack(levels: Sequence[tuple[str, object, bool]]) -> Fn:
    """The outermost function of a stack of ``levels`` (outermost first)."""
    fn: Fn | None = None
    for kind, name, generator in reversed(levels):
        fn = _level(kind, name, fn, generator)
    assert fn is not None
    return fn


def _both(outer: Fn, twin: CallSite, internal: frozenset[str], skip: int, alt: bool = False) -> list[str]:
    """The pure function's answer and the twin's, through the same frames, called from this one line (``alt``:
    each level's other line)."""
    return [outer(cs, internal, skip, alt) for cs in (call_site, twin)]


_NAMES = st.sampled_from([
    "app", "app.models", "torch.nn.modules", "metrale_core._backend", "metrale_core._memory.allocator",
    "metrale_core.testing._machine", "metrale_core._commands.bench.run", "metrale_cuda._device", "metrale_fake",
    "", ".", "app.", _Str("app"), _Str("metrale_core._backend"), 42, None, b"app",
])
_LEVELS = st.lists(
    st.tuples(st.sampled_from(["module", "dict", "missing", "lying"]), _NAMES, st.booleans()), min_size=1, max_size=8
)
_INTERNAL = st.frozensets(
    st.sampled_from(["metrale_core", "metrale_cuda", "metrale_fake", "app", "torch", "", "tests"])
)


#: Past the stack's start, within it, past its end (fewer frames than that), and negative (counts as 0).
_SKIPS = st.sampled_from([-2, -1, 0, 1, 2, 3, 4, 6, 9, 10_000])


@settings(max_examples=examples(300), deadline=None)
@given(levels=_LEVELS, internal=_INTERNAL, skip=_SKIPS)
@example(levels=[("module", "app", False)], internal=frozenset(), skip=-1)  # never the pure function's own frame
@example(levels=[("missing", None, True)], internal=frozenset({""}), skip=10_000)
@example(levels=[("lying", "app", False), ("module", _Str("app"), False)], internal=frozenset({"app"}), skip=0)
def test_the_twin_names_the_site_the_pure_function_names(
    twin: CallSite, levels: list[tuple[str, object, bool]], internal: frozenset[str], skip: int
) -> None:
    outer = _stack(levels)
    for alt in (False, True, False):
        pure, compiled = _both(outer, twin, internal, skip, alt)
        assert compiled == pure
        assert not pure.startswith(ledger.__file__)  # the pure function's own frame is never a site


def test_a_realistic_chain_names_the_user_s_line(twin: CallSite) -> None:
    """A user's function -> an internal module's -> an allocator as Python, which passes its own frame over
    (``skip=1``: the frame of ``GpuBackend.alloc`` the allocator passes over): both name the user's line."""
    internal = frozenset({"metrale_core", "metrale_fake"})
    allocator = _level("module", "metrale_core._memory.allocator", None)
    backend = _level("module", "metrale_core._backend", allocator)
    user = _level("module", "app", backend)
    expected = f"{user.__code__.co_filename}:4"
    for skip in (0, 1):
        assert _both(user, twin, internal, skip) == [expected, expected]
    # skip 2 starts past the backend's frame: at the user's still; 3 past the user's, at this test's line
    assert _both(user, twin, internal, 2) == [expected, expected]
    pure, compiled = _both(user, twin, internal, 3)
    assert pure == compiled and pure.startswith(f"{__file__}:")


@pytest.mark.parametrize("pure", [False, True])
def test_a_backend_s_allocation_names_the_user_s_line_either_way(pure: bool) -> None:
    """Through a backend as it runs (the allocator's own choice of call site), directly and through a user's
    ``functools.wraps`` wrapper of ``alloc``."""
    with open_backend("fake", settings=SETTINGS.updated(pure=pure)) as gpu:

        @functools.wraps(gpu.alloc)
        def wrapper(nbytes: int) -> DeviceBuffer:
            return gpu.alloc(nbytes)  # the call site

        wrapped = wrapper(64)
        assert wrapped.site == f"{__file__}:{wrapper.__code__.co_firstlineno + 2}"
        direct = gpu.alloc(64)
        assert direct.site == f"{__file__}:{sys._getframe().f_lineno - 1}"
        gpu.free(wrapped)
        gpu.free(direct)


def test_call_site_for_picks_the_twin_unless_pure(twin: CallSite) -> None:
    assert call_site_for(True) is call_site
    assert call_site_for(False) is twin


def test_a_wrapper_is_judged_by_its_globals_not_its_module(twin: CallSite) -> None:
    """``functools.wraps`` copies an internal function's ``__module__`` onto a user's wrapper: its frame is
    still the user's, by its globals' ``__name__``."""
    internal = frozenset({"metrale_core"})
    method = _level("module", "metrale_core._backend", None)
    g = _globals("module", "app", method=method, functools=functools)
    src = (
        "@functools.wraps(method)\n"
        "def wrapper(cs, internal, skip, alt):\n"
        "    return method(cs, internal, skip, alt)\n"
    )
    exec(compile(src, "/generated/wrapper.py", "exec"), g)
    assert g["wrapper"].__module__ == "metrale_core._backend"
    assert _both(g["wrapper"], twin, internal, 0) == ["/generated/wrapper.py:3"] * 2


def test_code_made_at_run_time_past_the_table_s_size(twin: CallSite) -> None:
    """More distinct sites than ``_SITES_MAX``: each cache starts again, and every answer stays right, new code
    at the address of code gone included."""
    internal = frozenset({"metrale_core"})
    for i in range(_SITES_MAX + 500):
        fn = _level("dict", "app", None)
        expected = f"{fn.__code__.co_filename}:4"
        assert _both(fn, twin, internal, 0) == [expected, expected], i
        del fn  # (the code object lives on in the caches: its address is never another's while it is there)
    assert len(_SITES) <= _SITES_MAX


def test_a_frame_with_no_line_number(twin: CallSite) -> None:
    """Code without a line table: ``f_lineno`` is None, and so is the site's line, in both."""
    fn = _level("module", "app", None)
    fn.__code__ = fn.__code__.replace(co_linetable=b"")
    assert _both(fn, twin, frozenset({"metrale_core"}), 0) == [f"{fn.__code__.co_filename}:None"] * 2


def test_one_line_reached_again_is_the_same_string(twin: CallSite) -> None:
    internal = frozenset({"metrale_core"})
    fn = _level("module", "app", None)
    first = [twin(internal, 0) for _ in range(3)]
    assert first[0] == first[1] == first[2]
    assert _both(fn, twin, internal, 0)[1] is _both(fn, twin, internal, 0)[1]  # formatted once, then kept


def test_internal_must_be_hashable_in_both(twin: CallSite) -> None:
    for cs in (call_site, twin):
        with pytest.raises(TypeError):
            cs({"metrale_core"})  # type: ignore[arg-type]


def test_a_thread_with_no_python_frame_has_no_site(twin: CallSite) -> None:
    """Called straight from C on a thread of its own (no Python frame at all): ``<unknown>:0`` from both."""
    internal = frozenset({"metrale_core"})
    for cs in (call_site, twin):
        out: collections.deque[str] = collections.deque()
        # deque.extend drains map, which calls partial, which calls cs: C all the way down
        _thread.start_new_thread(out.extend, (map(functools.partial(cs, internal), [0]),))
        deadline = time.monotonic() + 10
        while not out and time.monotonic() < deadline:
            time.sleep(0.001)
        assert list(out) == ["<unknown>:0"], cs


def test_threads_calling_at_once_each_get_their_own_site(twin: CallSite) -> None:
    """Eight threads, each through stacks of its own made as it goes (past the table's size in all, so it starts
    again while others read it): every answer is the right one."""
    internal = frozenset({"metrale_core"})
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(t: int) -> None:
        try:
            start.wait()
            kept = [_level("module", f"user{t}", None) for _ in range(8)]
            for i in range(_SITES_MAX // 4):
                fn = kept[i % 8] if i % 2 else _level("module", f"user{t}.new", None)
                inner = _level("module", "metrale_core._backend", None)
                expected = f"{fn.__code__.co_filename}:4"
                for cs in (twin, call_site):
                    assert fn(cs, internal, 0) == expected
                    site = inner(cs, internal, 0)  # past the backend's frame, internal: this line
                    assert site == f"{__file__}:{sys._getframe().f_lineno - 1}"
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
