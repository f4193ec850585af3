# The call site twin's C-level door, for the compiled lane: `call_site(internal, skip)` without a Python call.

cdef object call_site_c(object internal, Py_ssize_t skip)
