# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of the capture rule's check, [`forbid_during_capture`][metrale_core._device.capture.forbid_during_capture].

- Its common case at C level: no capture in progress or starting, the thread's flag set first, then the
  record read (as the pure check does, in the same order).
- Anything else (a capture in progress or starting) is the pure rule's locked half,
  `judge_under_capture`, with the flag still set (a capture starting meanwhile waits for this call): the record
  and its rules stay in ``capture.py``, whose state this twin reads and never writes.
- A free-threaded build runs the pure check, which takes the lock around the flag's store and the record's read.
"""

import sys

from . import capture as _pure

cdef object _ACTIVE = _pure._ACTIVE
cdef object _STARTING = _pure._STARTING
cdef object _MINE = _pure._MINE
cdef object _judge = _pure.judge_under_capture
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


def forbid_during_capture(str what):
    """Raise ``CaptureError`` (and invalidate every capture) if any capture is in progress (see the pure check)."""
    forbid_c(_MINE.flag, what)
