# door.py compiled as ``_door``: the Door's fields as C types, and its C-level calls for the compiled C functions of
# ``_doorfuncs.pyx`` (``from ._door cimport Door``): `alloc_c` and `free_c` are `alloc` and `free` without a Python
# call; neither raises (a refusal is logged and counted).

cimport cython
from libc.stdint cimport uintptr_t


@cython.final
cdef class Door:
    cdef object _gpu
    cdef object _pool
    cdef dict _out
    cdef dict _graphs
    cdef list _underway
    cdef dict _in_graphs
    cdef bint _zoned
    cdef public object framework
    cdef public Py_ssize_t failures
    cdef public object last_error

    @cython.locals(ptr=object)
    cdef uintptr_t alloc_c(self, size_t nbytes, uintptr_t stream) noexcept
    cdef void free_c(self, uintptr_t address) noexcept
    cdef _failed(self, str what, object exc)
