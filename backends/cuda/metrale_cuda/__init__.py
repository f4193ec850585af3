"""metrale's CUDA backend: NVIDIA GPUs through ``cuda.bindings.driver``.

metrale finds it through the ``metrale.backends`` entry point ``cuda``; open it
with ``metrale_core.open_backend("cuda")``. [`CudaDevice`][metrale_cuda.CudaDevice] is its raw
layer; [`probe`][metrale_cuda.probe] says whether it can run here. ``cuda.bindings`` is
imported only when the backend is probed or opened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._plugin import open_device, probe

if TYPE_CHECKING:
    from ._device import CudaDevice

__version__ = "0.2.0"

__all__ = ["CudaDevice", "open_device", "probe"]


def __getattr__(name: str) -> object:
    if name == "CudaDevice":
        from ._device import CudaDevice

        return CudaDevice
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
