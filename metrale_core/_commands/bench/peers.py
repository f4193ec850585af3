"""The peers metrale is timed next to: CuPy and PyTorch, imported only if installed, and only where
the backend's memory is CUDA device memory they can share a GPU with."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

from ... import GpuBackend

__all__ = ["find_cupy", "find_torch", "torch_graph"]


def find_cupy(gpu: GpuBackend, cuda_memory: bool) -> tuple[Any, str]:
    """CuPy and its source label, or ``None`` and why it is skipped; ``cuda_memory``: the backend's
    memory is CUDA device memory."""
    if not cuda_memory:
        return None, f"skipped: CuPy needs the cuda backend (this run is on {gpu.name})"
    try:
        import cupy  # type: ignore[import-not-found, import-untyped, unused-ignore]

        if gpu.ordinal >= cupy.cuda.runtime.getDeviceCount():
            return None, f"skipped: CuPy has no CUDA device {gpu.ordinal} here"
    except ImportError:
        return None, "skipped: CuPy is not installed"
    except Exception as exc:  # CuPy without a usable CUDA runtime raises its own errors
        return None, f"skipped: CuPy cannot reach the GPU ({type(exc).__name__}: {exc})"
    finally:
        gpu.bind_to_thread()
    return cupy, f"cupy {cupy.__version__}"


def find_torch(gpu: GpuBackend, cuda_memory: bool) -> tuple[Any, str]:
    """PyTorch with CUDA and its source label, or ``None`` and why it is skipped; ``cuda_memory``:
    the backend's memory is CUDA device memory."""
    if not cuda_memory:
        return None, f"skipped: PyTorch's CUDA needs the cuda backend (this run is on {gpu.name})"
    try:
        import torch  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        return None, "skipped: PyTorch is not installed"
    except Exception as exc:  # a PyTorch built for another CUDA fails to import with its own errors
        return None, f"skipped: PyTorch cannot be imported ({type(exc).__name__}: {exc})"
    try:
        usable = torch.cuda.is_available() and gpu.ordinal < torch.cuda.device_count()
    except Exception as exc:
        return None, f"skipped: PyTorch cannot reach the GPU ({type(exc).__name__}: {exc})"
    finally:
        gpu.bind_to_thread()  # whatever PyTorch made current, metrale's context is current again
    if not usable:
        return None, f"skipped: PyTorch {torch.__version__} has no CUDA device {gpu.ordinal} here"
    return torch, f"torch {torch.__version__}"


def torch_graph(
    torch: Any, ordinal: int, k: int, n: int, rounds: int
) -> tuple[Callable[[], None], Callable[[], float], Callable[[], None]]:
    """A ``torch.cuda.CUDAGraph`` of ``k`` ``torch.add(a, b, out=c)`` over ``n`` float32 on device ``ordinal``:
    its replay, a function giving its device time per replay from CUDA events, and a wait."""
    on_device = functools.partial(torch.cuda.device, ordinal)
    with on_device():
        a, b_, c = (torch.ones(n, dtype=torch.float32, device=torch.device("cuda", ordinal)) for _ in range(3))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as PyTorch asks
            for _ in range(3):
                torch.add(a, b_, out=c)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(k):
                torch.add(a, b_, out=c)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replay() -> None:  # on another device than the current one only: a device guard costs host time
        with on_device():
            graph.replay()

    if torch.cuda.current_device() == ordinal:
        replay = graph.replay

    def synchronize() -> None:
        torch.cuda.synchronize(ordinal)

    def device_us() -> float:
        times = []
        with on_device():
            for _ in range(rounds + 1):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(float(start.elapsed_time(end)) * 1e3)
        return statistics.median(times[1:])

    return replay, device_us, synchronize
