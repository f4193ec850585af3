# graph_lane.py compiled as ``_graph_lane``: the graph lane's fields as C types, the gate passed at C level
# (``_gate.pxd``), the ledger and the stats at C level (``_ledger.pxd``, ``_stats.pxd``), a graph's and a stream's
# fields read in place (``_device/_fields.pxd``), and the plugin's C ``graph_launch`` (``_device/_calls.pxd``) called
# by `call_graph_launch`, which graph_lane.py names only where it is compiled.

cimport cython
from cpython.object cimport PyObject

from metrale_core._device._calls cimport DEVICE_CALLS_GRAPH_LAUNCH, device_calls_with, metrale_device_calls_v1, table_of
from metrale_core._device._fields cimport GraphExec, Stream, check_fields
from metrale_core._device._gate cimport Gate, _Cell
from metrale_core._device._stats cimport StatsCounter
from metrale_core._memory._ledger cimport Ledger


@cython.final
cdef class GraphLane:
    cdef object _graphs
    cdef object _ctx
    cdef Gate _gate
    cdef Ledger _ledger
    cdef StatsCounter _stats
    cdef object _guard
    cdef Stream _default
    cdef bint _scan_graphs
    cdef object _is_live
    cdef object _ref
    cdef object _calls  # the plugin's capsule (keeps its struct alive), or None
    cdef metrale_device_calls_v1* _table  # its struct, or NULL

    @cython.locals(cell=_Cell, live=bint)
    cpdef launch(self, object graph, object stream)
    @cython.locals(taken=object, registry=object, hb=object)
    cdef bint _live(self, GraphExec graph) except -1
    @cython.locals(target=Stream)
    cdef bint _launch(self, GraphExec graph, object stream) except -1

    cdef bint _closed(self) except -1


cdef inline object graph_launch_calls(GraphLane lane, object plugin, bytes name):
    """The plugin's capsule (named ``name``) where its struct holds ``graph_launch`` (its struct kept in
    ``lane._table``), else None."""
    capsule = device_calls_with(plugin, name, DEVICE_CALLS_GRAPH_LAUNCH)
    lane._table = table_of(capsule, name)
    return capsule


cdef inline int call_graph_launch(GraphLane lane, object graph, object stream) except -1:
    """The plugin's C ``graph_launch``: 0 where done, 1 where declined; -1 raised the plugin's typed error."""
    return lane._table.graph_launch(lane._table.state, <PyObject*>graph, <PyObject*>stream)
