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
              graph's last node (``metrale_core._graphcheck``)
============  ===============================================================

The fake backend runs them through the Python implementations registered by
its plugin. ``python3 -m metrale_core.kernels`` regenerates the PTX with
``nvcc`` (``nvcc -ptx -arch=compute_75``).
"""

from __future__ import annotations

from importlib import resources
from typing import Final

__all__ = ["MODULES", "shipped_modules"]

#: The shipped modules, by name.
MODULES: Final = ("vector", "fault", "redzone")


def shipped_modules(*names: str) -> dict[str, bytes]:
    """The PTX images of the shipped modules (all of them when no name is given)."""
    wanted = names or MODULES
    unknown = sorted(set(wanted) - set(MODULES))
    if unknown:
        raise KeyError(f"no shipped kernel module {unknown}; shipped: {', '.join(MODULES)}")
    root = resources.files(__name__)
    return {name: root.joinpath(f"{name}.ptx").read_bytes() for name in wanted}
