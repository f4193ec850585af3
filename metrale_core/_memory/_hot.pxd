# The hot paths' calls into the other compiled parts, by name, for the one-source modules of the memory wing
# (``lane.py`` compiled as ``_lane``, ``pools.py`` as ``_pools``): each is a C-level door of another twin (the
# gate, the capture rule, the handle, the stats, the zone table, the quarantine) or a call through the plugin's C
# device calls. ``_hot.py`` gives the same names to their pure run, as ``_lock.py`` does for ``_lock.pxd``.

cimport cython
from cpython.object cimport PyObject
from libc.stdint cimport uintptr_t

from metrale_core._device._capture cimport forbid_c
from metrale_core._device._calls cimport ask_device_calls, device_calls_have_memset, device_calls_of, metrale_device_calls_v1
from metrale_core._device._gate cimport Gate, _Cell
from metrale_core._device._handle cimport (
    FIELD_INDEX, FIELD_KIND, FIELD_NBYTES, FIELD_OWNER, FIELD_PTR, buffer_field, make_buffer as _make_buffer,
)
from metrale_core._device._stats cimport KIND_DEVICE, KIND_POOL, StatsCounter
from metrale_core._memory._ledger cimport Ledger
from metrale_core._memory._quarantine cimport Quarantine
from metrale_core._redzones._layout cimport RedZones


cdef inline int check_parts(object gate, object ledger, object stats, object zones, object quarantine) except -1:
    """Refuse pure parts: a compiled lane passes the gate and calls the ledger, the stats, the zone table and the
    quarantine at C level (one ``pure`` setting picks them all)."""
    if not isinstance(gate, Gate):
        raise TypeError(f"the compiled lane needs the compiled gate, got {type(gate)!r}: one `pure` setting picks both")
    if not isinstance(ledger, Ledger) or not isinstance(stats, StatsCounter):
        raise TypeError(f"the compiled lane needs the compiled ledger and stats, got {type(ledger)!r} and "
                        f"{type(stats)!r}: one `pure` setting picks them all")
    if zones is not None and (not isinstance(zones, RedZones) or not isinstance(quarantine, Quarantine)):
        raise TypeError(f"the compiled lane needs the compiled zone table and quarantine, got {type(zones)!r} and "
                        f"{type(quarantine)!r}: one `pure` setting picks them all")
    return 0


# -- the gate and the capture rule ------------------------------------------------------------------------------

cdef inline _Cell gate_in(Gate gate):
    """Count the calling thread in (``Gate.enter``): its cell."""
    return gate.enter_c(False)

cdef inline int gate_out(Gate gate, _Cell cell) except -1:
    """Count the cell `gate_in` gave out (``Gate.leave``)."""
    gate.leave_c(cell)
    return 0

cdef inline int forbid(_Cell cell, str what) except -1:
    """``forbid_during_capture(what)``, with the calling thread's flag at hand."""
    return forbid_c(cell.flag, what)

cdef inline bint interrupted(Gate gate) except -1:
    """``Gate.interrupted``."""
    return gate.interrupted_c()

cdef inline bint gate_closed(Gate gate):
    """``Gate.closed``."""
    return gate.closed_c()

# -- handles --------------------------------------------------------------------------------------------------

cdef inline object make_buffer(object ptr, object nbytes, object kind, object index, object site, object owner):
    """``DeviceBuffer._make``."""
    return _make_buffer(ptr, nbytes, kind, index, site, owner)

# (a DeviceBuffer's fields: the caller checked ``type(buf) is DeviceBuffer``)
cdef inline object buf_ptr(object buf):
    return buffer_field(buf, FIELD_PTR)

cdef inline object buf_nbytes(object buf):
    return buffer_field(buf, FIELD_NBYTES)

cdef inline object buf_kind(object buf):
    return buffer_field(buf, FIELD_KIND)

cdef inline object buf_index(object buf):
    return buffer_field(buf, FIELD_INDEX)

cdef inline object buf_owner(object buf):
    return buffer_field(buf, FIELD_OWNER)

# -- the stats ------------------------------------------------------------------------------------------------

cdef inline void device_in(StatsCounter stats, long long nbytes) noexcept:
    stats.allocated_c(KIND_DEVICE, nbytes)

cdef inline void device_out(StatsCounter stats, long long nbytes) noexcept:
    stats.released_c(KIND_DEVICE, nbytes)

cdef inline void pool_in(StatsCounter stats, long long nbytes) noexcept:
    stats.allocated_c(KIND_POOL, nbytes)

cdef inline void pool_out(StatsCounter stats, long long nbytes) noexcept:
    stats.released_c(KIND_POOL, nbytes)

# -- red zones ------------------------------------------------------------------------------------------------

cdef inline object zone_lead(RedZones zones, object nbytes, object index):
    """The leading band of a new allocation's zones (0 where none leads), or -1 where it gets no zones."""
    if index < zones.min_idx or index % zones.sample:
        return -1
    return zones._lead_bytes

cdef inline int add_zones(RedZones zones, object buf, object index, object ptr, object nbytes,
                          object lead) except -1:
    """Watch the zones of ``buf`` (filled), as `zone_lead` laid them out."""
    return zones.add_c(buf, index, <uintptr_t>ptr, <size_t>nbytes)

cdef inline object reuse(Quarantine quarantine, object raw_bytes, object lead, object trail):
    """A checked block of ``raw_bytes`` kept for reuse (its raw address), or ``None``."""
    return quarantine.reuse_c(raw_bytes)

cdef inline int quarantine_free(Quarantine quarantine, object buf, object index, object nbytes, object raw_ptr,
                                object kind) except -1:
    """``Quarantine.free`` of a zoned allocation off the ledger."""
    return quarantine.free_c(buf, index, nbytes, raw_ptr, kind)

# -- the plugin's device calls (``RawDevice.device_calls``) ----------------------------------------------------

cdef inline bint calls_have_memset(metrale_device_calls_v1* calls):
    return calls is not NULL and device_calls_have_memset(calls)

cdef inline object calls_alloc(metrale_device_calls_v1* calls, Gate gate, object nbytes):
    """The plugin's C ``alloc``: the address, ``None`` where there is none, the backend closed or it declined (the
    method then does it); its error raised."""
    cdef uintptr_t ptr = 0
    if calls is NULL or gate.closed_c():
        return None
    if calls.alloc(calls.state, <size_t>nbytes, &ptr) == 0:
        return ptr
    return None

cdef inline bint calls_free(metrale_device_calls_v1* calls, Gate gate, object ptr) except -1:
    """The plugin's C ``free``: whether it freed (else the method does it); its error raised."""
    if calls is NULL or gate.closed_c():
        return False
    return calls.free(calls.state, <uintptr_t>ptr) == 0

cdef inline bint calls_memset(metrale_device_calls_v1* calls, bint has_memset, Gate gate, object ptr, int value,
                              object nbytes, object stream) except -1:
    """The plugin's C ``memset`` on ``stream``: whether it filled (else the method does it); its error raised."""
    if not has_memset or gate.closed_c():
        return False
    return calls.memset(calls.state, <uintptr_t>ptr, value, <size_t>nbytes, <PyObject*>stream) == 0
