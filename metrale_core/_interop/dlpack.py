"""DLPack capsules with ctypes: made for exports, read for imports; both forms of the protocol.

The structs follow ``dlpack.h`` (1.1): the versioned form DLPack 1.0 introduced,
``DLManagedTensorVersioned { DLPackVersion version; void *manager_ctx; void (*deleter)(...);
uint64_t flags; DLTensor dl_tensor; }`` in a ``"dltensor_versioned"`` capsule, made when the
consumer passes ``max_version`` with a major version of 1 or more; and the legacy form,
``DLManagedTensor { DLTensor dl_tensor; void *manager_ctx; void (*deleter)(...); }`` in a
``"dltensor"`` capsule, for consumers that ask for no version. A capsule made here owns one
managed tensor and the Python objects that keep its memory valid (`_LIVE`, by the
tensor's address); they are let go exactly once, by `reap`, whichever comes first of the
consumer's call of the deleter (it renamed the capsule ``"used_..."`` and owns the tensor) and
the capsule's death unconsumed (still named ``"dltensor..."``, held by this module alone). The
deleter is a C callback made by ctypes, which takes the GIL itself: a consumer may call it from
any thread, with or without the GIL (PyTorch drops it); it only records the address. The capsules
have no destructor: see `reap` for why.

Why ctypes and not numpy's or cuda-python's producers: numpy's ``ndarray.__dlpack__`` exports
only numpy's own CPU arrays, and cuda.core's ``Buffer.__dlpack__`` exports bytes (one
dimension, ``int8``) and needs cuda.core, which the backend-neutral core cannot; one producer
here serves every backend and every dtype, so the fake's tests run the capsule code the CUDA
backend ships.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import math
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from typing_extensions import CapsuleType  # (pydantic's dependency; types.CapsuleType from Python 3.13)

__all__ = [
    "DLPACK_CPU", "DLPACK_CUDA", "DLPACK_VERSION", "DTYPES", "ML_DTYPES", "ImportedTensor", "c_contiguous", "itemsize",
    "live_exports", "make_capsule", "numpy_dtype", "read_capsule",
]

DLPACK_CPU: Final = 1  # kDLCPU
DLPACK_CUDA: Final = 2  # kDLCUDA
#: The newest DLPack version this module writes (``dlpack.h`` 1.1: the float8 type codes).
DLPACK_VERSION: Final = (1, 1)
#: ``DLPACK_FLAG_BITMASK_READ_ONLY``: the consumer must not write.
FLAG_READ_ONLY: Final = 1
_LEGACY: Final = b"dltensor"
_VERSIONED: Final = b"dltensor_versioned"
_LEGACY_USED: Final = b"used_dltensor"
_VERSIONED_USED: Final = b"used_dltensor_versioned"


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    # ``shape`` and ``strides`` are ``int64_t *`` in C; declared as addresses here (the same layout), set
    # and read as integers
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64),
    ]


#: ``void (*deleter)(DLManagedTensor[Versioned] *self)``, its argument taken as an address (the same ABI).
_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


# (code, bits) of each dtype: dlpack.h's kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, and the float8
# codes of DLPack 1.1 (kDLFloat8_e3m4 7 ... kDLFloat8_e8m0fnu 14)
_CODES: Final[dict[str, tuple[int, int]]] = {
    "int8": (0, 8), "int16": (0, 16), "int32": (0, 32), "int64": (0, 64),
    "uint8": (1, 8), "uint16": (1, 16), "uint32": (1, 32), "uint64": (1, 64),
    "float16": (2, 16), "float32": (2, 32), "float64": (2, 64),
    "bfloat16": (4, 16),
    "float8_e3m4": (7, 8), "float8_e4m3": (8, 8), "float8_e4m3b11fnuz": (9, 8), "float8_e4m3fn": (10, 8),
    "float8_e4m3fnuz": (11, 8), "float8_e5m2": (12, 8), "float8_e5m2fnuz": (13, 8), "float8_e8m0fnu": (14, 8),
}
_NAMES: Final = {v: k for k, v in _CODES.items()}
#: The dtype names metrale exports and imports.
DTYPES: Final = tuple(_CODES)
#: The ones numpy knows only through the optional package ``ml_dtypes`` (the one JAX uses).
ML_DTYPES: Final = frozenset(name for name, (code, _) in _CODES.items() if code > 2)


def itemsize(name: str) -> int | None:
    """The bytes of one element of dtype ``name`` (such as ``"float32"``); ``None`` if not one of `DTYPES`."""
    code = _CODES.get(name)
    return None if code is None else code[1] // 8


def numpy_dtype(name: str) -> Any:
    """numpy's dtype of ``name`` (one of `DTYPES`); ``bfloat16`` and the float8 types through ``ml_dtypes``.

    Raises ``ImportError`` when ``name`` needs ``ml_dtypes`` and it is not installed.
    """
    import numpy as np

    if name in ML_DTYPES:
        return np.dtype(getattr(importlib.import_module("ml_dtypes"), name))
    return np.dtype(name)


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


def _c_strides(shape: tuple[int, ...]) -> list[int]:
    """The strides, in elements, of a C-contiguous tensor of ``shape``."""
    strides = [1] * len(shape)
    step = 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = step
        step *= max(shape[i], 1)
    return strides


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

# Live exports: the managed tensor's address -> [on_release, the block holding it, keepalive, the capsule while
# it may die unconsumed (else None), its name]. The block is a ctypes array: its memory stays valid exactly
# as long as its entry here.
_LIVE: dict[int, list[Any]] = {}
_LIVE_LOCK = threading.Lock()
#: Addresses of managed tensors whose deleter a consumer called, let go at the next `reap`.
_DELETED: dict[int, None] = {}
#: `reap` looks for capsules dropped unconsumed once `_LIVE` holds ``_SCAN_AT[0]`` entries (then twice as many as
#: it left), and always when asked directly (`live_exports`, a ``free`` that checks for held tensors).
_SCAN_AT = [64]


def _on_delete(address: int | None, _deleted: dict[int, None] = _DELETED) -> None:
    """The deleter a consumer calls (either form), from any thread, perhaps with its own exception pending
    or while the interpreter shuts down: it only records the address, one store and no call (any call
    would turn a pending exception into a ``SystemError``), and `reap` does the rest."""
    if address:
        _deleted[address] = None


def reap(*, scan: bool = True) -> None:
    """Let go of the exports that are done: those whose deleter ran, and (with ``scan``) those whose capsule
    died unconsumed, which only this module still holds. Their ``on_release`` runs here, on the caller's
    thread, outside every lock of this module.

    A capsule made here has no destructor: a destructor runs Python code wherever the capsule dies, in a
    consumer's error path (numpy refusing a dtype drops the capsule with its exception pending: a Python
    callback then replaces that exception with a ``SystemError``) or at interpreter exit after the callback's
    code is gone (a crash). Holding the capsule and looking at its reference count here costs neither."""
    released: list[Any] = []
    with _LIVE_LOCK:
        while _DELETED:
            address = _DELETED.popitem()[0]
            entry = _LIVE.pop(address, None)
            if entry is not None:
                released.append(entry[0])
        if scan:
            for address, entry in list(_LIVE.items()):
                capsule = entry[3]
                # three references: the entry, `capsule` and getrefcount's argument; more: a consumer holds it
                if capsule is None or sys.getrefcount(capsule) > 3:
                    continue
                if _capsule_is_valid(capsule, entry[4]):  # unconsumed, and nobody else holds it: ours to let go
                    del _LIVE[address]
                    released.append(entry[0])
                else:  # consumed (renamed "used_..."): the consumer calls the deleter when it is done
                    entry[3] = None
            _SCAN_AT[0] = max(64, 2 * len(_LIVE))
    for on_release in released:
        if on_release is not None:
            on_release()


def _immortal(callback: Any) -> Any:
    """Keep a ctypes callback for the life of the process: a consumer may call it during the interpreter's
    final collection, after module globals are gone, and its code must still be there."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(callback))
    return callback


