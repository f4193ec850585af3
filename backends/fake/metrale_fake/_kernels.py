"""Python implementations of the kernels metrale ships (``metrale_core.kernels``), for the fake backend."""

from __future__ import annotations

import numpy as np

from metrale_core import KernelImplementation, kernel_implementation

from ._launch import FakeLaunch

__all__ = ["SHIPPED"]


def _count(launch: FakeLaunch, n: np.integer) -> int:
    """Elements a grid-stride-free kernel touches: one per thread, below ``n``."""
    return min(int(n), launch.threads)


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
    for z, (address, length) in enumerate(table):
        data = launch.read(int(address), int(length))
        changed = np.flatnonzero(data != np.uint8(fill))
        out[z] = 0 if changed.size == 0 else int(changed[0]) + 1


#: The implementations the fake plugin registers through ``metrale_kernel_implementations``.
SHIPPED: tuple[KernelImplementation, ...] = (vector_add, fill_u32, write_to, redzone_scan)
