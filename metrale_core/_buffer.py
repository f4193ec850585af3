"""Handles to device memory: :class:`DeviceBuffer` and its typed view :class:`DeviceArray`.

A buffer is an immutable value (pointer, size, kind, creation index, call site) with a weak
reference to the device context that made it, its owner. Whether it is live is the owner's
to say, by the buffer's creation index and the size the owner recorded, never by the
address or size the buffer carries. Both export themselves to other array libraries (the
CUDA array interface, DLPack, numpy's ``__array__``) through their owner's export table
(:class:`BufferOwner`), which checks liveness and waits for the device's work first.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import sys
from collections.abc import Sequence
from typing import Any, Final, Protocol

from ._dlpack import DLPACK_CPU, DLPACK_CUDA, DTYPES, itemsize, make_capsule
from ._errors import InvalidArgumentError
from ._types import CLASS_SWAP, ForeignMemory, as_index

__all__ = ["BufferOwner", "DeviceArray", "DeviceBuffer", "dtype_name"]


class BufferOwner(Protocol):
    """What a buffer's exports ask of the backend that owns it (the export table)."""

    def export(self, buf: DeviceBuffer, view: DeviceArray, what: str, *, wait: bool = True) -> ForeignMemory:
        """How other libraries address ``buf``, checked live; with ``wait``, after the device's work."""

    def export_held(self, index: int, delta: int) -> None:
        """Count the DLPack tensors of allocation ``index`` a consumer still holds."""


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
    #: A weak reference to the :class:`~metrale_core._context.DeviceContext` that made it (its owner:
    #: liveness checks it first, exports go through it); not part of its value.
    _owner: Any = dataclasses.field(default=None, compare=False, repr=False, hash=False)

    def __int__(self) -> int:
        return self.ptr

    def view(self, dtype: object = "uint8", shape: object = None) -> DeviceArray:
        """A typed, C-contiguous view for other array libraries: ``dtype`` (a name such as
        ``"float32"``, or a numpy dtype) and ``shape`` (default: as many elements as fit)."""
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
        """The same as ``DeviceBuffer(...)`` at a third of the cost, for the hot paths (alloc, arena).

        A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` (slow, and
        its ``__setattr__`` keeps the interpreter from specializing the stores); this builds the
        value in :class:`_Unfrozen`, a class of the same slots whose plain ``__init__`` stores them
        directly, and then gives it this class (allowed: the layouts are the same). Only for
        ``DeviceBuffer`` itself: a subclass goes through its own ``__init__``; so does every buffer on a
        free-threaded build, where assigning ``__class__`` stops every thread (:data:`CLASS_SWAP`).
        """
        if cls is not DeviceBuffer or not CLASS_SWAP:
            return cls(ptr, nbytes, kind, index, site, owner)
        buf: Any = _Unfrozen(ptr, nbytes, kind, index, site, owner)
        buf.__class__ = DeviceBuffer
        return buf  # type: ignore[no-any-return]


class _Unfrozen:
    """:class:`DeviceBuffer`'s slots with a plain ``__init__``: how :meth:`DeviceBuffer._make` builds one."""

    __slots__ = DeviceBuffer.__slots__

    def __init__(self, ptr: int, nbytes: int, kind: str, index: int, site: str, owner: Any) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.kind = kind
        self.index = index
        self.site = site
        self._owner = owner


#: The byte orders numpy writes for a dtype metrale can export: native, little-endian, not applicable.
_NATIVE_ORDER: Final = ("=", "|", "<") if sys.byteorder == "little" else ("|", "<")


def dtype_name(dtype: object) -> str:
    """The name of ``dtype`` (a string, a numpy dtype or scalar type), checked against the ones metrale exports."""
    try:
        name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None) or getattr(dtype, "__name__", None)
        # numpy names a byte-swapped dtype as the native one (``dtype(">f4").name`` is ``"float32"``); metrale
        # exports native (little-endian) order only
        order = "=" if isinstance(dtype, str) else getattr(dtype, "byteorder", "=")
    except Exception:  # an object whose attributes raise is no dtype
        name = order = None
    if not isinstance(name, str) or itemsize(name) is None or order not in _NATIVE_ORDER:
        raise InvalidArgumentError(
            f"view: dtype {dtype!r} is not one metrale exports; use one of {', '.join(DTYPES)}"
        )
    return name


#: The most dimensions a view may have (numpy's limit; CuPy's and PyTorch's are the same or lower).
_MAX_DIMS: Final = 64


def _dims(shape: object) -> tuple[int, ...]:
    """``shape`` as a tuple of counts: an integer, or a sequence (not ``str``/``bytes``) of integers, each >= 0.

    Integers are what ``operator.index`` takes (numpy's too), never ``bool``; a float, a string, ``None`` or
    a nested sequence is refused, as is a set or a mapping (no order) and an iterator (used up once read).
    """
    one = as_index(shape)
    parts: list[int | None] = [None]
    if one is not None:
        parts = [one]
    elif isinstance(shape, Sequence) and not isinstance(shape, str | bytes | bytearray | memoryview):
        try:
            if len(shape) <= _MAX_DIMS:
                parts = [as_index(d) for d in shape]
        except Exception:  # a sequence that fails to be read is no shape
            parts = [None]
    if any(d is None or d < 0 for d in parts):
        raise InvalidArgumentError(
            f"view: shape must be an integer or a tuple of integers >= 0 (at most {_MAX_DIMS} of them), "
            f"got {reprlib.repr(shape)}"
        )
    return tuple(d for d in parts if d is not None)


def _typestr(name: str, size: int) -> str:
    return ("|" if size == 1 else "<") + name[0] + str(size)


