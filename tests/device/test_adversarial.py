"""What adversarial use of the public API found (issue 14): lying producers, sizes past 64 bits,
an out-of-memory callback that runs out of memory, and four threads at once. Every test runs
on every backend it applies to, the CUDA one included where a GPU answers.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_core import (
    CaptureError,
    GpuBackend,
    InvalidArgumentError,
    InvalidBufferError,
    MetraleError,
    MetraleSettings,
    OutOfMemoryError,
    open_backend,
)
from tests._support import SETTINGS, examples


class _Producer:
    """An object that exports whatever ``__cuda_array_interface__`` it is given."""

    def __init__(self, cai: object) -> None:
        self._cai = cai

    @property
    def __cuda_array_interface__(self) -> object:
        return self._cai

    def __repr__(self) -> str:
        return f"_Producer({self._cai!r:.80})"


def _state(gpu: GpuBackend) -> tuple[object, ...]:
    """What a refused call must leave as it was."""
    stats = gpu.stats()
    return (gpu.live_alloc_len(), stats.current_bytes, stats.alloc_count, stats.oom_count, stats.oom_retries)


def _contents(gpu: GpuBackend, bufs: list[Any]) -> list[bytes]:
    out = []
    for buf in bufs:
        host = bytearray(buf.nbytes)
        gpu.copy_to_host(host, buf)
        out.append(bytes(host))
    return out


# -- 1, 5: a producer that claims more than it owns -------------------------------------------------


@pytest.mark.needs("interop")
def test_a_wrap_claiming_more_than_its_allocation_is_refused(gpu: GpuBackend) -> None:
    """A ``__cuda_array_interface__`` claiming 1 MiB at the start of a live 4 KiB allocation is refused
    (on CUDA, its extent runs past the allocation the driver knows; on the fake, device memory is not
    addressable at all), and no metrale operation reaches the eight allocations beside it."""
    target = gpu.alloc(4096)
    neighbours = [gpu.alloc(4096) for _ in range(8)]
    for i, buf in enumerate(neighbours):
        gpu.memset(buf, 0x10 + i)
    gpu.synchronize()
    before, contents = _state(gpu), _contents(gpu, neighbours)
    liar = _Producer({"data": (target.ptr, False), "shape": (1 << 20,), "typestr": "|u1", "version": 3})
    with pytest.raises(InvalidArgumentError) as caught:
        gpu.wrap(liar)
    assert caught.value.name == "CUDA_ERROR_INVALID_DEVICE"
    assert _state(gpu) == before and _contents(gpu, neighbours) == contents
    for buf in [target, *neighbours]:
        gpu.free(buf)


@pytest.mark.needs("interop")
def test_wrap_refuses_memory_the_backend_cannot_address_with_an_invalid_argument_error(gpu: GpuBackend) -> None:
    """Memory the backend cannot address is an ``InvalidArgumentError`` named
    ``CUDA_ERROR_INVALID_DEVICE`` on every backend (host memory on CUDA; device memory on the fake)."""
    import numpy as np

    host = np.zeros(64, dtype=np.uint8)
    producer: object = host if gpu.name == "cuda" else _Producer(
        {"data": (0x7000_0000_0000, False), "shape": (64,), "typestr": "|u1", "version": 3}
    )
    before = _state(gpu)
    with pytest.raises(InvalidArgumentError) as caught:
        gpu.wrap(producer)
    assert caught.value.name == "CUDA_ERROR_INVALID_DEVICE"
    assert _state(gpu) == before


# -- 2: the same memory wrapped twice ----------------------------------------------------------------


@pytest.mark.needs("interop")
def test_the_same_memory_wrapped_twice_is_two_live_buffers(gpu: GpuBackend) -> None:
    buf = gpu.alloc(256)
    gpu.memset(buf, 0)
    view = buf.view("uint8")
    first = gpu.wrap(view)
    second = gpu.wrap(view)
    assert first.index != second.index
    gpu.memset(first, 0x11, nbytes=8)
    gpu.memset(second, 0x22, offset=8, nbytes=8)
    gpu.unwrap(first)
    with pytest.raises(InvalidBufferError):
        gpu.memset(first, 0)
    gpu.memset(second, 0x33, offset=16, nbytes=8)  # the second is still live
    out = bytearray(256)
    gpu.copy_to_host(out, buf)
    assert bytes(out[:24]) == b"\x11" * 8 + b"\x22" * 8 + b"\x33" * 8
    gpu.unwrap(second)
    with pytest.raises(InvalidBufferError):
        gpu.unwrap(second)
    gpu.free(buf)


# -- 4: lying producers, fuzzed --------------------------------------------------------------------

_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6) | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)
_POINTER = st.integers(min_value=-(1 << 66), max_value=1 << 66) | _ANY
_SHAPE = st.lists(st.integers(min_value=-3, max_value=1 << 40) | _ANY, max_size=3).map(tuple) | _ANY
_CAI = st.fixed_dictionaries(
    {},
    optional={
        "data": st.tuples(_POINTER, st.booleans() | _ANY) | _ANY,
        "shape": _SHAPE,
        "typestr": st.sampled_from(["<f4", "|u1", "<i8", "f4", "<f", "", "<x4", "<f0"]) | _ANY,
        "strides": st.none() | _SHAPE,
        "mask": st.none() | _ANY,
        "version": st.integers(0, 4) | _ANY,
    },
)


class _Raises:
    """A producer whose every export raises."""

    def __init__(self, exc: BaseException) -> None:
        self._exc = exc

    @property
    def __cuda_array_interface__(self) -> object:
        raise self._exc


class _Dlpack:
    """A DLPack-like object whose ``__dlpack__`` returns or raises what it is given."""

    def __init__(self, result: object, raise_it: bool) -> None:
        self._result, self._raise = result, raise_it

    def __dlpack__(self, **_: object) -> object:
        if self._raise:
            raise ValueError(f"{self._result!r:.40}")
        return self._result

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class _LyingIndex:
    def __index__(self) -> int:
        raise RuntimeError("a lying __index__")


_PRODUCERS = (
    _CAI.map(_Producer)
    | st.builds(_Dlpack, _ANY, st.booleans())
    | st.sampled_from([ValueError("v"), TypeError("t"), KeyError("k"), RuntimeError("r")]).map(_Raises)
    | st.sampled_from([b"read-only", bytearray(), memoryview(b"x"), object(), _LyingIndex()])
    | st.builds(lambda p: _Producer({"data": (p, False), "shape": (4,), "typestr": "<f4"}),
                st.sampled_from([_LyingIndex(), float("nan"), "0x1000", 1.5, None, -1, 1 << 64]))
)


def test_any_producer_gets_an_invalid_argument_error_and_changes_nothing(gpu: GpuBackend) -> None:
    """Random ``__cuda_array_interface__`` dicts and DLPack-like objects, on every backend: only
    ``InvalidArgumentError``, and nothing changes."""
    _fuzz_wrap(gpu)


def _fuzz_wrap(gpu: GpuBackend) -> None:
    keep = gpu.alloc(1024)
    gpu.memset(keep, 0x5A)

    @settings(suppress_health_check=list(HealthCheck), deadline=None, max_examples=examples(150))
    @given(producer=_PRODUCERS)
    def run(producer: object) -> None:
        before = _state(gpu)
        try:
            ext = gpu.wrap(producer)
        except InvalidArgumentError:
            pass
        else:  # pragma: no cover - a random dict describing real, addressable memory
            gpu.unwrap(ext)
        assert _state(gpu) == before

    run()
    assert _contents(gpu, [keep]) == [b"\x5a" * 1024]
    gpu.free(keep)


# -- 8: sizes that do not fit 64 bits, and sizes that cannot be had ---------------------------------


@pytest.mark.parametrize("call", ["alloc", "alloc_managed", "alloc_arena", "create_arena", "alloc_host"])
@pytest.mark.parametrize("nbytes", [1 << 64, 1 << 70])
def test_a_size_past_64_bits_is_an_invalid_argument_on_every_backend(gpu: GpuBackend, call: str, nbytes: int) -> None:
    before = _state(gpu)
    with pytest.raises(InvalidArgumentError, match="64 bits"):
        getattr(gpu, call)(nbytes)
    assert _state(gpu) == before


@pytest.mark.parametrize("call", ["alloc", "alloc_host"])
def test_a_size_that_cannot_be_had_is_out_of_memory_on_every_backend(gpu: GpuBackend, call: str) -> None:
    before = _state(gpu)
    with pytest.raises(OutOfMemoryError):
        getattr(gpu, call)(1 << 62)
    after = _state(gpu)
    assert after[:3] == before[:3]  # nothing allocated; the OOM itself is counted


# -- 12: an on_out_of_memory callback that runs out of memory itself -------------------------------


def test_an_oom_callback_runs_once_per_attempt_and_never_reenters(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []
    with open_backend("fake", settings=MetraleSettings(fake_memory_bytes=1 << 20, redzone=0)) as gpu:

        def reclaim(nbytes: int) -> bool:
            calls.append(nbytes)
            with contextlib.suppress(OutOfMemoryError):
                gpu.alloc(2 << 20)  # runs out of memory too, inside the callback
            return False

        gpu.on_out_of_memory(reclaim)
        with pytest.raises(OutOfMemoryError):
            gpu.alloc(4 << 20)
        assert calls == [4 << 20]
        assert gpu.stats().oom_count == 2  # the user's allocation and the callback's own
        assert "RecursionError" not in caplog.text


def test_an_oom_callback_that_frees_is_asked_again_on_the_next_attempt() -> None:
    calls: list[int] = []
    with open_backend("fake", settings=MetraleSettings(fake_memory_bytes=1 << 20, redzone=0, oom_retries=3)) as gpu:
        ballast = [gpu.alloc(256 << 10) for _ in range(4)]

        def reclaim(nbytes: int) -> bool:
            calls.append(nbytes)
            if ballast:
                gpu.free(ballast.pop())
                return True
            return False

        gpu.on_out_of_memory(reclaim)
        buf = gpu.alloc(512 << 10)
        assert len(calls) == 2 and gpu.stats().oom_retries == 2
        gpu.free(buf)


# -- 3: four threads, each on its own stream ----------------------------------------------------------


def test_four_threads_allocating_freeing_and_capturing_keep_their_buffers_live(backend_name: str) -> None:
    """Each thread allocates, writes, frees and captures on its own stream; a thread's own live buffer is
    always live to it (a refusal is a race), and at the end the ledger is exact."""
    rounds = 60
    errors: list[BaseException] = []
    with open_backend(backend_name, settings=SETTINGS) as gpu:
        baseline = gpu.live_alloc_len()
        start = threading.Barrier(4)

        def worker(seed: int) -> None:
            try:
                gpu.bind_to_thread()
                stream = gpu.create_stream()
                mine: list[Any] = []
                start.wait()
                for i in range(rounds):
                    mine.append(_retry(gpu.alloc, 256 + 64 * ((seed + i) % 5)))
                    for buf in mine:
                        gpu.memset(buf, (seed + i) & 0xFF, stream=stream)
                    if i % 3 == 2:
                        _retry(gpu.free, mine.pop(0))
                    if i % 10 == 5:
                        _capture_once(gpu, stream, mine[-1], seed)
                _retry(stream.synchronize)
                expected = bytes([(seed + rounds - 1) & 0xFF])
                for buf in mine:
                    host = bytearray(buf.nbytes)
                    _retry(gpu.copy_to_host, host, buf, stream=stream)
                    _retry(stream.synchronize)
                    assert bytes(host) == expected * buf.nbytes
                for buf in mine:
                    _retry(gpu.free, buf)
                _retry(stream.close)
            except BaseException as exc:  # reported below, with the thread's seed
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert gpu.live_alloc_len() == baseline


def _retry(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` until no other thread's capture (global mode) forbids it."""
    while True:
        try:
            return fn(*args, **kwargs)
        except CaptureError:
            continue


