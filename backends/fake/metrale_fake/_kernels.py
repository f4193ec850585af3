"""Python implementations of the kernels metrale ships (``metrale_core.kernels``), for the fake backend."""

from __future__ import annotations

import numpy as np

from metrale_core import KernelImplementation, kernel_implementation

from ._device import FakeLaunch

__all__ = ["SHIPPED"]


def _count(launch: FakeLaunch, n: np.integer) -> int:
    """Elements a grid-stride-free kernel touches: one per thread, below ``n``."""
    return min(int(n), launch.threads)


@kernel_implementation("vector", "vector_add")
def vector_add(launch: FakeLaunch, a: np.ndarray, b: np.ndarray, out: np.ndarray, n: np.uint32) -> None:
    count = _count(launch, n) * 4
    out[:count].view(np.float32)[:] = a[:count].view(np.float32) + b[:count].view(np.float32)


@kernel_implementation("vector", "fill_u32")
def fill_u32(launch: FakeLaunch, p: np.ndarray, n: np.uint32, value: np.uint32) -> None:
    p[: _count(launch, n) * 4].view(np.uint32)[:] = value


@kernel_implementation("fault", "write_to")
def write_to(launch: FakeLaunch, address: np.ndarray, value: np.uint32) -> None:
    address[:4].view(np.uint32)[0] = value  # an address no allocation holds gives an empty view: a fault


#: The implementations the fake plugin registers through ``metrale_kernel_implementations``.
SHIPPED: tuple[KernelImplementation, ...] = (vector_add, fill_u32, write_to)
