"""metrale as the allocator of other frameworks: their tensors from a metrale pool, each on the ledger.

- `torch`: PyTorch's CUDA tensors (``torch.cuda.memory.CUDAPluggableAllocator``): ``install(gpu)`` before torch
  first uses CUDA.
- `cupy`: CuPy's arrays (``cupy.cuda.set_allocator``): ``install(gpu)``.
- Both go through one `Door` each: a [`MemoryPool`][metrale_core.MemoryPool] of the backend whose pieces are
  found by address, reuse ordered on the framework's own streams (``MemoryPool.alloc_on``).
- Underneath: `door` (`Door`) and `doorfuncs` (the C functions a framework's hook calls, made for a door), with
  their compiled twins `_door` and `_doorfuncs`.
- Neither framework is a dependency: each module imports its framework when called, and a missing one raises
  [`MissingPackageError`][metrale_core.MissingPackageError].
"""

from __future__ import annotations

from .door import Door

__all__ = ["Door"]
