"""The records of the public contract: immutable values that hold no backend and call nothing.

The bottom floor of metrale's wings, beside the errors: every other module may use them.
[`DeviceBuffer`][metrale_core.DeviceBuffer] and [`DeviceArray`][metrale_core.DeviceArray], the
handles to memory that export themselves, are in ``_device/buffer``.
"""

from __future__ import annotations

import dataclasses
import operator
import struct
import sys
from collections.abc import Callable
from typing import Any, Final, Literal, SupportsIndex, cast, final

__all__ = [
    "WORD_LIMIT",
    "AllocKind",
    "AllocRecord",
    "BackendInfo",
    "ForeignMemory",
    "KernelImplementation",
    "LaunchArg",
    "MemoryInfo",
    "Origin",
    "Param",
    "RedZoneCheckMode",
    "RedZoneChecks",
    "RedZoneViolation",
    "as_index",
    "format_bytes",
    "kernel_implementation",
]


#: Sizes and device addresses end below this, on every backend alike: CUDA's ``size_t`` and pointers are 64 bits.
WORD_LIMIT: Final = 1 << 64


def as_index(value: object) -> int | None:
    """``value`` as an ``int`` if it is an integer (``__index__``, numpy integers too; no ``bool``), else ``None``."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(cast(SupportsIndex, value))
    except Exception:  # not an integer, or an ``__index__`` that lies (raises, returns a non-int)
        return None


def format_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


#: The kinds of device memory. ``"external"`` is reserved for memory metrale
#: does not own.
AllocKind = Literal["device", "managed", "arena", "pool"]


@dataclasses.dataclass(frozen=True, slots=True)
class Param:
    """One kernel parameter as PTX declares it.

    ``kind`` is PTX's ``u``/``s``/``b``/``f`` (unsigned, signed, untyped bits,
    float), ``size`` its size in bytes; an array (a struct passed by value)
    has ``count > 1`` and is given as that many raw bytes.
    """

    name: str
    kind: str
    size: int
    count: int = 1
    #: The alignment PTX declares (``.align N``), 0 where it declares none.
    align: int = 0

    @property
    def nbytes(self) -> int:
        return self.size * self.count

    @property
    def pointer_sized(self) -> bool:
        """Whether a device pointer fits here (a 64-bit integer parameter)."""
        return self.count == 1 and self.size == 8 and self.kind in "usb"

    @property
    def tensor_map(self) -> bool:
        """Whether this is a tensor-map slot: 128 bytes aligned to 64 or more (``const __grid_constant__
        CUtensorMap``, which PTX declares ``.param .align 64 .b8 name[128]``)."""
        return self.kind == "b" and self.size * self.count == 128 and self.align >= 64

    def describe(self) -> str:
        if self.tensor_map:
            return "CUtensorMap"
        text = f".{self.kind}{self.size * 8}"
        return f"{text}[{self.count}]" if self.count > 1 else text


@dataclasses.dataclass(frozen=True, slots=True)
class ForeignMemory:
    """Memory as another library sees it, for interop (DLPack, the CUDA array interface).

    :param device: ``"cuda"`` (a device pointer of CUDA device ``device_id``) or ``"cpu"``
        (host memory, as the fake's device memory is).
    :param device_id: the CUDA ordinal; 0 for ``"cpu"``.
    :param address: where the bytes are, in that device's address space.
    :param nbytes: how many.
    :param keepalive: an object that keeps the bytes valid while it lives (a numpy view of the
        fake's memory), or ``None`` when metrale's own bookkeeping does.
    """

    device: Literal["cuda", "cpu"]
    device_id: int
    address: int
    nbytes: int
    keepalive: object = None


@dataclasses.dataclass(frozen=True, slots=True)
class Origin:
    """Where a record comes from, so the reports of many processes merge: the host, the process, its rank in
    a distributed job where the engine says (``RANK`` and ``WORLD_SIZE``, as torchrun sets them), and the
    device: the backend, its ordinal and the device's UUID (``""`` where the backend has none).

    :param host: the host name.
    :param pid: the process id.
    :param rank: the process's rank in the job, or ``None`` outside one.
    :param world_size: the processes in the job, or ``None``.
    :param backend: the backend's name.
    :param ordinal: the device ordinal in this process (after ``CUDA_VISIBLE_DEVICES``).
    :param device_uuid: the device's UUID (``"GPU-…"`` on CUDA, ``"FAKE-…"`` on the fake), or ``""``.
    :param instance: the backend's number among those its process opened (1 for the first): what tells two
        backends of one process on one device apart; ``0`` where unknown (a snapshot written before it was).
    :param worker: the engine's name for the process (a Dask worker's address, a Ray actor's id), or ``""``.
    :param device_share: the part of the device the engine gave the process (Ray's fractional ``num_gpus``):
        below 1, other processes share the device.
    """

    host: str
    pid: int
    rank: int | None
    world_size: int | None
    backend: str
    ordinal: int
    device_uuid: str = ""
    instance: int = 0
    worker: str = ""
    device_share: float = 1.0

    def __setstate__(self, state: tuple[Any, ...] | list[Any]) -> None:
        """Unpickle, a pickle of an earlier version (without ``instance``, ``worker`` or ``device_share``) too: the
        missing fields take their defaults (an unknown instance is 0)."""
        restore_fields(self, state)

    @property
    def in_job(self) -> bool:
        """Whether an engine named the process (a rank or a worker): a distributed job's."""
        return self.rank is not None or bool(self.worker)

    @property
    def shared(self) -> bool:
        """Whether the engine gave the process only part of its device: other processes share it."""
        return self.device_share < 1

    def describe(self) -> str:
        """``rank 1 of 2 (host pid 4242), cuda:0 GPU-…``; without a rank, ``host pid 4242, cuda:0 …``; a worker
        named first (``worker tcp://…:4242 (host pid 4242), …``); a shared device said (``, 0.5 of the device``).
        A merged report adds ``#instance`` where one process has two backends on one device."""
        where = f"{self.host} pid {self.pid}"
        if self.rank is not None:
            of = f" of {self.world_size}" if self.world_size is not None else ""
            where = f"rank {self.rank}{of} ({where})"
        elif self.worker:
            where = f"worker {self.worker} ({where})"
        device = f"{self.backend}:{self.ordinal}" + (f" {self.device_uuid}" if self.device_uuid else "")
        if self.shared:
            device += f", {self.device_share:g} of the device (shared with other processes)"
        return f"{where}, {device}"

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON object (a snapshot's ``"origin"``)."""
        return dataclasses.asdict(self)


def restore_fields(obj: Any, state: tuple[Any, ...] | list[Any]) -> None:
    """Set the fields of a frozen dataclass ``obj`` from a pickle's ``state``, their values in order: what
    ``__setstate__`` does for a dataclass that gained fields (with defaults) at its end, so a pickle of an earlier
    version loads with the new fields at their defaults."""
    for i, field in enumerate(dataclasses.fields(obj)):
        if i < len(state):
            value = state[i]
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        elif field.default is not dataclasses.MISSING:
            value = field.default
        else:  # a pickle cut short: no version of the class lacked this field
            raise TypeError(f"{type(obj).__name__}: the pickle has no {field.name!r}")
        object.__setattr__(obj, field.name, value)


@dataclasses.dataclass(frozen=True, slots=True)
class AllocRecord:
    """One allocation on the ledger; the same fields as its [`DeviceBuffer`][metrale_core.DeviceBuffer], and
    the [`Origin`][metrale_core.Origin] of the backend whose ledger holds it (``None`` where unknown: a
    snapshot written before origins were)."""

    ptr: int
    nbytes: int
    kind: str
    index: int
    site: str
    origin: Origin | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True, slots=True)
class RedZoneViolation:
    """A guard band whose bytes changed.

    ``ptr``, ``nbytes``, ``index`` and ``site`` are the allocation's; ``side``
    is ``"trail"`` (or ``"lead"``); ``offset`` is the first changed byte,
    counted from the zone's start. ``suspects`` names the kernels that took the
    allocation (or, for an arena's piece, any piece of its arena) as an argument:
    for a graph's verdict, that graph's kernel nodes (``"write_u8 (node 2 of graph #3)"``);
    for any other check, the backend's last launches (``"write_u8 (the latest launch)"``).
    """

    ptr: int
    nbytes: int
    index: int
    site: str
    side: Literal["trail", "lead"]
    offset: int
    #: The backend that found it (``None`` where a caller built the record without one).
    origin: Origin | None = dataclasses.field(default=None, compare=False)
    #: The kernels suspected of the write, oldest first (empty: none took the allocation, or nobody asked).
    suspects: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def __setstate__(self, state: tuple[Any, ...] | list[Any]) -> None:
        """Unpickle, a pickle of an earlier version (without ``suspects``, or ``origin``) too: the missing fields
        take their defaults."""
        restore_fields(self, state)

    def describe(self) -> str:
        """One line for a log or an error message; in a distributed job (an origin with a rank) it names the
        rank, host, process and device; then the suspects, where there are any."""
        where = "past the end" if self.side == "trail" else "before the start"
        return (
            f"red zone {self.side}: a write {where} of allocation #{self.index} "
            f"({self.nbytes} bytes at {self.ptr:#x}, allocated at {self.site}), "
            f"first changed byte at zone offset {self.offset}"
            + (f", on {self.origin.describe()}" if self.origin is not None and self.origin.in_job else "")
            + (f"; suspects: {', '.join(self.suspects)}" if self.suspects else "")
        )


#: How graph launches are checked: see `RedZoneChecks`.
RedZoneCheckMode = Literal["inside", "queued", "waited", "unknown", "off"]


@final
class RedZoneChecks(str):
    """How a backend checks red zones around graph launches: a ``str``, the sentence ``metrale info`` prints.

    - `mode`: ``"inside"`` (the verdict kernel ends every captured graph), ``"queued"`` (a scan queued
      behind each launch), ``"waited"`` (a check after each launch, waited for), ``"unknown"`` (asked
      while a capture runs), or ``"off"`` (red zones off, or ``redzone_scan_graphs`` off).
    - `reason`: why graphs are not checked inside, in words (``""`` where they are).
    - Compare `mode`, not the sentence: the sentence is for people.
    """

    # (no __slots__: a str subclass holds its attributes in a __dict__)
    mode: RedZoneCheckMode
    reason: str

    def __new__(cls, text: str, mode: RedZoneCheckMode, reason: str = "") -> RedZoneChecks:
        self = super().__new__(cls, text)
        self.mode = mode
        self.reason = reason
        return self

    def __getnewargs__(self) -> tuple[str, RedZoneCheckMode, str]:  # type: ignore[override]
        return str(self), self.mode, self.reason


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryInfo:
    """Device memory, in bytes. ``effective_free`` is what can really be had: it counts the memory
    red zones hold back from the driver (``quarantined``: freed zoned buffers waiting for their check,
    and checked ones kept for reuse), which an allocation that runs out of memory gets back."""

    free: int
    total: int
    effective_free: int
    integrated: bool
    quarantined: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class BackendInfo:
    """A discovered backend, available here or not (``reason`` says why not)."""

    name: str
    available: bool
    reason: str | None
    distribution: str | None
    description: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchArg:
    """One kernel argument, checked against its parameter and packed as the kernel receives it."""

    param: Param
    """The kernel parameter it fills."""
    data: bytes
    """The parameter's bytes (little-endian); for a tensor-map slot, the map's image."""
    pointer: int | None = None
    """The device address where the argument is a buffer or a raw pointer, else ``None``."""
    tensor_map: object = None
    """The [`TensorMap`][metrale_core.TensorMap] (as it was at the launch) where the parameter is a tensor-map
    slot, else ``None`` (typed ``object``: records sit below the maps' layer)."""

    @classmethod
    def _make(
        cls, param: Param, data: bytes, pointer: int | None = None, tensor_map: object = None
    ) -> LaunchArg:
        """``LaunchArg(...)`` at a third of the cost, for launches (as ``DeviceBuffer._make``: built in a
        class of the same slots with a plain ``__init__``, then given this class)."""
        if not CLASS_SWAP:  # a free-threaded build: the assignment would stop every thread
            return cls(param, data, pointer, tensor_map)
        arg: Any = _UnfrozenArg(param, data, pointer, tensor_map)
        arg.__class__ = LaunchArg
        return arg  # type: ignore[no-any-return]

    def describe(self) -> str:
        """The argument's value as the kernel sees it: a pointer in hex, a number, or a byte count."""
        if self.pointer is not None:
            return f"{self.pointer:#x}"
        if self.tensor_map is not None:
            return repr(self.tensor_map)
        if self.param.count > 1:
            return f"<{len(self.data)} bytes>"
        if self.param.kind == "f" and self.param.size in (4, 8):
            return repr(struct.unpack("<f" if self.param.size == 4 else "<d", self.data)[0])
        return str(int.from_bytes(self.data, "little", signed=self.param.kind == "s"))


#: Whether ``LaunchArg._make`` and ``DeviceBuffer._make`` build through a twin class and a ``__class__``
#: assignment: under the GIL, a third of the dataclass's cost; on a free-threaded build the assignment stops
#: the world (CPython 3.13+), so there the dataclass's own ``__init__`` runs.
CLASS_SWAP: Final = getattr(sys, "_is_gil_enabled", lambda: True)()


class _UnfrozenArg:
    """[`LaunchArg`][metrale_core.LaunchArg]'s slots with a plain ``__init__``: how `LaunchArg._make` builds one."""

    __slots__ = LaunchArg.__slots__

    def __init__(self, param: Param, data: bytes, pointer: int | None, tensor_map: object) -> None:
        self.param = param
        self.data = data
        self.pointer = pointer
        self.tensor_map = tensor_map


@dataclasses.dataclass(frozen=True, slots=True)
class KernelImplementation:
    """A Python implementation of kernel ``kernel`` of module ``module``, for backends that run kernels on the CPU.

    ``function(launch, *args)`` receives a launch description (grid, block,
    shared memory) and one argument per kernel parameter: a writable
    ``numpy.uint8`` view for each pointer, from the pointed-to byte to the end
    of its allocation (red zone included, so a write one element too far lands
    in the zone as on a GPU, and one further faults), and a numpy scalar of the
    parameter's type for the others.
    """

    module: str
    kernel: str
    function: Callable[..., object]

    def __call__(self, *args: Any) -> object:
        return self.function(*args)


def kernel_implementation(module: str, kernel: str) -> Callable[[Callable[..., object]], KernelImplementation]:
    """Decorate a function as the implementation of ``(module, kernel)``.

    Register the result with ``backend.add_kernel_implementations(...)`` or
    return it from a plugin's ``metrale_kernel_implementations`` hook.
    """

    def wrap(function: Callable[..., object]) -> KernelImplementation:
        return KernelImplementation(module, kernel, function)

    return wrap


