# sites.py compiled as ``_sites``: `call_site` at C level for the compiled callers
# (``from metrale_core._memory._sites cimport call_site``). The frame API its walk reads is ``_frames.pxd``'s,
# cimported by sites.py alone.

cimport cython

cdef dict _INTERNAL_MODULES
cdef Py_ssize_t _SITES_MAX
cdef object _getframe

cdef str _site(object frame)

@cython.locals(own=Py_ssize_t, known=dict)
cpdef str call_site(object internal, Py_ssize_t skip=*)
