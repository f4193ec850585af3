# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`Arena`][metrale_core.Arena] (``arena.py``): the same interface and behaviour, the bump
allocation in C integers under a C-level lock (``_device/_lock.pxd``).

- The pure class is the reference and the public class: this one registers itself as its virtual subclass
  (``Arena.register``), so ``isinstance(x, metrale_core.Arena)`` holds, and is named ``Arena`` too.
  `_twins.pick("arena", Arena, pure)` chooses, once per backend.
- The live pieces since the last ``reset()`` are a C array of (creation index, offset, size), in creation order
  (the indexes rise: they are drawn under the lock): ``reset()`` empties it in O(1), ``holds`` looks an index up by
  bisection. ``holds`` takes no lock, as the pure class's dict read takes none (the allocator asks it under its
  holdings' lock, which ``close()`` takes under the arena's): under the GIL it runs in C alone, and no writer lets
  go of the GIL while the array is half changed; a free-threaded build guards the array with a lock of its own,
  held for C code only.
- The buffers are built by the handle twin (`make_buffer`, at C level). Arguments that are not plain ``int``
  (numpy integers, bad ones) go through the pure module's check, so they give the same typed errors.
- With ``redzone_arena``, the pieces' zones are the pure module's `ArenaZones` (Python calls, off the fast path):
  a zoned piece is bumped past its leading zone and its trailing one, filled, and judged at ``reset()`` and
  ``close()``, in the same steps and under the same locks as the pure class's.
