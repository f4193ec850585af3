# pack.py compiled as ``_pack``: the packer's loops over C-typed locals, a buffer's fields read in place
# (``_device/_fields.pxd``), each LaunchArg built in place where its layout allows (`new_arg`, `args_in_place`,
# which pack.py names only where it is compiled), and `pack_plain` at C level for the launch lane
# (``from metrale_core._launch._pack cimport pack_plain``).

cimport cython
from cpython.object cimport PyTypeObject

from metrale_core._device._fields cimport DeviceBuffer, check_fields
from metrale_core._device._slots cimport slot_set, slots_to_build
from metrale_core._memory._ledger cimport Ledger

cdef extern from "Python.h":
    object PyType_GenericAlloc(PyTypeObject* type, Py_ssize_t nitems)  # (a new reference, taken as one)

cdef Py_ssize_t _PACKS_KEPT
cdef dict _SCALARS
cdef dict _CTYPES_KINDS

# LaunchArg, and its four slots (param, data, pointer, tensor_map) where an argument is built in place
cdef object _ARG_CLASS
cdef Py_ssize_t _ARG_AT[4]
cdef bint _ARGS_IN_PLACE


@cython.locals(plan=tuple, packs=tuple, entry=tuple, i=Py_ssize_t)
cpdef list pack_args(object kernel, object args, object what, object live)

@cython.locals(plan=tuple, packs=tuple, entry=tuple, buf=DeviceBuffer, i=Py_ssize_t)
cpdef list pack_plain(object kernel, object args, Ledger ledger, object owner)

@cython.locals(hit=tuple, ptr=object)
cdef object _buffer_arg(object param, DeviceBuffer buf, dict packs)

@cython.locals(known=tuple)
cdef object _scalar_arg(tuple entry, object value)


cdef inline bint args_in_place() except -1:
    """Find LaunchArg's slots: whether `new_arg` builds an argument in place (its slots found, nothing else to do
    when it is built, and the GIL: ``CLASS_SWAP``)."""
    global _ARG_CLASS, _ARGS_IN_PLACE
    import metrale_core._types as types

    _ARG_CLASS = types.LaunchArg
    offsets = slots_to_build(_ARG_CLASS, ("param", "data", "pointer", "tensor_map"))
    if not types.CLASS_SWAP or offsets is None:
        return False
    for i in range(4):
        _ARG_AT[i] = offsets[i]
    _ARGS_IN_PLACE = True
    return True


cdef inline object new_arg(object param, object data, object pointer):
    """``LaunchArg._make(param, data, pointer)``."""
    if not _ARGS_IN_PLACE:
        return _ARG_CLASS._make(param, data, pointer)
    arg = PyType_GenericAlloc(<PyTypeObject*>_ARG_CLASS, 0)
    slot_set(arg, _ARG_AT[0], param)
    slot_set(arg, _ARG_AT[1], data)
    slot_set(arg, _ARG_AT[2], pointer)
    slot_set(arg, _ARG_AT[3], None)
    return arg
