"""A launch's arguments checked against the kernel's parameters and packed as the kernel receives them.

Written once, here, and compiled as well as run as Python (``_pack``, with ``_pack.pxd`` beside it:
docs/building.md); the kernel front picks one with ``_twins.pick("pack", ...)``.

- `pack_args`: every argument checked and packed; nothing reaches a driver otherwise. A buffer for a pointer is packed
  once per parameter and kept (a buffer is immutable, its packed pointer never changes); a scalar of a type met
  before (`_SCALARS`) is packed with one lookup; every other argument, and every error, by the full rule (`_pack`).
- `pack_plain`, for the launch lane: the common cases only (a live buffer of the ledger's for a pointer, a scalar of
  a type met before), the liveness asked of the ledger; ``None`` where any argument is not one of them (the lane then
  hands the launch to the front, whose `pack_args` checks it in full and raises).
- Compiled, a buffer's fields are read in place (``_device/_fields.pxd``) and each `LaunchArg` is built in place
  where its layout allows (`C_ARGS`), as ``LaunchArg._make`` builds it.
"""

from __future__ import annotations

import ctypes
import operator
import reprlib
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from .._errors import InvalidArgumentError
from .._types import WORD_LIMIT, LaunchArg
from ..kernels._ptx import Param
from .tensormaps import TensorMap

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

if not cython.compiled:  # (compiled: a buffer as _fields.pxd lays it out; arguments built in place, _pack.pxd)
    from .._device.buffer import DeviceBuffer

    def check_fields(lane: str) -> None:
        """(Compiled: refuse to load where the handles' fields are not where the packer reads them in place.)"""

    def args_in_place() -> bool:
        """Whether `new_arg` builds a `LaunchArg` in place (compiled only: as Python, ``LaunchArg._make`` does)."""
        return False

    new_arg = LaunchArg._make

if TYPE_CHECKING:  # (as modules: compiled, ``Ledger`` is the one _pack.pxd cimports)
    from .._memory import ledger as ledgers
    from .registry import Kernel

__all__ = ["C_ARGS", "pack_args", "pack_plain"]

check_fields("packer")

#: Whether launch arguments are built in place (compiled, under the GIL, where `LaunchArg` is only its slots), else
#: through ``LaunchArg._make``.
C_ARGS: Final = args_in_place()

#: Per kernel parameter, how many buffers' packed arguments are kept (then the kept ones are dropped).
_PACKS_KEPT: Final = 64


def pack_args(kernel: Kernel, args: object, what: str, live: Callable[[DeviceBuffer], None]) -> list[LaunchArg]:
    """Check ``args`` against the kernel's parameters and pack them; nothing reaches a driver otherwise."""
    if type(args) is not tuple and type(args) is not list:
        if isinstance(args, str | bytes) or not hasattr(args, "__len__") or not hasattr(args, "__iter__"):
            raise InvalidArgumentError(f"{what}: args must be a list or tuple, got {args!r}")
        args = list(args)  # type: ignore[call-overload, unused-ignore]
    values: Sequence[object] = args  # type: ignore[assignment, unused-ignore]
    params = kernel.params
    if len(values) != len(params):
        raise InvalidArgumentError(
            f"{what}: {kernel.signature} takes {len(params)} argument(s), got {len(values)}"
        )
    packed = []
    plan = kernel._plan
    packs = kernel._packs
    for i in range(len(values)):
        entry = plan[i]
        value = values[i]
        if type(value) is DeviceBuffer and entry[1]:  # the hot path: a buffer for a pointer
            live(value)
            packed.append(_buffer_arg(entry[0], value, packs[i]))
            continue
        arg = _scalar_arg(entry, value)  # a scalar of a type met before (what _pack would find, without its checks)
        packed.append(arg if arg is not None else _pack(kernel, entry[0], value, what, live))
    return packed


def pack_plain(kernel: Kernel, args: object, ledger: ledgers.Ledger, owner: object) -> list[LaunchArg] | None:
    """`pack_args` for the common cases only: each argument a buffer of ``owner`` (a backend's ``ctx.ref``) on
    ``ledger`` for a pointer, or a scalar of a type met before; ``None`` where any is not (nothing raised)."""
    if type(args) is not tuple and type(args) is not list:
        return None
    values: Sequence[object] = args
    plan = kernel._plan
    if len(values) != len(plan):
        return None
    packs = kernel._packs
    packed = []
    for i in range(len(values)):
        entry = plan[i]
        value = values[i]
        if type(value) is DeviceBuffer and entry[1]:
            buf = value  # (compiled: its fields read in place)
            if buf._owner is not owner or not ledger.has_index(buf.index, buf):
                return None
            packed.append(_buffer_arg(entry[0], buf, packs[i]))
            continue
        arg = _scalar_arg(entry, value)
        if arg is None:
            return None
        packed.append(arg)
    return packed


def _buffer_arg(param: Param, buf: DeviceBuffer, packs: dict[int, tuple[DeviceBuffer, LaunchArg]]) -> LaunchArg:
    """The packed argument of ``buf`` for ``param``: the one kept for it, or a new one, kept."""
    key = id(buf)
    hit = packs.get(key)
    if hit is not None and hit[0] is buf:
        return hit[1]
    ptr = buf.ptr
    arg = new_arg(param, ptr.to_bytes(8, "little"), ptr)
    if len(packs) >= _PACKS_KEPT:
        packs.clear()
    packs[key] = (buf, arg)
    return arg


