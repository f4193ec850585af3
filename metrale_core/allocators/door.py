"""The door a framework's allocator hook goes through: a metrale pool whose pieces are found by address.

- `Door` owns a [`MemoryPool`][metrale_core.MemoryPool] of one backend and the pieces out, by address: a
  framework hands back an address, never a metrale buffer.
- ``alloc(nbytes, stream)`` never raises: a framework's C allocator hook cannot take a Python exception. A
  refused allocation answers 0, logs the error (an out-of-memory error names the sites holding memory) and
  keeps it in `last_error`; what the framework makes of no memory is its own (torch's pluggable allocator does
  not check: see `metrale_core.allocators.torch`).
- A sweep (``sweep_unreleased()``) takes a door's pieces off the ledger, but the framework still holds them and
  frees them by address later: they stay out of the pool's cache until it closes (``strand_swept``), so no
  such free can ever give back a piece handed out again since.
- ``take(nbytes, stream)`` is the same allocation for a Python hook (CuPy's): it raises metrale's typed error.
- ``free(address)`` gives the piece back to the pool, cached for the stream it was allocated on. It may run from
  a finalizer that a garbage collection starts anywhere, inside a call of the door too: the door takes no lock
  of its own (a dict's item set and pop are atomic), and the pool defers a free that a collection runs inside
  one of its calls.
- Written once, here, and compiled as well as run as Python (``_door``, with ``_door.pxd`` beside it:
  docs/building.md). Compiled, it has two C-level calls (``alloc_c``, ``free_c``) for the compiled C functions of
  `doorfuncs` (``_doorfuncs.pyx``), so a framework's hook reaches the pool without a Python frame; nothing raises
  out of them. The class run as Python is the public one, an ABC; the compiled class (a ``cdef`` class, which
  cannot be one) registers as its subclass, so ``isinstance(door, Door)`` holds for both.
"""

from __future__ import annotations

import abc
import importlib
import logging
from typing import TYPE_CHECKING, Any, TypeVar

from .._errors import DoorError, MetraleError, MissingPackageError
from .doorfuncs import log_failure

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

if TYPE_CHECKING:
    from .. import DeviceBuffer, GpuBackend, MemoryPool

__all__ = ["Door", "framework", "require_cuda"]

_log = logging.getLogger("metrale")

_T = TypeVar("_T")


