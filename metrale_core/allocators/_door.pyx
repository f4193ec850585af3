# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`Door`][metrale_core.allocators.Door] (``door.py``): the same interface and behaviour,
and a C-level face (``_door.pxd``) for the compiled C functions of `doorfuncs`.

- The pure class is the reference and the public class: this one registers itself as its virtual subclass
  (``Door.register``), so ``isinstance(x, metrale_core.allocators.Door)`` holds, and is named ``Door`` too. The
  framework modules choose with `_twins.pick("door", Door, pure)`.
- `alloc_c` and `free_c` are `alloc` and `free` for a framework's C hook: no Python frame between the hook and the
  pool's compiled lane. Nothing raises out of them: a refusal is logged and counted (`last_error`), as `alloc` and
  `free` do, and anything else that goes wrong is logged and gives the framework no memory.
"""

cimport cython
from libc.stdint cimport uintptr_t

from metrale_core._device._handle cimport FIELD_PTR, buffer_field

import logging

from .._device.buffer import DeviceBuffer as _DeviceBuffer
from .._errors import DoorError as _DoorError
from .._errors import MetraleError as _MetraleError
from .door import Door as _Door
from .doorfuncs import log_failure as _log_failure

_log = logging.getLogger("metrale")


@cython.final
cdef class Door:
    """One backend's caching pool behind a framework's allocator hook (compiled twin of
    [`Door`][metrale_core.allocators.Door], registered as its subclass)."""

    def __init__(self, gpu, framework, *, release_threshold=0):
        self._gpu = gpu
        self._pool = gpu.create_pool(release_threshold=release_threshold)
        self._pool.strand_swept()
        self._out = {}
        self.framework = framework
        self.failures = 0
        self.last_error = None

    @property
    def gpu(self):
        return self._gpu

    @property
    def pool(self):
        return self._pool

    def take(self, nbytes, stream):
        """A piece of ``nbytes`` for the framework's stream ``stream`` (its raw handle), on the ledger with the
        caller's site; refused with metrale's typed error."""
        buf = self._pool.alloc_on(nbytes, stream)
        self._out[buf.ptr] = buf
        return buf

    def alloc(self, nbytes, stream):
        """As `take`, for a C hook: the piece's address; 0 for 0 bytes, and 0 where metrale refuses (logged, kept
        in `last_error`)."""
        if nbytes <= 0:
            return 0
        try:
            return self.take(nbytes, stream).ptr
        except _MetraleError as exc:
            self._failed("alloc", exc)
            return 0

    cdef uintptr_t alloc_c(self, size_t nbytes, uintptr_t stream) noexcept:
        """`alloc` at C level; 0 where metrale refuses (logged, counted) or anything else failed (logged)."""
        if nbytes == 0:
            return 0
        try:
            try:
                buf = self._pool.alloc_on(nbytes, stream)
            except _MetraleError as exc:
                self._failed("alloc", exc)
                return 0
            ptr = buffer_field(buf, FIELD_PTR) if type(buf) is _DeviceBuffer else buf.ptr
            self._out[ptr] = buf
            return <uintptr_t>ptr
        except BaseException:
            try:
                _log_failure("allocator door: alloc of %d bytes failed", nbytes)
            except BaseException:
                pass
            return 0

    def free(self, address):
        """Give back the piece at ``address`` (cached for the stream it was allocated on). An address that is no
        piece out of this door is logged and changes nothing; after the backend closed, a free changes nothing."""
        buf = self._out.pop(address, None)
        if buf is None:
            if address and not self._gpu.closed:
                self._failed("free", _DoorError(
                    f"{self.framework} freed {address:#x}, which is no piece of its metrale pool out now"))
            return
        if self._gpu.closed:
            return
        try:
            self._pool.free(buf)
        except _MetraleError as exc:  # swept meanwhile (the sweep named it): its memory stays out until close
            self._failed("free", exc)

    cdef void free_c(self, uintptr_t address) noexcept:
        """`free` at C level: what it refuses is logged and counted, anything else that fails is logged."""
        try:
            self.free(address)
        except BaseException:
            try:
                _log_failure("allocator door: free of %#x failed", address)
            except BaseException:
                pass

    def record(self, address, stream):
        """The piece at ``address`` is used on the framework's stream ``stream`` too: at its free it waits for the
        pool's next wait for the device before any reuse. An address that is no piece out of this door, or a call
        after the backend closed, changes nothing (logged at DEBUG)."""
        buf = self._out.get(address)
        if buf is None or self._gpu.closed:  # (as torch's own allocator: a pointer not its own is ignored)
            if address and not self._gpu.closed:
                _log.debug("%s allocator: record_stream of %#x, no piece of its metrale pool out now: ignored",
                           self.framework, address)
            return
        try:
            self._pool.record_stream(buf, stream)
        except _MetraleError as exc:
            self._failed("record_stream", exc)

    def piece(self, address):
        """The piece out at ``address`` (the ledger's record of a framework's tensor), or ``None``."""
        return self._out.get(address)

    def out(self):
        """How many pieces are out now."""
        return len(self._out)

    def close(self):
        """Close the pool: pieces still out are swept, each a leak named in a warning."""
        self._out.clear()
        self._pool.close()

    def refuse(self, what, why):
        """Count and log a call the framework's hook refuses before it reaches the pool (``why`` says why)."""
        self._failed(what, _DoorError(why))

    cdef int _failed(self, str what, object exc) except -1:
        self.failures += 1
        self.last_error = exc
        _log.error("%s allocator: %s refused: %s", self.framework, what, exc)
        return 0

    def __repr__(self):
        return f"<Door for {self.framework}: {self.out()} pieces out of {self._pool!r}>"


_Door.register(Door)