def _scalar_arg(entry: tuple[Param, bool, bool, int, bool, bool], value: object) -> LaunchArg | None:
    """The packed argument of ``value``, a scalar of a type met before that fits the parameter (``entry``: its plan);
    ``None`` else."""
    known = _SCALARS.get(type(value))
    if known is None:
        return None
    kind, size, to_bytes = known
    if entry[2] and size == entry[3] and (entry[4] or entry[5] == (kind == "f")):
        return new_arg(entry[0], to_bytes(value), None)
    return None


def _pack(kernel: Kernel, param: Param, value: object, what: str, live: Callable[[DeviceBuffer], None]) -> LaunchArg:
    def where() -> str:  # built only for an error: launches are a hot path
        return f"{what}: argument {param.name} ({param.describe()}) of {kernel.module}.{kernel.name}"

    if param.tensor_map:
        if not isinstance(value, TensorMap):
            raise InvalidArgumentError(
                f"{where()} is a tensor-map slot: pass a TensorMap of this backend (backend.tensor_map(buffer, "
                f"spec)), got {reprlib.repr(value)}"
            )
        frozen = value.frozen()
        live(frozen.buffer)  # a map over a freed buffer, or over another backend's, is refused here
        return LaunchArg._make(param, frozen.image, None, frozen)
    if param.count > 1:
        if isinstance(value, bytes | bytearray | memoryview) and len(memoryview(value).cast("B")) == param.nbytes:
            return new_arg(param, bytes(value), None)
        raise InvalidArgumentError(f"{where()} takes {param.nbytes} raw bytes, got {value!r}")
    if isinstance(value, DeviceBuffer) or (isinstance(value, int) and not isinstance(value, bool)):
        if not param.pointer_sized:
            raise InvalidArgumentError(
                f"{where()} is not a pointer: pass an explicitly typed scalar (numpy.uint32(7), ctypes.c_float(1.0))"
            )
        if isinstance(value, DeviceBuffer):
            live(value)
            pointer = value.ptr
        else:
            pointer = operator.index(value)
            if not 0 <= pointer < WORD_LIMIT:
                raise InvalidArgumentError(f"{where()}: {pointer} is not a 64-bit device address")
        return new_arg(param, pointer.to_bytes(8, "little"), pointer)
    kind, size, data = _scalar(value)
    if kind is None:
        raise InvalidArgumentError(
            f"{where()}: expected a DeviceBuffer, an int pointer or an explicitly typed scalar "
            f"(a numpy scalar or a ctypes value), got {value!r}"
        )
    compatible = param.kind == "b" or (param.kind == "f") == (kind == "f")
    if size != param.size or not compatible:
        raise InvalidArgumentError(f"{where()} does not take {value!r} ({kind}{size * 8}); pass a matching type")
    return new_arg(param, data, None)


_CTYPES_KINDS: dict[type, str | None] = {}

#: Per exact type of scalar met so far (ctypes values; numpy scalars where the host is little-endian):
#: ``(kind, size, to_bytes)``, so a launch packs a scalar of a known type with one lookup. A type's kind
#: and size never change; a ctypes value's bytes are read at each launch (it is mutable). (A cache: the compiled
#: packer keeps its own.)
_SCALARS: dict[type, tuple[str, int, Callable[[Any], bytes]]] = {}


def _scalar(value: object) -> tuple[str | None, int, bytes]:
    """``(kind, size, bytes)`` of a numpy scalar or ctypes value, kind ``f`` for floats, ``i`` for integers."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None and hasattr(value, "tobytes") and getattr(value, "shape", None) == ():
        kind = "f" if dtype.kind == "f" else "i" if dtype.kind in "iub" else None
        little = value.astype(dtype.newbyteorder("<")) if dtype.byteorder == ">" else value  # type: ignore[attr-defined]
        native = sys.byteorder == "little" and dtype.byteorder != ">"
        numpy = sys.modules.get("numpy")
        # only a numpy scalar type (numpy.generic): a 0-d array's type is ndarray, whose arrays may be of any
        # shape and dtype, so each is checked here in full
        if kind is not None and native and numpy is not None and isinstance(value, numpy.generic):
            _SCALARS.setdefault(type(value), (kind, int(dtype.itemsize), _numpy_bytes))
        return kind, int(dtype.itemsize), bytes(little.tobytes())
    if isinstance(value, ctypes._SimpleCData):
        cls = type(value)
        if cls in _CTYPES_KINDS:
            kind = _CTYPES_KINDS[cls]
        else:
            kind = "f" if isinstance(value, ctypes.c_float | ctypes.c_double) else "i"
            if isinstance(value, ctypes.c_char_p | ctypes.c_wchar_p | ctypes.c_void_p | ctypes.c_bool):
                kind = "i" if isinstance(value, ctypes.c_void_p) else None
            _CTYPES_KINDS[cls] = kind
            if kind is not None:
                _SCALARS.setdefault(cls, (kind, ctypes.sizeof(cls), bytes))
        return kind, ctypes.sizeof(value), bytes(value)
    return None, 0, b""


def _numpy_bytes(value: Any) -> bytes:
    """A native (little-endian) numpy scalar's bytes."""
    return bytes(value.tobytes())