def _capture_once(gpu: GpuBackend, stream: Any, buf: Any, seed: int) -> None:
    """Capture one memset on ``stream`` and replay it. Another thread's alloc or free during the capture
    invalidates it (global mode, as CUDA does): then capture again."""
    while True:
        try:
            gpu.begin_capture(stream)
        except CaptureError:  # another thread is capturing now
            continue
        recorded = True
        try:
            gpu.memset(buf, (seed * 7) & 0xFF, stream=stream)
        except CaptureError:  # the capture was invalidated by another thread
            recorded = False
        try:
            graph = gpu.end_capture(stream)
        except CaptureError:
            continue
        if recorded:
            break
        graph.close()
    executable = _retry(graph.instantiate)
    _retry(executable.launch, stream)
    _retry(stream.synchronize)
    _retry(executable.close)
    _retry(graph.close)


def test_red_zones_count_towards_the_64_bit_limit() -> None:
    with open_backend("fake", settings=MetraleSettings(redzone=4096)) as gpu:
        before = _state(gpu)
        with pytest.raises(InvalidArgumentError, match="64 bits"):
            gpu.alloc((1 << 64) - 4096)
        assert _state(gpu) == before


def test_a_freed_host_buffer_still_referenced_pins_no_memory(fake: GpuBackend) -> None:
    hb = fake.alloc_host(1 << 20)
    view = hb.view()
    array = weakref.ref(view.obj)  # the fake's host memory behind the view
    del view
    fake.free(hb)
    assert array() is None  # gone, though ``hb`` is still referenced
    with pytest.raises(MetraleError, match="closed"):
        hb.view()


