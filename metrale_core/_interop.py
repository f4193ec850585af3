"""Taking in another library's memory: what a CUDA-array-interface, DLPack or buffer-protocol
exporter holds, as :class:`~metrale_core.ForeignMemory` for ``GpuBackend.wrap``.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable

from ._dlpack import DLPACK_CPU, DLPACK_CUDA, c_contiguous, read_capsule
from ._errors import InvalidArgumentError
from ._types import ForeignMemory

__all__ = ["foreign_memory"]


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
