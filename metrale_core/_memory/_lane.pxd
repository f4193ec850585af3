# lane.py compiled as ``_lane``: the lane's fields as C types, the other parts called through their C-level doors
# (``_hot.pxd``, ``_ledger.pxd``, ``_pools.pxd``, ``_sites.pxd``), the plugin's device calls through their struct.

cimport cython

from metrale_core._device._calls cimport metrale_device_calls_v1
from metrale_core._device._gate cimport Gate, _Cell
from metrale_core._device._stats cimport StatsCounter
from metrale_core._memory._hot cimport (
    add_zones, ask_device_calls, buf_index, buf_kind, buf_nbytes, buf_owner, buf_ptr, calls_alloc, calls_free,
    calls_have_memset, calls_memset, check_parts, device_calls_of, device_in, device_out, forbid, gate_closed,
    gate_in, gate_out, interrupted, make_buffer, quarantine_free, reuse, zone_lead,
)
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
    @cython.locals(cell=_Cell, gate=Gate)
    cpdef free(self, object buf)
    @cython.locals(observers=tuple)
    cdef object _release(self, object buf, object ptr, object index, object n, object owner)