# -- found by review: dicts that lie in their methods, DLPack extents below zero, callbacks and captures ----


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("a repr that raises")


class _LyingDict(dict):  # type: ignore[type-arg]
    def get(self, key: object, default: object = None) -> object:
        raise KeyError(key)

    def __iter__(self) -> Any:
        raise RuntimeError("an iteration that raises")


@pytest.mark.parametrize("cai", [
    {"data": "x", "z": _BadRepr()},
    {"data": (1, False), "typestr": "<u1", "shape": (4,), "version": 3, "z": _BadRepr()},
    _LyingDict(data=1),
])
def test_a_cai_dict_that_lies_in_its_methods_is_an_invalid_argument(fake: GpuBackend, cai: object) -> None:
    before = _state(fake)
    with pytest.raises(InvalidArgumentError):
        fake.wrap(_Producer(cai))
    assert _state(fake) == before


@pytest.mark.parametrize("shape", [(-1, 8), (-2, -4), (3, -1)])
def test_a_dlpack_tensor_with_a_negative_extent_is_refused(fake: GpuBackend, shape: tuple[int, ...]) -> None:
    import numpy as np

    from metrale_core._interop.dlpack import DLPACK_CPU, make_capsule

    array = np.zeros(64, np.uint8)

    class Tensor:
        def __dlpack__(self, **_: object) -> object:
            return make_capsule(array.ctypes.data, shape, "uint8", DLPACK_CPU, 0, array)

        def __dlpack_device__(self) -> tuple[int, int]:
            return (1, 0)

    before = _state(fake)
    with pytest.raises(InvalidArgumentError, match="negative extent"):
        fake.wrap(Tensor())
    assert _state(fake) == before


