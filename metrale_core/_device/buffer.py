"""Handles to device memory: [`DeviceBuffer`][metrale_core.DeviceBuffer] and its typed view
[`DeviceArray`][metrale_core.DeviceArray].

A buffer is an immutable value (pointer, size, kind, creation index, call site) with a weak
reference to the device context that made it, its owner. Whether it is live is the owner's
to say, by the buffer's creation index and the size the owner recorded, never by the
address or size the buffer carries. Both export themselves to other array libraries (the
CUDA array interface, DLPack, numpy's ``__array__``) through their owner's export table
(`BufferOwner`), which checks liveness and waits for the device's work first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import reprlib
import sys
from typing import TYPE_CHECKING, Any, Final, Protocol, final, runtime_checkable

from .._errors import InvalidArgumentError
from .._interop.dlpack import (
    DLPACK_CPU,
    DLPACK_CUDA,
    DLPACK_VERSION,
    DTYPES,
    ML_DTYPES,
    itemsize,
    make_capsule,
    numpy_dtype,
)
from .._types import CLASS_SWAP, WORD_LIMIT, ForeignMemory, as_index
from .args import shape as shape_rule

if TYPE_CHECKING:
    from typing_extensions import CapsuleType  # (pydantic's dependency; types.CapsuleType from Python 3.13)

__all__ = ["NO_SYNC", "BufferOwner", "DeviceArray", "DeviceBuffer", "PeerSource", "StreamOrdering", "dtype_name"]

#: DLPack's ``stream=-1``: the consumer asks the producer for no synchronization at all.
NO_SYNC: Final = -1


class BufferOwner(Protocol):
    """What a buffer's exports ask of the backend that owns it (the export table)."""

    def export(self, buf: DeviceBuffer, view: DeviceArray, what: str, *, wait: bool = True) -> ForeignMemory:
        """How other libraries address ``buf``, checked live; with ``wait``, after the device's work."""

    def export_held(self, index: int, delta: int) -> None:
        """Count the DLPack tensors of allocation ``index`` a consumer still holds."""


@runtime_checkable
class StreamOrdering(Protocol):
    """What an export table that orders a DLPack consumer's stream offers besides `BufferOwner`
    (a closed backend's table does not: its ``export`` refuses every export)."""

    def export_for_stream(self, buf: DeviceBuffer, view: DeviceArray, what: str, stream: int) -> ForeignMemory:
        """`BufferOwner.export` for a consumer that names its DLPack ``stream``: the backend's work is
        ordered before that stream on the device, not waited for (none at all for `NO_SYNC`)."""


@runtime_checkable
class PeerSource(Protocol):
    """What an export table offers another backend of the process that copies from its buffers
    (``copy_peer``); a closed backend's table does not."""

    def peer_source(
        self, buf: DeviceBuffer, offset: int, nbytes: int | None, what: str
    ) -> contextlib.AbstractContextManager[tuple[int, int, Any]]:
        """While the ``with`` block runs, the source backend stays open (its ``close()`` waits): yields
        ``(pointer, nbytes, raw device)`` of bytes of ``buf``, checked live and in bounds, the raw device
        being the plugin's, which the copying backend's plugin reads them from. A closed backend is an
        ``InvalidBufferError``."""

    def peer_is_live(self, buf: DeviceBuffer) -> bool:
        """Whether ``buf`` is still a live buffer of this (open) backend: for a graph that copies from it."""


