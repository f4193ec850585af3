# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of the capture rule's check, [`forbid_during_capture`][metrale_core._device.capture.forbid_during_capture].

- Its common case at C level: no capture in progress or starting, the thread's flag set first, then the
  record read (as the pure check does, in the same order).
- Anything else (a capture in progress or starting) is the pure check's, which takes the lock: the record and
  its rules stay in ``capture.py``, whose state this twin reads and never writes.
"""

from . import capture as _pure

cdef object _ACTIVE = _pure._ACTIVE
cdef object _STARTING = _pure._STARTING
cdef object _MINE = _pure._MINE
cdef object _slow = _pure.forbid_during_capture


cdef int forbid_c(object flag, str what) except -1:
    was = flag.inside
    flag.inside = True
    if not _ACTIVE and not _STARTING.count:
        return 0
    if not was:  # the pure check sets the flag again and judges under the lock
        flag.inside = False
    _slow(what)
    return 0


def forbid_during_capture(str what):
    """Raise ``CaptureError`` (and invalidate every capture) if any capture is in progress (see the pure check)."""
    forbid_c(_MINE.flag, what)
