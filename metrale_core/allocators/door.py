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
- CUDA graphs: a framework that captures a graph into a private pool of its own (torch's ``torch.cuda.graph``)
  says so (`begin_pool`, `end_pool`, `release_pool`: torch's pool hooks). While a capture is underway, an
  allocation on a stream it captures comes from a private metrale pool for that framework pool
  (``create_pool(for_capture=True)``: it grows during the capture), and its pieces
  go back there: memory a graph uses is never handed out outside its pool while the graph lives. The private pool
  closes, its memory given back to the device, once the framework let go of it and none of its pieces is out.
- Red zones in graphs: with zones on, a capture's pieces are zoned as any (filled at once, on the backend's own
  stream: not captured), and a piece allocated while its stream captured stays out after the framework frees it,
  its zones watched, until the framework lets go of the graph: each piece's memory is then the graph's alone, and an
  overrun by any replay stays in its zone. It is found by a scan (``scan_redzones()``), and when the graph goes (its
  pieces are freed then, and judged), with the tensor's site. The cost: a graph's pool holds every piece of its
  capture (no reuse inside it). A pool used without a capture (``torch.cuda.use_mem_pool``) reuses as any.
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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .._errors import DoorError, InvalidBufferError, MetraleError, MissingPackageError, RedZoneError
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

    __slots__ = ("_gpu", "_graphs", "_in_graphs", "_out", "_pool", "_underway", "_zoned", "failures", "framework",
                 "last_error")

    def __init__(self, gpu: GpuBackend, framework: str, *, release_threshold: int = 0) -> None:
        self._gpu = gpu
        self._pool: MemoryPool = gpu.create_pool(release_threshold=release_threshold)
        self._pool.strand_swept()
        self._out: dict[int, DeviceBuffer] = {}
        #: The framework's private pools by its id: [metrale's pool for it, begins not yet released, pieces out, the
        #: pieces the framework freed that stay out for the graph (zones on: each piece's memory is the graph's)].
        self._graphs: dict[tuple[int, int], list[Any]] = {}
        self._zoned = gpu.settings.redzone > 0
        #: The pools begun, not ended: [pool id, which streams allocate to it, whether it keeps the backend's own
        #: red-zone checks off (until an allocation shows that no capture runs: ``torch.cuda.use_mem_pool``)].
        self._underway: list[list[Any]] = []
        #: The pieces out of a private pool: address -> (its pool's id, whether its graph keeps it after its free).
        self._in_graphs: dict[int, tuple[tuple[int, int], bool]] = {}
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
        caller's site; refused with metrale's typed error. From a private pool where a capture underway allocates on
        ``stream`` to one (`begin_pool`)."""
        buf = self._pool.alloc_on(nbytes, stream) if not self._underway else self._take_captured(nbytes, stream)
        self._out[buf.ptr] = buf
        return buf

    def _take_captured(self, nbytes: int, stream: int) -> DeviceBuffer:
        """`take`'s piece while a capture is underway (its caller lists it out): from the private pool of the first
        capture whose streams ``stream`` is one of, else from the door's pool."""
        for begun in list(self._underway):
            pool_id, allocates, deferring = begun
            try:
                mine = allocates(stream)
            except Exception as exc:  # (the framework's check of the stream failed)
                raise DoorError(f"{self.framework} allocator: which capture allocates on stream {stream:#x} could "
                                f"not be told ({type(exc).__name__}: {exc})") from None
            if mine:
                graph = self._graphs[pool_id]
                capturing = (self._zoned or deferring) and self._capturing(stream)
                if deferring and not capturing:  # (no capture: the backend's checks need not wait)
                    begun[2] = False
                    graph[0].capturing(False)
                buf: DeviceBuffer = graph[0].alloc_on(nbytes, stream)
                graph[2] += 1
                self._in_graphs[buf.ptr] = (pool_id, self._zoned and capturing)
                return buf
        return self._pool.alloc_on(nbytes, stream)

    def _capturing(self, stream: int) -> bool:
        """Whether the framework's ``stream`` captures now (its pieces are then the graph's; those of a pool used
        without a capture, ``torch.cuda.use_mem_pool``'s, are not); where the backend cannot tell, it does."""
        raw = self._gpu.raw
        try:
            return bool(raw.is_capturing(raw.foreign_stream(stream)))
        except MetraleError:
            return True

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
                    buf = self._pool.alloc_on(nbytes, stream) if not self._underway else self._take_captured(
                        nbytes, stream)
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
        in_graph = self._in_graphs.pop(address, None) if self._in_graphs else None
        try:
            if in_graph is None:
                self._pool.free(buf)
            else:
                pool_id, kept = in_graph
                graph = self._graphs[pool_id]
                graph[2] -= 1
                if kept:  # a capture's zoned piece: judged when the graph goes, its memory the graph's until then
                    graph[3].append(buf)
                else:
                    graph[0].free(buf)
                self._close_graph(pool_id)
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
        in_graph = self._in_graphs.get(address) if self._in_graphs else None
        try:
            (self._pool if in_graph is None else self._graphs[in_graph[0]][0]).record_stream(buf, stream)
        except MetraleError as exc:
            self._failed("record_stream", exc)

    def begin_pool(self, pool_id: tuple[int, int], allocates: Callable[[int], object]) -> None:
        """The framework begins allocating to its private pool ``pool_id`` (torch: before a CUDA graph's capture
        begins, or at ``torch.cuda.use_mem_pool``): until `end_pool`, an allocation on a stream for which
        ``allocates(stream)`` holds comes from metrale's private pool for ``pool_id``, made at its first begin and
        shared by every begin with that id (as torch shares a pool between graphs)."""
        graph = self._graphs.get(pool_id)
        if graph is None:
            pool = self._gpu.create_pool(for_capture=True)
            pool.strand_swept()
            graph = self._graphs[pool_id] = [pool, 0, 0, []]
        graph[1] += 1
        graph[0].capturing(True)
        self._underway.append([pool_id, allocates, True])

    def end_pool(self, pool_id: tuple[int, int]) -> None:
        """The framework ended allocating to ``pool_id`` (torch: its capture ended): its pieces stay the private
        pool's, and a private pool it let go of meanwhile closes now where none of its pieces is out."""
        for at, (begun, _, deferring) in enumerate(self._underway):
            if begun == pool_id:
                del self._underway[at]
                if deferring:
                    self._graphs[pool_id][0].capturing(False)
                break
        for done in [found for found, graph in self._graphs.items() if graph[1] <= 0]:
            self._close_graph(done)

    def release_pool(self, pool_id: tuple[int, int]) -> None:
        """The framework let go of ``pool_id`` once (torch: a graph's reset, the end of ``use_mem_pool``; once per
        `begin_pool`): after the last, the private pool closes once none of its pieces is out and no capture of this
        door is underway, its memory given back to the device."""
        graph = self._graphs.get(pool_id)
        if graph is not None:
            graph[1] -= 1
            self._close_graph(pool_id)

    def _close_graph(self, pool_id: tuple[int, int]) -> None:
        """Close the private pool ``pool_id`` where the framework let go of it, none of its pieces is out, and no
        capture of this door is underway (closing waits for the device, which a capture forbids)."""
        graph = self._graphs.get(pool_id)
        if graph is not None and graph[1] <= 0 and graph[2] <= 0 and not self._underway and self._let_go(graph):
            self._graphs.pop(pool_id, None)

    def _let_go(self, graph: list[Any]) -> bool:
        """Free the pieces a graph's pool kept (their zones judged: an overrun is reported with its site), then close
        the pool; whether it closed. What fails is counted and logged, and the next `end_pool` or `close` tries
        again (a close that a garbage collection's finalizer makes inside a metrale call is refused)."""
        pool, kept = graph[0], graph[3]
        try:
            while kept:
                try:
                    pool.free(kept[-1])
                except (InvalidBufferError, RedZoneError) as exc:  # swept meanwhile, or freed and found overrun
                    self._failed("free" if isinstance(exc, InvalidBufferError) else "graph release", exc)
                kept.pop()
            pool.close()
        except MetraleError as exc:
            self._failed("graph release", exc)
            return False
        return True

    def graphs(self) -> int:
        """How many private pools the door holds now (torch's graphs and pools not yet let go of)."""
        return len(self._graphs)

    def piece(self, address: int) -> DeviceBuffer | None:
        """The piece out at ``address`` (the ledger's record of a framework's tensor), or ``None``."""
        return self._out.get(address)

    def out(self) -> int:
        """How many pieces are out now."""
        return len(self._out)

    def close(self) -> None:
        """Close the pool and the private ones: pieces still out are swept, each a leak named in a warning."""
        self._out.clear()
        self._in_graphs.clear()
        graphs, self._graphs = self._graphs, {}
        for pool_id, _, deferring in self._underway:
            if deferring:
                graphs[pool_id][0].capturing(False)
        self._underway.clear()
        for graph in graphs.values():
            self._let_go(graph)  # (what fails is logged: its memory goes at the backend's close)
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