@final
@dataclasses.dataclass(frozen=True, slots=True)
class DeviceBuffer:
    """A handle to device memory. Immutable; liveness is the backend's to say.

    :param ptr: the device address handed to the user (256-byte aligned).
    :param nbytes: the bytes asked for (never rounded or padded).
    :param kind: ``"device"``, ``"managed"``, ``"arena"``, or ``"external"`` (another
        library's memory, from [`GpuBackend.wrap`][metrale_core.GpuBackend.wrap]).
    :param index: the creation index, from one per-process sequence.
    :param site: the caller's ``"file:line"``.

    A buffer from a backend exports itself to other array libraries as one-dimensional
    ``uint8`` (``__cuda_array_interface__``, ``__dlpack__``, and ``__array__`` on the fake);
    [`view`][metrale_core.DeviceBuffer.view] gives a typed, shaped [`DeviceArray`][metrale_core.DeviceArray].
    """

    ptr: int
    nbytes: int
    kind: str
    index: int
    site: str
    #: A weak reference to the `DeviceContext` that made it (its owner:
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
    ) -> CapsuleType:
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
        value in `_Unfrozen`, a class of the same slots whose plain ``__init__`` stores them
        directly, and then gives it this class (allowed: the layouts are the same). Only for
        ``DeviceBuffer`` itself: a subclass goes through its own ``__init__``; so does every buffer on a
        free-threaded build, where assigning ``__class__`` stops every thread (`CLASS_SWAP`).
        """
        if cls is not DeviceBuffer or not CLASS_SWAP:
            return cls(ptr, nbytes, kind, index, site, owner)
        buf: Any = _Unfrozen(ptr, nbytes, kind, index, site, owner)
        buf.__class__ = DeviceBuffer
        return buf  # type: ignore[no-any-return]


@final
class _Unfrozen:
    """[`DeviceBuffer`][metrale_core.DeviceBuffer]'s slots with a plain ``__init__``: how `DeviceBuffer._make` builds
    one."""

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
    """The name of ``dtype`` (a string, a numpy dtype or scalar type), checked against the ones metrale exports.

    ``bfloat16`` and the float8 types (`ML_DTYPES`) need the optional package
    ``ml_dtypes``, imported here on first use: without it they are refused with advice to install it.
    """
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
    if name in ML_DTYPES:
        try:
            numpy_dtype(name)
        except ImportError:
            raise InvalidArgumentError(
                f"view: dtype {name} comes from the optional package ml_dtypes, which is not installed; "
                f"install it with: pip install 'ml-dtypes>=0.5'"
            ) from None
        except AttributeError:  # float8_e3m4, float8_e4m3 and float8_e8m0fnu came in ml_dtypes 0.5
            raise InvalidArgumentError(
                f"view: dtype {name} is not in the installed ml_dtypes (it came in 0.5); upgrade it with: "
                f"pip install 'ml-dtypes>=0.5'"
            ) from None
    return name


def _typestr(name: str, size: int) -> str:
    return ("|" if size == 1 else "<") + name[0] + str(size)


def _pair(value: object) -> tuple[int | None, ...]:
    """The first three items of ``value`` as integers (``None`` where one is not), for a check that there
    are exactly two; ``()`` for what is not iterable or fails to be read. Never more than three are read:
    an endless iterator is refused, not run."""
    try:
        return tuple(as_index(part) for part in itertools.islice(value, 3))  # type: ignore[call-overload]
    except Exception:  # not iterable, or an iterable that fails
        return ()


def _dlpack_version(max_version: object) -> tuple[int, int] | None:
    """The DLPack version to export for a consumer's ``max_version``: ``None`` (the legacy capsule) for
    ``None`` or a major version 0, else the newest 1.x both sides know."""
    if max_version is None:
        return None
    if type(max_version) is tuple and len(max_version) == 2 and all(type(part) is int for part in max_version) \
            and max_version == (1, 0):  # numpy's, the common case (1.0 == 1: the types are checked first)
        return (1, 0)
    parts = _pair(max_version)
    if len(parts) != 2 or None in parts or any(part < 0 for part in parts if part is not None):
        raise InvalidArgumentError(
            f"__dlpack__: max_version must be None or a (major, minor) pair of integers, "
            f"got {reprlib.repr(max_version)}"
        )
    major, minor = parts
    assert major is not None and minor is not None
    if major < 1:
        return None
    return DLPACK_VERSION if major > 1 else (1, min(minor, DLPACK_VERSION[1]))


def _dlpack_stream(stream: object) -> int | None:
    """A consumer's ``stream`` checked as DLPack has it: ``None``, -1 (no synchronization), 1 (CUDA's legacy
    default stream), 2 (the per-thread default stream) or a stream's address; never 0, which is ambiguous."""
    if stream is None:
        return None
    value = as_index(stream)
    if value is None or value == 0 or not NO_SYNC <= value < WORD_LIMIT:
        raise InvalidArgumentError(
            f"__dlpack__: stream must be None, -1 (no synchronization), 1 (the legacy default stream), "
            f"2 (the per-thread default stream) or a CUDA stream's address, got {reprlib.repr(stream)}"
        )
    return value


