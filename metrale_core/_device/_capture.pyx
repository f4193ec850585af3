# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of the capture rule's check, [`forbid_during_capture`][metrale_core._device.capture.forbid_during_capture].

- Its common case at C level: no capture in progress or starting, the thread's flag set first, then the
  record read (as the pure check does, in the same order).
- Anything else (a capture in progress or starting) is the pure rule's locked half,
  `judge_under_capture`, with the flag still set (a capture starting meanwhile waits for this call): the record
  and its rules stay in ``capture.py``, whose state this twin reads and never writes.
- `leave_c` is the twin of `leave_call`: the end of a thread's barred call, which the gate's twin calls as a
  call leaves.
- A free-threaded build runs the pure check, which takes the lock around the flag's store and the record's read.
"""

import sys

from cpython.object cimport PyObject

from ._slots cimport slot_get, slot_named, slot_set

from . import capture as _pure

cdef object _ACTIVE = _pure._ACTIVE
cdef object _STARTING = _pure._STARTING
cdef object _MINE = _pure._MINE
cdef object _LOCK = _pure._LOCK
cdef object _IDLE = _pure._IDLE
cdef object _judge = _pure.judge_under_capture
cdef object _leave_serialized = _pure.leave_call
cdef object _serialized = _pure.forbid_during_capture
cdef bint _GIL = getattr(sys, "_is_gil_enabled", lambda: True)()

# The flag's slots (``_Flag.calls``, ``_Flag.inside``) and ``_STARTING.count``, read and written in place where
# their layout was checked at import (GIL builds; a flag of another type, or a layout not found: attributes).
cdef object _FLAG_TYPE = _pure._Flag
cdef Py_ssize_t _CALLS = -1
cdef Py_ssize_t _INSIDE = -1
cdef Py_ssize_t _COUNT = -1


def _offsets():
    """The three slots' offsets, each -1 where it is not a plain object slot of its class."""
    return slot_named(_pure._Flag, "calls"), slot_named(_pure._Flag, "inside"), slot_named(type(_STARTING), "count")


if _GIL:
    _CALLS, _INSIDE, _COUNT = _offsets()
    if min(_CALLS, _INSIDE, _COUNT) < 0:
        _CALLS = _INSIDE = _COUNT = -1

#: Whether the flag's slots are read and written in place (else through their attributes, as the pure module does).
SLOTS = _CALLS >= 0


cdef inline object _calls(object flag):
    cdef PyObject* value
    if _CALLS >= 0 and type(flag) is _FLAG_TYPE:
        value = slot_get(flag, _CALLS)
        if value is not NULL:
            return <object>value
    return flag.calls


cdef inline int _set_calls(object flag, object calls) except -1:
    if _CALLS >= 0 and type(flag) is _FLAG_TYPE:
        slot_set(flag, _CALLS, calls)
    else:
        flag.calls = calls
    return 0


cdef inline bint _inside(object flag) except -1:
    cdef PyObject* value
    if _INSIDE >= 0 and type(flag) is _FLAG_TYPE:
        value = slot_get(flag, _INSIDE)
        if value is not NULL:
            return value == <PyObject*>True or (value != <PyObject*>False and bool(<object>value))
    return bool(flag.inside)


cdef inline int _set_inside(object flag, bint inside) except -1:
    if _INSIDE >= 0 and type(flag) is _FLAG_TYPE:
        slot_set(flag, _INSIDE, True if inside else False)
    else:
        flag.inside = inside
    return 0


cdef inline bint _starting() except -1:
    cdef PyObject* value
    if _COUNT >= 0:
        value = slot_get(_STARTING, _COUNT)
        if value is not NULL:
            return bool(<object>value)
    return bool(_STARTING.count)


cdef int forbid_c(object flag, str what) except -1:
    if not _GIL:  # the pure check, serialized under the record's lock
        _serialized(what)
        return 0
    was = _inside(flag)
    _set_inside(flag, True)
    if not _ACTIVE and not _starting():
        return 0
    _judge(flag, was, what)
    return 0


cdef int enter_c(object flag) except -1:
    _set_calls(flag, _calls(flag) + 1)
    return 0


cdef int leave_c(object flag) except -1:
    if not _GIL:  # the pure leave, serialized under the record's lock
        _leave_serialized(flag)
        return 0
    calls = _calls(flag) - 1
    if calls > 0:
        _set_calls(flag, calls)
        return 0
    _set_calls(flag, 0)
    if _inside(flag):  # its barred call is over: cleared first, then a starting capture told (it may wait for it)
        _set_inside(flag, False)
        if _starting():
            with _LOCK:
                _IDLE.notify_all()
    return 0


def leave_call(flag):
    """The calling thread left a metrale call; leaving its outermost one ends its barred call (see the pure one)."""
    leave_c(flag)


def forbid_during_capture(str what):
    """Raise ``CaptureError`` (and invalidate every capture) if any capture is in progress (see the pure check)."""
    forbid_c(_MINE.flag, what)
