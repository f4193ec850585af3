"""What a measurement works with: the open backend, its baseline, what its memory is, the run's
scale and its progress line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from ... import Baseline, GpuBackend, Kernel
from ..._errors import MetraleError
from ...kernels import shipped_modules
from .model import Figure, Goal
from .timing import KIB, MIB

__all__ = ["DLPACK_CPU", "DLPACK_CUDA", "Bench", "Progress", "memory_device"]

Progress = Callable[[str], None]

#: DLPack's device types (dlpack.h's ``DLDeviceType``), as a buffer's ``__dlpack_device__()`` names its memory.
DLPACK_CPU: Final = 1  # kDLCPU: host memory (the fake's device memory)
DLPACK_CUDA: Final = 2  # kDLCUDA: CUDA device memory, which CuPy and PyTorch can share


def memory_device(gpu: GpuBackend) -> tuple[int, int] | None:
    """What the backend's device memory is, as DLPack says it: ``(device type, device id)`` of a
    small buffer allocated and freed again; ``None`` where the backend exports no memory."""
    buf = gpu.alloc(KIB)
    try:
        device_type, device_id = buf.__dlpack_device__()
    except (MetraleError, BufferError):  # a backend that shares no memory says so in either way
        return None
    finally:
        gpu.free(buf)
    return int(device_type), int(device_id)


class Bench:
    """The open backend, its baseline, what its memory is, the run's scale and its progress line.

    :param why_not: why there is no baseline (``""`` where there is one).
    """

    def __init__(self, gpu: GpuBackend, baseline: Baseline | None, why_not: str, quick: bool, say: Progress) -> None:
        self.gpu = gpu
        self.baseline = baseline
        self.why_not = why_not
        self.quick = quick
        self.say = say
        memory = memory_device(gpu)
        #: the backend's memory is a device's, not host memory: the figures of a GPU, and its goals
        self.on_gpu = memory is not None and memory[0] != DLPACK_CPU
        #: the backend's memory is CUDA device memory: CuPy and PyTorch can run beside it
        self.cuda_memory = memory is not None and memory[0] == DLPACK_CUDA

    def rounds(self, full: int) -> int:
        return 2 if self.quick else full

    def calls(self, full: int) -> int:
        return max(1, full // 20) if self.quick else full

    def size(self, gpu: int, host: int) -> int:
        """A transfer size: large on a GPU, smaller where device memory is host memory (the fake),
        small in a quick run."""
        if self.quick:
            return MIB
        return gpu if self.on_gpu else host

    def vector_add(self, gpu: GpuBackend | None = None) -> Kernel:
        """The shipped ``vector_add`` on ``gpu`` (the bench's backend by default); the kernel keeps its
        registry, so its module, loaded."""
        target = gpu or self.gpu
        return target.load_modules(shipped_modules("vector")).kernel("vector", "vector_add")

    def goals(self, *goals: Goal) -> tuple[Goal, ...]:
        """The goals, where they mean something: they are a GPU's, so none where device memory is host memory."""
        return goals if self.on_gpu else ()

    def raw_figure(self, label: str, unit: str, value: float | None) -> Figure:
        """The baseline's figure ``label``; without a baseline, skipped, saying why."""
        if self.baseline is None or value is None:
            return Figure(label, "baseline", unit, None, note=f"skipped: {self.why_not}")
        return Figure(label, self.baseline.label, unit, value)
