# An object slot (a ``__slots__`` entry) read and written in place, for the twins that know a class's layout
# (``_handle.pyx``: DeviceBuffer's; ``_capture.pyx``: the capture flag's): its offset, found once from its member
# descriptor and checked, then a load or a store at it.

from cpython.object cimport PyObject

cdef extern from *:
    """
    #include "structmember.h"

    /* The offset of the object slot behind member descriptor ``descr`` of ``type_object`` (a __slots__ entry,
       read-write); -1 where it is no such descriptor, or its slot lies outside the object or overlaps its header. */
    static Py_ssize_t metrale_slot_offset(PyObject *descr, PyObject *type_object) {
        PyTypeObject *type = (PyTypeObject *)type_object;
        PyMemberDef *member;
        if (Py_TYPE(descr) != &PyMemberDescr_Type) return -1;
        if (((PyDescrObject *)descr)->d_type != type) return -1;
        member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type != T_OBJECT_EX || (member->flags & READONLY)) return -1;
        if (member->offset < (Py_ssize_t)sizeof(PyObject)
                || member->offset + (Py_ssize_t)sizeof(PyObject *) > type->tp_basicsize
                || member->offset % (Py_ssize_t)sizeof(PyObject *) != 0) return -1;
        return member->offset;
    }

    /* The slot at ``offset`` of ``obj`` (borrowed; NULL where unset). */
    static inline PyObject *metrale_slot_get(PyObject *obj, Py_ssize_t offset) {
        return *(PyObject **)((char *)obj + offset);
    }

    /* Store ``value`` into the slot at ``offset`` of ``obj`` (its old value released after). */
    static inline void metrale_slot_set(PyObject *obj, Py_ssize_t offset, PyObject *value) {
        PyObject **at = (PyObject **)((char *)obj + offset);
        PyObject *old = *at;
        Py_INCREF(value);
        *at = value;
        Py_XDECREF(old);
    }
    """
    Py_ssize_t slot_offset "metrale_slot_offset"(object descr, object type_object)
    PyObject* slot_get "metrale_slot_get"(object obj, Py_ssize_t offset)
    void slot_set "metrale_slot_set"(object obj, Py_ssize_t offset, object value)


cdef inline Py_ssize_t slot_named(object cls, str name) except? -2:
    """The offset of ``name``, a plain object slot of ``cls``'s own ``__slots__`` (a class of ``type``); -1 where it
    is none: every twin that reads a class's slots in place finds them so."""
    if type(cls) is not type or not isinstance(cls.__dict__.get("__slots__"), tuple):
        return -1
    return slot_offset(cls.__dict__.get(name), cls)


cdef inline list slots_to_build(object cls, tuple names):
    """The offsets of ``names``, plain object slots of ``cls``, where an object of ``cls`` is made by storing them and
    nothing more (each slot its own, no items, no ``__post_init__``, no ``__new__`` of its own); else ``None``: the
    twins that build objects at C level (the packer's ``LaunchArg``, the zone table's ``Zone``) judge them so."""
    offsets = [slot_named(cls, name) for name in names]
    if (min(offsets) < 0 or len(set(offsets)) != len(offsets) or cls.__itemsize__ != 0
            or hasattr(cls, "__post_init__") or cls.__new__ is not object.__new__):
        return None
    return offsets
