"""Interop: metrale's buffers seen by numpy, CuPy and PyTorch without a copy, and theirs wrapped by metrale.

The fake's device memory is host memory, so numpy reads and writes it in place (``__array__``,
DLPack on the CPU). On CUDA, CuPy and PyTorch take the CUDA array interface and DLPack; those
tests run where the libraries and a GPU are (the H200 test machine has both).

DLPack: a consumer that passes ``max_version`` (1, x) gets a versioned, writable capsule; one that
names its stream gets that stream ordered after metrale's work on the device (an event), with no
host wait: the tracing backend shows which raw calls an export makes, and on CUDA a spy on the
driver calls shows that no device-wide synchronize happens while PyTorch and CuPy read the right bytes.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from metrale_core import (
    CaptureError,
    DeviceArray,
    GpuBackend,
    InvalidArgumentError,
    InvalidBufferError,
    open_backend,
)
from metrale_core._interop import dlpack
from metrale_core.plugin import error_for_code
from tests._support import SETTINGS

# -- the fake: numpy, in place -----------------------------------------------------------------


def test_numpy_reads_and_writes_fake_memory_in_place(fake: GpuBackend) -> None:
    buf = fake.alloc(64)
    fake.memset(buf, 7)
    array = np.asarray(buf)
    assert array.dtype == np.uint8 and array.shape == (64,) and (array == 7).all()
    array[:4] = [1, 2, 3, 4]  # numpy writes, metrale reads: the same bytes
    out = bytearray(4)
    fake.copy_to_host(out, buf)
    assert bytes(out) == b"\x01\x02\x03\x04"
    typed = np.asarray(buf.view("float32", (4, 4)))
    assert typed.shape == (4, 4) and typed.dtype == np.float32
    assert np.shares_memory(array, typed)
    del array, typed
    fake.free(buf)


def test_dlpack_on_the_cpu(fake: GpuBackend) -> None:
    buf = fake.alloc(32)
    fake.copy_to_device(buf, np.arange(8, dtype=np.float32).tobytes())
    assert buf.__dlpack_device__() == (1, 0)  # kDLCPU: the fake's memory is host memory
    tensor = np.from_dlpack(buf.view(np.float32))
    assert tensor.tolist() == list(range(8))
    assert tensor.ctypes.data == np.asarray(buf).ctypes.data  # no copy
    del tensor
    gc.collect()
    fake.free(buf)


def test_free_while_a_consumer_holds_a_tensor_warns(fake: GpuBackend, caplog: pytest.LogCaptureFixture) -> None:
    buf = fake.alloc(16)
    held = np.from_dlpack(buf)
    with caplog.at_level(logging.WARNING, logger="metrale"):
        fake.free(buf)
    assert any("still hold 1 DLPack tensor(s)" in r.getMessage() for r in caplog.records), caplog.text
    del held
    gc.collect()
    other = fake.alloc(16)
    caplog.clear()
    tensor = np.from_dlpack(other)
    del tensor
    gc.collect()  # released by the consumer: no warning
    with caplog.at_level(logging.WARNING, logger="metrale"):
        fake.free(other)
    assert not [r for r in caplog.records if "still hold" in r.getMessage()]


def test_wrapping_numpy_memory_on_the_fake(fake: GpuBackend) -> None:
    host = np.zeros(16, dtype=np.float32)
    before = fake.ledger_probe().records()
    ext = fake.wrap(host)
    assert ext.kind == "external" and ext.nbytes == 64
    assert fake.ledger_probe().records() == before, "wrapped memory is never on the ledger"
    fake.copy_to_device(ext, np.full(4, 2.5, dtype=np.float32).tobytes())
    fake.memset(ext, 0, offset=4, nbytes=4)
    assert host[:4].tolist() == [2.5, 0.0, 2.5, 2.5]
    with pytest.raises(InvalidBufferError, match="unwrap"):
        fake.free(ext)
    fake.unwrap(ext)
    with pytest.raises(InvalidBufferError):
        fake.memset(ext, 1)
    with pytest.raises(InvalidBufferError):
        fake.unwrap(ext)
    assert host[:4].tolist() == [2.5, 0.0, 2.5, 2.5]  # the memory is still its owner's


@pytest.mark.parametrize(
    "bad",
    [np.zeros(8)[::2], np.zeros(0), b"read-only bytes", object(), np.zeros(4).__dlpack__()],
    ids=["strided", "empty", "read-only", "no-protocol", "a-bare-capsule"],
)
def test_wrap_refuses_what_it_cannot_wrap(fake: GpuBackend, bad: object) -> None:
    before = fake.ledger_probe().records()
    with pytest.raises(InvalidArgumentError, match="wrap"):
        fake.wrap(bad)
    assert fake.ledger_probe().records() == before


@pytest.mark.parametrize(
    ("dtype", "shape", "needle"),
    [("complex64", None, "dtype"), ("float32", (100,), "needs"), ("uint32", (-1,), "shape"), ("uint8", "x", "shape")],
)
def test_view_refuses_bad_shapes(fake: GpuBackend, dtype: str, shape: object, needle: str) -> None:
    buf = fake.alloc(64)
    with pytest.raises(InvalidArgumentError, match=needle):
        buf.view(dtype, shape)
    fake.free(buf)


def test_a_freed_buffer_does_not_export(fake: GpuBackend) -> None:
    buf = fake.alloc(8)
    fake.free(buf)
    with pytest.raises(InvalidBufferError):
        np.asarray(buf)


# -- every backend: a buffer exported and wrapped back is the same memory ---------------------


@pytest.mark.needs("interop")
def test_export_and_wrap_round_trip(gpu: GpuBackend) -> None:
    buf = gpu.alloc(256)
    gpu.memset(buf, 0x11)
    view = buf.view("uint32", (8, 8))
    assert isinstance(view, DeviceArray) and view.nbytes == 256
    ext = gpu.wrap(view)
    gpu.memset(ext, 0x22, nbytes=16)
    out = bytearray(256)
    gpu.copy_to_host(out, buf)
    assert bytes(out) == b"\x22" * 16 + b"\x11" * 240
    gpu.unwrap(ext)
    gpu.free(buf)


@pytest.mark.needs("interop")
def test_cuda_array_interface_on_cuda_only(gpu: GpuBackend) -> None:
    buf = gpu.alloc(64)
    if gpu.name == "cuda":
        cai = buf.view("float32").__cuda_array_interface__
        assert cai["data"] == (buf.ptr, False) and cai["shape"] == (16,) and cai["typestr"] == "<f4"
        assert cai["version"] == 3
    else:
        assert not hasattr(buf, "__cuda_array_interface__")
    gpu.free(buf)


# -- CUDA: CuPy and PyTorch, where installed ------------------------------------------------


@pytest.fixture
def cuda() -> GpuBackend:
    backend = open_backend("cuda", settings=SETTINGS) if _cuda_available() else None
    if backend is None:
        pytest.skip("no CUDA device answers here")
    return backend


def _cuda_available() -> bool:
    from metrale_core import available_backends

    info = available_backends(SETTINGS).get("cuda")
    return info is not None and info.available


def test_cupy_and_metrale_share_memory(cuda: GpuBackend) -> None:
    cupy = pytest.importorskip("cupy")
    with cuda:
        buf = cuda.alloc(4096)
        cuda.memset(buf, 3)
        array = cupy.asarray(buf.view("uint8"))  # __cuda_array_interface__
        assert array.data.ptr == buf.ptr and int(array.sum()) == 3 * 4096
        array[:16] = 9  # CuPy writes, metrale reads
        cupy.cuda.runtime.deviceSynchronize()
        out = bytearray(16)
        cuda.copy_to_host(out, buf)
        assert out == b"\x09" * 16
        theirs = cupy.zeros(1024, dtype=cupy.float32)
        ext = cuda.wrap(theirs)
        assert ext.ptr == theirs.data.ptr
        cuda.memset(ext, 0xFF, nbytes=4)
        cuda.synchronize()
        assert int(theirs.view(cupy.uint32)[0]) == 0xFFFFFFFF
        cuda.unwrap(ext)
        del array
        cuda.free(buf)


def test_torch_and_metrale_share_memory(cuda: GpuBackend) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    with cuda:
        buf = cuda.alloc(1024)
        cuda.memset(buf, 1)
        tensor = torch.from_dlpack(buf.view("float32"))  # DLPack
        assert tensor.data_ptr() == buf.ptr and tensor.device.type == "cuda" and tensor.shape == (256,)
        through_cai = torch.as_tensor(buf, device="cuda")  # __cuda_array_interface__
        assert through_cai.data_ptr() == buf.ptr
        tensor.fill_(2.0)
        torch.cuda.synchronize()
        out = bytearray(4)
        cuda.copy_to_host(out, buf)
        assert np.frombuffer(out, np.float32)[0] == 2.0
        theirs = torch.zeros(64, device="cuda")
        ext = cuda.wrap(theirs)
        assert ext.ptr == theirs.data_ptr()
        cuda.memset(ext, 0, nbytes=256)
        cuda.unwrap(ext)
        del tensor, through_cai
        gc.collect()
        cuda.free(buf)


# -- DLPack 1.0: versioned, writable capsules; the legacy ones for old consumers ---------------------

_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _capsule_name(capsule: object) -> str:
    name = _get_name(capsule)
    assert isinstance(name, bytes)
    return name.decode()


def _versioned(capsule: object) -> Any:
    """The ``DLManagedTensorVersioned`` of an unconsumed versioned capsule (a view of it, not a copy)."""
    return dlpack._DLManagedTensorVersioned.from_address(_get_pointer(capsule, b"dltensor_versioned"))


def test_np_from_dlpack_is_writable_on_the_fake(fake: GpuBackend) -> None:
    """numpy >= 2.1 asks for DLPack 1.0 and marks the array read-only only when the capsule says so."""
    buf = fake.alloc(64)
    fake.memset(buf, 0)
    array = np.from_dlpack(buf)
    assert array.flags.writeable and array.shape == (64,)
    array[:3] = [5, 6, 7]  # numpy writes through DLPack, metrale reads
    typed = np.from_dlpack(buf.view("float32", (4, 4)))
    assert typed.flags.writeable and typed.dtype == np.float32
    typed[3, 3] = 2.5
    out = bytearray(64)
    fake.copy_to_host(out, buf)
    assert out[:3] == b"\x05\x06\x07" and np.frombuffer(out, np.float32)[15] == 2.5
    del array, typed
    gc.collect()
    fake.free(buf)


@pytest.mark.parametrize(
    ("max_version", "name", "version"),
    [(None, "dltensor", None), ((0, 8), "dltensor", None), ((1, 0), "dltensor_versioned", (1, 0)),
     ((1, 1), "dltensor_versioned", (1, 1)), ((1, 7), "dltensor_versioned", (1, 1)),
     ((2, 0), "dltensor_versioned", (1, 1)), ([1, 0], "dltensor_versioned", (1, 0))],
)
def test_the_capsule_is_the_form_the_consumer_asks_for(
    fake: GpuBackend, max_version: object, name: str, version: tuple[int, int] | None
) -> None:
    buf = fake.alloc(32)
    before = dlpack.live_exports()
    capsule = buf.view("float32", (2, 4)).__dlpack__(max_version=max_version)
    assert _capsule_name(capsule) == name
    if version is not None:
        managed = _versioned(capsule)
        assert (managed.version.major, managed.version.minor) == version
        assert managed.flags & dlpack.FLAG_READ_ONLY == 0, "metrale's memory is writable"
        tensor = managed.dl_tensor
        assert tensor.ndim == 2 and (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) == (2, 32, 1)
        assert list((ctypes.c_int64 * 4).from_address(tensor.shape)) == [2, 4, 4, 1]  # shape, then strides
    imported = dlpack.read_capsule(capsule)  # consumed (renamed "used_..."): the release is the consumer's now
    assert _capsule_name(capsule) == "used_" + name
    assert imported.shape == (2, 4) and imported.dtype == "float32" and imported.nbytes == 32
    assert imported.data == buf.ptr or imported.device_type == dlpack.DLPACK_CPU
    assert not imported.read_only
    del capsule
    gc.collect()
    assert dlpack.live_exports() == before + 1, "a consumed capsule's tensor lives until its deleter"
    imported.release()
    imported.release()  # a second call of the deleter finds nothing
    assert dlpack.live_exports() == before
    fake.free(buf)


@pytest.mark.parametrize("max_version", [None, (1, 0)], ids=["legacy", "versioned"])
def test_capsules_are_released_consumed_or_not(
    fake: GpuBackend, max_version: object, caplog: pytest.LogCaptureFixture
) -> None:
    buf = fake.alloc(16)
    before = dlpack.live_exports()
    capsule = buf.__dlpack__(max_version=max_version)
    assert dlpack.live_exports() == before + 1
    del capsule  # never consumed: its destructor lets the tensor go
    gc.collect()
    assert dlpack.live_exports() == before

    class Producer:  # a consumer's view of metrale: what np.from_dlpack calls
        def __dlpack__(self, **kwargs: object) -> Any:
            return buf.__dlpack__(max_version=max_version)

        def __dlpack_device__(self) -> tuple[int, int]:
            return buf.__dlpack_device__()

    array = np.from_dlpack(Producer())  # consumed by numpy: numpy calls the deleter when the array dies
    assert array.flags.writeable == (max_version is not None)  # numpy takes a legacy capsule as read-only
    assert dlpack.live_exports() == before + 1
    del array
    gc.collect()
    assert dlpack.live_exports() == before
    with caplog.at_level(logging.WARNING, logger="metrale"):
        fake.free(buf)
    assert not [r for r in caplog.records if "still hold" in r.getMessage()], "every tensor was released"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"max_version": "1.0"}, "max_version"), ({"max_version": (1,)}, "max_version"),
     ({"max_version": (1, "0")}, "max_version"), ({"max_version": (-1, 0)}, "max_version"),
     ({"max_version": 1}, "max_version"), ({"stream": 0}, "stream"), ({"stream": True}, "stream"),
     ({"stream": 1.0}, "stream"), ({"stream": "1"}, "stream"), ({"stream": 1 << 64}, "stream"),
     ({"stream": -2}, "stream"), ({"copy": "yes"}, "copy"), ({"copy": 0}, "copy")],
)
def test_malformed_dlpack_arguments_are_invalid_arguments(
    fake: GpuBackend, kwargs: dict[str, object], needle: str
) -> None:
    buf = fake.alloc(16)
    before = dlpack.live_exports()
    with pytest.raises(InvalidArgumentError, match=f"__dlpack__: {needle}"):
        buf.__dlpack__(**kwargs)
    with pytest.raises(BufferError, match="without copying"):
        buf.__dlpack__(copy=True)  # the protocol's refusal: metrale exports in place
    assert dlpack.live_exports() == before
    assert np.from_dlpack(buf.view(), copy=False).nbytes == 16  # nothing held back by the refusals
    fake.free(buf)


def test_an_export_with_a_stream_is_refused_during_a_capture(fake: GpuBackend) -> None:
    buf = fake.alloc(16)
    stream = fake.create_stream()
    fake.begin_capture(stream)
    with pytest.raises(CaptureError, match="__dlpack__"):
        buf.__dlpack__(stream=5)
    with pytest.raises(CaptureError, match="invalidated"):  # as every barred call, it invalidates the capture
        fake.end_capture(stream)
    stream.close()
    fake.free(buf)


# -- the consumer's stream: ordered on the device, not waited for on the host ------------------------


@pytest.fixture
def tracing() -> Iterator[GpuBackend]:
    """The tracing example over a fake that defers stream work until it must run (as a GPU would)."""
    pytest.importorskip("metrale_tracing")
    with open_backend("tracing", settings=SETTINGS.updated(fake_defer=True, redzone=0)) as gpu:
        yield gpu


def _calls_during(gpu: GpuBackend, fn: Callable[[], object]) -> tuple[object, list[str]]:
    before = len(gpu.raw_calls())  # type: ignore[attr-defined]
    result = fn()
    return result, gpu.raw_calls()[before:]  # type: ignore[attr-defined]


def _bytes_of(capsule: object) -> bytes:
    """What a consumer reads through ``capsule`` right now (it consumes and releases the capsule)."""
    imported = dlpack.read_capsule(capsule)
    try:
        return ctypes.string_at(imported.data, imported.nbytes)
    finally:
        imported.release()


def test_a_consumer_stream_is_ordered_after_the_work_not_waited_for(tracing: GpuBackend) -> None:
    buf = tracing.alloc(4096)
    tracing.memset(buf, 0)
    tracing.synchronize()
    stream = tracing.create_stream()
    tracing.memset(buf, 7, stream=stream)  # queued on a metrale stream; not run yet
    capsule, calls = _calls_during(tracing, lambda: buf.__dlpack__(stream=0x7F00_1234_5600, max_version=(1, 0)))
    assert "order_foreign_stream" in calls, calls
    assert not {"synchronize", "stream_synchronize", "event_synchronize"} & set(calls), calls
    assert _bytes_of(capsule) == b"\x07" * 4096, "the consumer's work runs after metrale's"
    stream.close()
    tracing.free(buf)


def test_no_stream_waits_and_minus_one_does_not_synchronize(tracing: GpuBackend) -> None:
    buf = tracing.alloc(64)
    tracing.memset(buf, 0)
    tracing.synchronize()
    tracing.memset(buf, 1)  # queued
    capsule, calls = _calls_during(tracing, lambda: buf.__dlpack__(stream=-1))
    assert not {"synchronize", "order_foreign_stream"} & set(calls), calls
    assert _bytes_of(capsule) == bytes(64), "stream=-1: the consumer asked for no synchronization"
    capsule, calls = _calls_during(tracing, buf.__dlpack__)
    assert "synchronize" in calls and "order_foreign_stream" not in calls, calls  # stream=None: the host waits
    assert _bytes_of(capsule) == b"\x01" * 64
    tracing.free(buf)


def test_a_backend_that_orders_no_streams_waits_instead(tracing: GpuBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(stream: int) -> None:
        raise error_for_code("CUDA_ERROR_NOT_SUPPORTED", "this backend orders no foreign streams")

    monkeypatch.setattr(tracing.raw.inner, "order_foreign_stream", refuse)  # type: ignore[attr-defined]
    buf = tracing.alloc(64)
    tracing.memset(buf, 3)
    for _ in range(2):  # the second export knows: it does not ask again
        capsule, calls = _calls_during(tracing, lambda: buf.__dlpack__(stream=2))
        assert "synchronize" in calls, calls
        assert _bytes_of(capsule) == b"\x03" * 64
    assert calls.count("order_foreign_stream") == 0
    tracing.free(buf)


# -- bfloat16 and the float8 types, through ml_dtypes --------------------------------------------------

_ML_CODES = {
    "bfloat16": (4, 16), "float8_e3m4": (7, 8), "float8_e4m3": (8, 8), "float8_e4m3b11fnuz": (9, 8),
    "float8_e4m3fn": (10, 8), "float8_e4m3fnuz": (11, 8), "float8_e5m2": (12, 8), "float8_e5m2fnuz": (13, 8),
    "float8_e8m0fnu": (14, 8),
}


@pytest.mark.parametrize("name", sorted(_ML_CODES))
def test_bfloat16_and_float8_views_through_ml_dtypes(fake: GpuBackend, name: str) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    kind = getattr(ml_dtypes, name)
    buf = fake.alloc(64)
    fake.memset(buf, 0)
    size = _ML_CODES[name][1] // 8
    for dtype in (name, kind, np.dtype(kind)):  # a name, ml_dtypes' scalar type, numpy's dtype
        view = buf.view(dtype, (4, 8 // size))
        assert view.dtype == name and view.itemsize == size and view.nbytes == 32
    values = np.arange(8, dtype=np.float32).astype(kind)
    array = np.asarray(buf.view(name, (8,)))  # on the fake: numpy over the same memory
    assert array.dtype == np.dtype(kind)
    array[:] = values
    out = bytearray(8 * size)
    fake.copy_to_host(out, buf)
    assert bytes(out) == values.tobytes()
    capsule = buf.view(name, (8,)).__dlpack__(max_version=(1, 0))
    tensor = _versioned(capsule).dl_tensor
    assert (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) == (*_ML_CODES[name], 1)
    assert dlpack.read_capsule(capsule).dtype == name  # and metrale reads the code back
    del array, capsule
    gc.collect()
    fake.free(buf)


def test_without_ml_dtypes_the_view_says_how_to_install_it(fake: GpuBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes now raises ImportError
    buf = fake.alloc(16)
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        with pytest.raises(InvalidArgumentError, match=r"pip install 'ml-dtypes>=0.5'"):
            buf.view(name)
    assert buf.view("float16").nbytes == 16  # numpy's own types need nothing more
    fake.free(buf)


def test_an_ml_dtypes_without_a_float8_type_is_an_invalid_argument(
    fake: GpuBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ml_dtypes 0.4 has no float8_e3m4, float8_e4m3 or float8_e8m0fnu."""
    import types

    old = types.ModuleType("ml_dtypes")
    monkeypatch.setitem(sys.modules, "ml_dtypes", old)
    buf = fake.alloc(16)
    with pytest.raises(InvalidArgumentError, match=r"came in 0.5.*ml-dtypes>=0.5"):
        buf.view("float8_e3m4")
    fake.free(buf)


