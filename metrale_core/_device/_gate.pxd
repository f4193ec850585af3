# gate.py compiled as ``_gate``: the gate's flags and counts as C fields, and its C-level door for the compiled parts
# that pass it (``from metrale_core._device._gate cimport Gate, _Cell``): `enter_c` counts the calling thread in and
# gives its cell, `leave_c` counts that cell out; `closed` is a C read, `interrupted` a C call.

cimport cython

from metrale_core._device._capture cimport _Flag, leave_call

cdef extern from *:
    """
    /* The calling thread's state's id: unique in the interpreter, never reused (a thread's ident may be). */
    static CYTHON_UNUSED unsigned long long metrale_thread_state_id(void) {
        return PyThreadState_GetID(PyThreadState_Get());
    }
    """
    unsigned long long thread_state_id "metrale_thread_state_id"()
    unsigned long thread_ident "PyThread_get_thread_ident"()

cdef unsigned long _collector
cdef unsigned long long _forks
cdef bint LOCK_FREE
cdef bint _CACHE


@cython.final
cdef class _Cell:
    cdef public Py_ssize_t depth
    cdef public _Flag flag
    cdef object __weakref__


@cython.final
cdef class Gate:
    cdef object _refusal
    cdef readonly bint closed
    cdef bint _faulted
    cdef object _lock
    cdef object _cond
    cdef object _cells
    cdef object _depth
    cdef list _later  # deferred frees: (call, arg), oldest first
    cdef unsigned long long _last_thread  # the thread state whose cell `_last_cell` is (a cache under the GIL)
    cdef unsigned long long _last_forks  # the forks this process had seen then
    cdef _Cell _last_cell

    @cython.locals(thread=cython.ulonglong, cell=_Cell)
    cdef _Cell _cell(self)
    @cython.locals(cell=_Cell, closed=cython.bint)
    cpdef _Cell enter_c(self, bint faulted_ok)
    @cython.locals(flag=_Flag)
    cpdef void leave_c(self, _Cell cell) except *
    cdef int _count_out(self, _Cell cell) except -1
    cpdef bint interrupted(self) except -1
