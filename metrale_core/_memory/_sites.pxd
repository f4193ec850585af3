# sites.py compiled as ``_site``: `call_site` at C level for the compiled callers
# (``from metrale_core._memory._sites cimport call_site``), and the frame API its walk reads (its
# ``if cython.compiled:`` branches).

cdef extern from *:
    """
    /* The calling frame, or None: a new reference. */
    static PyObject *metrale_frame_back(PyObject *frame) {
        PyObject *back = (PyObject *)PyFrame_GetBack((PyFrameObject *)frame);
        if (back == NULL) Py_RETURN_NONE;
        return back;
    }

    /* frame.f_globals.get("__name__", ""): a new reference, or NULL with the globals' own error. */
    static PyObject *metrale_frame_module(PyObject *frame) {
        static PyObject *key = NULL, *empty = NULL;
        PyObject *globals, *name;
        if (key == NULL && (key = PyUnicode_InternFromString("__name__")) == NULL) return NULL;
        if (empty == NULL && (empty = PyUnicode_FromStringAndSize("", 0)) == NULL) return NULL;
        globals = PyFrame_GetGlobals((PyFrameObject *)frame);
        if (globals == NULL) return NULL;
        if (PyDict_CheckExact(globals)) {
    #if PY_VERSION_HEX >= 0x030D0000
            int found = PyDict_GetItemRef(globals, key, &name);
            if (found == 0) { name = empty; Py_INCREF(name); }
    #else
            name = PyDict_GetItemWithError(globals, key);
            if (name != NULL) Py_INCREF(name);
            else if (!PyErr_Occurred()) { name = empty; Py_INCREF(name); }
    #endif
        } else {  /* (a dict subclass's own get, or the error of globals that are not a dict, as Python's) */
            name = PyObject_CallMethod(globals, "get", "OO", key, empty);
        }
        Py_DECREF(globals);
        return name;
    }
    """
    object _frame_back "metrale_frame_back"(object)
    object _frame_module "metrale_frame_module"(object)

cpdef str call_site(object internal, Py_ssize_t skip=*)
