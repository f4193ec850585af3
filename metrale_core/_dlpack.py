"""DLPack, the unversioned ``"dltensor"`` capsule, with ctypes: made for exports, read for imports.

The structs follow ``dlpack.h`` (v0.8, the layout every consumer reads):
``DLManagedTensor { DLTensor dl_tensor; void *manager_ctx; void (*deleter)(DLManagedTensor *); }``.
A capsule this module makes owns one ``DLManagedTensor`` and the Python objects
that keep its memory valid; they are let go when the consumer calls the deleter,
or when the capsule is destroyed unconsumed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

__all__ = [
    "DLPACK_CPU", "DLPACK_CUDA", "DTYPES", "ImportedTensor", "c_contiguous", "itemsize", "make_capsule", "read_capsule",
]

DLPACK_CPU: Final = 1  # kDLCPU
DLPACK_CUDA: Final = 2  # kDLCUDA
_NAME: Final = b"dltensor"
_USED: Final = b"used_dltensor"


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

# code: 0 int, 1 uint, 2 float (dlpack.h's kDLInt, kDLUInt, kDLFloat)
_CODES: Final[dict[str, tuple[int, int]]] = {
    "int8": (0, 8), "int16": (0, 16), "int32": (0, 32), "int64": (0, 64),
    "uint8": (1, 8), "uint16": (1, 16), "uint32": (1, 32), "uint64": (1, 64),
    "float16": (2, 16), "float32": (2, 32), "float64": (2, 64),
}
_NAMES: Final = {v: k for k, v in _CODES.items()}
#: The dtype names metrale exports and imports.
DTYPES: Final = tuple(_CODES)


def itemsize(name: str) -> int | None:
    """The bytes of one element of dtype ``name`` (such as ``"float32"``); ``None`` if not one of :data:`DTYPES`."""
    code = _CODES.get(name)
    return None if code is None else code[1] // 8


def c_contiguous(shape: tuple[int, ...], byte_strides: Sequence[int] | None, size: int) -> bool:
    """Whether elements of ``size`` bytes with ``byte_strides`` (``None``: packed) lie C-contiguous."""
    if byte_strides is None:
        return True
    expected = size
    for extent, stride in zip(reversed(shape), reversed(tuple(byte_strides)), strict=True):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_set_name = ctypes.pythonapi.PyCapsule_SetName
_capsule_set_name.restype = ctypes.c_int
_capsule_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]
# The destructor gets the capsule as a borrowed PyObject *; these variants take it as an address.
_raw_is_valid_fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_raw_get_pointer_fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)

# Live exports: the managed tensor's address -> what keeps it and its memory valid, and who to tell.
_LIVE: dict[int, tuple[Any, ...]] = {}
_LIVE_LOCK = threading.Lock()


def _release(address: int) -> None:
    with _LIVE_LOCK:
        entry = _LIVE.pop(address, None)
    if entry is not None:
        on_release = entry[0]
        if on_release is not None:
            on_release()


def _on_delete(managed: Any) -> None:  # called by the consumer when it is done with the tensor
    _release(ctypes.addressof(managed.contents))


def _on_capsule_death(capsule: int) -> None:  # the capsule died unconsumed: its tensor is ours to let go
    if _raw_is_valid_fn(capsule, _NAME):
        address = _raw_get_pointer_fn(capsule, _NAME)
        if address:
            _release(address)


# The C callbacks; module globals, so they live as long as any capsule that points at them.
_deleter: Any = _Deleter(_on_delete)
_capsule_destructor: Any = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_on_capsule_death)


def make_capsule(
    data: int,
    nbytes_shape: tuple[int, ...],
    dtype: str,
    device_type: int,
    device_id: int,
    keepalive: object,
    on_release: Callable[[], None] | None = None,
) -> object:
    """A ``"dltensor"`` capsule of a C-contiguous tensor of ``dtype`` with ``nbytes_shape`` at ``data``.

    ``keepalive`` is held until the consumer lets go (or the capsule dies
    unconsumed); then ``on_release`` is called.
    """
    code, bits = _CODES[dtype]
    managed = _DLManagedTensor()
    shape = (ctypes.c_int64 * max(len(nbytes_shape), 1))(*nbytes_shape)
    tensor = managed.dl_tensor
    tensor.data = data
    tensor.device = _DLDevice(device_type, device_id)
    tensor.ndim = len(nbytes_shape)
    tensor.dtype = _DLDataType(code, bits, 1)
    tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = None  # C-contiguous
    tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _deleter
    address = ctypes.addressof(managed)
    with _LIVE_LOCK:
        _LIVE[address] = (on_release, managed, shape, keepalive)
    return _capsule_new(address, _NAME, ctypes.cast(_capsule_destructor, ctypes.c_void_p))


def live_exports() -> int:
    """How many capsules made here are still held by a consumer (or not yet consumed)."""
    with _LIVE_LOCK:
        return len(_LIVE)


@dataclasses.dataclass(frozen=True, slots=True)
class ImportedTensor:
    """What a ``"dltensor"`` capsule of someone else's describes. ``release()`` gives it back."""

    data: int
    nbytes: int
    device_type: int
    device_id: int
    dtype: str
    shape: tuple[int, ...]
    _release: Callable[[], None]

    def release(self) -> None:
        """Call the producer's deleter (once)."""
        self._release()


def read_capsule(capsule: object) -> ImportedTensor:
    """Consume a ``"dltensor"`` capsule: rename it ``"used_dltensor"`` and describe its tensor.

    Raises ``ValueError`` for a capsule that is not an unconsumed ``"dltensor"``, or a tensor
    that is not C-contiguous or has a dtype this module does not name.
    """
    if not _capsule_is_valid(capsule, _NAME):
        raise ValueError("not an unconsumed DLPack capsule (\"dltensor\")")
    address = _capsule_get_pointer(capsule, _NAME)
    managed = ctypes.cast(address, ctypes.POINTER(_DLManagedTensor)).contents
    tensor = managed.dl_tensor
    ndim = tensor.ndim
    if ndim < 0 or (ndim and not tensor.shape):
        raise ValueError(f"a DLPack tensor of {ndim} dimensions without a shape")
    shape = tuple(tensor.shape[i] for i in range(ndim))
    if any(extent < 0 for extent in shape):
        raise ValueError(f"a DLPack tensor with a negative extent: shape {shape}")
    name = _NAMES.get((tensor.dtype.code, tensor.dtype.bits))
    if name is None or tensor.dtype.lanes != 1:
        raise ValueError(f"a DLPack dtype metrale does not name (code {tensor.dtype.code}, bits {tensor.dtype.bits})")
    size = tensor.dtype.bits // 8
    strides = [tensor.strides[i] * size for i in range(ndim)] if tensor.strides else None
    if not c_contiguous(shape, strides, size):
        raise ValueError("a DLPack tensor that is not C-contiguous; pass a contiguous copy")
    _capsule_set_name(capsule, _USED)
    done = threading.Lock()
    released = [False]
    deleter = managed.deleter

    def release() -> None:
        with done:
            if released[0]:
                return
            released[0] = True
        if deleter:
            deleter(ctypes.pointer(managed))

    return ImportedTensor(
        data=(tensor.data or 0) + tensor.byte_offset,
        nbytes=math.prod(shape) * size,
        device_type=tensor.device.device_type,
        device_id=tensor.device.device_id,
        dtype=name,
        shape=shape,
        _release=release,
    )
