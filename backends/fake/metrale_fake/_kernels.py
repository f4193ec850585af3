"""Python implementations of the kernels metrale ships (``metrale_core.kernels``), for the fake backend."""

from __future__ import annotations

import math

import numpy as np

from metrale_core import KernelImplementation, TensorMap, kernel_implementation

from ._launch import FakeLaunch

__all__ = ["SHIPPED"]


def _count(launch: FakeLaunch, n: np.integer) -> int:
    """Elements a grid-stride-free kernel touches: one per thread, below ``n``."""
    return min(int(n), launch.threads)


def _judge(launch: FakeLaunch, table: np.ndarray, fill: int) -> np.ndarray:
    """Each zone ``(address, length)`` of ``table`` judged as the CUDA kernels judge it: 0 where all its bytes hold the
    fill's low byte, else 1 + the offset of its first byte that does not. The zones are read in address order through
    `FakeLaunch.reader` (an allocation found once for the zones it holds), each compared as bytes with the fill
    repeated to its length: no array of booleans per zone (a scan of thousands of zones on a laptop). A zone that no
    one allocation holds reads as a kernel's load does (``IndexError``: an illegal address)."""
    out = np.zeros(len(table), dtype=np.int64)
    byte = np.uint8(fill & 0xFF)
    filled: dict[int, bytes] = {}
    read = launch.reader()
    addresses, lengths = table[:, 0].tolist(), table[:, 1].tolist()
    for z in np.argsort(table[:, 0], kind="stable").tolist():
        length = lengths[z]
        zone = read(addresses[z], length)
        want = filled.get(length)
        if want is None:
            want = filled[length] = bytes((int(byte),)) * length
        if zone.tobytes() != want:
            out[z] = _first_changed(zone, byte)
    return out


def _first_changed(data: np.ndarray, byte: np.uint8) -> int:
    """0 where every byte of ``data`` is ``byte``, else 1 + the offset of the first that is not."""
    changed = np.flatnonzero(data != byte)
    return int(changed[0]) + 1 if len(changed) else 0


@kernel_implementation("vector", "vector_add")
def vector_add(launch: FakeLaunch, a: np.ndarray, b: np.ndarray, out: np.ndarray, n: np.uint32) -> None:
    count = _count(launch, n)
    f32 = np.float32
    launch.elements(out, count, f32)[:] = launch.elements(a, count, f32) + launch.elements(b, count, f32)


@kernel_implementation("vector", "fill_u32")
def fill_u32(launch: FakeLaunch, p: np.ndarray, n: np.uint32, value: np.uint32) -> None:
    launch.elements(p, _count(launch, n), np.uint32)[:] = value


@kernel_implementation("fault", "write_to")
def write_to(launch: FakeLaunch, address: np.ndarray, value: np.uint32) -> None:
    launch.elements(address, 1, np.uint32)[0] = value  # an address no allocation holds gives an empty view: a fault


@kernel_implementation("redzone", "redzone_scan")
def redzone_scan(launch: FakeLaunch, zones: np.ndarray, n: np.uint32, fill: np.uint32, result: np.ndarray) -> None:
    """The fake's red-zone scan, with numpy: the same answers as the CUDA kernel."""
    count = min(int(n), launch.grid[0])
    table = launch.elements(zones, count * 2, np.uint64).reshape(count, 2)
    out = launch.elements(result, count, np.uint32)
    out[:] = _judge(launch, table, int(fill))


@kernel_implementation("fault", "write_u8")
def write_u8(launch: FakeLaunch, address: np.ndarray, value: np.uint32) -> None:
    launch.elements(address, 1, np.uint8)[0] = np.uint8(int(value) & 0xFF)


@kernel_implementation("redzone", "redzone_verdict")
def redzone_verdict(launch: FakeLaunch, desc: np.ndarray, state: np.ndarray, slot: np.ndarray) -> None:
    """The fake's in-graph check: the zones its descriptor's table names, counted where changed; the
    verdict, then the sequence number, into the slot (as the CUDA kernel leaves them)."""
    table_ptr, count, version, fill = (int(v) for v in launch.elements(desc, 4, np.uint64))
    bad = 0
    if count:
        table = launch.read(table_ptr, count * 16).view(np.uint64).reshape(count, 2)
        bad = int(np.count_nonzero(_judge(launch, table, fill)))
    words = launch.elements(state, 2, np.uint64)
    words[1] += np.uint64(1)
    out = launch.elements(slot, 4, np.uint64)
    out[0] = bad
    out[1] = version
    out[2] = words[1]


@kernel_implementation("tma", "tma_copy_2d")
def tma_copy_2d(
    launch: FakeLaunch, src: TensorMap, dst: TensorMap, box_cols: np.uint32, box_rows: np.uint32,
    tile_bytes: np.uint32,
) -> None:
    """The fake's TMA tile copy: each block's box loaded from ``src`` (out-of-bounds elements filled) and stored
    to ``dst`` (out-of-bounds elements skipped), as the CUDA kernel's TMA load and store do."""
    box_bytes = math.prod(src.spec.tile_shape) * src.spec.itemsize
    if box_bytes != int(tile_bytes):
        raise RuntimeError(f"the TMA load brings {box_bytes} bytes where the kernel expects {tile_bytes} (on a GPU its"
                           f" barrier never completes)")
    for spec in (src.spec, dst.spec):  # each box in shared memory, padded as its swizzle pads it
        if spec.shared_bytes > launch.shared_mem:
            raise IndexError(f"a box of {spec.box} {spec.dtype} elements (swizzle {spec.swizzle!r}) takes "
                             f"{spec.shared_bytes} bytes of shared memory, past the launch's {launch.shared_mem}")
    for by in range(launch.grid[1]):
        for bx in range(launch.grid[0]):
            coords = (by * int(box_rows), bx * int(box_cols))
            smem = launch.shared()  # what earlier launches left there, as on a GPU
            tile = launch.tma_load(src, coords).reshape(-1).view(np.uint8)
            smem[: tile.nbytes] = tile
            launch.tma_store(dst, coords, smem)



#: The implementations the fake plugin registers through ``metrale_kernel_implementations``.
SHIPPED: tuple[KernelImplementation, ...] = (
    vector_add, fill_u32, write_to, write_u8, redzone_scan, redzone_verdict, tma_copy_2d,
)
