"""Interop: metrale's buffers seen by numpy, CuPy and PyTorch without a copy, and theirs wrapped by metrale.

The fake's device memory is host memory, so numpy reads and writes it in place (``__array__``,
DLPack on the CPU). On CUDA, CuPy and PyTorch take the CUDA array interface and DLPack; those
tests run where the libraries and a GPU are (the H200 test machine has both).
"""

from __future__ import annotations

import gc
import logging

import numpy as np
import pytest

from conftest import SETTINGS
from metrale_core import DeviceArray, GpuBackend, InvalidArgumentError, InvalidBufferError, open_backend

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
