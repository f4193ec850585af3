"""What a fake kernel implementation gets: its launch (`FakeLaunch`), its arguments, and the errors of a launch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Final

import numpy as np

from metrale_core import MetraleError
from metrale_core.plugin import LaunchArg, TensorMap, error_for_code

from ._tensormap import tma_load, tma_store

__all__ = ["DTYPES", "FakeLaunch", "MisalignedAddressError", "kernel_arg", "no_implementation"]

#: The numpy type of a scalar kernel parameter, by PTX kind and size.
DTYPES: Final = {
    ("u", 1): np.uint8, ("u", 2): np.uint16, ("u", 4): np.uint32, ("u", 8): np.uint64,
    ("b", 1): np.uint8, ("b", 2): np.uint16, ("b", 4): np.uint32, ("b", 8): np.uint64,
    ("s", 1): np.int8, ("s", 2): np.int16, ("s", 4): np.int32, ("s", 8): np.int64,
    ("f", 2): np.float16, ("f", 4): np.float32, ("f", 8): np.float64,
}


class MisalignedAddressError(Exception):
    """Raised by a fake kernel implementation for a typed access at a misaligned address; the
    launch then faults the fake device with ``CUDA_ERROR_MISALIGNED_ADDRESS``, as a GPU does."""


@dataclasses.dataclass(frozen=True, slots=True)
class FakeLaunch:
    """What a fake kernel implementation learns about its launch."""

    module: str
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    memory: Callable[[int, int], np.ndarray]
    #: The device's shared memory as blocks find it (`shared`); ``None``: fresh zeros at each call.
    leftover: Callable[[int], np.ndarray] | None = None
    #: The allocation holding an address, as ``(base, size, bytes)`` (`reader`); ``None``: each read looks it up.
    extent: Callable[[int], tuple[int, int, np.ndarray] | None] | None = None

    def shared(self) -> np.ndarray:
        """The block's dynamic shared memory, ``shared_mem`` bytes (``uint8``), as a GPU hands it over: holding
        what an earlier launch left there, never cleared (zeros only before any launch used it). A kernel
        that reads bytes it did not write reads stale data, as on a GPU (seen on an H100: a tile store of
        bytes a load never wrote carried the previous launch's values)."""
        if self.leftover is None:
            return np.zeros(self.shared_mem, dtype=np.uint8)
        return self.leftover(self.shared_mem)

    def read(self, address: int, nbytes: int) -> np.ndarray:
        """The device bytes ``[address, address + nbytes)``, for a kernel that follows a pointer it read.

        Bytes outside one allocation raise ``IndexError``: an illegal address.
        """
        return self.memory(address, nbytes)

    def reader(self) -> Callable[[int, int], np.ndarray]:
        """`read`, for a kernel that follows many pointers (the red-zone scans): the allocation last found is kept, so
        a range inside it needs no lookup. The same bytes, and the same ``IndexError`` outside one allocation."""
        extent = self.extent
        if extent is None:
            return self.read
        memory = self.memory
        last: list[tuple[int, int, np.ndarray]] = []

        def holds(found: tuple[int, int, np.ndarray], address: int, nbytes: int) -> bool:
            base, size, data = found
            return 0 <= address - base <= size and address - base + nbytes <= len(data)

        def read(address: int, nbytes: int) -> np.ndarray:
            if not (last and holds(last[0], address, nbytes)):
                found = extent(address)
                if found is None or not holds(found, address, nbytes):
                    return memory(address, nbytes)  # (raises where no one allocation holds it)
                last[:] = [found]
            base, _, data = last[0]
            return data[address - base : address - base + nbytes]

        return read

    @staticmethod
    def elements(view: np.ndarray, count: int, dtype: type[np.generic]) -> np.ndarray:
        """The first ``count`` elements of ``dtype`` at a pointer argument's ``view``, as a kernel's typed
        loads and stores see them: past the allocation (and its red zone) is an illegal address
        (``IndexError``), and a pointer not aligned to the element size is a misaligned address
        ([`MisalignedAddressError`][metrale_fake.MisalignedAddressError]), as on a GPU, where both fault the context."""
        size = np.dtype(dtype).itemsize
        nbytes = count * size
        if len(view) < nbytes:
            raise IndexError(f"{nbytes} bytes from this pointer run past its allocation ({len(view)} bytes)")
        # Allocations start 256-byte aligned on the fake device and numpy's buffers at least 16-byte aligned
        # on the host, so a view's host address has the device address's alignment.
        if view.ctypes.data % size:
            raise MisalignedAddressError(f"a {np.dtype(dtype).name} access at an address that is not a multiple "
                                         f"of {size}")
        return view[:nbytes].view(dtype)

    def tma_load(self, tmap: TensorMap, coords: tuple[int, ...]) -> np.ndarray:
        """The box of tensor map ``tmap`` at element ``coords`` (outermost first), as the TMA brings it to shared
        memory (``cp.async.bulk.tensor`` from global): ``spec.tile_shape`` elements, those outside the tensor
        filled with zero or NaN as its ``oob_fill`` says, laid out as the TMA lays them out in shared memory
        (with a swizzle, each innermost row padded to its span and its 16-byte chunks moved: ``nbytes`` is
        ``spec.shared_bytes``). Interleaved maps are not copied (``ValueError``)."""
        return tma_load(self.memory, tmap, coords)

    def tma_store(self, tmap: TensorMap, coords: tuple[int, ...], tile: np.ndarray) -> None:
        """Write the box of ``tmap`` at ``coords`` from ``tile``, shared memory read as this map lays a box
        out there (at least ``spec.shared_bytes`` bytes, else ``ValueError``), as a TMA store does: elements
        outside the tensor are skipped. ``tile`` holds the map's element type or bytes as ``uint8``; another
        element type is refused (``TypeError``) rather than reinterpreted."""
        tma_store(self.memory, tmap, coords, tile)

    @property
    def threads(self) -> int:
        """Threads in the whole launch."""
        g, b = self.grid, self.block
        return g[0] * g[1] * g[2] * b[0] * b[1] * b[2]


def no_implementation(module: str, kernel: str) -> MetraleError:
    """The error of a launch of a kernel the fake has no Python implementation of: how to give it one."""
    err = error_for_code("CUDA_ERROR_NOT_SUPPORTED", f"fake launch of {module}.{kernel}")
    return type(err)(
        f"the fake backend has no Python implementation of kernel {kernel!r} of module "
        f"{module!r}: decorate one with @metrale_core.kernel_implementation({module!r}, "
        f"{kernel!r}) and register it with backend.add_kernel_implementations(...), or "
        f"return it from a plugin's metrale_kernel_implementations hook",
        code=err.code,
        name=err.name,
    )


def kernel_arg(arg: LaunchArg, tail: np.ndarray | None) -> object:
    """What an implementation gets for ``arg``: for a pointer, ``tail``, the bytes from it to the end of its
    allocation (``None``: outside any, so an empty view that faults at any access); a numpy scalar of the
    parameter's type; a struct's bytes; or, for a tensor-map slot, the [`TensorMap`][metrale_core.TensorMap] as it was
    at the launch."""
    if arg.tensor_map is not None:
        return arg.tensor_map
    if arg.pointer is not None:
        return np.empty(0, dtype=np.uint8) if tail is None else tail
    if arg.param.count > 1:
        return arg.data
    return np.frombuffer(arg.data, dtype=DTYPES[(arg.param.kind, arg.param.size)])[0]
