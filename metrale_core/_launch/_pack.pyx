# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`pack_args`][metrale_core._launch.registry.pack_args]: a launch's arguments checked against
the kernel's parameters and packed, the common cases at C level.

- The pure function in ``registry.py`` is the reference: ``_twins.pick("pack", ...)`` picks this one where it was
  built and ``pure`` is off. A differential test runs both on the same arguments.
- ``pack_args`` (the same interface): the common cases here (a live buffer of the ledger's for a pointer, kept
  packed per parameter as the pure function keeps it; a scalar of a type met before); every other argument, and
  every error, by the pure function's own rule (``registry._pack``).
- ``pack_c`` (``_pack.pxd``), for the launch lane: the common cases only, the liveness of a buffer asked of the
  ledger's twin at C level; ``None`` where any argument is not one of them (the lane then hands the launch to the
  front, whose ``pack_args`` checks it in full and raises).
"""

cimport cython
from cpython.object cimport PyObject, PyTypeObject

from .._device._handle cimport FIELD_INDEX, FIELD_OWNER, FIELD_PTR, buffer_field
from .._device._slots cimport slot_set, slots_to_build
from .._memory._ledger cimport Ledger

from .._device.buffer import DeviceBuffer as _DeviceBuffer
from .._errors import InvalidArgumentError as _InvalidArgumentError
from .._types import CLASS_SWAP as _CLASS_SWAP
from .._types import LaunchArg as _LaunchArg
from . import registry as _pure

cdef extern from "Python.h":
    object PyType_GenericAlloc(PyTypeObject* type, Py_ssize_t nitems)  # (a new reference, taken as one)

cdef object _make = _LaunchArg._make
cdef object _NONE = None

# LaunchArg's four slots (param, data, pointer, tensor_map): an argument is built at C level, as the handle twin
# builds a DeviceBuffer, where their layout was found and building one does no more than store its fields (no
# ``__post_init__``, no ``__new__`` of its own), and the class may be built so (`CLASS_SWAP`: the GIL); else through
# ``LaunchArg._make``.
cdef Py_ssize_t _ARG_SLOT[4]
_offsets = slots_to_build(_LaunchArg, ("param", "data", "pointer", "tensor_map"))
cdef bint _C_ARGS = bool(_CLASS_SWAP) and _offsets is not None
for _i in range(4):
    _ARG_SLOT[_i] = _offsets[_i] if _offsets is not None else -1

#: Whether launch arguments are built at C level (else through ``LaunchArg._make``).
C_ARGS = _C_ARGS


cdef object _arg(object param, object data, object pointer):
    """``LaunchArg._make(param, data, pointer)``."""
    if not _C_ARGS:
        return _make(param, data, pointer)
    arg = PyType_GenericAlloc(<PyTypeObject*>_LaunchArg, 0)
    slot_set(arg, _ARG_SLOT[0], param)
    slot_set(arg, _ARG_SLOT[1], data)
    slot_set(arg, _ARG_SLOT[2], pointer)
    slot_set(arg, _ARG_SLOT[3], _NONE)
    return arg
cdef object _pack_one = _pure._pack
cdef dict _SCALARS = _pure._SCALARS
cdef Py_ssize_t _KEPT = _pure._PACKS_KEPT


cdef inline object _buffer_arg(object param, object value, dict packs):
    """The packed argument of buffer ``value`` for ``param``: the one kept for it, or a new one, kept."""
    key = id(value)
    hit = packs.get(key)
    if hit is not None and (<tuple>hit)[0] is value:
        return (<tuple>hit)[1]
    ptr = buffer_field(value, FIELD_PTR)
    arg = _arg(param, (<object>ptr).to_bytes(8, "little"), ptr)
    if len(packs) >= _KEPT:
        packs.clear()
    packs[key] = (value, arg)
    return arg


cdef inline object _scalar_arg(tuple entry, object value):
    """The packed argument of ``value``, a scalar of a type met before that fits the parameter; ``None`` else."""
    known = _SCALARS.get(type(value))
    if known is None:
        return None
    kind, size, to_bytes = <tuple>known
    if entry[2] and size == entry[3] and (entry[4] or entry[5] == (kind == "f")):
        return _arg(entry[0], to_bytes(value), None)
    return None


cdef list pack_c(object kernel, object args, Ledger ledger, object owner):
    cdef tuple plan = kernel._plan
    cdef tuple packs = kernel._packs
    cdef Py_ssize_t i, n
    cdef tuple entry
    if type(args) is tuple:
        n = len(<tuple>args)
    elif type(args) is list:
        n = len(<list>args)
    else:
        return None
    if n != len(plan):
        return None
    packed = []
    for i in range(n):
        entry = <tuple>plan[i]
        value = args[i]
        if type(value) is _DeviceBuffer and entry[1]:
            if buffer_field(value, FIELD_OWNER) is not owner or not ledger.has_index(buffer_field(value, FIELD_INDEX), value):
                return None
            packed.append(_buffer_arg(entry[0], value, <dict>packs[i]))
            continue
        arg = _scalar_arg(entry, value)
        if arg is None:
            return None
        packed.append(arg)
    return packed


def pack_args(kernel, args, what, live):
    """Check ``args`` against the kernel's parameters and pack them; nothing reaches a driver otherwise (compiled
    twin: the same checks, errors and packing as the pure function)."""
    cdef tuple plan
    cdef tuple packs
    cdef tuple entry
    cdef Py_ssize_t i, n
    if type(args) is not tuple and type(args) is not list:
        if isinstance(args, (str, bytes)) or not hasattr(args, "__len__") or not hasattr(args, "__iter__"):
            raise _InvalidArgumentError(f"{what}: args must be a list or tuple, got {args!r}")
        args = list(args)
    plan = kernel._plan
    packs = kernel._packs
    n = len(args)
    if n != len(kernel.params):
        raise _InvalidArgumentError(f"{what}: {kernel.signature} takes {len(kernel.params)} argument(s), got {n}")
    packed = []
    for i in range(n):
        entry = <tuple>plan[i]
        value = args[i]
        if type(value) is _DeviceBuffer and entry[1]:  # the hot path: a buffer for a pointer
            live(value)
            packed.append(_buffer_arg(entry[0], value, <dict>packs[i]))
            continue
        arg = _scalar_arg(entry, value)
        packed.append(arg if arg is not None else _pack_one(kernel, entry[0], value, what, live))
    return packed
