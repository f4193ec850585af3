# The handles the compiled lanes read on their hot paths, declared as the C structs their ``__slots__`` make, so that
# the one-source lanes (``_memory/lane.py``, ``_memory/pools.py``, ``_streams/lane.py``, ``_streams/graph_lane.py``,
# ``_launch/lane.py``, ``_launch/pack.py``) read a field as ``buf.ptr`` and Cython reads it in place, where a local is
# typed as the class (``@cython.locals`` in their .pxd). Here in ``_device``, whose classes they lay out.
#
# - A class's slots lie after its base's, sorted by name, ``__weakref__`` after its own class's (before 3.12); each
#   struct here writes that layout out. `check_fields` checks it against the classes' member descriptors as a lane
#   loads: a lane whose fields are not where it reads them refuses to load (its pure module runs, the log says why).
# - Only with the GIL: on a free-threaded build a field read in place could race with its writer's release of the
#   old value, so there a lane refuses to load too (quietly).
# - Declarations only: this file makes no module (setup.py's `compiled_sources`).

from metrale_core._device._slots cimport slot_named

cdef extern from *:
    """
    #include <stddef.h>
    /* DeviceBuffer (a frozen dataclass with slots): _owner, index, kind, nbytes, ptr, site */
    typedef struct {
        PyObject_HEAD
        PyObject *_owner; PyObject *index; PyObject *kind; PyObject *nbytes; PyObject *ptr; PyObject *site;
    } metrale_buffer_fields;
    /* _Handle: _closed, _ctx, raw, then __weakref__ (from Python 3.12 a managed weak reference: no slot, as the H100
       machine's 3.12 showed: a Stream of 64 bytes, not 72) */
    #if PY_VERSION_HEX >= 0x030C0000
    #define METRALE_HANDLE_FIELDS PyObject_HEAD PyObject *_closed; PyObject *_ctx; PyObject *raw;
    #else
    #define METRALE_HANDLE_FIELDS PyObject_HEAD PyObject *_closed; PyObject *_ctx; PyObject *raw; PyObject *weakref_;
    #endif
    /* Stream(_Handle): _owner, capture, default */
    typedef struct { METRALE_HANDLE_FIELDS PyObject *_owner; PyObject *capture; PyObject *default_; }
        metrale_stream_fields;
    /* GraphExec(_Handle): _owner, buffers, check, host_buffers, kernels, live_at, peers, registries */
    typedef struct {
        METRALE_HANDLE_FIELDS
        PyObject *_owner; PyObject *buffers; PyObject *check; PyObject *host_buffers; PyObject *kernels;
        PyObject *live_at; PyObject *peers; PyObject *registries;
    } metrale_graph_exec_fields;
    #define METRALE_AT(type, field) ((Py_ssize_t)offsetof(type, field))
    """
    Py_ssize_t BUFFER_OWNER "METRALE_AT(metrale_buffer_fields, _owner)"
    Py_ssize_t BUFFER_INDEX "METRALE_AT(metrale_buffer_fields, index)"
    Py_ssize_t BUFFER_KIND "METRALE_AT(metrale_buffer_fields, kind)"
    Py_ssize_t BUFFER_NBYTES "METRALE_AT(metrale_buffer_fields, nbytes)"
    Py_ssize_t BUFFER_PTR "METRALE_AT(metrale_buffer_fields, ptr)"
    Py_ssize_t BUFFER_SIZE "sizeof(metrale_buffer_fields)"
    Py_ssize_t HANDLE_CLOSED "METRALE_AT(metrale_stream_fields, _closed)"
    Py_ssize_t HANDLE_CTX "METRALE_AT(metrale_stream_fields, _ctx)"
    Py_ssize_t HANDLE_RAW "METRALE_AT(metrale_stream_fields, raw)"
    Py_ssize_t STREAM_CAPTURE "METRALE_AT(metrale_stream_fields, capture)"
    Py_ssize_t STREAM_SIZE "sizeof(metrale_stream_fields)"
    Py_ssize_t GRAPH_BUFFERS "METRALE_AT(metrale_graph_exec_fields, buffers)"
    Py_ssize_t GRAPH_CHECK "METRALE_AT(metrale_graph_exec_fields, check)"
    Py_ssize_t GRAPH_HOSTS "METRALE_AT(metrale_graph_exec_fields, host_buffers)"
    Py_ssize_t GRAPH_LIVE_AT "METRALE_AT(metrale_graph_exec_fields, live_at)"
    Py_ssize_t GRAPH_PEERS "METRALE_AT(metrale_graph_exec_fields, peers)"
    Py_ssize_t GRAPH_REGISTRIES "METRALE_AT(metrale_graph_exec_fields, registries)"
    Py_ssize_t GRAPH_SIZE "sizeof(metrale_graph_exec_fields)"

    ctypedef class metrale_core._device.buffer.DeviceBuffer [object metrale_buffer_fields, check_size ignore]:
        cdef object _owner
        cdef object index
        cdef object kind
        cdef object nbytes
        cdef object ptr

    ctypedef class metrale_core._device.handles.Stream [object metrale_stream_fields, check_size ignore]:
        cdef object _closed
        cdef object _ctx
        cdef object raw
        cdef object capture

    ctypedef class metrale_core._device.handles.GraphExec [object metrale_graph_exec_fields, check_size ignore]:
        cdef object _closed
        cdef object raw
        cdef object buffers
        cdef object check
        cdef object host_buffers
        cdef object live_at
        cdef object peers
        cdef object registries


cdef inline bint _in_place(object cls, Py_ssize_t size, tuple fields) except -1:
    """Whether each of ``fields`` (name, offset) is a plain object slot of ``cls`` (or its base) at that offset, in an
    object of ``size`` bytes."""
    if cls.__basicsize__ != size:
        return False
    for name, offset in fields:
        owner = cls
        while name not in owner.__dict__.get("__slots__", ()):
            owner = owner.__base__
            if owner is object:
                return False
        if slot_named(owner, name) != offset:
            return False
    return True


cdef inline int check_fields(str lane) except -1:
    """Refuse to load ``lane`` (an ImportError: its pure module runs) where the fields declared here are not where it
    reads them: on a free-threaded build (quietly), or where a class changed (a RuntimeError, which the log shows)."""
    import sys

    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        raise ImportError(f"the compiled {lane} reads the handles' fields in place, which needs the GIL")
    if not (
        _in_place(DeviceBuffer, BUFFER_SIZE, (("_owner", BUFFER_OWNER), ("index", BUFFER_INDEX),
                                              ("kind", BUFFER_KIND), ("nbytes", BUFFER_NBYTES), ("ptr", BUFFER_PTR)))
        and _in_place(Stream, STREAM_SIZE, (("_closed", HANDLE_CLOSED), ("_ctx", HANDLE_CTX), ("raw", HANDLE_RAW),
                                            ("capture", STREAM_CAPTURE)))
        and _in_place(GraphExec, GRAPH_SIZE, (("_closed", HANDLE_CLOSED), ("raw", HANDLE_RAW),
                                              ("buffers", GRAPH_BUFFERS), ("check", GRAPH_CHECK),
                                              ("host_buffers", GRAPH_HOSTS), ("live_at", GRAPH_LIVE_AT),
                                              ("peers", GRAPH_PEERS), ("registries", GRAPH_REGISTRIES)))
    ):
        raise RuntimeError(
            f"the compiled {lane} reads the handles' fields in place, and DeviceBuffer, Stream or GraphExec no longer "
            f"lays them out as metrale_core/_device/_fields.pxd says: write their slots out there again"
        )
    return 0
