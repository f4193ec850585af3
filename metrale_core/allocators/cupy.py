"""CuPy's arrays from a metrale pool: every array a ledger record with the application's call site.

- `allocator(gpu)` is a callable for ``cupy.cuda.set_allocator``: each call takes a piece of a `Door` of ``gpu``
  for CuPy's current stream and returns a ``MemoryPointer`` over it; the piece goes back to the pool when CuPy
  drops its last reference (a finalizer).
- `install(gpu)` sets it and returns the door. A refused allocation raises metrale's typed error (an
  [`OutOfMemoryError`][metrale_core.OutOfMemoryError] names the sites holding memory).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, final

from .._twins import pick
from .door import Door, framework, require_cuda

if TYPE_CHECKING:
    from .. import GpuBackend

__all__ = ["allocator", "install"]


def _cupy() -> Any:
    return framework("cupy", "CuPy", "pip install cupy-cuda12x (or the build for your CUDA)")


@final
class _Owner:
    """What a ``MemoryPointer`` keeps alive: when CuPy drops it, its piece goes back (`weakref.finalize`)."""

    __slots__ = ("__weakref__",)


def allocator(gpu: GpuBackend, *, release_threshold: int = 0) -> Callable[[int], Any]:
    """A CuPy allocator (``nbytes -> MemoryPointer``) over a new pool of ``gpu``; its door is its ``door``
    attribute.

    :raises MissingPackageError: CuPy is not installed.
    :raises DoorError: ``gpu`` is no CUDA device.
    """
    cupy = _cupy()
    require_cuda(gpu, "CuPy")
    door = pick("door", Door, gpu.settings.pure)(gpu, "CuPy", release_threshold=release_threshold)
    ordinal = gpu.ordinal
    memory = cupy.cuda.memory

    def alloc(nbytes: int) -> Any:
        if nbytes <= 0:
            return memory.MemoryPointer(memory.UnownedMemory(0, 0, None, ordinal), 0)
        buf = door.take(nbytes, cupy.cuda.get_current_stream().ptr)
        owner = _Owner()
        weakref.finalize(owner, door.free, buf.ptr)
        return memory.MemoryPointer(memory.UnownedMemory(buf.ptr, nbytes, owner, ordinal), 0)

    alloc.door = door  # type: ignore[attr-defined]
    return alloc


def install(gpu: GpuBackend, *, release_threshold: int = 0) -> Door:
    """Make CuPy allocate every array from a pool of ``gpu`` (``cupy.cuda.set_allocator``); returns its `Door`.
    CuPy's arrays allocated before keep their memory."""
    cupy = _cupy()
    made = allocator(gpu, release_threshold=release_threshold)
    cupy.cuda.set_allocator(made)
    door: Door = made.door  # type: ignore[attr-defined]
    return door
