"""The fake's tensor maps: the 128-byte image (a deterministic packing of the encoding and the address) and the
Tensor Memory Accelerator's tile copies, in numpy, for fake kernel implementations
([`FakeLaunch`][metrale_fake.FakeLaunch]).

A fake image is not the driver's: kernels on the fake never read it (their implementations get the
[`TensorMap`][metrale_core.TensorMap] itself), only
[`FakeDevice.tensor_map_replace_address`][metrale_fake.FakeDevice.tensor_map_replace_address] does.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from metrale_core import TENSOR_MAP_DTYPES, TensorMapSpec
from metrale_core.plugin import TensorMap, TensorMapEncoding, error_for_code

__all__ = ["NAN_BITS", "decode_image", "encode_image", "tma_load", "tma_store"]

_MAGIC: Final = b"MFTM"
#: magic, version, data type, rank, interleave, swizzle, L2 promotion, OOB fill, a pad byte; the address; five
#: global dimensions, four global strides (u64); five box dimensions (u16); five element strides (u8)
_LAYOUT: Final = struct.Struct("<4s8BQ5Q4Q5H5B")
_VERSION: Final = 1
_RANK_MAX: Final = 5

#: The numpy type a tile of each data type is read as (``bfloat16`` as its 16 bits).
_NUMPY: Final[dict[str, type[np.generic]]] = {
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "uint64": np.uint64,
    "int64": np.int64, "float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": np.uint16,
    "float32_ftz": np.float32, "tfloat32": np.float32, "tfloat32_ftz": np.float32,
}
#: The bits of the NaN an out-of-bounds element gets with ``oob_fill="nan"``, by element size: the 16-bit word
#: ``0x7FF7`` over the whole element, a NaN in every float format (as the H200's TMA writes it: seen for 2-, 4- and
#: 8-byte elements).
NAN_BITS: Final = {2: 0x7FF7, 4: 0x7FF77FF7, 8: 0x7FF77FF77FF77FF7}


def encode_image(encoding: TensorMapEncoding, address: int) -> bytes:
    """The fake's 128 bytes for ``encoding`` at ``address`` (already checked as the driver checks)."""
    e = encoding

    def pad(values: Sequence[int], n: int) -> list[int]:
        return [*values, *([0] * (n - len(values)))]

    packed = _LAYOUT.pack(
        _MAGIC, _VERSION, e.data_type, e.rank, e.interleave, e.swizzle, e.l2_promotion, e.oob_fill, 0, address,
        *pad(e.global_dim, 5), *pad(e.global_strides, 4), *pad(e.box_dim, 5), *pad(e.element_strides, 5),
    )
    return packed.ljust(128, b"\0")


def decode_image(image: bytes) -> tuple[TensorMapEncoding, int]:
    """``(encoding, address)`` of a fake image; anything else is ``CUDA_ERROR_INVALID_VALUE``."""
    if len(image) != 128 or image[:4] != _MAGIC:
        raise error_for_code("CUDA_ERROR_INVALID_VALUE", "tensor map: not a tensor map of the fake backend")
    fields = _LAYOUT.unpack(image[: _LAYOUT.size])
    _, _, data_type, rank, interleave, swizzle, l2, oob, _, address = fields[:10]
    dims, strides, box, every = fields[10:15], fields[15:19], fields[19:24], fields[24:29]
    return TensorMapEncoding(
        data_type=data_type, rank=rank, global_dim=tuple(dims[:rank]), global_strides=tuple(strides[: rank - 1]),
        box_dim=tuple(box[:rank]), element_strides=tuple(every[:rank]), interleave=interleave, swizzle=swizzle,
        l2_promotion=l2, oob_fill=oob,
    ), address


def _unsupported(spec: TensorMapSpec) -> None:
    if spec.interleave != "none":
        raise ValueError(f"the fake's TMA copies tiles of interleave 'none' only, not {spec.interleave!r}")


def _plan(
    tmap: TensorMap, coords: Sequence[int]
) -> tuple[tuple[int, ...], np.ndarray, np.ndarray, type[np.generic], int]:
    """The tile's shape, each element's byte offset from the tensor's start, which elements lie inside the
    tensor, the numpy type and the element size."""
    spec = tmap.spec
    _unsupported(spec)
    if len(coords) != spec.rank:
        raise ValueError(f"a {spec.rank}-dimensional tensor map takes {spec.rank} coordinates, got {len(coords)}")
    every = [*spec.element_strides[:-1], 1]  # the TMA ignores the innermost element stride (seen on the H200)
    axes = [int(c) + np.arange(0, b, e, dtype=np.int64) for c, b, e in zip(coords, spec.box, every, strict=True)]
    grids = np.meshgrid(*axes, indexing="ij")
    inside = np.ones(grids[0].shape, dtype=bool)
    offsets = np.zeros(grids[0].shape, dtype=np.int64)
    for grid, dim, stride in zip(grids, spec.shape, spec.strides, strict=True):
        inside &= (grid >= 0) & (grid < dim)
        offsets += grid * stride
    return grids[0].shape, offsets, inside, _NUMPY[spec.dtype], TENSOR_MAP_DTYPES[spec.dtype]


def _bytes_at(read: Callable[[int, int], np.ndarray], address: int, offsets: np.ndarray, size: int) -> tuple[
    np.ndarray, np.ndarray
]:
    """A byte view of device memory covering ``offsets`` from ``address``, and the byte index of each element."""
    lo, hi = int(offsets.min()), int(offsets.max()) + size
    memory = read(address + lo, hi - lo)
    return memory, (offsets - lo)[:, None] + np.arange(size, dtype=np.int64)


