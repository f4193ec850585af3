# Cython's view of ``metrale/device_calls.h``, the plugin's device calls (``RawDevice.device_calls``), shipped beside
# the header for a plugin's ``.pyx`` and the core's compiled lanes alike: ``from metrale.device_calls cimport ...``
# with ``metrale_core.plugin.get_include()`` on Cython's include path (the folder that holds ``metrale/``). The C
# compiler checks every use against the header itself; this file only tells Cython the names.

from cpython.object cimport PyObject
from libc.stdint cimport uintptr_t

cdef extern from "metrale/device_calls.h":
    # the capsule's name, the struct's version in it (``metrale_core.plugin.DEVICE_CALLS``)
    const char* METRALE_DEVICE_CALLS_CAPSULE
    # the three answers of each function: done; declined, nothing done (the core calls the method); failed, raised
    int METRALE_DEVICE_CALLS_DONE
    int METRALE_DEVICE_CALLS_DECLINED
    int METRALE_DEVICE_CALLS_FAILED
    ctypedef struct metrale_device_calls_v1:
        size_t size
        void* state
        int (*alloc)(void* state, size_t nbytes, uintptr_t* ptr) except -1
        int (*free)(void* state, uintptr_t ptr) except -1
        int (*memset)(void* state, uintptr_t ptr, int value, size_t nbytes, PyObject* stream) except -1
        int (*graph_launch)(void* state, PyObject* graph_exec, PyObject* stream) except -1
        int (*launch)(void* state, PyObject* function, const unsigned int* shape, unsigned int shared_mem,
                      PyObject* stream, PyObject* args) except -1
    bint metrale_device_calls_v1_usable(const metrale_device_calls_v1* calls)
    bint metrale_device_calls_v1_has_memset(const metrale_device_calls_v1* calls)
    bint metrale_device_calls_v1_has_graph_launch(const metrale_device_calls_v1* calls)
    bint metrale_device_calls_v1_has_launch(const metrale_device_calls_v1* calls)
