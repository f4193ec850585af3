# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`GraphLane`][metrale_core._streams.graph_lane.GraphLane]: ``GraphExec.launch``, the common
case done here at C level.

- The common case, as the front's plain path has it (`GraphFront.launch_checked`): a graph with no red-zone check
  and no other backend's buffers, its kernels' modules loaded, its host buffers open, its device buffers on the
  ledger (found so at a launch since which no record came off: the ledger's ``taken`` count, read at C level), a
  live stream of this backend (or the default one) with no capture on it, and no scan after graphs.
- The gate is passed at C level (``_gate.pxd``); the plugin is called through its C ``graph_launch`` where it offers
  one (``RawDevice.device_calls``), else through its method. A C call that declined (``1``) is made through the
  method; one that failed (``-1``) raised the plugin's typed error, raised as the front raises a raw call's.
- The handles' fields (``GraphExec``'s and ``Stream``'s ``__slots__``) are read in place where their layout was
  checked at import, as the handle twin reads a ``DeviceBuffer``'s (``_slots.pxd``); elsewhere (a free-threaded build,
  a layout not found) through their attributes.
- Everything else goes to the front, which checks again and does the work or raises: a closed or dead operand, a
  check, another backend's buffers, a capture, a scan, a stream that is not one of this backend.
"""

cimport cython
from cpython.object cimport PyObject

from .._device._slots cimport slot_get, slot_named, slot_set

from .._device._calls cimport DEVICE_CALLS_GRAPH_LAUNCH, device_calls_with, metrale_device_calls_v1, table_of
from .._device._gate cimport Gate, _Cell
from .._device._stats cimport StatsCounter
from .._memory._ledger cimport Ledger

import sys

from .._device.guarded import raise_raw as _raise_raw
from .._device.handles import GraphExec as _GraphExec
from .._device.handles import Stream as _Stream
from .._device.handles import _Handle
from .._device.raw import DEVICE_CALLS as _DEVICE_CALLS

cdef bytes _CAPSULE_NAME = _DEVICE_CALLS.encode()

# -- the handles' slots, read in place where their layout was found (GIL builds) ------------------------------

#: Each field read here: the class whose ``__slots__`` declares it, and its name.
_FIELDS = (
    (_Handle, "_closed"), (_Handle, "_ctx"), (_Handle, "raw"),
    (_GraphExec, "check"), (_GraphExec, "peers"), (_GraphExec, "registries"), (_GraphExec, "host_buffers"),
    (_GraphExec, "live_at"), (_GraphExec, "buffers"), (_Stream, "capture"),
)
cdef enum:
    _CLOSED, _CTX, _RAW, _CHECK, _PEERS, _REGISTRIES, _HOSTS, _LIVE_AT, _BUFFERS, _CAPTURE, _NFIELDS
cdef Py_ssize_t _offset[_NFIELDS]
cdef tuple _NAMES = tuple(name for _, name in _FIELDS)


def _find_offsets():
    """Each field's offset, or -1 for all where any is not a plain object slot of its class."""
    found = [slot_named(cls, name) for cls, name in _FIELDS]
    return found if min(found) >= 0 else [-1] * len(found)


cdef Py_ssize_t _i
for _i, _at in enumerate(_find_offsets() if getattr(sys, "_is_gil_enabled", lambda: True)() else [-1] * _NFIELDS):
    _offset[_i] = _at

#: Whether the handles' fields are read in place (else through their attributes).
SLOTS = _offset[0] >= 0


cdef inline object _get(object handle, int field):
    """Field ``field`` of ``handle`` (a GraphExec or a Stream, by the caller's check of its type)."""
    cdef PyObject* value
    if _offset[field] >= 0:
        value = slot_get(handle, _offset[field])
        if value is not NULL:
            return <object>value
    return getattr(handle, _NAMES[field])  # (unset: its AttributeError)


