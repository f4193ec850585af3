"""The kernels metrale ships: CUDA C sources with their PTX, committed so nothing compiles at install.

============  ===============================================================
module        kernels
============  ===============================================================
``vector``    ``vector_add(a, b, out, n)``: ``out[i] = a[i] + b[i]`` (float32);
              ``fill_u32(p, n, value)``: ``p[i] = value`` for ``i < n``
``fault``     ``write_to(address, value)``: a store to any address; given one
              no allocation holds, a sticky ``CUDA_ERROR_ILLEGAL_ADDRESS``;
              ``write_u8(address, value)``: one byte stored (a planted overrun)
``redzone``   ``redzone_scan(zones, n, fill, result)``: the device-side red-zone
              scan, one block per zone, ``result[z]`` = first changed offset + 1;
              ``redzone_verdict(desc, state, slot)``: the check captured as a
              graph's last node (``metrale_core._redzones.ingraph``)
``tma``       ``tma_copy_2d(src, dst, box_cols, box_rows, tile_bytes)``: block
              ``(x, y)`` copies the box at ``(y * box_rows, x * box_cols)`` of
              tensor map ``src`` to the same place of ``dst`` through shared
              memory (a TMA load, then a TMA store); sm_90 or newer
============  ===============================================================

The fake backend runs them through the Python implementations registered by
its plugin. ``python3 -m metrale_core.kernels`` (`__main__`) regenerates the
PTX with ``nvcc`` (``nvcc -ptx -arch=compute_75``; ``tma`` with
``-arch=sm_90``, the first architecture with a TMA).

Beside the sources lies what a kernel is on no backend, offered by
``metrale_core``: `_ptx` reads PTX images (the target, the kernels and their
parameters, the architecture preflight), `_tensormap` holds tensor-map specs
and the driver's rules, `_ntile` chooses a GEMM's N tile.
"""

from __future__ import annotations

from importlib import resources
from typing import Final

__all__ = ["ARCHES", "MODULES", "shipped_modules"]

#: The shipped modules, by name.
MODULES: Final = ("vector", "fault", "redzone", "tma")

#: The architecture each shipped module is compiled for (``nvcc -arch``).
ARCHES: Final = {"vector": "compute_75", "fault": "compute_75", "redzone": "compute_75", "tma": "sm_90"}


def shipped_modules(*names: str) -> dict[str, bytes]:
    """The PTX images of the shipped modules (all of them when no name is given)."""
    wanted = names or MODULES
    unknown = sorted(set(wanted) - set(MODULES))
    if unknown:
        raise KeyError(f"no shipped kernel module {unknown}; shipped: {', '.join(MODULES)}")
    root = resources.files(__name__)
    return {name: root.joinpath(f"{name}.ptx").read_bytes() for name in wanted}
