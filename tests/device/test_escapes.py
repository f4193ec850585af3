"""Nothing escapes (issue 14, items 6 and 7): bad arguments to ``preflight``, ``save_snapshot`` and ``view``
get a typed ``MetraleError``, never a raw ``AttributeError``/``TypeError``, and change nothing."""

from __future__ import annotations

import collections.abc
import decimal
import fractions
import os
from pathlib import Path

import numpy as np
import pytest

from metrale_core import GpuBackend, InvalidArgumentError, SnapshotError
from metrale_core.kernels import shipped_modules


def _id(value: object) -> str:
    """A test id that is the same on every run (no addresses)."""
    text = repr(value)
    return type(value).__name__ if " at 0x" in text else text


# -- preflight: a mapping of module names to PTX images, nothing else --------------------------------


class _NotAMapping:
    def items(self) -> list[tuple[str, bytes]]:
        return [("vector", b".target sm_75")]


@pytest.mark.parametrize(
    "images",
    [
        None,
        [b"x"],
        b".target sm_75",
        ".target sm_75",
        ("vector", b".target sm_75"),
        5,
        _NotAMapping(),
        {1: b".target sm_75"},
        {"vector": None},
        {"vector": 5},
        {"vector": [b".target sm_75"]},
        {b"vector": b".target sm_75"},
    ],
    ids=["None", "list", "bytes", "str", "tuple", "int", "items-only", "int-name", "None-image", "int-image",
         "list-image", "bytes-name"],
)
def test_preflight_refuses_what_is_not_a_mapping_of_ptx(gpu: GpuBackend, images: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"preflight: expected .*mapping.*, got") as info:
        gpu.preflight(images)  # type: ignore[arg-type]
    assert type(info.value) is InvalidArgumentError


@pytest.mark.needs("kernels")
def test_preflight_takes_bytes_bytearray_and_str_and_names_itself(gpu: GpuBackend) -> None:
    vector = shipped_modules("vector")["vector"]
    gpu.preflight({"a": vector, "b": bytearray(vector), "c": vector.decode()})
    gpu.preflight({})  # nothing to check
    with pytest.raises(InvalidArgumentError, match="module 'junk' is not a PTX image"):
        gpu.preflight({"junk": b"not ptx"})
    major, _ = gpu.compute_capability()
    newer = vector.replace(b".target sm_75", f".target sm_{major + 1}0".encode())
    with pytest.raises(InvalidArgumentError, match=r"^preflight: .* cannot run newer"):
        gpu.preflight({"newer": newer})


# -- save_snapshot: a path, and no temporary file left behind ------------------------------------------


class _BytesPath:
    def __fspath__(self) -> bytes:
        return b"snapshot.json"


class _BrokenPath:
    def __fspath__(self) -> str:
        raise RuntimeError("no path today")


@pytest.mark.parametrize(
    "path",
    [None, 5, 2.5, b"snapshot.json", ["snapshot.json"], object(), _BytesPath(), _BrokenPath(), "snap\x00shot.json"],
    ids=["None", "int", "float", "bytes", "list", "object", "bytes-pathlike", "broken-pathlike", "nul"],
)
def test_save_snapshot_refuses_what_is_not_a_path(
    gpu: GpuBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: object
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"save_snapshot: expected a path \(str or os.PathLike\)"):
        gpu.save_snapshot(path)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


def _unwritable(tmp_path: Path) -> list[Path]:
    folder = tmp_path / "a-folder"
    folder.mkdir()
    full = tmp_path / "full"
    full.mkdir()
    (full / "inside").write_text("x")
    return [folder, full, tmp_path / "missing" / "s.json", tmp_path / "a-file" / "s.json"]


@pytest.mark.parametrize("case", range(4), ids=["empty-folder", "full-folder", "missing-folder", "under-a-file"])
def test_a_failed_save_snapshot_leaves_nothing_behind(gpu: GpuBackend, tmp_path: Path, case: int) -> None:
    (tmp_path / "a-file").write_text("keep me")
    path = _unwritable(tmp_path)[case]
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    buf = gpu.alloc(64)
    with pytest.raises(SnapshotError, match="cannot write the memory snapshot") as info:
        gpu.save_snapshot(path)
    assert info.value.path == str(path) and str(path) in str(info.value)
    after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert after == before, "a temporary file was left behind"
    assert (tmp_path / "a-file").read_text() == "keep me"
    saved = gpu.save_snapshot(tmp_path / "ok.json")  # the backend is unharmed
    assert saved == tmp_path / "ok.json" and saved.read_text().startswith("{")
    gpu.free(buf)


