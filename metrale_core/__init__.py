"""metrale: a backend-neutral GPU runtime for Python host applications.

Open a backend, allocate, copy, capture graphs; the allocation ledger, red
zones and capture rules hold the same on every backend:

    from metrale_core import open_backend

    with open_backend() as gpu:          # "auto": cuda where a GPU answers, else fake
        buf = gpu.alloc(1 << 20)
        gpu.memset(buf, 0)
        gpu.free(buf)

``import metrale_core`` is cheap: each public name is imported from its module
the first time it is used (PEP 562), so pydantic, pluggy and the backend's
modules load with the first name that needs them (``open_backend``,
``MetraleSettings``); ``from metrale_core import X`` works as ever.
"""

from __future__ import annotations

TYPE_CHECKING = False  # as typing.TYPE_CHECKING is (type checkers take it as True), without importing typing

if TYPE_CHECKING:
    from ._backend import GpuBackend
    from ._device.buffer import DeviceArray, DeviceBuffer
    from ._device.handles import Event, Graph, GraphExec, HostBuffer, Stream
    from ._device.raw import Baseline, CopyDirection, RawDevice
    from ._device.stats import MemoryStats
    from ._discovery import ENTRY_POINT_GROUP, available_backends, device_count, open_backend
    from ._errors import (
        ArchitectureError,
        ArenaFullError,
        BackendClosedError,
        BackendNotFoundError,
        BackendUnavailableError,
        CaptureError,
        ConfigError,
        DeviceFaultError,
        DriverError,
        InvalidArgumentError,
        InvalidBufferError,
        KernelNotFoundError,
        MetraleError,
        OutOfMemoryError,
        RedZoneError,
        SnapshotError,
        TensorMapError,
        cuda_code,
        error_for_code,
    )
    from ._launch.registry import Kernel, KernelRegistry, RunMetrics
    from ._launch.tensormaps import TensorMap
    from ._memory.arena import Arena
    from ._memory.ledger import LedgerEvent, LedgerProbe
    from ._memory.meminfo import effective_free_bytes, parse_mem_available, read_mem_available
    from ._memory.pressure import OomWatchdog
    from ._placement import Placement, open_for_rank, placement
    from ._registration import BackendRegistration
    from ._reports.merge import LedgerReport, MergedReport, RankSummary, SiteTotal, merge_reports
    from ._settings.model import LaunchEnvironment, MetraleSettings
    from ._types import (
        AllocKind,
        AllocRecord,
        BackendInfo,
        ForeignMemory,
        KernelImplementation,
        LaunchArg,
        MemoryInfo,
        Origin,
        Param,
        RedZoneViolation,
        kernel_implementation,
    )
    from .hookspec import hookimpl
    from .kernels._ntile import NTile, n_tile
    from .kernels._ptx import PtxImage, parse_ptx
    from .kernels._tensormap import (
        TENSOR_MAP_DTYPES,
        TENSOR_MAP_RULES,
        TensorMapEncoding,
        TensorMapSpec,
        check_tensor_map,
    )

__version__ = "0.2.0"

__all__ = [
    "ENTRY_POINT_GROUP",
    "TENSOR_MAP_DTYPES",
    "TENSOR_MAP_RULES",
    "AllocKind",
    "AllocRecord",
    "ArchitectureError",
    "Arena",
    "ArenaFullError",
    "BackendClosedError",
    "BackendInfo",
    "BackendNotFoundError",
    "BackendRegistration",
    "BackendUnavailableError",
    "Baseline",
    "CaptureError",
    "ConfigError",
    "CopyDirection",
    "DeviceArray",
    "DeviceBuffer",
    "DeviceFaultError",
    "DriverError",
    "Event",
    "ForeignMemory",
    "GpuBackend",
    "Graph",
    "GraphExec",
    "HostBuffer",
    "InvalidArgumentError",
    "InvalidBufferError",
    "Kernel",
    "KernelImplementation",
    "KernelNotFoundError",
    "KernelRegistry",
    "LaunchArg",
    "LaunchEnvironment",
    "LedgerEvent",
    "LedgerProbe",
    "LedgerReport",
    "MemoryInfo",
    "MemoryStats",
    "MergedReport",
    "MetraleError",
    "MetraleSettings",
    "NTile",
    "OomWatchdog",
    "Origin",
    "OutOfMemoryError",
    "Param",
    "Placement",
    "PtxImage",
    "RankSummary",
    "RawDevice",
    "RedZoneError",
    "RedZoneViolation",
    "RunMetrics",
    "SiteTotal",
    "SnapshotError",
    "Stream",
    "TensorMap",
    "TensorMapEncoding",
    "TensorMapError",
    "TensorMapSpec",
    "__version__",
    "available_backends",
    "check_tensor_map",
    "cuda_code",
    "device_count",
    "effective_free_bytes",
    "error_for_code",
    "hookimpl",
    "kernel_implementation",
    "merge_reports",
    "n_tile",
    "open_backend",
    "open_for_rank",
    "parse_mem_available",
    "parse_ptx",
    "placement",
    "read_mem_available",
]

