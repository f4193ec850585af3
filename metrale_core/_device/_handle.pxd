# handle.py compiled as ``_handle``: a DeviceBuffer built by storing its slots in place, and the C-level door other
# compiled modules cimport (``from metrale_core._device._handle cimport make_buffer``): `make_buffer` (`make`).

from metrale_core._device._slots cimport slot_named

cdef extern from *:
    """
    /* DeviceBuffer's six slots, in its fields' order: their offsets, and the type (NULL until checked); each
       offset found by metrale_slot_offset (_slots.pxd). Only _handle's own functions read them. */
    static CYTHON_UNUSED PyTypeObject *metrale_buffer_type = NULL;
    static CYTHON_UNUSED Py_ssize_t metrale_buffer_slot[6];

    /* Whether this is a free-threaded build: there the pure path runs (as DeviceBuffer._make's own rule has it). */
    #ifdef Py_GIL_DISABLED
    #define METRALE_FREE_THREADED 1
    #else
    #define METRALE_FREE_THREADED 0
    #endif

    static CYTHON_UNUSED int metrale_use_layout(PyObject *type_object, Py_ssize_t *offsets) {
        PyTypeObject *type = (PyTypeObject *)type_object;
        int i;
        if (type->tp_itemsize != 0) return -1;
        for (i = 0; i < 6; i++) metrale_buffer_slot[i] = offsets[i];
        metrale_buffer_type = type;
        return 0;
    }

    /* A new DeviceBuffer of these fields (new references in its slots), or NULL with an exception set. */
    static CYTHON_UNUSED PyObject *metrale_build_buffer(PyObject *ptr, PyObject *nbytes, PyObject *kind,
                                                        PyObject *index, PyObject *site, PyObject *owner) {
        PyTypeObject *type = metrale_buffer_type;
        PyObject *buf = type->tp_alloc(type, 0);  /* zeroed; a GC type's object is tracked: its slots are NULL */
        char *at;
        if (buf == NULL) return NULL;
        at = (char *)buf;
        Py_INCREF(ptr); *(PyObject **)(at + metrale_buffer_slot[0]) = ptr;
        Py_INCREF(nbytes); *(PyObject **)(at + metrale_buffer_slot[1]) = nbytes;
        Py_INCREF(kind); *(PyObject **)(at + metrale_buffer_slot[2]) = kind;
        Py_INCREF(index); *(PyObject **)(at + metrale_buffer_slot[3]) = index;
        Py_INCREF(site); *(PyObject **)(at + metrale_buffer_slot[4]) = site;
        Py_INCREF(owner); *(PyObject **)(at + metrale_buffer_slot[5]) = owner;
        return buf;
    }
    """
    int FREE_THREADED "METRALE_FREE_THREADED"
    int use_layout "metrale_use_layout"(object type, Py_ssize_t *offsets)
    object build_buffer "metrale_build_buffer"(object ptr, object nbytes, object kind, object index, object site,
                                               object owner)

cdef bint _direct

cdef object make_buffer(object ptr, object nbytes, object kind, object index, object site, object owner)


cdef inline str keep_layout(object cls, tuple names):
    """Why the slots ``names`` of ``cls`` cannot be stored into in place, or ``None``: their offsets are kept."""
    cdef Py_ssize_t offsets[6]
    cdef int i, j
    if FREE_THREADED:
        return "a free-threaded build"
    if len(names) != 6:
        return f"DeviceBuffer has {len(names)} fields, not 6"
    for i in range(6):
        offsets[i] = slot_named(cls, names[i])
        if offsets[i] < 0:
            return f"DeviceBuffer.{names[i]} is not an object slot of the expected layout"
        for j in range(i):
            if offsets[j] == offsets[i]:
                return "two of DeviceBuffer's slots share an offset"
    if use_layout(cls, offsets) < 0:
        return "DeviceBuffer has variable-size instances"
    return None

