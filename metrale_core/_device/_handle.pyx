# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of ``DeviceBuffer._make`` (`metrale_core._device.buffer`): a `DeviceBuffer` built at C speed.

- `make_buffer` (C level, in ``_handle.pxd``) is for other twins: ``from metrale_core._device._handle cimport
  make_buffer``. `make` is the same for Python callers. Both return a real `DeviceBuffer`: the same type, value,
  hash, repr and pickle as ``DeviceBuffer(...)``.
- How: the type's ``tp_alloc``, then each field stored into its slot, at the offset its member descriptor holds
  (``PyMemberDescrObject->d_member->offset``). The offsets are read once, at import, and checked: six object slots
  in the dataclass's order, inside the object, after its header. Where the layout is not that (a changed class, a
  free-threaded build), both call ``DeviceBuffer._make`` instead, and the log says why once (at debug).
- ``DeviceBuffer._make`` stays the pure reference; `_twins.pick("handle", DeviceBuffer._make, pure)` chooses.
"""

cimport cython
from cpython.object cimport PyObject

from ._slots cimport slot_offset

import dataclasses
import logging

from .buffer import DeviceBuffer

cdef extern from *:
    """
    /* DeviceBuffer's six slots, in its fields' order: their offsets, and the type (NULL until checked); each
       offset found by metrale_slot_offset (_slots.pxd). */
    static PyTypeObject *metrale_buffer_type = NULL;
    static Py_ssize_t metrale_buffer_slot[6];

    /* Whether this is a free-threaded build: there the pure path runs (as DeviceBuffer._make's own rule has it). */
    #ifdef Py_GIL_DISABLED
    #define METRALE_FREE_THREADED 1
    #else
    #define METRALE_FREE_THREADED 0
    #endif

    static int metrale_use_layout(PyObject *type_object, Py_ssize_t *offsets) {
        PyTypeObject *type = (PyTypeObject *)type_object;
        int i;
        if (type->tp_itemsize != 0) return -1;
        for (i = 0; i < 6; i++) metrale_buffer_slot[i] = offsets[i];
        metrale_buffer_type = type;
        return 0;
    }

    /* Field ``i`` of DeviceBuffer ``buf`` (a borrowed reference; NULL where the slot is empty). */
    static PyObject *metrale_buffer_get(PyObject *buf, int i) {
        return *(PyObject **)((char *)buf + metrale_buffer_slot[i]);
    }

    /* A new DeviceBuffer of these fields (new references in its slots), or NULL with an exception set. */
    static PyObject *metrale_build_buffer(PyObject *ptr, PyObject *nbytes, PyObject *kind, PyObject *index,
                                          PyObject *site, PyObject *owner) {
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
    int METRALE_FREE_THREADED
    int metrale_use_layout(object type, Py_ssize_t *offsets)
    object metrale_build_buffer(object ptr, object nbytes, object kind, object index, object site, object owner)
    PyObject* metrale_buffer_get(object buf, int i)

_log = logging.getLogger("metrale")

#: DeviceBuffer's fields, in the order ``make`` takes them and its slots are stored.
_FIELDS = ("ptr", "nbytes", "kind", "index", "site", "_owner")

cdef object _pure_make = DeviceBuffer._make
cdef bint _direct = False


def _layout_problem():
    """Why ``DeviceBuffer``'s slots cannot be stored into directly here, or ``None`` (then their offsets are kept)."""
    cdef Py_ssize_t offsets[6]
    cdef int i
    if METRALE_FREE_THREADED:
        return "a free-threaded build"
    if type(DeviceBuffer) is not type or DeviceBuffer.__base__ is not object:
        return "DeviceBuffer has a metaclass or a base class"
    slots = DeviceBuffer.__dict__.get("__slots__")
    if tuple(slots or ()) != _FIELDS or tuple(f.name for f in dataclasses.fields(DeviceBuffer)) != _FIELDS:
        return f"DeviceBuffer's slots are {slots}, not {_FIELDS}"
    if hasattr(DeviceBuffer, "__post_init__") or DeviceBuffer.__new__ is not object.__new__:
        return "DeviceBuffer's construction does more than store its fields"
    for i, name in enumerate(_FIELDS):
        offsets[i] = slot_offset(DeviceBuffer.__dict__[name], DeviceBuffer)
        if offsets[i] < 0:
            return f"DeviceBuffer.{name} is not an object slot of the expected layout"
    seen = set()
    for i in range(6):
        seen.add(offsets[i])
    if len(seen) != 6:
        return "two of DeviceBuffer's slots share an offset"
    if metrale_use_layout(DeviceBuffer, offsets) < 0:
        return "DeviceBuffer has variable-size instances"
    return None


def _self_check():
    """A buffer built here is the one ``DeviceBuffer(...)`` builds: the same type, value and repr."""
    owner = object()
    built = metrale_build_buffer(4096, 256, "device", 7, "app.py:1", owner)
    made = DeviceBuffer(4096, 256, "device", 7, "app.py:1", owner)
    return type(built) is DeviceBuffer and built == made and repr(built) == repr(made) and built._owner is owner


try:
    _why = _layout_problem()
except Exception as exc:  # a class this module cannot read: the pure path
    _why = f"{type(exc).__name__}: {exc}"
if _why is None and not _self_check():
    _why = "a buffer built in place differed from DeviceBuffer(...)"
if _why is None:
    _direct = True
else:
    _log.debug("the handle twin calls DeviceBuffer._make: its slots cannot be stored into directly (%s)", _why)

#: Whether ``make`` stores into ``DeviceBuffer``'s slots directly (else it calls ``DeviceBuffer._make``).
DIRECT = _direct


cdef object make_buffer(object ptr, object nbytes, object kind, object index, object site, object owner):
    """A `DeviceBuffer` of these fields, at C speed where the layout was checked at import."""
    if _direct:
        return metrale_build_buffer(ptr, nbytes, kind, index, site, owner)
    return _pure_make(ptr, nbytes, kind, index, site, owner)


def make(ptr, nbytes, kind, index, site, owner=None):
    """The same as ``DeviceBuffer._make(ptr, nbytes, kind, index, site, owner)``, built in C."""
    if _direct:
        return metrale_build_buffer(ptr, nbytes, kind, index, site, owner)
    return _pure_make(ptr, nbytes, kind, index, site, owner)


cdef object buffer_field(object buf, int i):
    """Field ``i`` (``FIELD_PTR`` ... ``FIELD_OWNER``) of ``buf``, a `DeviceBuffer` (its exact type: the caller checks)."""
    cdef PyObject* value
    if _direct:
        value = metrale_buffer_get(buf, i)
        if value is not NULL:
            return <object>value
    return getattr(buf, _FIELDS[i])  # (an unset slot: its AttributeError)