class DeviceArray:
    """A typed, C-contiguous view of a device buffer, for other array libraries. Made by
    :meth:`DeviceBuffer.view <metrale_core.DeviceBuffer.view>`.

    - ``__cuda_array_interface__`` (version 3) on a backend whose memory is CUDA device memory;
    - ``__dlpack__`` / ``__dlpack_device__``: a DLPack tensor on the CUDA device, or on the CPU
      for the fake backend, whose device memory is host memory;
    - ``__array__`` on the fake: a numpy array over the fake's device memory, no copy.

    Each export waits for the backend's work first. A consumer that holds a view while the
    buffer is freed points at freed memory: ``free`` logs a WARNING when it knows of one (a
    ``DeviceArray`` still referenced, or a DLPack tensor not yet released).
    """

    __slots__ = ("__weakref__", "buffer", "dtype", "itemsize", "shape")

    def __init__(self, buffer: DeviceBuffer, dtype: str, itemsize: int, shape: tuple[int, ...]) -> None:
        self.buffer = buffer
        self.dtype = dtype
        self.itemsize = itemsize
        self.shape = shape

    @classmethod
    def of(cls, buffer: DeviceBuffer, dtype: object = "uint8", shape: object = None) -> DeviceArray:
        name = dtype_name(dtype)
        size = itemsize(name)
        assert size is not None  # dtype_name checked it
        if shape is None:
            if buffer.nbytes % size:
                raise InvalidArgumentError(
                    f"view: allocation #{buffer.index} of {buffer.nbytes} bytes is not a whole number of {name} "
                    f"({size} bytes); give a shape"
                )
            dims: tuple[int, ...] = (buffer.nbytes // size,)
        else:
            dims = _dims(shape)
        need = math.prod(dims) * size
        if need > buffer.nbytes:
            raise InvalidArgumentError(
                f"view: {name}{list(dims)} needs {need} bytes, allocation #{buffer.index} has {buffer.nbytes}; "
                f"ask for a smaller shape"
            )
        if buffer.ptr % size:
            raise InvalidArgumentError(
                f"view: allocation #{buffer.index} at {buffer.ptr:#x} is not aligned for {name}; "
                f"take it from an aligned buffer"
            )
        return cls(buffer, name, size, dims)

    def __repr__(self) -> str:
        return f"<DeviceArray {self.dtype}{list(self.shape)} of allocation #{self.buffer.index}>"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def _backend(self) -> BufferOwner:
        owner = self.buffer._owner
        context = owner() if owner is not None else None
        backend: BufferOwner | None = getattr(context, "exports", None)
        if backend is None:
            raise InvalidArgumentError(
                f"export of allocation #{self.buffer.index}: its backend is gone (closed and collected), "
                f"or the buffer was not made by one"
            )
        return backend

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        backend = self._backend()
        what = "__cuda_array_interface__"
        if backend.export(self.buffer, self, what, wait=False).device != "cuda":
            # AttributeError, so hasattr() says no (without waiting for the device) and a consumer tries
            # another protocol
            raise AttributeError(f"backend memory of allocation #{self.buffer.index} is not CUDA memory")
        memory = backend.export(self.buffer, self, what)
        return {
            "shape": self.shape,
            "typestr": _typestr(self.dtype, self.itemsize),
            "data": (memory.address, False),
            "version": 3,
            "strides": None,
            "stream": None,  # the export waited for the backend's work: nothing to synchronize with
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        memory = self._backend().export(self.buffer, self, "__dlpack_device__", wait=False)
        return (DLPACK_CUDA, memory.device_id) if memory.device == "cuda" else (DLPACK_CPU, 0)

    def __dlpack__(
        self, *, stream: object = None, max_version: object = None, dl_device: object = None, copy: object = None
    ) -> object:
        if copy is True:
            raise BufferError("metrale exports its memory without copying (copy=True asked for a copy)")
        backend = self._backend()
        memory = backend.export(self.buffer, self, "__dlpack__")
        device = (DLPACK_CUDA, memory.device_id) if memory.device == "cuda" else (DLPACK_CPU, 0)
        if dl_device is not None:
            try:
                asked = tuple(as_index(part) for part in dl_device)  # type: ignore[attr-defined]
            except Exception:  # not iterable, or an iterable that fails
                asked = ()
            if len(asked) != 2 or None in asked:
                raise InvalidArgumentError(
                    f"__dlpack__: dl_device must be a (device type, device id) pair of integers, "
                    f"got {reprlib.repr(dl_device)}"
                )
            if asked != device:
                raise BufferError(f"metrale's memory is on DLPack device {device}, not {dl_device}")
        index = self.buffer.index
        backend.export_held(index, +1)
        return make_capsule(
            memory.address, self.shape, self.dtype, device[0], device[1], (memory.keepalive, self.buffer),
            on_release=lambda: backend.export_held(index, -1),
        )

    def __array__(self, dtype: object = None, copy: object = None) -> Any:
        memory = self._backend().export(self.buffer, self, "__array__")
        if memory.device != "cpu":
            raise TypeError(
                f"allocation #{self.buffer.index} is device memory: numpy cannot read it in place; "
                f"copy it with backend.copy_to_host, or hand it to CuPy or PyTorch"
            )
        import numpy as np

        host: Any = memory.keepalive  # a numpy uint8 view of the fake's memory: it keeps the bytes alive
        array = host[: self.nbytes].view(self.dtype).reshape(self.shape)
        if dtype is not None:
            try:
                wanted = np.dtype(dtype)  # type: ignore[call-overload]
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"__array__: dtype {reprlib.repr(dtype)} is not a numpy dtype; pass one such as 'float32'"
                ) from None
            return array.astype(wanted, copy=bool(copy) or wanted != array.dtype)
        return array.copy() if copy else array
