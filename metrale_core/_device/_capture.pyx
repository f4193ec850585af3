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


cdef int forbid_c(object flag, str what) except -1:
    if not _GIL:  # the pure check, serialized under the record's lock
        _serialized(what)
        return 0
    was = flag.inside
    flag.inside = True
    if not _ACTIVE and not _STARTING.count:
        return 0
    _judge(flag, was, what)
    return 0


cdef int leave_c(object flag) except -1:
    if not _GIL:  # the pure leave, serialized under the record's lock
        _leave_serialized(flag)
        return 0
    calls = flag.calls - 1
    if calls > 0:
        flag.calls = calls
        return 0
    flag.calls = 0
    if flag.inside:  # its barred call is over: cleared first, then a starting capture told (it may wait for it)
        flag.inside = False
        if _STARTING.count:
            with _LOCK:
                _IDLE.notify_all()
    return 0


def leave_call(flag):
    """The calling thread left a metrale call; leaving its outermost one ends its barred call (see the pure one)."""
    leave_c(flag)


def forbid_during_capture(str what):
    """Raise ``CaptureError`` (and invalidate every capture) if any capture is in progress (see the pure check)."""
    forbid_c(_MINE.flag, what)
