# lane.py compiled as ``_lane``: the launch lane's fields as C types, the gate passed at C level (``_gate.pxd``), the
# arguments packed at C level (``_pack.pxd``), a stream's fields read in place (``_device/_fields.pxd``), and the
# plugin's C ``launch`` (``_device/_calls.pxd``) called by `call_launch`, which lane.py names only where it is
# compiled.

cimport cython
from cpython.object cimport PyObject

from metrale_core._device._calls cimport DEVICE_CALLS_LAUNCH, device_calls_with, metrale_device_calls_v1, table_of
from metrale_core._device._fields cimport Stream, check_fields
from metrale_core._device._gate cimport Gate, _Cell
from metrale_core._launch._pack cimport pack_plain
from metrale_core._memory._ledger cimport Ledger


@cython.final
cdef class LaunchLane:
    cdef object _kernels
    cdef object _ctx
    cdef Gate _gate
    cdef Ledger _ledger
    cdef object _guard
    cdef Stream _default
    cdef object _metrics
    cdef object _recent
    cdef object _ref
    cdef bint _plain
    cdef object _calls  # the plugin's capsule (keeps its struct alive), or None
    cdef metrale_device_calls_v1* _table  # its struct, or NULL

    @cython.locals(cell=_Cell)
    cpdef launch(self, object kernel, object grid, object block, object args, object shared_mem, object stream)
    @cython.locals(target=Stream, packed=list)
    cdef bint _launch(self, object kernel, object grid, object block, object args, object shared_mem,
                      object stream) except -1
    cdef bint _closed(self) except -1


cdef inline object launch_calls(LaunchLane lane, object plugin, bytes name):
    """The plugin's capsule (named ``name``) where its struct holds ``launch`` (its struct kept in ``lane._table``),
    else None."""
    capsule = device_calls_with(plugin, name, DEVICE_CALLS_LAUNCH)
    lane._table = table_of(capsule, name)
    return capsule


cdef inline int call_launch(LaunchLane lane, object function, object grid, object block, object shared_mem,
                            object stream, object args) except -1:
    """The plugin's C ``launch`` of a one-dimensional grid and block: 0 where done, 1 where declined; -1 raised the
    plugin's typed error."""
    cdef unsigned int shape[6]
    shape[0], shape[1], shape[2] = <unsigned int>grid, 1, 1
    shape[3], shape[4], shape[5] = <unsigned int>block, 1, 1
    return lane._table.launch(lane._table.state, <PyObject*>function, shape, <unsigned int>shared_mem,
                              <PyObject*>stream, <PyObject*>args)
