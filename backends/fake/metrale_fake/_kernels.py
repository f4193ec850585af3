"""Python implementations of the kernels metrale ships (``metrale_core.kernels``), for the fake backend."""

from __future__ import annotations

import numpy as np

from metrale_core import KernelImplementation, kernel_implementation

from ._device import FakeLaunch

__all__ = ["SHIPPED"]


def _count(launch: FakeLaunch, n: np.integer) -> int:
    """Elements a grid-stride-free kernel touches: one per thread, below ``n``."""
    return min(int(n), launch.threads)


def _span(view: np.ndarray, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of a pointer's view; past the allocation (and its red zone) is a fault."""
    if len(view) < nbytes:
        raise IndexError(f"{nbytes} bytes from this pointer run past its allocation ({len(view)} bytes)")
    return view[:nbytes]


@kernel_implementation("vector", "vector_add")
def vector_add(launch: FakeLaunch, a: np.ndarray, b: np.ndarray, out: np.ndarray, n: np.uint32) -> None:
    count = _count(launch, n) * 4
    _span(out, count).view(np.float32)[:] = _span(a, count).view(np.float32) + _span(b, count).view(np.float32)


@kernel_implementation("vector", "fill_u32")
def fill_u32(launch: FakeLaunch, p: np.ndarray, n: np.uint32, value: np.uint32) -> None:
    _span(p, _count(launch, n) * 4).view(np.uint32)[:] = value


@kernel_implementation("fault", "write_to")
def write_to(launch: FakeLaunch, address: np.ndarray, value: np.uint32) -> None:
    _span(address, 4).view(np.uint32)[0] = value  # an address no allocation holds gives an empty view: a fault


@kernel_implementation("redzone", "redzone_scan")
def redzone_scan(launch: FakeLaunch, zones: np.ndarray, n: np.uint32, fill: np.uint32, result: np.ndarray) -> None:
    """The fake's red-zone scan, with numpy: the same answers as the CUDA kernel."""
    count = min(int(n), launch.grid[0])
    table = _span(zones, count * 16).view(np.uint64).reshape(count, 2)
    out = _span(result, count * 4).view(np.uint32)
    for z, (address, length) in enumerate(table):
        data = launch.read(int(address), int(length))
        changed = np.flatnonzero(data != np.uint8(fill))
        out[z] = 0 if changed.size == 0 else int(changed[0]) + 1


#: The implementations the fake plugin registers through ``metrale_kernel_implementations``.
SHIPPED: tuple[KernelImplementation, ...] = (vector_add, fill_u32, write_to, redzone_scan)
