# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`StreamLane`][metrale_core._streams.lane.StreamLane]: ``GpuBackend.memset``, the common case
done here at C level.

- The common case: a live device buffer of this backend (the very handle its ledger holds), plain ints, the default
  stream with no capture on it, no red zones (no fills to settle), and a plugin whose C door has ``memset``
  (``RawDevice.device_calls``). The gate is passed at C level (``_gate.pxd``), the liveness asked of the ledger's
  twin (``_ledger.pxd``), the handle's fields read from its slots (``_handle.pxd``).
- Everything else goes to the stream front, as the pure lane sends every call: another stream, a capture, red zones,
  bad arguments (their errors), a buffer not on the ledger, a door that declines (``1``).
- A door that fails (``-1``) raised the plugin's typed error; it is raised as the front raises a raw call's.
"""

cimport cython
from cpython.object cimport PyObject
from libc.stdint cimport uintptr_t

from .._device._calls cimport DEVICE_CALLS_MEMSET, device_calls_with, metrale_device_calls_v1, table_of
from .._device._gate cimport Gate, _Cell
from .._device._handle cimport FIELD_INDEX, FIELD_NBYTES, FIELD_OWNER, FIELD_PTR, buffer_field
from .._memory._ledger cimport Ledger

from .._device.buffer import DeviceBuffer as _DeviceBuffer
from .._device.guarded import raise_raw as _raise_raw
from .._device.raw import DEVICE_CALLS as _DEVICE_CALLS

cdef bytes _CAPSULE_NAME = _DEVICE_CALLS.encode()


@cython.final
cdef class StreamLane:
    """``GpuBackend.memset``: inside the gate, the common case here (compiled twin)."""

    cdef object _streams
    cdef object _ctx
    cdef Gate _gate
    cdef Ledger _ledger
    cdef object _ref
    cdef object _default  # the default stream (a Stream: its capture is read at each call)
    cdef bint _zoned
    cdef object _capsule  # (keeps the plugin's struct alive)
    cdef metrale_device_calls_v1* _door

    def __init__(self, streams, ledger):
        ctx = streams.ctx
        if not isinstance(ctx.gate, Gate) or not isinstance(ledger, Ledger):
            raise TypeError(
                f"the compiled stream lane needs the compiled gate and ledger, got {type(ctx.gate)!r} and "
                f"{type(ledger)!r}: one `pure` setting picks them all"
            )
        self._streams = streams
        self._ctx = ctx
        self._gate = ctx.gate
        self._ledger = ledger
        self._ref = ctx.ref
        self._default = streams.default
        self._zoned = bool(streams.guard.fills)
        self._capsule = device_calls_with(ctx.plugin, _CAPSULE_NAME, DEVICE_CALLS_MEMSET)
        self._door = table_of(self._capsule, _CAPSULE_NAME)

    def memset(self, dst, value, offset, nbytes, stream):
        """``GpuBackend.memset``."""
        cdef _Cell cell = self._gate.enter_c(False)
        try:
            if self._door is NULL or self._gate.closed_c() or not self._memset(dst, value, offset, nbytes, stream):
                self._streams.memset(dst, value, offset, nbytes, stream)
        finally:
            self._gate.leave_c(cell)

    cdef bint _memset(self, object dst, object value, object offset, object nbytes, object stream) except -1:
        """The common case through the plugin's C ``memset``: whether it was done (else the front does it)."""
        cdef Py_ssize_t size, off, count, byte
        cdef int rc
        if (stream is not None or self._zoned or type(dst) is not _DeviceBuffer or type(value) is not int
                or type(offset) is not int or (nbytes is not None and type(nbytes) is not int)):
            return False
        if buffer_field(dst, FIELD_OWNER) is not self._ref or not self._ledger.has_index(buffer_field(dst, FIELD_INDEX), dst):
            return False
        recorded = buffer_field(dst, FIELD_NBYTES)
        if not (0 <= value <= 255 and 0 <= offset <= recorded and (nbytes is None or 0 < nbytes <= recorded)):
            return False  # (compared as Python ints: nothing converted that might not fit)
        size = recorded
        off = offset
        count = size - off if nbytes is None else nbytes
        if count <= 0 or off > size - count:  # (no sum that could overflow)
            return False
        target = self._default
        if target.capture is not None:
            return False
        byte = value
        ctx = self._ctx
        try:
            rc = self._door.memset(self._door.state, <uintptr_t>buffer_field(dst, FIELD_PTR) + <uintptr_t>off,
                                   <int>byte, <size_t>count, <PyObject*>target.raw)
        except Exception as exc:
            _raise_raw(ctx, ctx.name, "memset", exc)
        return rc == 0
