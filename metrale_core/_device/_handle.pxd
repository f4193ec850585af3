# The handle twin's C-level face: other twins build a DeviceBuffer without a Python call
# (``from metrale_core._device._handle cimport make_buffer``).

cdef object make_buffer(object ptr, object nbytes, object kind, object index, object site, object owner)