# The C callback every managed tensor names as its deleter.
_deleter: Any = _immortal(_Deleter(_on_delete))


# The structs as ``make_capsule`` writes them, in one ``struct.pack_into`` each (native sizes and alignment, as
# the C compiler lays them out): far cheaper than setting a ctypes structure field by field. The ctypes
# structures above are the reference: the layouts are checked against them at import.
_VERSIONED_HEAD: Final = struct.Struct("@IIPPQ" "PiiiBBHPPQ")  # version, manager_ctx, deleter, flags, dl_tensor
_LEGACY_HEAD: Final = struct.Struct("@PiiiBBHPPQ" "PP")  # dl_tensor, manager_ctx, deleter
assert _VERSIONED_HEAD.size == ctypes.sizeof(_DLManagedTensorVersioned)
assert _LEGACY_HEAD.size == ctypes.sizeof(_DLManagedTensor)
assert _DLManagedTensorVersioned.dl_tensor.offset == 32 and _DLManagedTensor.manager_ctx.offset == 48
assert _DLTensor.shape.offset == 24 and _DLTensor.byte_offset.offset == 40 and ctypes.sizeof(_DLTensor) == 48
_deleter_address: Final = ctypes.cast(_deleter, ctypes.c_void_p).value


def make_capsule(
    data: int,
    nbytes_shape: tuple[int, ...],
    dtype: str,
    device_type: int,
    device_id: int,
    keepalive: object,
    on_release: Callable[[], None] | None = None,
    *,
    version: tuple[int, int] | None = None,
    read_only: bool = False,
) -> CapsuleType:
    """A capsule of a C-contiguous tensor of ``dtype`` with ``nbytes_shape`` at ``data``.

    With ``version`` (``(1, minor)``), a ``"dltensor_versioned"`` capsule of that version whose
    ``DLPACK_FLAG_BITMASK_READ_ONLY`` says ``read_only``; without, a legacy ``"dltensor"`` capsule
    (which cannot say read-only: consumers take it as writable, or as numpy does, as read-only).
    ``keepalive`` is held until the consumer lets go (or the capsule dies unconsumed); then
    ``on_release`` is called (never, if this raises). The strides are always given (DLPack 1.2 requires
    them for ``ndim > 0``).

    The managed tensor, its shape and its strides lie in one block of 8-byte words, owned by the
    entry in `_LIVE` that the release removes.
    """
    code, bits = _CODES[dtype]
    ndim = len(nbytes_shape)
    head = _LEGACY_HEAD if version is None else _VERSIONED_HEAD
    block = (ctypes.c_uint64 * (head.size // 8 + 2 * ndim))()
    address = ctypes.addressof(block)
    shape = address + head.size if ndim else 0
    strides = shape + 8 * ndim if ndim else 0
    tensor = (data, device_type, device_id, ndim, code, bits, 1, shape, strides, 0)
    if version is None:
        head.pack_into(block, 0, *tensor, 0, _deleter_address)
        name = _LEGACY
    else:
        flags = FLAG_READ_ONLY if read_only else 0
        head.pack_into(block, 0, version[0], version[1], 0, _deleter_address, flags, *tensor)
        name = _VERSIONED
    if ndim:
        struct.pack_into(f"@{2 * ndim}q", block, head.size, *nbytes_shape, *_c_strides(nbytes_shape))
    if _DELETED or len(_LIVE) >= _SCAN_AT[0]:
        reap(scan=len(_LIVE) >= _SCAN_AT[0])
    capsule: CapsuleType = _capsule_new(address, name, None)  # no destructor: see reap
    with _LIVE_LOCK:
        _LIVE[address] = [on_release, block, keepalive, capsule, name]
    return capsule


def live_exports() -> int:
    """How many capsules made here are still held by a consumer (or not yet consumed), after a `reap`."""
    reap()
    with _LIVE_LOCK:
        return len(_LIVE)


@dataclasses.dataclass(frozen=True, slots=True)
class ImportedTensor:
    """What a DLPack capsule of someone else's describes. ``release()`` gives it back."""

    data: int
    nbytes: int
    device_type: int
    device_id: int
    dtype: str
    shape: tuple[int, ...]
    read_only: bool
    _release: Callable[[], None]

    def release(self) -> None:
        """Call the producer's deleter (once)."""
        self._release()


def _releaser(address: int, deleter: Any) -> Callable[[], None]:
    """A call of the producer's ``deleter`` on the managed tensor at ``address``, at most once."""
    done = threading.Lock()
    released = [False]

    def release() -> None:
        with done:
            if released[0]:
                return
            released[0] = True
        if deleter:
            deleter(address)

    return release


def read_capsule(capsule: object) -> ImportedTensor:
    """Consume a ``"dltensor_versioned"`` or ``"dltensor"`` capsule: rename it ``"used_..."`` and describe
    its tensor.

    Raises ``ValueError`` for a capsule that is neither (or was consumed), a versioned tensor of a
    major version other than 1 (its deleter called, as ``dlpack.h`` says), or a tensor that is not
    C-contiguous or has a dtype this module does not name; the capsule is left unconsumed then.
    """
    managed: Any
    if _capsule_is_valid(capsule, _VERSIONED):
        address = _capsule_get_pointer(capsule, _VERSIONED)
        managed = _DLManagedTensorVersioned.from_address(address)
        if managed.version.major != 1:
            _capsule_set_name(capsule, _VERSIONED_USED)  # ours to delete now: its layout may differ past flags
            _releaser(address, managed.deleter)()
            raise ValueError(f"a DLPack tensor of version {managed.version.major}.{managed.version.minor}, not 1.x")
        used, read_only = _VERSIONED_USED, bool(managed.flags & FLAG_READ_ONLY)
    elif _capsule_is_valid(capsule, _LEGACY):
        address = _capsule_get_pointer(capsule, _LEGACY)
        managed = _DLManagedTensor.from_address(address)
        used, read_only = _LEGACY_USED, False
    else:
        raise ValueError("not an unconsumed DLPack capsule (\"dltensor_versioned\" or \"dltensor\")")
    tensor = managed.dl_tensor
    ndim = tensor.ndim
    if ndim < 0 or (ndim and not tensor.shape):
        raise ValueError(f"a DLPack tensor of {ndim} dimensions without a shape")
    shape = tuple((ctypes.c_int64 * ndim).from_address(tensor.shape)) if ndim else ()
    if any(extent < 0 for extent in shape):
        raise ValueError(f"a DLPack tensor with a negative extent: shape {shape}")
    name = _NAMES.get((tensor.dtype.code, tensor.dtype.bits))
    if name is None or tensor.dtype.lanes != 1:
        raise ValueError(f"a DLPack dtype metrale does not name (code {tensor.dtype.code}, bits {tensor.dtype.bits})")
    size = tensor.dtype.bits // 8
    strides = None
    if ndim and tensor.strides:
        strides = [step * size for step in (ctypes.c_int64 * ndim).from_address(tensor.strides)]
    if not c_contiguous(shape, strides, size):
        raise ValueError("a DLPack tensor that is not C-contiguous; pass a contiguous copy")
    _capsule_set_name(capsule, used)
    return ImportedTensor(
        data=(tensor.data or 0) + tensor.byte_offset,
        nbytes=math.prod(shape) * size,
        device_type=tensor.device.device_type,
        device_id=tensor.device.device_id,
        dtype=name,
        shape=shape,
        read_only=read_only,
        _release=_releaser(address, managed.deleter),
    )
