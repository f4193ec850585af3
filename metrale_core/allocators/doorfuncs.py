"""The C functions a framework's allocator hooks call, made for a door.

- `c_functions(door, device)` returns the addresses (`DoorFunctions`) of ``void* alloc(size_t size, int device,
  void* stream)`` and ``void free(void* ptr, size_t size, int device, void* stream)`` (torch's
  ``CUDAPluggableAllocator`` calls these), which call ``door.alloc(size, stream)`` and ``door.free(ptr)``; of
  ``void record_stream(void* ptr, void* stream)``, which calls ``door.record(ptr, stream)`` (torch's
  ``Tensor.record_stream``); and of ``void end_pool(int device, uint64_t id_0, uint64_t id_1)`` (torch's end of a
  ``torch.cuda.graph`` capture, or of ``torch.cuda.use_mem_pool``; its pool id, a pair of 64-bit words passed by
  value: two words in registers on x86-64 (System V) and AArch64), which refuses the capture (`graph_captured`):
  these callbacks cannot take torch's beginning of a pool, whose test of a stream is a C++ ``std::function``. An
  allocation for another device than ``device`` is refused (``door.refuse``: counted, logged), and the framework
  gets no memory.
- Nothing may cross into the framework's C++. ``door.alloc`` answers an address (an integer from 1 to 2**64 - 1),
  or 0 / ``None`` for none; anything else it answers, and anything it raises, gives the framework no memory,
  logged (a log that fails is dropped).
- Here they are ctypes callbacks, kept for the life of the process: the framework may call them until it exits.
- Its compiled twin (``_doorfuncs.pyx``, C++) has one set of C functions, called with the GIL and without ctypes in
  the way, which call a compiled door (``door.py`` compiled as ``_door``) at C level and any other door through its
  methods, and torch's three pool hooks (`Door.begin_pool`: graphs under the door): it serves the first door of the
  process, and answers ``None`` after that (the caller then makes ctypes callbacks here).
"""

from __future__ import annotations

import ctypes
import logging
import operator
from typing import Final, NamedTuple, Protocol

__all__ = [
    "EXPORTED", "DoorFunctions", "DoorLike", "address", "c_functions", "graph_captured", "log_failure", "refusal",
    "wrong_device",
]

#: The names under which the compiled pair (alloc, free) is exported from its shared library
#: (``metrale_core.allocators._doorfuncs``), for a framework that finds its allocator's functions by name.
EXPORTED: Final = ("metrale_door_alloc", "metrale_door_free")

_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_RECORD = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
_CAPTURED = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64)
_ADDRESS_END: Final = 1 << 64

_log = logging.getLogger("metrale")

#: Every callback made here, never let go.
_KEPT: list[tuple[object, ...]] = []


class DoorFunctions(NamedTuple):
    """The addresses of a door's C functions (`c_functions`): torch's pluggable allocator's pair, its
    ``record_stream`` hook, and its three pool hooks (``begin_pool`` and ``release_pool``: 0 where none is made here;
    ``end_pool``, where they are not, refuses a capture: `graph_captured`)."""

    alloc: int
    free: int
    record_stream: int
    end_pool: int
    begin_pool: int = 0
    release_pool: int = 0


def address(got: object) -> int:
    """What ``alloc`` answered, as the address the framework gets: 0 for none (``None``, 0); an integer from 1 to
    2**64 - 1 as it is; anything else raises."""
    if got is None:
        return 0
    value = operator.index(got)  # type: ignore[arg-type]  # (a float, a string: TypeError)
    if not 0 <= value < _ADDRESS_END:
        raise OverflowError(f"allocator door: {value:#x} is no address")
    return value


class DoorLike(Protocol):
    """What the C functions call: a `Door` (or anything with its four calls and its name)."""

    framework: str

    def alloc(self, nbytes: int, stream: int) -> int | None: ...

    def free(self, address: int) -> None: ...

    def record(self, address: int, stream: int) -> None: ...

    def refuse(self, what: str, why: str) -> None: ...