#: Per swizzle mode, the bits of a shared-memory byte offset that pick its 16-byte chunk and are XORed with the
#: bits three places above them (CUTLASS's ``Swizzle<B, 4, 3>``: B = 1, 2, 3 for the 32-, 64- and 128-byte modes).
_SWIZZLE_BITS: Final = {"none": 0, "32b": 0x10, "64b": 0x30, "128b": 0x70}


def _layout(spec: TensorMapSpec) -> tuple[tuple[int, ...], np.ndarray | None]:
    """How a box of ``spec`` lies in shared memory: its shape there (the tile's, each innermost row padded to
    the swizzle's span: ``spec.shared_bytes`` in all) and, with a swizzle, where each byte of that row-major
    image goes (``None``: nowhere else). The tile starts at a 1024-byte boundary, as the shipped kernel's
    shared memory does."""
    bits = _SWIZZLE_BITS.get(spec.swizzle)
    if bits is None:
        raise ValueError(f"the fake's TMA has no model of swizzle {spec.swizzle!r}")
    *outer, _ = spec.tile_shape
    shape = (*outer, spec.shared_bytes // (math.prod(outer) * spec.itemsize))
    if not bits:
        return shape, None
    offsets = np.arange(spec.shared_bytes, dtype=np.int64)
    return shape, offsets ^ ((offsets >> 3) & bits)  # (only bits 4-6 change: a byte stays in its span)



def tma_load(read: Callable[[int, int], np.ndarray], tmap: TensorMap, coords: Sequence[int]) -> np.ndarray:
    """The box of ``tmap`` at element ``coords`` (outermost first), as the TMA brings it to shared memory:
    ``tile_shape`` elements, those outside the tensor filled with zero or NaN as ``oob_fill`` says, laid out in
    the array's memory as the TMA lays them out in shared memory: row-major without a swizzle; with one, each
    innermost row padded to the swizzle's span (the array's last dimension is then the span's elements, the
    padding zero) and each 16-byte chunk moved within it, so a tile loaded with one swizzle and stored with
    another comes out permuted, as on a GPU. Its ``nbytes`` is ``spec.shared_bytes``."""
    shape, offsets, inside, dtype, size = _plan(tmap, coords)
    tile = np.zeros(shape, dtype=dtype)
    if tmap.spec.oob_fill == "nan":
        tile.view(f"u{size}")[...] = NAN_BITS[size]
    if inside.any():
        memory, index = _bytes_at(read, tmap.address, offsets[inside], size)
        tile[inside] = memory[index].reshape(-1).view(dtype)
    smem_shape, where = _layout(tmap.spec)
    if where is None:
        return tile
    rows = np.zeros(smem_shape, dtype=dtype)
    rows[..., : shape[-1]] = tile
    smem = np.empty(rows.nbytes, dtype=np.uint8)
    smem[where] = rows.reshape(-1).view(np.uint8)
    return smem.view(dtype).reshape(smem_shape)


def tma_store(
    read: Callable[[int, int], np.ndarray], tmap: TensorMap, coords: Sequence[int], tile: np.ndarray
) -> None:
    """Write the box of ``tmap`` at ``coords`` from ``tile``, shared memory from the tile's start (as
    `tma_load` lays a box out; its bytes are read as this map's layout says, so they may come from a load
    through another map), as the TMA stores: elements outside the tensor are not written. Fewer bytes than
    ``spec.shared_bytes`` are a read past the kernel's shared memory (``ValueError``: a fault). ``tile`` is
    either that shared memory as bytes (``uint8``) or an array of the map's element type in native byte
    order (as `tma_load` returns it, or ml_dtypes' ``bfloat16`` for a ``bfloat16`` map); another element
    type is a mistake of the implementation, refused (``TypeError``: the launch fails) rather than silently
    reinterpreted: view it as ``uint8`` to store its bytes as they are."""
    shape, offsets, inside, dtype, size = _plan(tmap, coords)
    given = np.asarray(tile)
    own = given.dtype.isnative and given.dtype.name == tmap.spec.dtype  # ml_dtypes' bfloat16
    if given.dtype not in (np.dtype(np.uint8), np.dtype(dtype)) and not own:
        wanted = "ml_dtypes.bfloat16" if tmap.spec.dtype == "bfloat16" else np.dtype(dtype).name
        order = "" if given.dtype.isnative else f" (byte order {given.dtype.byteorder!r})"
        raise TypeError(f"a tile of {given.dtype}{order} stored through a {tmap.spec.dtype} tensor map:"
                        f" give {wanted} elements in native byte order, or the shared memory's bytes as uint8"
                        f" (tile.view(np.uint8)) to store them as they are")
    raw = np.ascontiguousarray(given).reshape(-1).view(np.uint8)
    need = tmap.spec.shared_bytes
    if raw.nbytes < need:
        raise ValueError(f"a box of {tmap.spec.box} {tmap.spec.dtype} elements takes {need} bytes of shared memory"
                         f" (swizzle {tmap.spec.swizzle!r}); the tile given has {raw.nbytes}")
    smem_shape, where = _layout(tmap.spec)
    image = raw[:need] if where is None else raw[:need][where]
    data = image.view(dtype).reshape(smem_shape)[..., : shape[-1]]
    if inside.any():
        memory, index = _bytes_at(read, tmap.address, offsets[inside], size)
        memory[index] = data[inside].reshape(-1).view(np.uint8).reshape(-1, size)
