# lane.py compiled as ``_lane``: the lane's fields as C types, the other parts called at C level through their own
# .pxd (the gate, the capture rule, the handle, the stats, the ledger, the pool front, the call site, the zone table,
# the quarantine), a buffer's fields read in place (``_device/_fields.pxd``), and the plugin's C device calls
# (``_device/_calls.pxd``) through `lane_calls`, `call_alloc`, `call_free` and `call_memset`, which lane.py names
# only where it is compiled.

cimport cython
from cpython.object cimport PyObject
from libc.stdint cimport uintptr_t

from metrale_core._device._calls cimport (
    ask_device_calls, device_calls_have_memset, device_calls_of, metrale_device_calls_v1,
)
from metrale_core._device._capture cimport forbid_during_capture
from metrale_core._device._fields cimport DeviceBuffer, check_fields
from metrale_core._device._gate cimport Gate, _Cell
from metrale_core._device._handle cimport make_buffer
from metrale_core._device._stats cimport KIND_DEVICE, StatsCounter
from metrale_core._memory._ledger cimport Ledger
from metrale_core._memory._pools cimport PoolFront
from metrale_core._memory._quarantine cimport Quarantine
from metrale_core._memory._sites cimport call_site
from metrale_core._redzones._layout cimport RedZones


@cython.final
cdef class DeviceLane:
    cdef metrale_device_calls_v1* _calls
    cdef bint _calls_memset
    cdef object _capsule
    cdef object _ctx
    cdef object _fill_stream
    cdef Py_ssize_t _frames
    cdef object _free_host
    cdef Gate _gate
    cdef object _guard
    cdef object _holdings
    cdef object _indexes
    cdef object _internal
    cdef Ledger _ledger
    cdef PoolFront _pools
    cdef Quarantine _quarantine
    cdef object _raw
    cdef dict _raw_base
    cdef object _rawmem
    cdef object _ref
    cdef object _releases
    cdef StatsCounter _stats
    cdef object _trace_idx
    cdef bint _zeroes
    cdef RedZones _zones

    @cython.locals(cell=_Cell, gate=Gate)
    cpdef object alloc(self, object nbytes)
    @cython.locals(zones=RedZones)
    cdef object _alloc(self, object nbytes, str kind, str what, object site, Py_ssize_t frames)
    @cython.locals(zones=RedZones, recycled=bint)
    cdef object _zoned(self, object n, object index, object site, object lead, str what)
    @cython.locals(done=bint)
    cdef int _memset(self, object ptr, int value, object nbytes) except -1
    @cython.locals(committed=bint)
    cdef object _commit(self, object buf, object index, object n, str kind, object raw_ptr, bint zoned, object site,
                        str what)
    @cython.locals(cell=_Cell, gate=Gate, handle=DeviceBuffer)
    cpdef free(self, object buf)
    @cython.locals(observers=tuple, record=DeviceBuffer)
    cdef object _release(self, object buf, object ptr, object index, object n, object owner)


cdef inline object lane_calls(DeviceLane lane, object plugin, bytes name, object log):
    """The plugin's capsule of device calls (``None`` where it offers none or fails: logged), kept by the lane as
    long as it calls them; their struct in ``lane._calls`` (NULL where it cannot be used), ``memset``'s in it in
    ``lane._calls_memset``."""
    capsule = ask_device_calls(plugin, log)
    lane._calls = device_calls_of(plugin, capsule, name, log)
    lane._calls_memset = lane._calls is not NULL and device_calls_have_memset(lane._calls)
    return capsule


cdef inline object call_alloc(DeviceLane lane, object nbytes):
    """The plugin's C ``alloc``: the address; ``None`` where there is none, the backend closed or it declined (the
    method then does it); its error raised."""
    cdef uintptr_t ptr = 0
    if lane._calls is NULL or lane._gate.closed:
        return None
    if lane._calls.alloc(lane._calls.state, <size_t>nbytes, &ptr) == 0:
        return ptr
    return None


cdef inline bint call_free(DeviceLane lane, object ptr) except -1:
    """The plugin's C ``free``: whether it freed (else the method does it); its error raised."""
    if lane._calls is NULL or lane._gate.closed:
        return False
    return lane._calls.free(lane._calls.state, <uintptr_t>ptr) == 0


cdef inline bint call_memset(DeviceLane lane, object ptr, int value, object nbytes, object stream) except -1:
    """The plugin's C ``memset`` on ``stream``: whether it filled (else the method does it); its error raised."""
    if not lane._calls_memset or lane._gate.closed:
        return False
    return lane._calls.memset(lane._calls.state, <uintptr_t>ptr, value, <size_t>nbytes, <PyObject*>stream) == 0
