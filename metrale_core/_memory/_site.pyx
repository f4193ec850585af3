# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`call_site`][metrale_core._memory.ledger.call_site]: the same function, its walk of
the frame chain through the C API and its ``"file:line"`` strings in a C hash table.

- The pure function in ``ledger.py`` is the reference: ``ledger.call_site_for(pure)`` (`_twins.pick`)
  chooses this one where it was built and ``pure`` is off. A differential test runs both on the same stacks.
- ``skip``: this function has no frame of its own (the pure one has, and passes it over), so the walk
  starts at its caller's frame, ``skip`` frames out: the same frame the pure function starts at. It gets
  there with ``sys._getframe`` (one C call), which makes a frame object of that frame only: walking out to
  it with ``PyFrame_GetBack`` would make one of each frame passed (measured: slower by one frame object,
  about 20 ns at the allocator's depth). From there ``PyFrame_GetBack`` and ``PyFrame_GetGlobals``.
- Whether a module's frames are internal is judged once per module name, by ``ledger._is_internal``, and
  kept in a dict per set of internal packages, as in the pure function (its own dicts).
- A site is formatted once per (code object, instruction) and kept in an open-addressing table of C
  structs: no key object is made per call (the pure function makes a tuple of two ints). An entry holds
  its code object, so its address stays its own; at ``_SITES_MAX`` entries the table starts again, as
  the pure dict does. On a free-threaded build the table is read and written in a critical section
  (nothing on a build with the GIL, which no C code here gives up); references are dropped outside it.
"""

cimport cython
from cpython.object cimport PyObject
from libc.stdlib cimport calloc, free

import sys

from .ledger import _SITES_MAX, _is_internal

cdef extern from *:
    """
    /* The frame API, each taking and giving PyObject: new references, never NULL without an exception set. */
    static PyObject *metrale_frame_back(PyObject *frame) {  /* the calling frame, or None */
        PyObject *back = (PyObject *)PyFrame_GetBack((PyFrameObject *)frame);
        if (back == NULL) Py_RETURN_NONE;
        return back;
    }
    static PyObject *metrale_frame_code(PyObject *frame) { return (PyObject *)PyFrame_GetCode((PyFrameObject *)frame); }
    static PyObject *metrale_frame_globals(PyObject *frame) { return PyFrame_GetGlobals((PyFrameObject *)frame); }
    static int metrale_frame_lasti(PyObject *frame) { return PyFrame_GetLasti((PyFrameObject *)frame); }
    static int metrale_frame_line(PyObject *frame) { return PyFrame_GetLineNumber((PyFrameObject *)frame); }

    /* d.get(key, dflt) of a dict: PyDict_GetItemRef where there is one (a free-threaded build needs it) */
    static PyObject *metrale_dict_get(PyObject *d, PyObject *key, PyObject *dflt) {
        PyObject *value;
    #if PY_VERSION_HEX >= 0x030D0000
        int found = PyDict_GetItemRef(d, key, &value);
        if (found < 0) return NULL;
        if (found) return value;
    #else
        value = PyDict_GetItemWithError(d, key);
        if (value) { Py_INCREF(value); return value; }
        if (PyErr_Occurred()) return NULL;
    #endif
        Py_INCREF(dflt);
        return dflt;
    }
    """
    object _frame_back "metrale_frame_back"(object)
    object _frame_code "metrale_frame_code"(object)
    object _frame_globals "metrale_frame_globals"(object)
    int _frame_lasti "metrale_frame_lasti"(object)
    int _frame_line "metrale_frame_line"(object)
    object _dict_get "metrale_dict_get"(object, object, object)
    void _incref "Py_INCREF"(PyObject*)
    void _xdecref "Py_XDECREF"(PyObject*)


# -- the sites: "file:line" per (code object, instruction), in a table of C structs ------------------------------

cdef struct _Entry:
    PyObject* code  # a strong reference (its address is the key's); NULL where the slot is free
    PyObject* site  # a strong reference: ``"file:line"``
    int lasti

cdef enum:
    _SLOTS = 8192  # a power of two, twice the most entries: a probe meets a free slot soon
if _SITES_MAX * 2 > _SLOTS:  # the loader falls back to the pure function, saying why
    raise ImportError(f"the call-site twin's table has {_SLOTS} slots, too few for _SITES_MAX {_SITES_MAX}")

cdef _Entry* _table = <_Entry*>calloc(_SLOTS, sizeof(_Entry))
if _table is NULL:
    raise MemoryError()
cdef Py_ssize_t _count = 0
#: What the table's critical sections lock on a free-threaded build (any object has a lock there).
cdef object _GUARD = object()


cdef inline size_t _slot(_Entry* table, PyObject* code, int lasti) noexcept:
    """The slot of (``code``, ``lasti``) in ``table``: its entry, or the free slot it would take."""
    cdef unsigned long long h = (<unsigned long long><size_t>code >> 4) ^ (<unsigned long long><unsigned int>lasti << 32)
    cdef size_t i = <size_t>((h * 0x9E3779B97F4A7C15ULL) >> 51)  # the top 13 bits: one of 8192 slots
    while table[i].code is not NULL and (table[i].code is not code or table[i].lasti != lasti):
        i = (i + 1) & (_SLOTS - 1)
    return i


cdef object _site(frame):
    """``"file:line"`` of ``frame``, formatted once per call (code object and instruction)."""
    global _table, _count
    code = _frame_code(frame)
    cdef int lasti = _frame_lasti(frame)
    cdef _Entry* entry
    with cython.critical_section(_GUARD):
        entry = &_table[_slot(_table, <PyObject*>code, lasti)]
        site = <object>entry.site if entry.code is not NULL else None
    if site is not None:
        return site
    line = _frame_line(frame)  # (the pure function reads f_lineno: None where the line is unknown)
    site = f"{code.co_filename}:{line if line >= 0 else None}"
    cdef _Entry* fresh = NULL  # a table to start again with, made outside the section where one is needed
    cdef _Entry* old = NULL
    cdef bint done = False
    while not done:
        with cython.critical_section(_GUARD):
            entry = &_table[_slot(_table, <PyObject*>code, lasti)]
            if entry.code is not NULL:  # another thread put it there meanwhile (formatted outside the section)
                site = <object>entry.site
                done = True
            elif _count < _SITES_MAX or fresh is not NULL:
                if _count >= _SITES_MAX:  # code made at run time (exec, generated tests): start again
                    old, _table, fresh = _table, fresh, NULL
                    _count = 0
                    entry = &_table[_slot(_table, <PyObject*>code, lasti)]
                entry.code = <PyObject*>code
                entry.site = <PyObject*>site
                entry.lasti = lasti
                _incref(entry.code)
                _incref(entry.site)
                _count += 1
                done = True
        if not done:  # full: a fresh table, made outside the section, and the insert tried again
            fresh = <_Entry*>calloc(_SLOTS, sizeof(_Entry))
            if fresh is NULL:
                raise MemoryError()
    free(fresh)  # (NULL unless another thread started the table again first)
    cdef Py_ssize_t i
    if old is not NULL:  # the old table's references, dropped outside the section: a code object's weak
        for i in range(_SLOTS):  # references may call back into Python
            _xdecref(old[i].code)
            _xdecref(old[i].site)
        free(old)
    return site


# -- the walk ---------------------------------------------------------------------------------------------------

#: Per set of internal packages: per module name, whether its frames are internal (the pure ``_INTERNAL_MODULES``).
cdef dict _INTERNAL_MODULES = {}
cdef object _getframe = sys._getframe


cdef inline object _module_of(frame):
    """The name a frame is judged by: its globals' ``__name__``, ``""`` where that is missing or not a str."""
    globals_ = _frame_globals(frame)
    if type(globals_) is dict:
        module = _dict_get(globals_, "__name__", "")
    else:  # (a dict subclass's own get, or the error of globals that are not a dict, as in the pure function)
        module = globals_.get("__name__", "")
    return module if type(module) is str else ""


def call_site(internal, Py_ssize_t skip=0):
    """``"file:line"`` of the first frame whose top-level package is not in ``internal`` (compiled twin).

    The walk starts at the caller's frame, ``skip`` frames out (a negative ``skip`` counts as 0; where there
    are fewer frames, at the caller's own), as the pure function's does past its own frame.
    """
    return call_site_c(internal, skip)


cdef object call_site_c(object internal, Py_ssize_t skip):
    """`call_site` for the compiled callers (the lane): no Python call (a C function makes no frame of its own)."""
    known = _dict_get(_INTERNAL_MODULES, internal, None)
    if known is None:
        known = _INTERNAL_MODULES.setdefault(internal, {})
    try:  # sys._getframe makes a frame object of the one it returns only (PyFrame_GetBack: of each on the way)
        frame = _getframe(skip if skip > 0 else 0)
    except ValueError:  # fewer frames than that (not from a caller that told the truth): from the caller's own
        try:
            frame = _getframe(0)
        except ValueError:  # (no Python frame at all: called from C)
            return "<unknown>:0"
    while frame is not None:
        module = _module_of(frame)
        inside = _dict_get(known, module, None)
        if inside is None:
            inside = (<dict>known)[module] = _is_internal(module, internal)
        if not inside:
            return _site(frame)
        frame = _frame_back(frame)
    return "<unknown>:0"