def test_save_snapshot_over_an_old_one_replaces_it_and_leaves_no_temporary(gpu: GpuBackend, tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text("old")
    assert gpu.save_snapshot(str(path)) == path
    assert path.read_text().startswith("{") and os.listdir(tmp_path) == ["s.json"]


# -- view: a shape is an integer or a sequence of integers; a dtype is one metrale exports --------------


class _BrokenSequence(collections.abc.Sequence[int]):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: object) -> int:  # type: ignore[override]
        raise RuntimeError("no shape today")


class _BrokenDtype:
    @property
    def name(self) -> str:
        raise RuntimeError("no name today")


@pytest.mark.parametrize(
    "shape",
    [
        "12", b"12", bytearray(b"12"), "", ("3",), (b"3",), 2.0, (2.0,), (2, 1.0), (None,), (2, None),
        ((2, 3),), [[2]], True, (True, 2), (2, False), -1, (-1,), (2, -3), {2: 1}, {2}, frozenset({2}),
        decimal.Decimal(4), (decimal.Decimal(4),), (fractions.Fraction(4),), (np.float32(2.0),), np.float64(2.0),
        object(), iter([2]), 1j, (1,) * 65, range(10**12), _BrokenSequence(),
    ],
    ids=_id,
)
def test_view_refuses_shapes_that_are_not_integers(gpu: GpuBackend, shape: object) -> None:
    buf = gpu.alloc(64)
    with pytest.raises(InvalidArgumentError, match=r"view: shape must be an integer or a tuple of integers >= 0 "):
        buf.view("uint8", shape)
    gpu.free(buf)


@pytest.mark.parametrize(
    ("shape", "dims"),
    [(4, (4,)), (np.int64(4), (4,)), ((2, 2), (2, 2)), ([2, 2], (2, 2)), ((np.uint8(2), 8), (2, 8)), ((), ()),
     ((0,), (0,)), ((16, 0, 5), (16, 0, 5))],
    ids=_id,
)
def test_view_takes_integer_shapes(gpu: GpuBackend, shape: object, dims: tuple[int, ...]) -> None:
    buf = gpu.alloc(64)
    view = buf.view("float32", shape)
    assert view.shape == dims and all(type(d) is int for d in view.shape)
    gpu.free(buf)


@pytest.mark.parametrize(
    "dtype",
    [None, "complex64", "float", "", b"uint8", 5, object(), np.dtype(">f4"), np.dtype(">i8"), np.dtype([("a", "f4")]),
     np.dtype("U4"), float, _BrokenDtype()],
    ids=_id,
)
def test_view_refuses_dtypes_it_does_not_export(gpu: GpuBackend, dtype: object) -> None:
    buf = gpu.alloc(64)
    with pytest.raises(InvalidArgumentError, match=r"view: dtype .* is not one metrale exports"):
        buf.view(dtype)
    gpu.free(buf)


def test_view_takes_numpy_dtypes_of_native_order(gpu: GpuBackend) -> None:
    buf = gpu.alloc(64)
    assert buf.view(np.dtype("<f4")).dtype == "float32" and buf.view(np.int16).dtype == "int16"
    assert buf.view(np.dtype("|u1")).dtype == "uint8" and buf.view(np.dtype("=u8")).dtype == "uint64"
    gpu.free(buf)


def test_array_of_a_view_refuses_a_bad_dtype(fake: GpuBackend) -> None:
    buf = fake.alloc(16)
    view = buf.view("uint8")
    with pytest.raises(InvalidArgumentError, match=r"__array__: dtype 'junk'"):
        view.__array__("junk")
    assert view.__array__("float32").dtype == np.float32
    fake.free(buf)


@pytest.mark.parametrize("dl_device", [5, "cpu", (1,), (1, 0, 0), (1.0, 0), (None, 0), ("1", "0")], ids=_id)
def test_dlpack_of_a_view_refuses_a_dl_device_that_is_not_a_pair(fake: GpuBackend, dl_device: object) -> None:
    buf = fake.alloc(16)
    with pytest.raises(InvalidArgumentError, match=r"__dlpack__: dl_device must be a \(device type, device id\) pair"):
        buf.view().__dlpack__(dl_device=dl_device)
    with pytest.raises(BufferError, match="DLPack device"):
        buf.view().__dlpack__(dl_device=(2, 0))  # a pair, of another device: the protocol's BufferError
    assert np.from_dlpack(buf.view()).nbytes == 16  # nothing held back by the refusals
    fake.free(buf)