def framework(module: str, name: str, install: str) -> Any:
    """The framework's package ``module`` (imported when a door is made, never before), or a `MissingPackageError`
    that names it (``name``) and how to ``install`` it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackageError(f"metrale_core.allocators.{module} needs {name}: {install}") from None


def require_cuda(gpu: GpuBackend, framework: str) -> None:
    """Refuse a backend whose memory is not the CUDA device memory ``framework`` runs its kernels on (the fake's
    addresses are not)."""
    if not gpu.origin.device_uuid.startswith("GPU-"):
        raise DoorError(
            f"{framework} allocator: {gpu!r} is no CUDA device (its memory is not device memory {framework}'s "
            f"kernels can use); open the cuda backend (METRALE_BACKEND=cuda)"
        )


class Door:  # (final: _door.pxd says so to Cython; an ABC as Python: see the end of the module)
    """One backend's caching pool behind a framework's allocator hook.

    :param gpu: the backend whose pool serves the framework.
    :param framework: the framework's name, for messages.
    :param release_threshold: the pool's ``release_threshold``.
    """

    __slots__ = ("_gpu", "_out", "_pool", "failures", "framework", "last_error")

    def __init__(self, gpu: GpuBackend, framework: str, *, release_threshold: int = 0) -> None:
        self._gpu = gpu
        self._pool: MemoryPool = gpu.create_pool(release_threshold=release_threshold)
        self._pool.strand_swept()
        self._out: dict[int, DeviceBuffer] = {}
        self.framework = framework
        #: Allocations and frees refused so far.
        self.failures = 0
        #: The last refusal's error, or ``None``.
        self.last_error: MetraleError | None = None

    @property
    def gpu(self) -> GpuBackend:
        return self._gpu

    @property
    def pool(self) -> MemoryPool:
        return self._pool

    def take(self, nbytes: int, stream: int) -> DeviceBuffer:
        """A piece of ``nbytes`` for the framework's stream ``stream`` (its raw handle), on the ledger with the
        caller's site; refused with metrale's typed error."""
        buf = self._pool.alloc_on(nbytes, stream)
        self._out[buf.ptr] = buf
        return buf

    def alloc(self, nbytes: int, stream: int) -> int:
        """As `take`, for a C hook: the piece's address; 0 for 0 bytes, and 0 where metrale refuses (logged, kept
        in `last_error`)."""
        if nbytes <= 0:
            return 0
        try:
            return self.take(nbytes, stream).ptr
        except MetraleError as exc:
            self._failed("alloc", exc)
            return 0

    if cython.compiled:  # (the C functions' calls: _door.pxd)

        def alloc_c(self, nbytes: int, stream: int) -> int:
            """`alloc` at C level: 0 where metrale refuses (logged, counted) or anything else failed (logged)."""
            if nbytes == 0:
                return 0
            try:
                try:
                    buf = self._pool.alloc_on(nbytes, stream)
                except MetraleError as exc:
                    self._failed("alloc", exc)
                    return 0
                ptr: int = buf.ptr
                self._out[ptr] = buf
                return ptr
            except BaseException:
                log_failure("allocator door: alloc of %d bytes failed", nbytes)
                return 0

        def free_c(self, address: int) -> None:
            """`free` at C level: what it refuses is logged and counted, anything else that fails is logged."""
            try:
                self.free(address)
            except BaseException:
                log_failure("allocator door: free of %#x failed", address)

    def free(self, address: int) -> None:
        """Give back the piece at ``address`` (cached for the stream it was allocated on). An address that is no
        piece out of this door is logged and changes nothing; after the backend closed (its pools swept), a free
        changes nothing."""
        buf = self._out.pop(address, None)
        if buf is None:
            if address and not self._gpu.closed:
                self._failed("free", DoorError(
                    f"{self.framework} freed {address:#x}, which is no piece of its metrale pool out now"))
            return
        if self._gpu.closed:
            return
        try:
            self._pool.free(buf)
        except MetraleError as exc:  # swept meanwhile (the sweep named it): its memory stays out until close
            self._failed("free", exc)

    def record(self, address: int, stream: int) -> None:
        """The piece at ``address`` is used on the framework's stream ``stream`` too (torch's
        ``Tensor.record_stream``): at its free it waits for the pool's next wait for the device before any reuse
        (`MemoryPool.record_stream`). An address that is no piece out of this door (0, another allocator's), or a
        call after the backend closed, changes nothing (logged at DEBUG)."""
        buf = self._out.get(address)
        if buf is None or self._gpu.closed:  # (as torch's own allocator: a pointer not its own is ignored)
            if address and not self._gpu.closed:
                _log.debug("%s allocator: record_stream of %#x, no piece of its metrale pool out now: ignored",
                           self.framework, address)
            return
        try:
            self._pool.record_stream(buf, stream)
        except MetraleError as exc:
            self._failed("record_stream", exc)

    def piece(self, address: int) -> DeviceBuffer | None:
        """The piece out at ``address`` (the ledger's record of a framework's tensor), or ``None``."""
        return self._out.get(address)

    def out(self) -> int:
        """How many pieces are out now."""
        return len(self._out)

    def close(self) -> None:
        """Close the pool: pieces still out are swept, each a leak named in a warning."""
        self._out.clear()
        self._pool.close()

    def refuse(self, what: str, why: str) -> None:
        """Count and log a call the framework's hook refuses before it reaches the pool (``why`` says why)."""
        self._failed(what, DoorError(why))

    def _failed(self, what: str, exc: MetraleError) -> None:
        self.failures += 1
        self.last_error = exc
        _log.error("%s allocator: %s refused: %s", self.framework, what, exc)

    def __repr__(self) -> str:
        return f"<Door for {self.framework}: {self.out()} pieces out of {self._pool!r}>"


def _as_abc(cls: type[_T]) -> type[_T]:
    """``cls`` made again as an ABC, the same body (its slots made again): for the compiled alias to register with."""
    slots = set(getattr(cls, "__slots__", ()))
    body = {name: value for name, value in vars(cls).items() if name not in slots | {"__dict__", "__weakref__"}}
    return abc.ABCMeta(cls.__name__, cls.__bases__, body)  # type: ignore[return-value]


if cython.compiled:  # a cdef class cannot be an ABC: this one registers with the public class, door.py's
    importlib.import_module("metrale_core.allocators.door").Door.register(Door)
else:  # run as Python, the public class: an ABC, for the compiled one to register with
    Door = _as_abc(Door)  # type: ignore[misc]