@final
class DeviceArray:
    """A typed, C-contiguous view of a device buffer, for other array libraries. Made by
    [`DeviceBuffer.view`][metrale_core.DeviceBuffer.view].

    - ``__cuda_array_interface__`` (version 3) on a backend whose memory is CUDA device memory;
    - ``__dlpack__`` / ``__dlpack_device__``: a DLPack tensor on the CUDA device, or on the CPU
      for the fake backend, whose device memory is host memory;
    - ``__array__`` on the fake: a numpy array over the fake's device memory, no copy.

    ``dtype`` is one of `DTYPES`: numpy's integer and float types,
    and ``bfloat16`` and the float8 types through the optional package ``ml_dtypes`` (DLPack
    names them; the CUDA array interface cannot, so those views export through DLPack only).

    Each export comes after the backend's work: ``__dlpack__(stream=s)`` orders the consumer's
    stream ``s`` after it on the device, every other export waits for it. A consumer that holds
    a view while the buffer is freed points at freed memory: ``free`` logs a WARNING when it
    knows of one (a ``DeviceArray`` still referenced, or a DLPack tensor not yet released).
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
            dims = shape_rule(shape)
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
        if self.dtype in ML_DTYPES:  # numpy's type strings have no name for them ("<V2" is any 2 bytes)
            raise AttributeError(
                f"the CUDA array interface has no type string for {self.dtype}; export it with DLPack "
                f"(torch.from_dlpack), which names it"
            )
        memory = backend.export(self.buffer, self, what)
        return {
            "shape": self.shape,
            "typestr": _typestr(self.dtype, self.itemsize),
            "data": (memory.address, False),
            "version": 3,
            "strides": None,
            # the export waited for the backend's work: nothing to synchronize with (the interface lets no
            # consumer name its stream, and PyTorch's consumer ignores this key, so naming metrale's stream
            # here instead of waiting would let it read memory still being written)
            "stream": None,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        memory = self._backend().export(self.buffer, self, "__dlpack_device__", wait=False)
        return (DLPACK_CUDA, memory.device_id) if memory.device == "cuda" else (DLPACK_CPU, 0)

    def __dlpack__(
        self, *, stream: object = None, max_version: object = None, dl_device: object = None, copy: object = None
    ) -> CapsuleType:
        """A DLPack capsule of this view (the Python array API's protocol, 2023.12).

        ``max_version`` with a major version of 1 or more gets a ``"dltensor_versioned"`` capsule
        (writable: the read-only flag cleared), else the legacy ``"dltensor"``. ``stream`` is the
        consumer's: ``None`` waits for the backend's work on the host; an integer (1 or 2, CUDA's
        default streams, or a stream's address) orders that stream after the backend's work on
        the device, with no host wait; -1 asks for no synchronization. ``copy=True`` and a
        ``dl_device`` of another device are DLPack's ``BufferError``: metrale exports its memory
        in place. Malformed arguments are an ``InvalidArgumentError``.
        """
        if copy is True:
            raise BufferError("metrale exports its memory without copying (copy=True asked for a copy)")
        if copy is not None and copy is not False:
            raise InvalidArgumentError(f"__dlpack__: copy must be None, False or True, got {reprlib.repr(copy)}")
        version = _dlpack_version(max_version)
        order = _dlpack_stream(stream)
        asked: tuple[int | None, ...] | None = None
        if dl_device is not None:
            asked = _pair(dl_device)
            if len(asked) != 2 or None in asked:
                raise InvalidArgumentError(
                    f"__dlpack__: dl_device must be a (device type, device id) pair of integers, "
                    f"got {reprlib.repr(dl_device)}"
                )
        backend = self._backend()
        if asked is not None and asked != (device := self.__dlpack_device__()):  # refused before any wait
            raise BufferError(f"metrale's memory is on DLPack device {device}, not {dl_device}")
        if order is not None and isinstance(backend, StreamOrdering):
            memory = backend.export_for_stream(self.buffer, self, "__dlpack__", order)
        else:
            memory = backend.export(self.buffer, self, "__dlpack__")
        device = (DLPACK_CUDA, memory.device_id) if memory.device == "cuda" else (DLPACK_CPU, 0)
        index = self.buffer.index
        backend.export_held(index, +1)
        try:
            return make_capsule(
                memory.address, self.shape, self.dtype, device[0], device[1], (memory.keepalive, self.buffer),
                on_release=lambda: backend.export_held(index, -1), version=version,
            )
        except BaseException:
            backend.export_held(index, -1)
            raise

    def __array__(self, dtype: object = None, copy: object = None) -> Any:
        memory = self._backend().export(self.buffer, self, "__array__")
        if memory.device != "cpu":
            raise TypeError(
                f"allocation #{self.buffer.index} is device memory: numpy cannot read it in place; "
                f"copy it with backend.copy_to_host, or hand it to CuPy or PyTorch"
            )
        import numpy as np

        host: Any = memory.keepalive  # a numpy uint8 view of the fake's memory: it keeps the bytes alive
        array = host[: self.nbytes].view(numpy_dtype(self.dtype)).reshape(self.shape)
        if dtype is not None:
            try:
                wanted = np.dtype(dtype)  # type: ignore[call-overload]
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"__array__: dtype {reprlib.repr(dtype)} is not a numpy dtype; pass one such as 'float32'"
                ) from None
            return array.astype(wanted, copy=bool(copy) or wanted != array.dtype)
        return array.copy() if copy else array
