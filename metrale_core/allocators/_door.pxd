# The compiled door's C-level face, for the compiled C functions of `doorfuncs` (``_doorfuncs.pyx``): `alloc_c` and
# `free_c` are `alloc` and `free` without a Python call; neither raises (a refusal is logged and counted).

from libc.stdint cimport uintptr_t


cdef class Door:
    cdef object _gpu
    cdef object _pool
    cdef dict _out
    cdef public object framework
    cdef public Py_ssize_t failures
    cdef public object last_error

    cdef uintptr_t alloc_c(self, size_t nbytes, uintptr_t stream) noexcept
    cdef void free_c(self, uintptr_t address) noexcept
    cdef int _failed(self, str what, object exc) except -1
