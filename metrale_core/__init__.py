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
    from ._device.memory_stats import MemoryStats
    from ._device.raw import Baseline, RawDevice
    from ._discovery import available_backends, device_count, open_backend
    from ._errors import (
        ArchitectureError,
        ArenaFullError,
        BackendClosedError,
        BackendNotFoundError,
        BackendUnavailableError,
        CaptureError,
        ConfigError,
        DeviceFaultError,
        DoorError,
        DriverError,
        InvalidArgumentError,
        InvalidBufferError,
        KernelNotFoundError,
        MetraleError,
        MissingPackageError,
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
    from ._memory.ledger import LedgerProbe
    from ._memory.meminfo import effective_free_bytes
    from ._memory.pool import MemoryPool
    from ._memory.poolstats import PoolStats
    from ._memory.pressure import OomWatchdog
    from ._memory.records import LedgerEvent
    from ._memory.snapshot import MemorySnapshot, load_snapshot
    from ._placement import Placement, assigned_ordinal, open_for_rank, placement
    from ._registration import BackendRegistration
    from ._reports.merge import LedgerReport, MergedReport, RankSummary, SiteTotal, merge_reports
    from ._settings.model import LaunchEnvironment, MetraleSettings
    from ._settings.plugins import ENTRY_POINT_GROUP
    from ._types import (
        AllocRecord,
        BackendInfo,
        ForeignMemory,
        KernelImplementation,
        LaunchArg,
        MemoryInfo,
        Origin,
        Param,
        RedZoneChecks,
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
    "DeviceArray",
    "DeviceBuffer",
    "DeviceFaultError",
    "DoorError",
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
    "MemoryPool",
    "MemorySnapshot",
    "MemoryStats",
    "MergedReport",
    "MetraleError",
    "MetraleSettings",
    "MissingPackageError",
    "NTile",
    "OomWatchdog",
    "Origin",
    "OutOfMemoryError",
    "Param",
    "Placement",
    "PoolStats",
    "PtxImage",
    "RankSummary",
    "RawDevice",
    "RedZoneError",
    "RedZoneChecks",
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
    "assigned_ordinal",
    "available_backends",
    "check_tensor_map",
    "cuda_code",
    "device_count",
    "effective_free_bytes",
    "error_for_code",
    "hookimpl",
    "kernel_implementation",
    "load_snapshot",
    "merge_reports",
    "n_tile",
    "open_backend",
    "open_for_rank",
    "parse_ptx",
    "placement",
]

#: The public names, by the module that defines each: the one table. The lazy loader reads it (`_WHERE`);
#: ``__all__`` and the imports above say the same for static tools, and ``tests/test_exported_members.py``
#: checks that all three agree.
_PUBLIC: dict[str, tuple[str, ...]] = {
    "_backend": ("GpuBackend",),
    "_device.buffer": ("DeviceArray", "DeviceBuffer"),
    "_device.handles": ("Event", "Graph", "GraphExec", "HostBuffer", "Stream"),
    "_device.memory_stats": ("MemoryStats",),
    "_device.raw": ("Baseline", "RawDevice"),
    "_discovery": ("available_backends", "device_count", "open_backend"),
    "_errors": (
        "ArchitectureError", "ArenaFullError", "BackendClosedError", "BackendNotFoundError", "BackendUnavailableError",
        "CaptureError", "ConfigError", "DeviceFaultError", "DoorError", "DriverError", "InvalidArgumentError",
        "InvalidBufferError", "KernelNotFoundError", "MetraleError", "MissingPackageError", "OutOfMemoryError",
        "RedZoneError", "SnapshotError", "TensorMapError",
        "cuda_code", "error_for_code",
    ),
    "_launch.registry": ("Kernel", "KernelRegistry", "RunMetrics"),
    "_launch.tensormaps": ("TensorMap",),
    "_memory.arena": ("Arena",),
    "_memory.ledger": ("LedgerProbe",),
    "_memory.meminfo": ("effective_free_bytes",),
    "_memory.pool": ("MemoryPool",),
    "_memory.poolstats": ("PoolStats",),
    "_memory.pressure": ("OomWatchdog",),
    "_memory.records": ("LedgerEvent",),
    "_memory.snapshot": ("MemorySnapshot", "load_snapshot"),
    "_placement": ("Placement", "assigned_ordinal", "open_for_rank", "placement"),
    "_registration": ("BackendRegistration",),
    "_reports.merge": ("LedgerReport", "MergedReport", "RankSummary", "SiteTotal", "merge_reports"),
    "_settings.model": ("LaunchEnvironment", "MetraleSettings"),
    "_settings.plugins": ("ENTRY_POINT_GROUP",),
    "_types": (
        "AllocRecord", "BackendInfo", "ForeignMemory", "KernelImplementation", "LaunchArg", "MemoryInfo",
        "Origin", "Param", "RedZoneChecks", "RedZoneViolation", "kernel_implementation",
    ),
    "hookspec": ("hookimpl",),
    "kernels._ntile": ("NTile", "n_tile"),
    "kernels._ptx": ("PtxImage", "parse_ptx"),
    "kernels._tensormap": (
        "TENSOR_MAP_DTYPES", "TENSOR_MAP_RULES", "TensorMapEncoding", "TensorMapSpec", "check_tensor_map",
    ),
}

#: The module each public name is imported from on first use (PEP 562), so ``import metrale_core`` costs
#: little: pydantic, pluggy and the backend load with the first name that needs them.
_WHERE: dict[str, str] = {name: module for module, names in _PUBLIC.items() for name in names}

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