def wrong_device(door: DoorLike, asked: int, device: int) -> None:
    """Refuse (count, log) an allocation for device ``asked`` at a door serving ``device``."""
    door.refuse("alloc", f"{door.framework} asked for memory on device {asked}; this door serves device {device} "
                         f"(install one allocator per process, for its device)")


def graph_captured(door: DoorLike, device: int, pool_id: tuple[int, int]) -> None:
    """Tell ``door`` (refused: counted, logged at ERROR) that its framework ended allocating to a private pool of its
    own on ``device`` (torch's pool ``pool_id``: a CUDA graph's capture, or ``use_mem_pool``) through the ctypes
    callbacks, which never saw its beginning: not supported there, and why."""
    door.refuse("graph capture", (
        f"{door.framework} captured a CUDA graph (or allocated to a private pool of its own) on device {device}, its "
        f"pool {pool_id}, through metrale's ctypes callbacks (the pure build), which cannot take the beginning of a "
        f"pool: its memory came from the door's own pool, where a piece freed during the capture may be handed out "
        f"again while the graph still uses it, and a new segment during a capture fails. The compiled build "
        f"(metrale_core.allocators._doorfuncs) keeps a private pool per graph"))


def refusal(door: object, size: int, failures_before: object) -> str:
    """What a framework's C++ caller is told (the compiled pair's throw) when ``door`` gave no memory for ``size``
    bytes: the refusal the door counted during the call (its ``failures`` went past ``failures_before``), as
    ``metrale: <error type>: <message>``; an out-of-memory begins "CUDA out of memory.", as torch's own error does
    (applications test for that text)."""
    why = getattr(door, "last_error", None)
    failures = getattr(door, "failures", None)
    counted = isinstance(failures, int) and isinstance(failures_before, int) and failures > failures_before
    if not counted or not isinstance(why, BaseException):
        return f"metrale: the allocator door gave no memory for {size} bytes (the metrale log says why)"
    said = f"metrale: {type(why).__name__}: {why}"
    return f"CUDA out of memory. {said}" if isinstance(why, MemoryError) else said


def log_failure(message: str, value: object) -> None:
    try:  # noqa: SIM105 - no contextlib: at shutdown the module's names may be gone already
        _log.exception(message, value)
    except BaseException:  # (at shutdown the logger is gone; a handler may raise): nothing may cross into C
        pass


def c_functions(door: DoorLike, device: int) -> DoorFunctions | None:
    """The addresses of C functions calling ``door`` for memory on ``device`` (``None``: none can be made here;
    never here)."""
    if not all(callable(getattr(door, name, None)) for name in ("alloc", "free", "record", "refuse")):
        raise TypeError(f"c_functions: {door!r} is no door (it needs alloc, free, record and refuse)")
    if type(device) is not int:
        raise TypeError(f"c_functions: device must be an int, got {device!r}")

    def alloc_c(size: int, asked: int, stream: int | None) -> int | None:
        try:  # (a ctypes callback that raises, or answers what is no pointer, gives an undefined one: never let it)
            if asked != device:
                wrong_device(door, asked, device)
                return None
            return address(door.alloc(size, stream or 0)) or None
        except BaseException:
            log_failure("allocator door: alloc of %d bytes failed", size)
            return None

    def free_c(ptr: int | None, size: int, asked: int, stream: int | None) -> None:
        try:
            door.free(ptr or 0)
        except BaseException:
            log_failure("allocator door: free of %#x failed", ptr or 0)

    def record_c(ptr: int | None, stream: int | None) -> None:
        try:
            door.record(ptr or 0, stream or 0)
        except BaseException:
            log_failure("allocator door: record_stream of %#x failed", ptr or 0)

    def captured_c(asked: int, id_0: int, id_1: int) -> None:
        try:
            graph_captured(door, asked, (id_0, id_1))
        except BaseException:
            log_failure("allocator door: a graph capture's end on device %d failed", asked)

    made = (_ALLOC(alloc_c), _FREE(free_c), _RECORD(record_c), _CAPTURED(captured_c))
    _KEPT.append(made)
    addresses = [ctypes.cast(fn, ctypes.c_void_p).value for fn in made]
    assert all(at is not None for at in addresses)
    return DoorFunctions(*addresses)  # type: ignore[arg-type]
