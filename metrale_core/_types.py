"""The immutable value types of the public contract."""

from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ._interop import DeviceArray

__all__ = [
    "AllocRecord",
    "as_index",
    "BackendInfo",
    "DeviceBuffer",
    "MemoryInfo",
    "RedZoneViolation",
]


def as_index(value: object) -> int | None:
    """``value`` as an ``int`` if it is an integer (``__index__``, numpy integers too; no ``bool``), else ``None``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        return None
    return operator.index(value)


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceBuffer:
    """A handle to device memory. Immutable; liveness is the backend's to say.

    :param ptr: the device address handed to the user (256-byte aligned).
    :param nbytes: the bytes asked for (never rounded or padded).
    :param kind: ``"device"``, ``"managed"``, ``"arena"``, or ``"external"`` (another
        library's memory, from :meth:`GpuBackend.wrap <metrale_core.GpuBackend.wrap>`).
    :param index: the creation index, from one per-process sequence.
    :param site: the caller's ``"file:line"``.

    A buffer from a backend exports itself to other array libraries as one-dimensional
    ``uint8`` (``__cuda_array_interface__``, ``__dlpack__``, and ``__array__`` on the fake);
    :meth:`view` gives a typed, shaped :class:`~metrale_core.DeviceArray`.
    """

    ptr: int
    nbytes: int
    kind: str
    index: int
    site: str
    #: A weak reference to the backend that made it (for exports); not part of its value.
    _owner: Any = dataclasses.field(default=None, compare=False, repr=False, hash=False)

    def __int__(self) -> int:
        return self.ptr

    def view(self, dtype: object = "uint8", shape: object = None) -> DeviceArray:
        """A typed, C-contiguous view for other array libraries: ``dtype`` (a name such as
        ``"float32"``, or a numpy dtype) and ``shape`` (default: as many elements as fit)."""
        from ._interop import DeviceArray

        return DeviceArray.of(self, dtype, shape)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self.view().__cuda_array_interface__

    def __dlpack__(
        self, *, stream: object = None, max_version: object = None, dl_device: object = None, copy: object = None
    ) -> object:
        return self.view().__dlpack__(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.view().__dlpack_device__()

    def __array__(self, dtype: object = None, copy: object = None) -> Any:
        return self.view().__array__(dtype, copy)

    @classmethod
    def _make(cls, ptr: int, nbytes: int, kind: str, index: int, site: str, owner: Any = None) -> DeviceBuffer:
        """The same as ``DeviceBuffer(...)`` at half the cost, for the arena's fast path: a frozen
        dataclass's ``__init__`` sets each field through ``object.__setattr__``; this sets the slots."""
        buf = object.__new__(cls)
        _SET_PTR(buf, ptr)
        _SET_NBYTES(buf, nbytes)
        _SET_KIND(buf, kind)
        _SET_INDEX(buf, index)
        _SET_SITE(buf, site)
        _SET_OWNER(buf, owner)
        return buf


# The slot descriptors' setters, which a frozen dataclass's __setattr__ does not guard.
_SET_PTR, _SET_NBYTES, _SET_KIND, _SET_INDEX, _SET_SITE, _SET_OWNER = (
    vars(DeviceBuffer)[field].__set__ for field in ("ptr", "nbytes", "kind", "index", "site", "_owner")
)


@dataclasses.dataclass(frozen=True, slots=True)
class AllocRecord:
    """One allocation on the ledger; the same fields as its :class:`DeviceBuffer`."""

    ptr: int
    nbytes: int
    kind: str
    index: int
    site: str


@dataclasses.dataclass(frozen=True, slots=True)
class RedZoneViolation:
    """A guard band whose bytes changed.

    ``ptr``, ``nbytes``, ``index`` and ``site`` are the allocation's; ``side``
    is ``"trail"`` (or ``"lead"``); ``offset`` is the first changed byte,
    counted from the zone's start.
    """

    ptr: int
    nbytes: int
    index: int
    site: str
    side: Literal["trail", "lead"]
    offset: int

    def describe(self) -> str:
        """One line for a log or an error message."""
        where = "past the end" if self.side == "trail" else "before the start"
        return (
            f"red zone {self.side}: a write {where} of allocation #{self.index} "
            f"({self.nbytes} bytes at {self.ptr:#x}, allocated at {self.site}), "
            f"first changed byte at zone offset {self.offset}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryInfo:
    """Device memory, in bytes. ``effective_free`` is what can really be had."""

    free: int
    total: int
    effective_free: int
    integrated: bool


@dataclasses.dataclass(frozen=True, slots=True)
class BackendInfo:
    """A discovered backend, available here or not (``reason`` says why not)."""

    name: str
    available: bool
    reason: str | None
    distribution: str | None
    description: str = ""
