# The twins' C-level lock (``from metrale_core._device._lock cimport lock_t, acquire, release``): a short critical
# section's lock that reads no clock.
#
# - Python 3.13 and later: a ``PyMutex`` (what ``cython.pymutex`` is there): an atomic word; a waiter lets go of the
#   GIL (or detaches, free-threaded).
# - Python 3.11 and 3.12, where the GIL is always on: a flag the GIL guards. ``cython.pymutex`` is a
#   ``PyThread_type_lock`` there, whose every acquire reads the monotonic clock (sem_clockwait's deadline): about
#   half the cost of a ledger update. Taking the flag needs no atomic: only the thread holding the GIL runs. A
#   holder may lose the GIL inside its section (a collection runs a finalizer); a waiter then lets go of the GIL
#   until the flag is down. Not reentrant, as ``cython.pymutex`` is not.
#   A waiter then gets the GIL back at the holder's next switch (``sys.getswitchinterval()``, 5 ms by default), as
#   a blocked waiter of any lock does under the GIL.
# - A section must not block on anything the GIL's holder needs (as with any lock taken with the GIL held); a
#   thread that takes the lock again inside its own section (a finalizer freeing a buffer) spins, where a
#   ``cython.pymutex`` would block: both hang.

cdef extern from *:
    """
    #if PY_VERSION_HEX >= 0x030D0000
    typedef PyMutex metrale_lock_t;
    static inline void metrale_acquire(metrale_lock_t *lock) { PyMutex_Lock(lock); }
    static inline void metrale_release(metrale_lock_t *lock) { PyMutex_Unlock(lock); }
    #else
    typedef struct { volatile int held; } metrale_lock_t;
    static inline void metrale_acquire(metrale_lock_t *lock) {
        while (lock->held) {
            Py_BEGIN_ALLOW_THREADS
            Py_END_ALLOW_THREADS
        }
        lock->held = 1;
    }
    static inline void metrale_release(metrale_lock_t *lock) { lock->held = 0; }
    #endif
    """
    ctypedef struct lock_t "metrale_lock_t":
        pass
    void acquire "metrale_acquire"(lock_t* lock) noexcept
    void release "metrale_release"(lock_t* lock) noexcept