def test_a_consumer_that_refuses_a_capsule_keeps_its_error_and_releases_it(fake: GpuBackend) -> None:
    """numpy drops a capsule of a dtype it does not know with its own exception pending: the exception
    reaches the caller as numpy raised it (no SystemError) and the export is let go. (numpy 2.5.2 on the GPU
    machine took the capsule: then the export lives as long as the array.)"""
    pytest.importorskip("ml_dtypes")
    buf = fake.alloc(64)
    before = dlpack.live_exports()
    try:
        taken = np.from_dlpack(buf.view("bfloat16"))
    except Exception as exc:  # whatever numpy raises, as long as it is not SystemError
        assert not isinstance(exc, SystemError), exc
    else:
        assert taken.dtype.itemsize == 2 and taken.size == 32
        del taken
    gc.collect()
    assert dlpack.live_exports() == before
    fake.free(buf)


@pytest.mark.parametrize("form", ["class attribute", "cycle"])
def test_exports_alive_at_interpreter_exit_do_not_crash_it(form: str, tmp_path: Path) -> None:
    """A capsule or a consumer's array collected in the interpreter's final collection, after module globals
    are gone, must not call freed code."""
    hold = (
        "class Holder:\n    cap = buf.__dlpack__()\n" if form == "class attribute"
        else "h = type('H', (), {})()\nh.me = h\nh.arr = np.from_dlpack(buf)\n"
    )
    script = tmp_path / "exit.py"
    script.write_text(
        "import numpy as np\nfrom metrale_core import open_backend\n"
        "gpu = open_backend('fake')\nbuf = gpu.alloc(64)\n" + hold + "print('ok')\n"
    )
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_a_refused_dl_device_waits_for_nothing_and_records_nothing(
    tracing: GpuBackend, caplog: pytest.LogCaptureFixture
) -> None:
    buf = tracing.alloc(64)
    for kwargs in ({"dl_device": (2, 0)}, {"stream": 0x7F00_1234_5600, "dl_device": (2, 0)}):
        def refused(kwargs: dict[str, object] = kwargs) -> None:
            with pytest.raises(BufferError):
                buf.__dlpack__(**kwargs)

        _, calls = _calls_during(tracing, refused)
        assert not {"synchronize", "order_foreign_stream"} & set(calls), (kwargs, calls)  # asked where, no more
    with caplog.at_level(logging.WARNING, logger="metrale"):
        tracing.free(buf)
    assert not [r for r in caplog.records if "still hold" in r.getMessage()], "a refused export recorded a view"


