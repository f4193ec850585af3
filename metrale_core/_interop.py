"""Interop with the array ecosystem: typed views of device memory that CuPy, PyTorch, Numba
and numpy can take without a copy (the CUDA array interface, DLPack, numpy's ``__array__``).

A :class:`DeviceArray` is a typed, shaped view of a :class:`~metrale_core.DeviceBuffer`
(``buf.view(dtype, shape)``; the buffer itself exports as one-dimensional ``uint8``). Every
export asks the buffer's backend, which checks that the buffer is live, waits for the work
it issued (so a consumer sees every write before the export), and says how the memory is
addressed: device memory on CUDA, host memory on the fake.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._dlpack import DLPACK_CPU, DLPACK_CUDA, DTYPES, c_contiguous, itemsize, make_capsule, read_capsule
from ._errors import InvalidArgumentError
from ._raw import ForeignMemory

if TYPE_CHECKING:
    from ._types import DeviceBuffer

__all__ = ["DeviceArray", "dtype_name", "foreign_memory"]



def dtype_name(dtype: object) -> str:
    """The name of ``dtype`` (a string, a numpy dtype or scalar type), checked against the ones metrale exports."""
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None) or getattr(dtype, "__name__", None)
    if not isinstance(name, str) or itemsize(name) is None:
        raise InvalidArgumentError(
            f"view: dtype {dtype!r} is not one metrale exports; use one of {', '.join(DTYPES)}"
        )
    return name


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
            raw: Any = (shape,) if isinstance(shape, int) else shape
            try:
                parts = list(raw)
                dims = tuple(int(d) for d in parts)
            except (TypeError, ValueError):
                raise InvalidArgumentError(f"view: shape must be an int or a tuple of ints, got {shape!r}") from None
            if any(d < 0 for d in dims) or any(isinstance(d, bool | float) for d in parts):
                raise InvalidArgumentError(f"view: shape must hold counts >= 0, got {shape!r}")
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

    def _backend(self) -> Any:
        owner = self.buffer._owner
        backend = owner() if owner is not None else None
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
        if backend._export(self.buffer, self, what, wait=False).device != "cuda":
            # AttributeError, so hasattr() says no (without waiting for the device) and a consumer tries
            # another protocol
            raise AttributeError(f"backend memory of allocation #{self.buffer.index} is not CUDA memory")
        memory = backend._export(self.buffer, self, what)
        return {
            "shape": self.shape,
            "typestr": _typestr(self.dtype, self.itemsize),
            "data": (memory.address, False),
            "version": 3,
            "strides": None,
            "stream": None,  # the export waited for the backend's work: nothing to synchronize with
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        memory = self._backend()._export(self.buffer, self, "__dlpack_device__", wait=False)
        return (DLPACK_CUDA, memory.device_id) if memory.device == "cuda" else (DLPACK_CPU, 0)

    def __dlpack__(
        self, *, stream: object = None, max_version: object = None, dl_device: object = None, copy: object = None
    ) -> object:
        if copy is True:
            raise BufferError("metrale exports its memory without copying (copy=True asked for a copy)")
        backend = self._backend()
        memory = backend._export(self.buffer, self, "__dlpack__")
        device = (DLPACK_CUDA, memory.device_id) if memory.device == "cuda" else (DLPACK_CPU, 0)
        wanted: Any = dl_device
        if wanted is not None and tuple(wanted) != device:
            raise BufferError(f"metrale's memory is on DLPack device {device}, not {dl_device}")
        index = self.buffer.index
        backend._export_held(index, +1)
        return make_capsule(
            memory.address, self.shape, self.dtype, device[0], device[1], (memory.keepalive, self.buffer),
            on_release=lambda: backend._export_held(index, -1),
        )

    def __array__(self, dtype: object = None, copy: object = None) -> Any:
        memory = self._backend()._export(self.buffer, self, "__array__")
        if memory.device != "cpu":
            raise TypeError(
                f"allocation #{self.buffer.index} is device memory: numpy cannot read it in place; "
                f"copy it with backend.copy_to_host, or hand it to CuPy or PyTorch"
            )
        import numpy as np

        host = memory.keepalive  # a numpy uint8 view of the fake's memory: it keeps the bytes alive
        array = host[: self.nbytes].view(self.dtype).reshape(self.shape)
        if dtype is not None:
            return array.astype(dtype, copy=bool(copy) or np.dtype(dtype) != array.dtype)  # type: ignore[call-overload]
        return array.copy() if copy else array


def foreign_memory(obj: object) -> tuple[ForeignMemory, Callable[[], None] | None]:
    """What ``obj`` (a CUDA-array-interface, DLPack or buffer-protocol exporter) holds, and how to give
    it back; raises :class:`~metrale_core.InvalidArgumentError` for anything metrale cannot wrap."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if isinstance(cai, dict):
        data = cai.get("data")
        shape = tuple(cai.get("shape", ()))
        typestr = str(cai.get("typestr", ""))
        if not isinstance(data, tuple) or len(data) != 2 or not typestr[2:].isdigit():
            raise InvalidArgumentError(f"wrap: {type(obj).__name__}'s __cuda_array_interface__ is malformed: {cai!r}")
        if data[1]:
            raise InvalidArgumentError(f"wrap: {type(obj).__name__} exports read-only memory; metrale writes")
        size = int(typestr[2:])
        if cai.get("mask") is not None or not c_contiguous(shape, cai.get("strides"), size):
            raise InvalidArgumentError(f"wrap: {type(obj).__name__} is not C-contiguous; pass a contiguous copy")
        nbytes = math.prod(shape) * size
        if nbytes == 0 or not data[0]:
            raise InvalidArgumentError(f"wrap: {type(obj).__name__} holds no bytes; nothing to wrap")
        return ForeignMemory("cuda", -1, int(data[0]), nbytes, obj), None
    if hasattr(obj, "__dlpack__"):
        try:
            tensor = read_capsule(obj.__dlpack__())
        except (ValueError, BufferError, TypeError) as exc:
            raise InvalidArgumentError(f"wrap: {type(obj).__name__}'s DLPack export cannot be wrapped: {exc}") from None
        kinds = {DLPACK_CUDA: "cuda", DLPACK_CPU: "cpu"}
        device = kinds.get(tensor.device_type)
        if device is None or tensor.nbytes == 0:
            tensor.release()
            what = "holds no bytes" if device else f"is on DLPack device type {tensor.device_type}, not CUDA or CPU"
            raise InvalidArgumentError(f"wrap: {type(obj).__name__} {what}")
        memory = ForeignMemory(device, tensor.device_id, tensor.data, tensor.nbytes, obj)  # type: ignore[arg-type]
        return memory, tensor.release
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(
            f"wrap: {type(obj).__name__} exports neither __cuda_array_interface__, __dlpack__ nor a buffer"
        ) from None
    if view.readonly or not view.c_contiguous or view.nbytes == 0:
        raise InvalidArgumentError(f"wrap: {type(obj).__name__} must be writable, C-contiguous and not empty")
    flat = view.cast("B")
    anchor = (ctypes.c_char * flat.nbytes).from_buffer(flat)
    return ForeignMemory("cpu", 0, ctypes.addressof(anchor), flat.nbytes, (obj, flat, anchor)), None