def test_a_capture_begun_while_an_oom_callback_runs_is_not_broken_by_the_driver() -> None:
    """An ``on_out_of_memory`` callback is user code, outside metrale's barred calls: a capture another
    thread begins meanwhile does not wait for it, and the allocation's retry is then refused by metrale's
    own rule (a ``CaptureError`` naming ``alloc``), never by the driver halfway through."""
    with open_backend("fake", settings=MetraleSettings(fake_memory_bytes=1 << 20, redzone=0)) as gpu:
        hog = gpu.alloc(900 << 10)
        stream = gpu.create_stream()
        began = threading.Event()
        outcome: dict[str, object] = {}

        def capture() -> None:
            gpu.begin_capture(stream)
            began.set()

        def reclaim(nbytes: int) -> bool:
            gpu.free(hog)
            thread = threading.Thread(target=capture)
            thread.start()
            thread.join(10)  # would wait forever (bounded: 2 s) if the callback still counted as barred
            outcome["began"] = began.is_set()
            return True

        gpu.on_out_of_memory(reclaim)
        with pytest.raises(CaptureError, match="alloc is not allowed"):
            gpu.alloc(500 << 10)
        assert outcome["began"]
        with pytest.raises(CaptureError):
            gpu.end_capture(stream)  # invalidated by the refused alloc, as CUDA's global mode does
        assert gpu.live_alloc_len() == 0
