# The frame API and the table of sites that sites.py's compiled walk reads (its ``if cython.compiled:`` branches,
# ``from cython.cimports.metrale_core._memory._frames import ...``): C declarations only, no module. Cimported by
# sites.py alone, so its C (and the table's static storage) is in ``_sites`` only, not in each module that cimports
# ``call_site`` from ``_sites.pxd``.

cdef extern from *:
    """
    /* The calling frame, or None: a new reference. */
    static PyObject *metrale_frame_back(PyObject *frame) {
        PyObject *back = (PyObject *)PyFrame_GetBack((PyFrameObject *)frame);
        if (back == NULL) Py_RETURN_NONE;
        return back;
    }

    static PyObject *metrale_frames_key = NULL, *metrale_frames_empty = NULL;

    /* The keys `metrale_frame_module` reads, made once as the module loads (no thread may race a first use);
       -1 with an exception where memory ran out. */
    static int metrale_frames_init(void) {
        if (metrale_frames_key == NULL && (metrale_frames_key = PyUnicode_InternFromString("__name__")) == NULL)
            return -1;
        if (metrale_frames_empty == NULL && (metrale_frames_empty = PyUnicode_FromStringAndSize("", 0)) == NULL)
            return -1;
        return 0;
    }

    /* frame.f_globals.get("__name__", ""): a new reference, or NULL with the globals' own error (after
       `metrale_frames_init`). */
    static PyObject *metrale_frame_module(PyObject *frame) {
        PyObject *key = metrale_frames_key, *empty = metrale_frames_empty;
        PyObject *globals, *name;
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
    /* The sites, formatted once per (code object, instruction): an open-addressing table of C structs, so no key
       object is made per call. An entry holds its code object (its address stays its own) and its site. At `max`
       entries it starts again: the old entries are unhooked first and released after, since releasing a code
       object may run Python code (a weak reference's callback) that calls back here. On a free-threaded build a
       mutex guards it (the GIL does elsewhere: no Python code runs while an entry is half written). */
    #define METRALE_SITE_SLOTS 8192  /* a power of two, twice the most entries: a probe meets a free slot soon */
    typedef struct { PyObject *code; PyObject *site; int lasti; } metrale_site_entry;
    static metrale_site_entry metrale_sites[METRALE_SITE_SLOTS];
    static Py_ssize_t metrale_sites_count = 0;
    #ifdef Py_GIL_DISABLED
    static PyMutex metrale_sites_mutex = {0};
    #define METRALE_SITES_LOCK() PyMutex_Lock(&metrale_sites_mutex)
    #define METRALE_SITES_UNLOCK() PyMutex_Unlock(&metrale_sites_mutex)
    #else
    #define METRALE_SITES_LOCK()
    #define METRALE_SITES_UNLOCK()
    #endif

    static size_t metrale_site_slot(PyObject *code, int lasti) {
        unsigned long long h = ((unsigned long long)(size_t)code >> 4) ^ ((unsigned long long)(unsigned int)lasti << 32);
        size_t i = (size_t)((h * 0x9E3779B97F4A7C15ULL) >> 51);  /* the top 13 bits: one of 8192 slots */
        while (metrale_sites[i].code != NULL && (metrale_sites[i].code != code || metrale_sites[i].lasti != lasti))
            i = (i + 1) & (METRALE_SITE_SLOTS - 1);
        return i;
    }

    /* The site kept for (code, lasti): a new reference, or None. */
    static PyObject *metrale_cached_site(PyObject *code, int lasti) {
        PyObject *site;
        METRALE_SITES_LOCK();
        site = metrale_sites[metrale_site_slot(code, lasti)].site;
        if (site == NULL) site = Py_None;
        Py_INCREF(site);
        METRALE_SITES_UNLOCK();
        return site;
    }

    /* Keep `site` for (code, lasti), starting again at `max` entries; -1 with an exception where memory ran out. */
    static int metrale_cache_site(PyObject *code, int lasti, PyObject *site, Py_ssize_t max) {
        metrale_site_entry *old = NULL, *entry;
        Py_ssize_t i, dropped = 0;
        if (max * 2 > METRALE_SITE_SLOTS) max = METRALE_SITE_SLOTS / 2;
        METRALE_SITES_LOCK();
        entry = &metrale_sites[metrale_site_slot(code, lasti)];
        if (entry->code == NULL) {  /* (another thread may have put it there meanwhile) */
            if (metrale_sites_count >= max) {
                old = (metrale_site_entry *)PyMem_RawMalloc(sizeof(metrale_sites));
                if (old == NULL) { METRALE_SITES_UNLOCK(); PyErr_NoMemory(); return -1; }
                memcpy(old, metrale_sites, sizeof(metrale_sites));
                memset(metrale_sites, 0, sizeof(metrale_sites));
                dropped = metrale_sites_count;
                metrale_sites_count = 0;
                entry = &metrale_sites[metrale_site_slot(code, lasti)];
            }
            Py_INCREF(code);
            Py_INCREF(site);
            entry->code = code;
            entry->site = site;
            entry->lasti = lasti;
            metrale_sites_count++;
        }
        METRALE_SITES_UNLOCK();
        if (old != NULL) {
            for (i = 0; i < METRALE_SITE_SLOTS && dropped; i++) {
                if (old[i].code != NULL) { Py_DECREF(old[i].code); Py_DECREF(old[i].site); dropped--; }
            }
            PyMem_RawFree(old);
        }
        return 0;
    }

    static PyObject *metrale_frame_code(PyObject *frame) { return (PyObject *)PyFrame_GetCode((PyFrameObject *)frame); }
    static int metrale_frame_lasti(PyObject *frame) { return PyFrame_GetLasti((PyFrameObject *)frame); }
    """
    int frames_init "metrale_frames_init"() except -1
    object _frame_back "metrale_frame_back"(object)
    object _frame_module "metrale_frame_module"(object)
    object _frame_code "metrale_frame_code"(object)
    int _frame_lasti "metrale_frame_lasti"(object)
    object _cached_site "metrale_cached_site"(object code, int lasti)
    int _cache_site "metrale_cache_site"(object code, int lasti, object site, Py_ssize_t max) except -1
