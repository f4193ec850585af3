/*
 * metrale/device_calls.h: the device calls, the one C definition of the functions a backend plugin may offer
 * metrale's core instead of some of its RawDevice methods (version 1).
 *
 * A backend's RawDevice.device_calls() returns a PyCapsule named METRALE_DEVICE_CALLS_CAPSULE
 * ("metrale_core.device_calls.v1", metrale_core.plugin.DEVICE_CALLS) whose pointer is a metrale_device_calls_v1,
 * valid as long as the capsule lives. The core's compiled code then calls these functions instead of the methods
 * alloc and free (of "device" memory), memset, graph_launch and launch. Where the core runs its pure build, or the
 * backend returns None, the methods are called.
 *
 * Find this header with metrale_core.plugin.get_include() (the folder to add to the include path):
 *
 *     #define PY_SSIZE_T_CLEAN
 *     #include <Python.h>
 *     #include "metrale/device_calls.h"
 *
 * docs/plugin-authors.md ("Device calls in C") shows a backend that offers them.
 *
 * Every function follows one convention:
 *
 * - It is called with the GIL held (it may release it while the device works), only while the backend is open,
 *   from any thread. state is the struct's state, handed back as it is.
 * - It returns METRALE_DEVICE_CALLS_DONE (0): done, as the method would have done it.
 * - METRALE_DEVICE_CALLS_DECLINED (1): declined, nothing done. The core calls the method instead, which does the
 *   work or raises: a function may decline whatever it does not handle (another context current, a closed device,
 *   an object not of its own).
 * - METRALE_DEVICE_CALLS_FAILED (-1), with a Python exception set: the device failed. The exception is the typed
 *   error the method would raise (a metrale_core.MetraleError, OutOfMemoryError for an allocation: the core then
 *   reclaims and retries, through the method). The call is not made again.
 *
 * The PyObject * arguments are borrowed: the objects the backend's own methods returned (a stream of
 * stream_create, an executable graph of graph_instantiate, a kernel of module_function).
 */
#ifndef METRALE_DEVICE_CALLS_H
#define METRALE_DEVICE_CALLS_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The capsule's name (metrale_core.plugin.DEVICE_CALLS): the struct's version is in it. */
#define METRALE_DEVICE_CALLS_CAPSULE "metrale_core.device_calls.v1"
/* The struct's version: a new version is a new struct and a new capsule name. */
#define METRALE_DEVICE_CALLS_VERSION 1

/* What each function returns. */
#define METRALE_DEVICE_CALLS_DONE 0
#define METRALE_DEVICE_CALLS_DECLINED 1
#define METRALE_DEVICE_CALLS_FAILED (-1)

typedef struct metrale_device_calls_v1 {
    /* sizeof the struct the backend filled: the core refuses one that ends before free, and reads no function past
       its end (a backend written against a shorter struct has none of the later ones). */
    size_t size;
    /* The backend's own, handed back to each call. */
    void *state;
    /* Required. Allocate nbytes (> 0) of "device" memory; on DONE, *ptr is a non-zero, 256-byte-aligned address. */
    int (*alloc)(void *state, size_t nbytes, uintptr_t *ptr);
    /* Required. Release ptr, an address alloc (or the method alloc) returned. */
    int (*free)(void *state, uintptr_t ptr);
    /* Optional (NULL: the method). Set nbytes bytes at ptr to value (0 to 255), on stream. */
    int (*memset)(void *state, uintptr_t ptr, int value, size_t nbytes, PyObject *stream);
    /* Optional (NULL: the method). Launch graph_exec on stream. */
    int (*graph_launch)(void *state, PyObject *graph_exec, PyObject *stream);
    /* Optional (NULL: the method). Launch function with shape[6] = grid x, y, z, block x, y, z and shared_mem bytes
       of dynamic shared memory, on stream; args is the list of metrale_core.plugin.LaunchArg the method would get,
       already checked. */
    int (*launch)(void *state, PyObject *function, const unsigned int *shape, unsigned int shared_mem,
                  PyObject *stream, PyObject *args);
} metrale_device_calls_v1;

/* The least size the core accepts: the struct up to free. */
#define METRALE_DEVICE_CALLS_V1_MIN_SIZE (offsetof(metrale_device_calls_v1, free) + sizeof(void *))

/* How the core reads a struct: whether it can be used at all (long enough, alloc and free set), and whether it
   holds each optional function (long enough to have it, and set). */
static inline int metrale_device_calls_v1_usable(const metrale_device_calls_v1 *calls) {
    return calls != NULL && calls->size >= METRALE_DEVICE_CALLS_V1_MIN_SIZE && calls->alloc != NULL
           && calls->free != NULL;
}
static inline int metrale_device_calls_v1_has_memset(const metrale_device_calls_v1 *calls) {
    return calls->size >= offsetof(metrale_device_calls_v1, memset) + sizeof(void *) && calls->memset != NULL;
}
static inline int metrale_device_calls_v1_has_graph_launch(const metrale_device_calls_v1 *calls) {
    return calls->size >= offsetof(metrale_device_calls_v1, graph_launch) + sizeof(void *)
           && calls->graph_launch != NULL;
}
static inline int metrale_device_calls_v1_has_launch(const metrale_device_calls_v1 *calls) {
    return calls->size >= offsetof(metrale_device_calls_v1, launch) + sizeof(void *) && calls->launch != NULL;
}

#ifdef __cplusplus
}
#endif

#endif /* METRALE_DEVICE_CALLS_H */