@pytest.mark.parametrize("argument", ["max_version", "dl_device"])
def test_an_endless_iterator_is_refused_not_run(fake: GpuBackend, argument: str) -> None:
    buf = fake.alloc(16)
    with pytest.raises(InvalidArgumentError, match=argument):
        buf.__dlpack__(**{argument: itertools.count()})
    fake.free(buf)


@pytest.mark.parametrize("pair", [(1.0, 0.0), (1.0, 0), (1, 0.0), (np.float64(1), 0)], ids=str)
def test_max_version_and_dl_device_refuse_non_integers_alike(gpu: GpuBackend, pair: tuple[object, object]) -> None:
    """issue 37 item 11: interop.md says both must be pairs of integers; (1.0, 0.0) equals (1, 0), and was
    taken as a max_version while refused as a dl_device."""
    buf = gpu.alloc(16)
    before = dlpack.live_exports()
    for argument in ("max_version", "dl_device"):
        with pytest.raises(InvalidArgumentError, match=f"__dlpack__: {argument} must be .* pair of integers"):
            buf.__dlpack__(**{argument: pair})
    assert dlpack.live_exports() == before
    gpu.free(buf)


@pytest.mark.needs("interop")
def test_a_bfloat16_view_exports_and_wraps_back(gpu: GpuBackend) -> None:
    pytest.importorskip("ml_dtypes")
    buf = gpu.alloc(256)
    gpu.memset(buf, 0x11)
    view = buf.view("bfloat16", (8, 16))
    if gpu.name == "cuda":  # the CUDA array interface has no type string for it: DLPack only
        assert not hasattr(view, "__cuda_array_interface__")
    ext = gpu.wrap(view)  # through DLPack, versioned: kDLBfloat read back
    assert ext.nbytes == 256
    gpu.memset(ext, 0x22, nbytes=2)
    out = bytearray(4)
    gpu.copy_to_host(out, buf)
    assert out == b"\x22\x22\x11\x11"
    gpu.unwrap(ext)
    gpu.free(buf)


