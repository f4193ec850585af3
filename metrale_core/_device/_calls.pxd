# The plugin's device calls (``RawDevice.device_calls``) as the compiled lanes see them: the struct of a capsule named
# ``metrale_core.device_calls.v1``, defined once in ``metrale/device_calls.h`` and seen by Cython through
# ``metrale/device_calls.pxd`` beside it (``metrale_core/include``, found by ``metrale_core.plugin.get_include()``; the
# CUDA plugin's ``_cdriver.pyx`` cimports the same).
# `ask_device_calls` asks the plugin for its capsule, `device_calls_of` checks it, `device_calls_with` finds one that
# holds an optional function.


from cpython.object cimport PyObject
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from libc.stdint cimport uintptr_t

from metrale.device_calls cimport (
    metrale_device_calls_v1,
    metrale_device_calls_v1_has_graph_launch as device_calls_have_graph_launch,
    metrale_device_calls_v1_has_launch as device_calls_have_launch,
    metrale_device_calls_v1_has_memset as device_calls_have_memset,
    metrale_device_calls_v1_usable as device_calls_usable,
)


cdef inline object ask_device_calls(object plugin, object log):
    """``plugin.device_calls()``: its capsule, or ``None`` where it offers none or fails (logged where ``log`` is
    not ``None``: the device lane says it once per backend)."""
    try:
        return plugin.device_calls()
    except Exception as exc:  # a plugin whose device calls fail: its methods are called
        if log is not None:
            log.warning("%s.device_calls() failed, its methods are called: %s: %s", type(plugin).__name__,
                        type(exc).__name__, exc)
        return None


cdef inline metrale_device_calls_v1* device_calls_of(object plugin, object capsule, bytes name, object log):
    """The struct in ``capsule`` (named ``name``: ``DEVICE_CALLS``), or NULL where it is none that can be used
    (logged where ``log`` is not ``None``). The caller keeps the capsule alive as long as it calls the struct."""
    cdef metrale_device_calls_v1* calls
    if capsule is None:
        return NULL
    if not PyCapsule_IsValid(capsule, name):
        if log is not None:
            log.warning("%s.device_calls() gave %r, not a capsule named %s: its methods are called",
                        type(plugin).__name__, capsule, name.decode())
        return NULL
    calls = <metrale_device_calls_v1*>PyCapsule_GetPointer(capsule, name)
    if not device_calls_usable(calls):
        if log is not None:
            log.warning("%s.device_calls(): a struct of %d bytes or without its functions: its methods are called",
                        type(plugin).__name__, calls.size)
        return NULL
    return calls


cdef enum:
    # The optional functions a lane may need of the device calls (`device_calls_with`).
    DEVICE_CALLS_MEMSET = 1
    DEVICE_CALLS_GRAPH_LAUNCH = 2
    DEVICE_CALLS_LAUNCH = 3


cdef inline object device_calls_with(object plugin, bytes name, int function):
    """The plugin's capsule where its struct holds ``function`` (a ``DEVICE_CALLS_*``), else ``None``; quietly (the
    device lane said what is wrong with the device calls as the backend opened). The caller keeps the capsule and
    calls `table_of`."""
    cdef metrale_device_calls_v1* calls
    capsule = ask_device_calls(plugin, None)
    calls = device_calls_of(plugin, capsule, name, None)
    if calls is NULL:
        return None
    if function == DEVICE_CALLS_MEMSET:
        return capsule if device_calls_have_memset(calls) else None
    if function == DEVICE_CALLS_GRAPH_LAUNCH:
        return capsule if device_calls_have_graph_launch(calls) else None
    if function == DEVICE_CALLS_LAUNCH:
        return capsule if device_calls_have_launch(calls) else None
    return None


cdef inline metrale_device_calls_v1* table_of(object capsule, bytes name) except? NULL:
    """The struct of a capsule `device_calls_with` gave (``NULL`` for ``None``)."""
    if capsule is None:
        return NULL
    return <metrale_device_calls_v1*>PyCapsule_GetPointer(capsule, name)
