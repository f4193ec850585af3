# The plugin's C door (``RawDevice.device_calls``) as the compiled lanes see it: the struct of a capsule named
# ``metrale_core.device_calls.v1`` (raw.py's docstring; the CUDA plugin's ``_cdriver.pyx`` writes the same struct,
# a C contract it cannot cimport); `ask_door` asks the plugin for its capsule, `door_of` checks it.


from cpython.object cimport PyObject
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from libc.stdint cimport uintptr_t

cdef extern from *:
    """
    #include <stddef.h>
    #include <stdint.h>
    typedef struct {
        size_t size;
        void *state;
        int (*alloc)(void *state, size_t nbytes, uintptr_t *ptr);
        int (*free)(void *state, uintptr_t ptr);
        int (*memset)(void *state, uintptr_t ptr, int value, size_t nbytes, PyObject *stream);
        int (*graph_launch)(void *state, PyObject *graph_exec, PyObject *stream);
        int (*launch)(void *state, PyObject *function, const unsigned int *shape, unsigned int shared_mem,
                      PyObject *stream, PyObject *args);
    } metrale_device_calls_v1;
    /* The least a struct holds: up to its free (the functions after it are optional: a shorter struct has none). */
    #define METRALE_DEVICE_CALLS_ALLOC_FREE (offsetof(metrale_device_calls_v1, free) + sizeof(void *))
    /* Whether a struct holds an optional function: long enough to have it, and it is set. */
    static int metrale_door_has_memset(const metrale_device_calls_v1 *t) {
        return t->size >= offsetof(metrale_device_calls_v1, memset) + sizeof(void *) && t->memset != NULL;
    }
    static int metrale_door_has_graph_launch(const metrale_device_calls_v1 *t) {
        return t->size >= offsetof(metrale_device_calls_v1, graph_launch) + sizeof(void *) && t->graph_launch != NULL;
    }
    static int metrale_door_has_launch(const metrale_device_calls_v1 *t) {
        return t->size >= offsetof(metrale_device_calls_v1, launch) + sizeof(void *) && t->launch != NULL;
    }
    """
    size_t METRALE_DEVICE_CALLS_ALLOC_FREE
    ctypedef struct metrale_device_calls_v1:
        size_t size
        void* state
        int (*alloc)(void* state, size_t nbytes, uintptr_t* ptr) except -1
        int (*free)(void* state, uintptr_t ptr) except -1
        int (*memset)(void* state, uintptr_t ptr, int value, size_t nbytes, PyObject* stream) except -1
        int (*graph_launch)(void* state, PyObject* graph_exec, PyObject* stream) except -1
        int (*launch)(void* state, PyObject* function, const unsigned int* shape, unsigned int shared_mem,
                      PyObject* stream, PyObject* args) except -1
    bint door_has_memset "metrale_door_has_memset"(const metrale_device_calls_v1* table)
    bint door_has_graph_launch "metrale_door_has_graph_launch"(const metrale_device_calls_v1* table)
    bint door_has_launch "metrale_door_has_launch"(const metrale_device_calls_v1* table)


cdef inline object ask_door(object plugin, object log):
    """``plugin.device_calls()``: its capsule, or ``None`` where it offers none or fails (logged where ``log`` is
    not ``None``: the device lane says it once per backend)."""
    try:
        return plugin.device_calls()
    except Exception as exc:  # a plugin whose door fails: its methods are called
        if log is not None:
            log.warning("%s.device_calls() failed, its methods are called: %s: %s", type(plugin).__name__,
                        type(exc).__name__, exc)
        return None


cdef inline metrale_device_calls_v1* door_of(object plugin, object capsule, bytes name, object log):
    """The struct in ``capsule`` (named ``name``: ``DEVICE_CALLS``), or NULL where it is none that can be used
    (logged where ``log`` is not ``None``). The caller keeps the capsule alive as long as it calls the struct."""
    cdef metrale_device_calls_v1* table
    if capsule is None:
        return NULL
    if not PyCapsule_IsValid(capsule, name):
        if log is not None:
            log.warning("%s.device_calls() gave %r, not a capsule named %s: its methods are called",
                        type(plugin).__name__, capsule, name.decode())
        return NULL
    table = <metrale_device_calls_v1*>PyCapsule_GetPointer(capsule, name)
    if table.size < METRALE_DEVICE_CALLS_ALLOC_FREE or table.alloc is NULL or table.free is NULL:
        if log is not None:
            log.warning("%s.device_calls(): a struct of %d bytes or without its functions: its methods are called",
                        type(plugin).__name__, table.size)
        return NULL
    return table


cdef enum:
    # The optional functions a lane may need of a door (`door_with`).
    DOOR_MEMSET = 1
    DOOR_GRAPH_LAUNCH = 2
    DOOR_LAUNCH = 3


cdef inline object door_with(object plugin, bytes name, int function):
    """The plugin's capsule where its struct holds ``function`` (a ``DOOR_*``), else ``None``; quietly (the device
    lane said what is wrong with a door as the backend opened). The caller keeps the capsule and calls `table_of`."""
    cdef metrale_device_calls_v1* table
    capsule = ask_door(plugin, None)
    table = door_of(plugin, capsule, name, None)
    if table is NULL:
        return None
    if function == DOOR_MEMSET:
        return capsule if door_has_memset(table) else None
    if function == DOOR_GRAPH_LAUNCH:
        return capsule if door_has_graph_launch(table) else None
    if function == DOOR_LAUNCH:
        return capsule if door_has_launch(table) else None
    return None


cdef inline metrale_device_calls_v1* table_of(object capsule, bytes name) except? NULL:
    """The struct of a capsule `door_with` gave (``NULL`` for ``None``)."""
    if capsule is None:
        return NULL
    return <metrale_device_calls_v1*>PyCapsule_GetPointer(capsule, name)
