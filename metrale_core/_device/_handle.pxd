# The handle twin's C-level face: other twins build a DeviceBuffer without a Python call
# (``from metrale_core._device._handle cimport make_buffer``).

cdef object make_buffer(object ptr, object nbytes, object kind, object index, object site, object owner)

# A DeviceBuffer's fields, in its slots' order, for `buffer_field` (the caller checks ``type(buf) is DeviceBuffer``).
cdef enum:
    FIELD_PTR = 0
    FIELD_NBYTES = 1
    FIELD_KIND = 2
    FIELD_INDEX = 3
    FIELD_SITE = 4
    FIELD_OWNER = 5

cdef object buffer_field(object buf, int i)