cdef inline int _set(object handle, int field, object value) except -1:
    if _offset[field] >= 0:
        slot_set(handle, _offset[field], value)
    else:
        setattr(handle, _NAMES[field], value)
    return 0


@cython.final
cdef class GraphLane:
    """``GraphExec.launch``: inside the gate, the common case here (compiled twin)."""

    cdef object _graphs
    cdef object _ctx
    cdef Gate _gate
    cdef Ledger _ledger
    cdef StatsCounter _stats
    cdef object _guard
    cdef object _default
    cdef bint _scan_graphs
    cdef object _ref
    cdef object _capsule  # (keeps the plugin's struct alive)
    cdef metrale_device_calls_v1* _door

    def __init__(self, graphs, parts):
        ctx = parts.ctx
        if not isinstance(ctx.gate, Gate) or not isinstance(parts.ledger, Ledger) or not isinstance(
                parts.stats, StatsCounter):
            raise TypeError(
                f"the compiled graph lane needs the compiled gate, ledger and stats, got {type(ctx.gate)!r}, "
                f"{type(parts.ledger)!r} and {type(parts.stats)!r}: one `pure` setting picks them all"
            )
        self._graphs = graphs
        self._ctx = ctx
        self._gate = ctx.gate
        self._ledger = parts.ledger
        self._stats = parts.stats
        self._guard = parts.guard
        self._default = parts.default
        self._scan_graphs = parts.scan_graphs
        self._ref = ctx.ref
        self._capsule = device_calls_with(ctx.plugin, _CAPSULE_NAME, DEVICE_CALLS_GRAPH_LAUNCH)
        self._door = table_of(self._capsule, _CAPSULE_NAME)

    def launch(self, graph, stream):
        """``GraphExec.launch``."""
        cdef _Cell cell = self._gate.enter_c(False)
        try:
            if type(graph) is not _GraphExec or _get(graph, _CLOSED):  # (the owner's read of its handle)
                graph._live()  # raises, naming the handle (a closed one)
            if not self._launch(graph, stream):
                self._graphs.launch_checked(graph, stream)
        finally:
            self._gate.leave_c(cell)

    cdef bint _launch(self, object graph, object stream) except -1:
        """The common case: whether it was done (else the front does it)."""
        cdef int rc = 1
        if type(graph) is not _GraphExec or _get(graph, _CHECK) is not None or _get(graph, _PEERS):
            return False
        for registry in <tuple?>_get(graph, _REGISTRIES):
            if registry.unloaded:
                return False
        for hb in <tuple?>_get(graph, _HOSTS):
            if hb.closed:
                return False
        taken = self._ledger.taken  # read first: a record that comes off during the check shows at the next launch
        if _get(graph, _LIVE_AT) != taken:  # records came off since its buffers were last found live: look again
            if self._ledger.holds_all(_get(graph, _BUFFERS), self._ref) is not True:
                return False
            _set(graph, _LIVE_AT, taken)
        if stream is None:
            target = self._default
        elif type(stream) is _Stream and _get(stream, _CTX) is self._ctx and not _get(stream, _CLOSED):
            target = stream  # (as the front resolves a stream)
        else:
            return False
        if self._gate.closed_c() or _get(target, _CAPTURE) is not None or self._scan_graphs:
            return False
        guard = self._guard
        if guard.fills:
            guard.settle_for(target)
        ctx = self._ctx
        graph_raw = _get(graph, _RAW)
        stream_raw = _get(target, _RAW)
        try:
            if self._door is not NULL:
                rc = self._door.graph_launch(self._door.state, <PyObject*>graph_raw, <PyObject*>stream_raw)
            if rc != 0:  # no door, or it declined
                ctx.plugin.graph_launch(graph_raw, stream_raw)
        except Exception as exc:
            _raise_raw(ctx, ctx.name, "graph_launch", exc)
        self._stats.graph_launches += 1
        return True
