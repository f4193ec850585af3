# The twins' C-level lock (``from metrale_core._device._lock cimport lock_t, acquire, release``): a short critical
# section's lock that reads no clock.
#
# - Python 3.13 and later: a ``PyMutex`` (what ``cython.pymutex`` is there): an atomic word; a waiter lets go of the
#   GIL (or detaches, free-threaded).
# - Python 3.11 and 3.12, where the GIL is always on: a flag the GIL guards. ``cython.pymutex`` is a
#   ``PyThread_type_lock`` there, whose every acquire reads the monotonic clock (sem_clockwait's deadline): about
#   half the cost of a ledger update. Taking the flag needs no atomic: only the thread holding the GIL runs. A
#   holder may lose the GIL inside its section where the section runs Python code (a ledger's history record, an
#   arena's close callback, which may free through the driver) or a collection runs a finalizer; a waiter then
#   lets go of the GIL, napping longer each time (up to 1 ms), until the flag is down. Not reentrant, as
#   ``cython.pymutex`` is not.
#   A waiter then gets the GIL back at the holder's next switch (``sys.getswitchinterval()``, 5 ms by default), as
#   a blocked waiter of any lock does under the GIL.
# - A section must not block on anything the GIL's holder needs (as with any lock taken with the GIL held); a
#   thread that takes the lock again inside its own section (a finalizer freeing a buffer) spins, where a
#   ``cython.pymutex`` would block: both hang.

# - The one-source modules (``ledger.py`` compiled as ``_ledger``) call it by the lock's name, not its address:
#   ``acquire_lock(self._lock)``, ``release_lock(self._lock)``, ``self._lock = new_lock()``. Their pure run reads
#   the same three names from ``_lock.py``, a ``threading.Lock``'s (``_thread``'s C functions: no Python frame).

cdef extern from *:
    """
    #if PY_VERSION_HEX >= 0x030D0000
    typedef PyMutex metrale_lock_t;
    static inline void metrale_acquire(metrale_lock_t *lock) { PyMutex_Lock(lock); }
    static inline void metrale_release(metrale_lock_t *lock) { PyMutex_Unlock(lock); }
    #else
    #ifdef _WIN32
    #include <windows.h>
    #define METRALE_NAP(us) Sleep((us) >= 1000 ? 1 : 0)
    #else
    #include <time.h>
    #define METRALE_NAP(us) do { struct timespec t_ = {0, (long)(us) * 1000L}; nanosleep(&t_, NULL); } while (0)
    #endif
    typedef struct { volatile int held; } metrale_lock_t;
    static inline void metrale_acquire(metrale_lock_t *lock) {
        unsigned int nap = 0;  /* microseconds: none at first (the holder may only need the GIL), then up to 1 ms */
        while (lock->held) {
            Py_BEGIN_ALLOW_THREADS
            if (nap) METRALE_NAP(nap);
            Py_END_ALLOW_THREADS
            nap = nap ? (nap < 1000 ? nap * 2 : 1000) : 1;
        }
        lock->held = 1;
    }
    static inline void metrale_release(metrale_lock_t *lock) { lock->held = 0; }
    #endif
    #define metrale_acquire_lock(lock) metrale_acquire(&(lock))
    #define metrale_release_lock(lock) metrale_release(&(lock))
    #define metrale_new_lock() ((metrale_lock_t){0})
    """
    ctypedef struct lock_t "metrale_lock_t":
        pass
    void acquire "metrale_acquire"(lock_t* lock) noexcept
    void release "metrale_release"(lock_t* lock) noexcept
    void acquire_lock "metrale_acquire_lock"(lock_t lock) noexcept
    void release_lock "metrale_release_lock"(lock_t lock) noexcept
    lock_t new_lock "metrale_new_lock"() noexcept