#: The module each public name is defined in. A name is imported from it on first use (PEP 562), so
#: ``import metrale_core`` costs little: pydantic, pluggy and the backend load with the first name that needs them.
_WHERE: dict[str, str] = {
    "Arena": "_memory.arena",
    "GpuBackend": "_backend",
    "DeviceArray": "_device.buffer",
    "DeviceBuffer": "_device.buffer",
    "ENTRY_POINT_GROUP": "_settings.plugins",
    "available_backends": "_discovery",
    "open_backend": "_discovery",
    "ArchitectureError": "_errors",
    "ArenaFullError": "_errors",
    "BackendClosedError": "_errors",
    "BackendNotFoundError": "_errors",
    "BackendUnavailableError": "_errors",
    "CaptureError": "_errors",
    "ConfigError": "_errors",
    "DeviceFaultError": "_errors",
    "DriverError": "_errors",
    "InvalidArgumentError": "_errors",
    "InvalidBufferError": "_errors",
    "KernelNotFoundError": "_errors",
    "MetraleError": "_errors",
    "OutOfMemoryError": "_errors",
    "RedZoneError": "_errors",
    "SnapshotError": "_errors",
    "TensorMapError": "_errors",
    "cuda_code": "_errors",
    "error_for_code": "_errors",
    "Event": "_device.handles",
    "Graph": "_device.handles",
    "GraphExec": "_device.handles",
    "HostBuffer": "_device.handles",
    "Stream": "_device.handles",
    "LedgerEvent": "_memory.ledger",
    "LedgerProbe": "_memory.ledger",
    "effective_free_bytes": "_memory.meminfo",
    "parse_mem_available": "_memory.meminfo",
    "read_mem_available": "_memory.meminfo",
    "NTile": "kernels._ntile",
    "n_tile": "kernels._ntile",
    "MemoryStats": "_device.stats",
    "OomWatchdog": "_memory.pressure",
    "Param": "_types",
    "PtxImage": "kernels._ptx",
    "parse_ptx": "kernels._ptx",
    "Baseline": "_device.raw",
    "CopyDirection": "_device.raw",
    "RawDevice": "_device.raw",
    "BackendRegistration": "_registration",
    "Kernel": "_launch.registry",
    "KernelRegistry": "_launch.registry",
    "RunMetrics": "_launch.registry",
    "MetraleSettings": "_settings.model",
    "TENSOR_MAP_DTYPES": "kernels._tensormap",
    "TENSOR_MAP_RULES": "kernels._tensormap",
    "TensorMapEncoding": "kernels._tensormap",
    "TensorMapSpec": "kernels._tensormap",
    "check_tensor_map": "kernels._tensormap",
    "TensorMap": "_launch.tensormaps",
    "AllocKind": "_types",
    "AllocRecord": "_types",
    "BackendInfo": "_types",
    "ForeignMemory": "_types",
    "KernelImplementation": "_types",
    "LaunchArg": "_types",
    "MemoryInfo": "_types",
    "RedZoneViolation": "_types",
    "kernel_implementation": "_types",
    "device_count": "_discovery",
    "LedgerReport": "_reports.merge",
    "MergedReport": "_reports.merge",
    "RankSummary": "_reports.merge",
    "SiteTotal": "_reports.merge",
    "merge_reports": "_reports.merge",
    "Placement": "_placement",
    "open_for_rank": "_placement",
    "placement": "_placement",
    "LaunchEnvironment": "_settings.model",
    "Origin": "_types",
    "hookimpl": "hookspec",
}

if not TYPE_CHECKING:  # mypy sees the imports above; a name missing from them is an error there, as it should be

    def __getattr__(name: str) -> object:
        module = _WHERE.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        from importlib import import_module

        value = getattr(import_module(f".{module}", __name__), name)
        globals()[name] = value  # later lookups find it without this hook
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
