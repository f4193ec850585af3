# The compiled gate's C-level door, for the compiled parts that pass it (the allocator's lane): `enter_c` counts
# the calling thread in and gives its cell; `leave_c` counts that cell out.

cdef class _Cell:
    cdef public Py_ssize_t depth
    cdef public object flag
    cdef object __weakref__


cdef class Gate:
    cdef object _refusal
    cdef bint _closed
    cdef bint _faulted
    cdef object _lock
    cdef object _cond
    cdef object _cells
    cdef object _depth
    cdef unsigned long long _last_thread  # the thread state whose cell `_last_cell` is (a cache under the GIL)
    cdef unsigned long long _last_forks  # the forks this process had seen then
    cdef _Cell _last_cell
    cdef list _later  # deferred frees: (call, arg), oldest first

    cdef _Cell _cell(self)

    cdef inline bint closed_c(self):
        return self._closed

    cdef _Cell enter_c(self, bint faulted_ok)
    cdef bint interrupted_c(self) except -1
    cdef int leave_c(self, _Cell cell) except -1
    cdef int _count_out(self, _Cell cell) except -1