# -- taking theirs in: versioned capsules, the read-only flag, old producers ---------------------------


def test_wrap_refuses_a_read_only_dlpack_tensor(fake: GpuBackend) -> None:
    array = np.zeros(64, np.uint8)
    before = dlpack.live_exports()

    class ReadOnly:
        def __dlpack__(self, **kwargs: object) -> object:
            return dlpack.make_capsule(
                array.ctypes.data, (64,), "uint8", dlpack.DLPACK_CPU, 0, array, version=(1, 0), read_only=True
            )

        def __dlpack_device__(self) -> tuple[int, int]:
            return (1, 0)

    with pytest.raises(InvalidArgumentError, match="read-only"):
        fake.wrap(ReadOnly())
    gc.collect()
    assert dlpack.live_exports() == before, "the refused tensor was given back"


def test_wrap_takes_a_producer_that_knows_no_max_version(fake: GpuBackend) -> None:
    array = np.zeros(16, np.float32)

    class Old:  # DLPack before 1.0: __dlpack__(stream=None) only
        def __dlpack__(self, stream: object = None) -> object:
            return dlpack.make_capsule(array.ctypes.data, (16,), "float32", dlpack.DLPACK_CPU, 0, array)

        def __dlpack_device__(self) -> tuple[int, int]:
            return (1, 0)

    ext = fake.wrap(Old())
    fake.memset(ext, 0xFF, nbytes=4)
    assert np.isnan(array[0]) and array[1] == 0
    fake.unwrap(ext)


