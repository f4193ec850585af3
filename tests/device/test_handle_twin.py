"""The handle twin (``_device/handle.py`` compiled as ``_handle``) against ``DeviceBuffer._make`` and
``DeviceBuffer(...)``: the same buffer, to every reader (equality, hash, repr, ``asdict``, pickle, ``replace``), and
no reference leaked."""

from __future__ import annotations

import copy
import dataclasses
import gc
import pickle
import subprocess
import sys
import tracemalloc
import weakref
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_core import DeviceBuffer
from tests._support import compiled_twin, examples, in_threads

Make = Callable[..., DeviceBuffer]


def _make() -> Make:
    make: Make = compiled_twin("handle")  # type: ignore[assignment]
    return make


class _Owner:
    """A stand-in owner: picklable, compared by identity."""


_FIELDS = st.tuples(
    st.integers(0, (1 << 64) - 1),  # ptr
    st.integers(0, 1 << 70),  # nbytes (a buffer's are smaller; the handle does not check)
    st.sampled_from(["device", "managed", "arena", "external"]) | st.text(max_size=8),  # kind
    st.integers(-(1 << 70), 1 << 70),  # index
    st.text(max_size=40),  # site
)


def test_the_handle_twin_stores_into_the_slots() -> None:
    """Where it was built, the layout check passed here (a CPython with the GIL)."""
    compiled_twin("handle")
    from metrale_core._device import _handle

    assert _handle.DIRECT is (getattr(sys, "_is_gil_enabled", lambda: True)())


@settings(max_examples=examples(200), deadline=None)
@given(fields=_FIELDS, owned=st.booleans())
def test_a_buffer_made_by_the_twin_is_the_one_the_class_makes(
    fields: tuple[int, int, str, int, str], owned: bool
) -> None:
    make = _make()
    owner = _Owner() if owned else None
    made, reference, pure = make(*fields, owner), DeviceBuffer(*fields, owner), DeviceBuffer._make(*fields, owner)
    assert type(made) is DeviceBuffer
    assert made == reference == pure and (made != reference) is False
    assert hash(made) == hash(reference)
    assert repr(made) == repr(reference)
    as_dict, reference_dict = dataclasses.asdict(made), dataclasses.asdict(reference)  # (the owner deep-copied)
    assert type(as_dict.pop("_owner")) is type(reference_dict.pop("_owner")) and as_dict == reference_dict
    assert dataclasses.astuple(made)[:5] == dataclasses.astuple(reference)[:5] == fields
    assert made._owner is owner
    assert tuple(getattr(made, f.name) for f in dataclasses.fields(DeviceBuffer)) == (*fields, owner)
    for field, value in zip(("ptr", "nbytes", "kind", "index", "site"), fields, strict=True):
        assert getattr(made, field) is value  # the very objects, not copies
    back = pickle.loads(pickle.dumps(made))
    assert type(back) is DeviceBuffer and back == reference and repr(back) == repr(reference)
    assert copy.copy(made) == copy.deepcopy(made) == reference
    moved = dataclasses.replace(made, nbytes=fields[1] + 1)
    assert moved == dataclasses.replace(reference, nbytes=fields[1] + 1) and moved != made
    if hasattr(copy, "replace"):  # Python 3.13
        assert copy.replace(made, site="x.py:1") == copy.replace(reference, site="x.py:1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.ptr = 0  # type: ignore[misc]


def test_the_twin_takes_the_owner_as_keyword_and_by_default() -> None:
    make = _make()
    owner = _Owner()
    assert make(1, 2, "device", 3, "a:1", owner=owner)._owner is owner
    assert make(1, 2, "device", 3, "a:1")._owner is None
    with pytest.raises(TypeError):
        make(1, 2, "device", 3)


def test_a_buffer_of_the_twin_is_weakly_referenced_and_collected() -> None:
    """Its owner is held weakly by the backend (a weakref.ref as the owner): held, then let go."""
    make = _make()
    context = _Owner()
    buf = make(4096, 256, "device", 1, "a:1", weakref.ref(context))
    assert buf._owner() is context
    gone = weakref.ref(context)
    del context
    gc.collect()
    assert gone() is None and buf._owner() is None


def test_the_twin_keeps_the_reference_counts() -> None:
    """Each field is held once per buffer, and let go when the buffer goes."""
    make = _make()
    ptr, nbytes, index = 1 << 40, 1 << 33, 1 << 62  # not cached small ints
    kind, site, owner = "kind-" + str(ptr), "site-" + str(index), _Owner()
    fields = (ptr, nbytes, kind, index, site, owner)
    before = [sys.getrefcount(value) for value in fields]
    bufs = [make(*fields) for _ in range(10)]
    assert [sys.getrefcount(value) for value in fields] == [count + 10 for count in before]
    del bufs
    assert [sys.getrefcount(value) for value in fields] == before
    type_count = sys.getrefcount(DeviceBuffer)
    buf = make(*fields)
    del buf
    assert sys.getrefcount(DeviceBuffer) == type_count


def test_the_twin_leaks_no_memory() -> None:
    make = _make()
    owner = _Owner()

    def churn() -> None:
        for i in range(20_000):
            buf = make(i << 12, i, "arena", i, "a:1", owner)
            assert buf.index == i

    churn()
    gc.collect()
    tracemalloc.start()
    try:
        first, _ = tracemalloc.get_traced_memory()
        for _ in range(5):
            churn()
        gc.collect()
        last, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert last - first < 64 * 1024, f"{last - first} bytes more after 100,000 buffers"


def test_the_twin_is_safe_across_threads() -> None:
    make = _make()
    def work(t: int) -> None:
        for i in range(5000):
            buf = make(t, i, "device", t * 10_000 + i, f"t{t}")
            assert (buf.ptr, buf.nbytes, buf.index) == (t, i, t * 10_000 + i)

    in_threads(work)


_OTHER_LAYOUT = """
import dataclasses, logging
logging.basicConfig(level=logging.DEBUG, format="%(message)s")
from metrale_core._device import buffer

@dataclasses.dataclass(frozen=True, slots=True)
class Changed:  # another layout: a field more, in another order
    nbytes: int
    ptr: int
    kind: str
    index: int
    site: str
    extra: int = 0
    _owner: object = None

    @classmethod
    def _make(cls, ptr, nbytes, kind, index, site, owner=None):
        return cls(nbytes, ptr, kind, index, site, 0, owner)

buffer.DeviceBuffer = Changed
from metrale_core._device import _handle
made = _handle.make(1, 2, "device", 3, "a:1")
print(_handle.DIRECT, type(made).__name__, made.ptr, made.nbytes, made.extra)
"""


def test_a_layout_it_does_not_expect_falls_back_to_the_pure_path() -> None:
    """A DeviceBuffer of other slots (here a changed class): ``make`` calls its ``_make``, and says why once."""
    compiled_twin("handle")
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_LAYOUT], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "Changed", "1", "2", "0"]
    assert done.stderr.count("the handle twin calls DeviceBuffer._make") == 1, done.stderr
