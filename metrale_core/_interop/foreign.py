"""Taking in another library's memory: what a CUDA-array-interface, DLPack or buffer-protocol
exporter holds, as [`ForeignMemory`][metrale_core.ForeignMemory] for ``GpuBackend.wrap``.
"""

from __future__ import annotations

import ctypes
import math
import re
from collections.abc import Callable

from .._errors import InvalidArgumentError
from .._types import WORD_LIMIT, ForeignMemory, as_index
from .dlpack import DLPACK_CPU, DLPACK_CUDA, DLPACK_VERSION, c_contiguous, read_capsule

__all__ = ["foreign_memory"]


_TYPESTR = re.compile(r"[<>|=][biufcmMOSUV]([1-9][0-9]{0,3})")


def _attribute(obj: object, name: str) -> object:
    """``obj.name``, or ``None`` when it is missing or its getter raises (a producer that lies is refused later)."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def _cuda_array_interface(obj: object, cai: dict[object, object]) -> ForeignMemory:
    """The memory a ``__cuda_array_interface__`` dict describes, every field checked before it is used;
    whatever the dict (a subclass whose methods raise, values whose ``repr`` raises) does, the answer is
    the memory or an ``InvalidArgumentError``."""
    try:
        return _read_cai(type(obj).__name__, dict(cai), obj)
    except InvalidArgumentError:
        raise
    except Exception as exc:
        raise InvalidArgumentError(
            f"wrap: {type(obj).__name__}'s __cuda_array_interface__ cannot be read: {type(exc).__name__}"
        ) from None


def _read_cai(who: str, cai: dict[object, object], obj: object) -> ForeignMemory:
    def malformed(why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"wrap: {who}'s __cuda_array_interface__ is malformed ({why}): {_shown(cai)}")

    data = cai.get("data")
    if not isinstance(data, tuple) or len(data) != 2:
        raise malformed("'data' must be a tuple (pointer, read_only)")
    ptr = as_index(data[0])
    if ptr is None or not 0 <= ptr < WORD_LIMIT:
        raise malformed("the pointer must be an integer address of 64 bits")
    if not isinstance(data[1], int):  # bool is an int
        raise malformed("read_only must be a bool")
    typestr = cai.get("typestr")
    match = _TYPESTR.fullmatch(typestr) if isinstance(typestr, str) else None
    if match is None:
        raise malformed("'typestr' must be a string such as '<f4'")
    size = int(match.group(1))
    raw_shape = cai.get("shape")
    if not isinstance(raw_shape, tuple):
        raise malformed("'shape' must be a tuple of integers")
    dims = [as_index(extent) for extent in raw_shape]
    if any(extent is None or extent < 0 for extent in dims):
        raise malformed("'shape' must hold non-negative integers")
    shape = tuple(extent for extent in dims if extent is not None)
    raw_strides = cai.get("strides")
    strides: tuple[int, ...] | None = None
    if raw_strides is not None:
        if not isinstance(raw_strides, tuple) or len(raw_strides) != len(shape):
            raise malformed("'strides' must be None or a tuple of one integer per dimension")
        steps = [as_index(step) for step in raw_strides]
        if any(step is None for step in steps):
            raise malformed("'strides' must hold integers")
        strides = tuple(step for step in steps if step is not None)
    if data[1]:
        raise InvalidArgumentError(f"wrap: {who} exports read-only memory; metrale writes")
    if cai.get("mask") is not None or not c_contiguous(shape, strides, size):
        raise InvalidArgumentError(f"wrap: {who} is not C-contiguous; pass a contiguous copy")
    nbytes = math.prod(shape) * size
    if nbytes == 0 or ptr == 0:
        raise InvalidArgumentError(f"wrap: {who} holds no bytes; nothing to wrap")
    if ptr + nbytes > WORD_LIMIT:
        raise malformed(f"{nbytes} bytes at {ptr:#x} run past the 64-bit address space")
    return ForeignMemory("cuda", -1, ptr, nbytes, obj)


def _shown(value: object) -> str:
    """``repr(value)``, at most 300 characters, or a placeholder when its ``repr`` raises."""
    try:
        return repr(value)[:300]
    except Exception:
        return f"<a {type(value).__name__} whose repr raises>"


def _dlpack_capsule(export: Callable[..., object]) -> object:
    """A producer's capsule, asked for in DLPack 1.x's form (which can say read-only); a producer older than
    ``max_version`` (a ``TypeError`` for the keyword) is asked again without it."""
    try:
        return export(max_version=DLPACK_VERSION)
    except TypeError:
        return export()


def foreign_memory(obj: object) -> tuple[ForeignMemory, Callable[[], None] | None]:
    """What ``obj`` (a CUDA-array-interface, DLPack or buffer-protocol exporter) holds, and how to give
    it back; raises [`InvalidArgumentError`][metrale_core.InvalidArgumentError] for anything metrale cannot wrap,
    whatever the producer claims or raises."""
    who = type(obj).__name__
    cai = _attribute(obj, "__cuda_array_interface__")
    if isinstance(cai, dict):
        return _cuda_array_interface(obj, cai), None
    export = _attribute(obj, "__dlpack__")
    if export is not None:
        if not callable(export):
            raise InvalidArgumentError(f"wrap: {who}.__dlpack__ is not callable")
        try:
            tensor = read_capsule(_dlpack_capsule(export))
        except Exception as exc:  # a producer's own failure, or a capsule metrale cannot read
            raise InvalidArgumentError(
                f"wrap: {who}'s DLPack export cannot be wrapped: {type(exc).__name__}: {exc}"
            ) from None
        if tensor.read_only:
            tensor.release()
            raise InvalidArgumentError(
                f"wrap: {who} exports read-only memory (DLPack's read-only flag); metrale writes"
            )
        kinds = {DLPACK_CUDA: "cuda", DLPACK_CPU: "cpu"}
        device = kinds.get(tensor.device_type)
        outside = not 0 < tensor.data < WORD_LIMIT or tensor.data + tensor.nbytes > WORD_LIMIT
        if device is None or tensor.nbytes <= 0 or outside:
            tensor.release()
            if device is None:
                what = f"is on DLPack device type {tensor.device_type}, not CUDA or CPU"
            elif tensor.nbytes <= 0:
                what = "holds no bytes"
            else:
                what = f"claims {tensor.nbytes} bytes at {tensor.data:#x}, outside a 64-bit address space"
            raise InvalidArgumentError(f"wrap: {who} {what}")
        memory = ForeignMemory(device, tensor.device_id, tensor.data, tensor.nbytes, obj)  # type: ignore[arg-type]
        return memory, tensor.release
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except Exception:
        raise InvalidArgumentError(
            f"wrap: {who} exports neither __cuda_array_interface__, __dlpack__ nor a buffer"
        ) from None
    if view.readonly or not view.c_contiguous or view.nbytes == 0:
        raise InvalidArgumentError(f"wrap: {who} must be writable, C-contiguous and not empty")
    flat = view.cast("B")
    anchor = (ctypes.c_char * flat.nbytes).from_buffer(flat)
    return ForeignMemory("cpu", 0, ctypes.addressof(anchor), flat.nbytes, (obj, flat, anchor)), None