"""

cimport cython

from metrale_core._device._lock cimport acquire, lock_t, release
from cpython.mem cimport PyMem_Free, PyMem_RawFree, PyMem_RawMalloc, PyMem_Realloc
from libc.string cimport memcpy
from metrale_core._device._handle cimport make_buffer

import itertools

from .._errors import ArenaFullError, InvalidBufferError
from .._types import format_bytes
from .arena import MAX_ALIGN as _MAX_ALIGN
from .arena import Arena as _Arena
from .arena import _check_alloc
from .records import next_index as _process_next_index

cdef extern from *:
    """
    /* An exact int that fits in a long long, into *out; 0 (no exception) for anything else. */
    static CYTHON_INLINE int metrale_small(PyObject *o, long long *out) {
        int overflow;
        long long v;
        if (!PyLong_CheckExact(o)) return 0;
        v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow) return 0;
        *out = v;
        return 1;
    }

    /* An exact int from 0 to 2**64 - 1, into *out; 0 (no exception) for anything else. */
    static CYTHON_INLINE int metrale_word(PyObject *o, unsigned long long *out) {
        long long v;
        unsigned long long u;
        if (!PyLong_CheckExact(o)) return 0;
        if (metrale_small(o, &v)) {
            if (v < 0) return 0;
            *out = (unsigned long long)v;
            return 1;
        }
        u = PyLong_AsUnsignedLongLong(o);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
        *out = u;
        return 1;
    }

    /* The pieces' own lock: none where the GIL guards them, a PyMutex on a free-threaded build. */
    #ifdef Py_GIL_DISABLED
    typedef PyMutex metrale_pieces_lock;
    #define METRALE_PIECES_LOCK(m) PyMutex_Lock(&(m))
    #define METRALE_PIECES_UNLOCK(m) PyMutex_Unlock(&(m))
    #else
    typedef char metrale_pieces_lock;
    #define METRALE_PIECES_LOCK(m) ((void)(m))
    #define METRALE_PIECES_UNLOCK(m) ((void)(m))
    #endif
    """
    int metrale_small(object o, long long *out)
    int metrale_word(object o, unsigned long long *out)
    ctypedef int metrale_pieces_lock
    void METRALE_PIECES_LOCK(metrale_pieces_lock m) nogil
    void METRALE_PIECES_UNLOCK(metrale_pieces_lock m) nogil


ctypedef struct Piece:
    long long index  # its creation index
    unsigned long long offset  # its address less the block's
    unsigned long long nbytes

cdef long long MAX_ALIGN = _MAX_ALIGN
cdef unsigned long long WORD_MAX = <unsigned long long>-1
#: Pieces kept room for after a reset (beyond it, the array is given back).
cdef Py_ssize_t KEPT_ROOM = 1 << 16

# next_index, called as C calls it where it is the per-process itertools.count's own __next__ (the GIL build)
cdef object _sequence = getattr(_process_next_index, "__self__", None)
if type(_sequence) is not itertools.count:
    _sequence = None


cdef inline object _next_index():
    if _sequence is not None:
        return next(_sequence)
    return _process_next_index()


@cython.final
cdef class Arena:
    """A sub-allocator over one block of device memory; thread-safe (compiled twin of
    [`Arena`][metrale_core.Arena], registered as its subclass)."""

    cdef lock_t _lock
    cdef metrale_pieces_lock _pieces_lock
    cdef object _block
    cdef object _base_object
    cdef object _capacity_object
    cdef object _on_close
    cdef object _owner
    cdef unsigned long long _base
    cdef unsigned long long _capacity
    cdef unsigned long long _top
    cdef Piece *_pieces
    cdef Py_ssize_t _count
    cdef Py_ssize_t _room
    cdef bint _in_order
    cdef public object site
    cdef public long long allocs
    cdef object _where
    cdef object _where_at
    cdef object _zones

    def __init__(self, block, on_close, where=None, zones=None, where_at=None):
        # (the block is an alloc_arena buffer: its ptr and nbytes are ints from 0 to 2**64 - 1, or this raises)
        self._base = block.ptr
        self._capacity = block.nbytes
        self._block = block
        self._base_object = block.ptr
        self._capacity_object = block.nbytes
        self._top = 0
        self._count = 0
        self._on_close = on_close
        self._owner = block._owner
        self._in_order = True
        self.site = block.site
        self._where = where  # a piece's site: its Arena.alloc's (None: the arena's own)
        self._zones = zones  # the pieces' red zones (redzone_arena): an ArenaZones, or None
        self._where_at = where_at  # a piece's site for a stacklevel other than 1 (None: the arena's own)
        self.allocs = 0

    def __dealloc__(self):
        PyMem_Free(self._pieces)

    @property
    def base(self):
        """The device address of the block's first byte."""
        return self._base_object

    @property
    def capacity(self):
        """Bytes in the block."""
        return self._capacity_object

    @property
    def used(self):
        """Bytes handed out since the last ``reset()`` (alignment padding included)."""
        return self._top

    @property
    def closed(self):
        return self._block is None

    def alloc(self, nbytes, align=256, *, stacklevel=1):
        """The next ``nbytes`` of the block, at an address that is a multiple of ``align`` (a power of two).

        :param nbytes: the size in bytes.
        :param align: the address alignment, a power of two.
        :returns: a buffer of kind ``"arena"``, live until the next ``reset()``; it is not on the ledger.
        :raises ArenaFullError: the block has no room left for it since the last ``reset()``.
        :raises InvalidBufferError: the arena is closed.
        :raises InvalidArgumentError: ``nbytes``, ``align`` or ``stacklevel`` is not valid.
        """
        cdef long long n = -1
        cdef long long a = 0
        if not (metrale_small(nbytes, &n) and n >= 0 and metrale_small(align, &a)
                and 0 < a <= MAX_ALIGN and (a & (a - 1)) == 0):
            nbytes, align = _check_alloc(nbytes, align)  # numpy integers; a bad one raises as the pure class does
            if not metrale_small(nbytes, &n):
                n = -1  # more than a long long: no block has room for it
            a = align
        if stacklevel == 1 and type(stacklevel) is int:  # (the site before the lock: it runs Python)
            site = self.site if self._where is None else self._where()
        else:
            site = self.site if self._where_at is None else self._where_at(stacklevel)
        if self._zones is not None:
            return self._zoned(nbytes, align, n, a, site)
        return self._bump(nbytes, align, n, a, site, None, 0, 0)

    cdef object _zoned(self, object nbytes, object align, long long n, long long a, object site):
        """``alloc`` with ``redzone_arena`` (the pure class's ``_zoned``): the index drawn and the zones laid out
        before the C lock (Python code), the bump under it, the fill after it; all under the zones' lock."""
        zones = self._zones
        with zones.lock:
            if self._block is None:  # (before the gate: a closed backend's arenas are closed)
                raise InvalidBufferError(
                    f"Arena.alloc({nbytes}): this arena (from {self.site}) is closed; create another"
                )
            may_fill = zones.enter()
            try:
                index = _next_index()
                layout = zones.layout(nbytes, index) if may_fill and n >= 0 else None
                if layout is None:
                    buf = self._bump(nbytes, align, n, a, site, index, 0, 0)
                else:
                    if layout.lead > WORD_MAX or layout.trail > WORD_MAX:  # (zones past 64 bits: no block holds them)
                        raise self._full(nbytes, align)
                    buf = self._bump(nbytes, align, n, a, site, index, layout.lead, layout.trail)
                    zones.fill(buf, layout)
                return buf
            finally:
                zones.leave()

    cdef object _bump(self, object nbytes, object align, long long n, long long a, object site, object index,
                      unsigned long long lead, unsigned long long trail):
        """The next piece, ``lead`` bytes of zone before it and ``trail`` after it; ``index``: its creation index,
        or ``None`` to draw it under the lock."""
        cdef unsigned long long start, top, pad
        cdef long long c_index
        cdef Piece *grown
        cdef Py_ssize_t room
        acquire(&self._lock)
        try:
            if self._block is None:
                raise InvalidBufferError(
                    f"Arena.alloc({nbytes}): this arena (from {self.site}) is closed; create another"
                )
            top = self._top
            # the bytes from base + top + lead up to its next multiple of a (modulo 2**64, which a divides); then
            # the room left compared without a sum that could wrap (lead and trail are a zone's few bytes)
            pad = lead + ((0 - (self._base + top + lead)) & <unsigned long long>(a - 1))
            if (n < 0 or pad > self._capacity - top or trail > self._capacity - top - pad
                    or <unsigned long long>n > self._capacity - top - pad - trail):
                raise self._full(nbytes, align)
            start = top + pad
            if index is None:
                index = _next_index()
            c_index = index
            METRALE_PIECES_LOCK(self._pieces_lock)  # (C alone while it is held: no Python code runs)
            if self._count == self._room:
                room = 16 if self._room == 0 else 2 * self._room
                grown = <Piece *>PyMem_Realloc(self._pieces, room * sizeof(Piece))
                if grown == NULL:
                    METRALE_PIECES_UNLOCK(self._pieces_lock)
                    raise MemoryError()
                self._pieces = grown
                self._room = room
            self._top = start + <unsigned long long>n + trail
            self.allocs += 1
            self._pieces[self._count].index = c_index
            self._pieces[self._count].offset = start
            self._pieces[self._count].nbytes = <unsigned long long>n
            if self._count and self._pieces[self._count - 1].index >= self._pieces[self._count].index:
                self._in_order = False
            self._count += 1
            METRALE_PIECES_UNLOCK(self._pieces_lock)
        finally:
            release(&self._lock)
        if start <= WORD_MAX - self._base:
            return make_buffer(self._base + start, nbytes, "arena", index, site, self._owner)
        return make_buffer(self._base_object + start, nbytes, "arena", index, site, self._owner)

    cdef object _full(self, object nbytes, object align):
        return ArenaFullError(
            f"Arena.alloc({nbytes}, align={align}): the arena from {self.site} is full: "
            f"{format_bytes(self._top)} of {format_bytes(self._capacity_object)} handed out since its last "
            f"reset(); reset() it when its pieces are done with, or create a larger arena",
            requested=nbytes, capacity=self._capacity_object, used=self._top,
        )

    def holds(self, buf):
        """Whether ``buf`` is a live piece of this arena: one it handed out since the last ``reset()``,
        at the address and with the size it recorded (a copy of the handle with another size is not)."""
        cdef long long index
        cdef unsigned long long ptr, nbytes
        cdef Py_ssize_t at
        cdef bint found
        if buf._owner is not self._owner:
            return False
        index_object = buf.index
        ptr_object = buf.ptr
        nbytes_object = buf.nbytes
        if not (metrale_small(index_object, &index) and metrale_word(ptr_object, &ptr)
                and metrale_word(nbytes_object, &nbytes)):
            return self._pieces_by_index().get(index_object) == (ptr_object, nbytes_object)
        METRALE_PIECES_LOCK(self._pieces_lock)
        at = self._find(index)
        found = (at >= 0 and ptr >= self._base and ptr - self._base == self._pieces[at].offset
                 and nbytes == self._pieces[at].nbytes)
        METRALE_PIECES_UNLOCK(self._pieces_lock)
        return found

    cdef Py_ssize_t _find(self, long long index) noexcept:
        """Where the piece of creation ``index`` is in the array, or -1 (C only: no Python call)."""
        cdef Py_ssize_t low = 0, high = self._count, middle
        if not self._in_order:
            for middle in range(self._count):
                if self._pieces[middle].index == index:
                    return middle
            return -1
        while low < high:
            middle = (low + high) // 2
            if self._pieces[middle].index < index:
                low = middle + 1
            else:
                high = middle
        if low < self._count and self._pieces[low].index == index:
            return low
        return -1

    cdef dict _pieces_by_index(self):
        """The live pieces as the pure class keeps them (creation index -> (address, nbytes)): for a ``holds`` of a
        handle whose fields are not plain ints, which then compares as the pure class does."""
        cdef Py_ssize_t i, count
        cdef Piece *copied
        cdef dict pieces = {}
        METRALE_PIECES_LOCK(self._pieces_lock)
        count = self._count
        copied = <Piece *>PyMem_RawMalloc(count * sizeof(Piece) + 1)  # (no Python code while the lock is held)
        if copied != NULL and count:
            memcpy(copied, self._pieces, count * sizeof(Piece))
        METRALE_PIECES_UNLOCK(self._pieces_lock)
        if copied == NULL:
            raise MemoryError()
        try:
            for i in range(count):
                pieces[copied[i].index] = (self._base_object + copied[i].offset, copied[i].nbytes)
        finally:
            PyMem_RawFree(copied)
        return pieces

    cdef void _forget_pieces(self) noexcept:
        """Every piece taken back (the lock held): the array kept for the next ones, unless it grew large."""
        cdef Piece *gone = NULL
        METRALE_PIECES_LOCK(self._pieces_lock)
        self._count = 0
        self._in_order = True
        if self._room > KEPT_ROOM or self._block is None:
            gone, self._pieces, self._room = self._pieces, NULL, 0
        METRALE_PIECES_UNLOCK(self._pieces_lock)
        PyMem_Free(gone)

    def reset(self):
        """Take every piece back; buffers handed out so far are no longer live.

        With ``redzone_arena``, their zones are judged first (it waits for the device; refused while a capture
        runs, changing nothing), and a violation is reported once the pieces went.
        """
        zones = self._zones
        if zones is None:
            self._reset()
            return
        with zones.lock:
            if self._block is None:
                raise InvalidBufferError(f"Arena.reset: this arena (from {self.site}) is closed")
            found = zones.judged("Arena.reset", self._reset_locked)
        zones.report(found, "Arena.reset()")

    def _reset_locked(self):
        self._reset()

    cdef void _reset(self) except *:
        acquire(&self._lock)
        try:
            if self._block is None:
                raise InvalidBufferError(f"Arena.reset: this arena (from {self.site}) is closed")
            self._top = 0
            self._forget_pieces()
        finally:
            release(&self._lock)

    def close(self):
        """Release the block; idempotent. Its pieces are no longer live.

        Refused (during a capture, say) it changes nothing: the arena stays open and usable. With
        ``redzone_arena``, the pieces' zones are judged first, as by ``reset()``.
        """
        zones = self._zones
        if zones is None:
            self._close()
            return
        with zones.lock:
            if self._block is None:
                return
            found = zones.judged("Arena.close", self._close_locked)
        zones.report(found, "Arena.close()")

    def _close_locked(self):
        self._close()

    cdef void _close(self) except *:
        acquire(&self._lock)
        try:
            block = self._block
            if block is None:
                return
            self._on_close(self, block)  # may refuse; nothing has changed then
            self._block = None
            self._top = 0
            self._forget_pieces()
        finally:
            release(&self._lock)

    def _take_block(self):
        """For the backend's close (its final scan judged the zones): forget the block (the backend releases it)."""
        acquire(&self._lock)
        try:
            block, self._block = self._block, None
            self._top = 0
            self._forget_pieces()
        finally:
            release(&self._lock)
        if self._zones is not None:
            with self._zones.lock:
                self._zones.drop()
        return block

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()

    def __repr__(self):
        if self._block is None:
            state = "closed"
        else:
            state = f"{format_bytes(self._top)} of {format_bytes(self._capacity_object)} used"
        return f"<Arena at {self._base_object:#x}, {state}, from {self.site}>"


_Arena.register(Arena)
