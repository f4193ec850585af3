# capture.py compiled as ``_capture``: the record's flags read and written in place, and the capture rule's C-level
# door for the compiled parts (``from metrale_core._device._capture cimport _Flag, forbid_during_capture, leave_call``):
# `forbid_during_capture` takes the calling thread's flag where the caller has it at hand; `leave_call` ends a call
# (the gate's).

from metrale_core._device._slots cimport slot_named

cdef extern from *:
    """
    /* The layout of capture_record._Flag and _Starting: object slots after the header, in their names' order (as
       CPython lays out __slots__); checked as the module loads (flags_in_place). */
    typedef struct { PyObject_HEAD PyObject *calls; PyObject *inside; } metrale_capture_flag;
    typedef struct { PyObject_HEAD PyObject *count; } metrale_capture_starting;
    #define METRALE_FLAG_CALLS offsetof(metrale_capture_flag, calls)
    #define METRALE_FLAG_INSIDE offsetof(metrale_capture_flag, inside)
    #define METRALE_STARTING_COUNT offsetof(metrale_capture_starting, count)
    """
    ctypedef class metrale_core._device.capture_record._Flag [object metrale_capture_flag, check_size ignore]:
        cdef object calls
        cdef object inside

    ctypedef class metrale_core._device.capture_record._Starting [object metrale_capture_starting, check_size ignore]:
        cdef object count

    Py_ssize_t FLAG_CALLS "METRALE_FLAG_CALLS"
    Py_ssize_t FLAG_INSIDE "METRALE_FLAG_INSIDE"
    Py_ssize_t STARTING_COUNT "METRALE_STARTING_COUNT"

cdef dict _ACTIVE
cdef _Starting _STARTING
cdef bint GIL

cpdef void forbid_during_capture(object what, _Flag flag=*) except *
cpdef void leave_call(_Flag flag) except *
cdef void _barred_call_done(_Flag flag) except *


cdef inline bint flags_in_place(object flag, object starting) except -1:
    """Whether the slots this module reads in place are those of ``flag`` and ``starting`` (the record's classes)."""
    return (slot_named(flag, "calls") == FLAG_CALLS and slot_named(flag, "inside") == FLAG_INSIDE
            and slot_named(starting, "count") == STARTING_COUNT)
