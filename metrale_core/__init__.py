"""metrale: a backend-neutral GPU runtime for Python host applications.

Open a backend, allocate, copy, capture graphs; the allocation ledger, red
zones and capture rules hold the same on every backend::

    from metrale_core import open_backend

    with open_backend() as gpu:          # "auto": cuda where a GPU answers, else fake
        buf = gpu.alloc(1 << 20)
        gpu.memset(buf, 0)
        gpu.free(buf)
"""

from __future__ import annotations

from ._arena import Arena
from ._backend import GpuBackend
from ._buffer import DeviceArray, DeviceBuffer
from ._discovery import ENTRY_POINT_GROUP, available_backends, open_backend
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
    cuda_code,
    error_for_code,
)
from ._handles import Event, Graph, GraphExec, HostBuffer, Stream
from ._ledger import LedgerEvent, LedgerProbe
from ._meminfo import effective_free_bytes, parse_mem_available, read_mem_available
from ._pressure import MemoryStats, OomWatchdog
from ._ptx import Param, PtxImage, parse_ptx
from ._raw import Baseline, CopyDirection, RawDevice
from ._registration import BackendRegistration
from ._registry import Kernel, KernelRegistry, RunMetrics
from ._settings import MetraleSettings
from ._types import (
    AllocKind,
    AllocRecord,
    BackendInfo,
    ForeignMemory,
    KernelImplementation,
    LaunchArg,
    MemoryInfo,
    RedZoneViolation,
    kernel_implementation,
)
from .hookspec import hookimpl

__version__ = "0.1.0"

__all__ = [
    "ENTRY_POINT_GROUP",
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
    "LedgerEvent",
    "LedgerProbe",
    "MemoryInfo",
    "MemoryStats",
    "MetraleError",
    "MetraleSettings",
    "OomWatchdog",
    "OutOfMemoryError",
    "Param",
    "PtxImage",
    "RawDevice",
    "RedZoneError",
    "RedZoneViolation",
    "RunMetrics",
    "SnapshotError",
    "Stream",
    "__version__",
    "available_backends",
    "cuda_code",
    "effective_free_bytes",
    "error_for_code",
    "hookimpl",
    "kernel_implementation",
    "open_backend",
    "parse_mem_available",
    "parse_ptx",
    "read_mem_available",
]