# -- CUDA: a consumer's stream ordered by an event, no device-wide wait (the H200) ----------------------


class _DriverSpy:
    """Counts metrale's own driver calls (``metrale_cuda``'s ``drv``) while it is on: the waits that would
    hold the host, and the stream waits that order the consumer's stream."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from metrale_cuda._driver import drv  # the bindings' driver module, whose functions metrale calls

        self.on = False
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        for name in ("cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize", "cuStreamWaitEvent"):
            monkeypatch.setattr(drv, name, self._spy(name, getattr(drv, name)))

    def _spy(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def spy(*args: object) -> Any:
            if self.on:
                self.calls.append((name, args))
            return real(*args)

        return spy

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


#: Work long enough to be still running when the export returns: 160 memsets of 1 GiB (about 55 ms on an H100).
_LONG_BYTES = 1 << 30
_LONG_ROUNDS = 160


def _queue_long_work(gpu: GpuBackend, stream: Any) -> tuple[Any, int]:
    buf = gpu.alloc(_LONG_BYTES)
    gpu.memset(buf, 0)
    gpu.synchronize()
    for value in range(1, _LONG_ROUNDS + 1):
        gpu.memset(buf, value, stream=stream)
    return buf, _LONG_ROUNDS


def test_torch_reads_on_its_stream_after_metrale_work_without_a_device_wait(
    cuda: GpuBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    with cuda:
        consumer = torch.cuda.Stream()  # torch's own start-up first: it outlasted 48 memsets on the H100
        torch.zeros(1, device="cuda").sum().item()
        spy = _DriverSpy(monkeypatch)
        stream = cuda.create_stream()
        buf, last = _queue_long_work(cuda, stream)
        with torch.cuda.stream(consumer):
            spy.on = True
            tensor = torch.from_dlpack(buf.view("uint8"))  # torch passes its current stream: consumer's
            spy.on = False
            busy = not stream.query()  # metrale's memsets still run: the export did not wait for them
            low, high = torch.aminmax(tensor)  # read on the consumer's stream
        consumer.synchronize()
        assert (int(low), int(high)) == (last, last), "the consumer's read ran after metrale's writes"
        assert busy, "metrale's stream was idle when the export returned: no proof it did not wait"
        assert not {"cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize"} & set(spy.names()), spy.calls
        waited = [int(args[0]) for name, args in spy.calls if name == "cuStreamWaitEvent"]
        assert waited and set(waited) == {consumer.cuda_stream}, (waited, consumer.cuda_stream)
        assert tensor.data_ptr() == buf.ptr and tensor.numel() == _LONG_BYTES
        del tensor
        gc.collect()
        stream.close()
        cuda.free(buf)


def test_cupy_reads_on_its_stream_after_metrale_work_without_a_device_wait(
    cuda: GpuBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    cupy = pytest.importorskip("cupy")
    with cuda:
        spy = _DriverSpy(monkeypatch)
        stream = cuda.create_stream()
        buf, last = _queue_long_work(cuda, stream)
        consumer = cupy.cuda.Stream(non_blocking=True)
        with consumer:
            spy.on = True
            array = cupy.from_dlpack(buf.view("uint8"))  # CuPy passes its current stream: consumer's
            spy.on = False
            busy = not stream.query()
            low, high = array.min(), array.max()  # read on the consumer's stream
        consumer.synchronize()
        assert (int(low), int(high)) == (last, last), "the consumer's read ran after metrale's writes"
        assert busy, "metrale's stream was idle when the export returned: no proof it did not wait"
        assert not {"cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize"} & set(spy.names()), spy.calls
        waited = [int(args[0]) for name, args in spy.calls if name == "cuStreamWaitEvent"]
        assert waited and set(waited) == {consumer.ptr}, (waited, consumer.ptr)
        assert array.data.ptr == buf.ptr
        del array
        gc.collect()
        stream.close()
        cuda.free(buf)


def test_work_of_a_closed_stream_is_ordered_too(cuda: GpuBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream closed with work still running leaves that work to be ordered before the consumer's stream."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    with cuda:
        spy = _DriverSpy(monkeypatch)
        stream = cuda.create_stream()
        buf, last = _queue_long_work(cuda, stream)
        stream.close()  # destroyed while its memsets run
        consumer = torch.cuda.Stream()
        with torch.cuda.stream(consumer):
            spy.on = True
            tensor = torch.from_dlpack(buf.view("uint8"))
            spy.on = False
            low, high = torch.aminmax(tensor)
        consumer.synchronize()
        assert (int(low), int(high)) == (last, last)
        assert not {"cuCtxSynchronize", "cuStreamSynchronize"} & set(spy.names()), spy.calls
        del tensor
        gc.collect()
        cuda.free(buf)


def test_torch_takes_bfloat16_and_float8_views(cuda: GpuBackend) -> None:
    torch = pytest.importorskip("torch")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    with cuda:
        buf = cuda.alloc(64)
        values = np.array([0.5, 1.5, -2.0, 3.0] * 8, dtype=ml_dtypes.bfloat16)
        cuda.copy_to_device(buf, values.tobytes())
        tensor = torch.from_dlpack(buf.view("bfloat16"))
        assert tensor.dtype == torch.bfloat16 and tensor.shape == (32,) and tensor.data_ptr() == buf.ptr
        assert tensor[:4].tolist() == [0.5, 1.5, -2.0, 3.0]
        cai = buf.view("float32").__cuda_array_interface__
        assert cai["stream"] is None  # the CUDA array interface waited: nothing to synchronize with
        unsupported = []
        for name, kind in (("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2")):
            try:
                fp8 = torch.from_dlpack(buf.view(name, (16,)))
            except Exception as exc:  # a torch without DLPack's float8 codes
                unsupported.append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            assert fp8.dtype == getattr(torch, kind) and fp8.data_ptr() == buf.ptr
            del fp8
        del tensor
        gc.collect()
        cuda.free(buf)
        if unsupported:
            pytest.skip(f"this torch ({torch.__version__}) takes no float8 DLPack tensors: {unsupported}")
