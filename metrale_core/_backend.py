"""``GpuBackend``: the backend-neutral front every host application talks to.

It holds the invariants (the ledger, red zones, bounds and stale-handle
checks, the capture rules) and calls a backend's :class:`RawDevice` only
once they hold. Collaborators keep their own state: :class:`Ledger`,
:class:`RedZones`, the capture record in ``_capture``, the handles in
``_handles``.
"""

from __future__ import annotations

import array
import collections
import ctypes
import logging
import os
import threading
import traceback
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, TypeVar, cast

from ._arena import Arena
from ._capture import Capture, active_captures, forbid_during_capture, invalidated_error
from ._errors import (
    CaptureError,
    DeviceFaultError,
    DriverError,
    InvalidArgumentError,
    InvalidBufferError,
    MetraleError,
    OutOfMemoryError,
    RedZoneError,
    error_for_code,
)
from ._handles import Event, Graph, GraphExec, HostBuffer, Stream, _Handle
from ._interop import DeviceArray, foreign_memory
from ._kernels import (
    MAX_BLOCK,
    MAX_GRID,
    MAX_THREADS_PER_BLOCK,
    Kernel,
    KernelImplementation,
    KernelRegistry,
    LaunchArg,
    RunMetrics,
    pack_args,
)
from ._ledger import (
    Ledger,
    LedgerProbe,
    call_site,
    describe_sites,
    format_bytes,
    largest_sites,
    next_index,
)
from ._meminfo import effective_free_bytes, read_mem_available
from ._pressure import MemoryStats, OomWatchdog, StatsCounter, check_watchdog_args
from ._ptx import check_architecture, parse_ptx
from ._raw import AllocKind, ForeignMemory, RawDevice
from ._redzone import Layout, RedZones, Zone
from ._settings import MetraleSettings
from ._snapshot import write_snapshot
from ._types import AllocRecord, DeviceBuffer, MemoryInfo, RedZoneViolation, as_index
from .kernels import shipped_modules

__all__ = ["GpuBackend"]

_H = TypeVar("_H", bound=_Handle)

_log = logging.getLogger("metrale")

#: Timed launches whose events are kept before the finished ones are resolved (``kernel_timing``).
_MAX_PENDING_TIMINGS: Final = 4096

#: Fewer live zones than this are read back rather than scanned by the device-side kernel.
_DEVICE_SCAN_MIN_ZONES: Final = 8

#: Top-level packages whose frames are never a call site.
CORE_PACKAGES: Final = frozenset({"metrale_core"})


#: A launch as the fault report describes it: kernel, grid, block, packed arguments.
_Launch = tuple[Kernel, tuple[int, int, int], tuple[int, int, int], list[LaunchArg]]


def _describe_launch(launch: _Launch) -> str:
    kernel, grid, block, args = launch
    return f"{kernel.module}.{kernel.name}<<<{grid}, {block}>>>({', '.join(a.describe() for a in args)})"


class _GuardedRaw:
    """The raw layer as the core calls it: one place that watches every raw call.

    A foreign exception (a plugin's bug) becomes a ``DriverError`` naming the
    call, so none reaches the user; a ``DeviceFaultError`` marks the backend
    faulted, so every later call reports the first fault.
    """

    def __init__(self, target: RawDevice, backend: GpuBackend) -> None:
        self._target = target
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr
        backend = self._backend

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except DeviceFaultError as exc:
                raise backend._faulted_by(exc) from None
            except MetraleError:
                raise
            except Exception as exc:
                raise DriverError(
                    f"the {backend.name} backend's raw {name}() raised {type(exc).__name__}: {exc}; "
                    f"this is a bug in that backend"
                ) from exc

        self.__dict__[name] = call  # looked up once per name
        return call


#: What a finished queued scan found: the launch it followed, and the violations.
_Judged = tuple[str, list[RedZoneViolation]]

#: Red-zone scans queued behind graph launches (``redzone_scan_queued``) that may be in flight at once;
#: a launch that finds them all pending waits for the oldest.
_MAX_QUEUED_SCANS: Final = 4


class _QueuedScan:
    """A red-zone scan queued behind a graph launch: its own buffers, and what judging it needs.

    Each slot has its own copy of the zone table on the device, written on the stream of the scan
    that reads it (so a scan on another stream never reads a table still being written) and only
    when the live-zone set changed since the slot last held it.
    """

    __slots__ = ("capacity", "event", "host", "pending", "result_ptr", "seq", "table_ptr", "table_version", "when",
                 "zones")

    def __init__(self, event: object) -> None:
        self.event = event
        self.result_ptr = 0  # device memory, one result per zone (raw arena memory: on no ledger)
        self.table_ptr = 0  # device memory, the (address, length) pair of each zone
        self.table_version = -1  # the live-zone table version table_ptr holds
        self.host: tuple[int, memoryview] | None = None  # pinned memory the results are copied to
        self.capacity = 0  # zones the buffers hold
        self.pending = False
        self.seq = 0
        self.when = ""
        self.zones: Sequence[Zone] = ()


def _zone_table(zones: Sequence[Zone]) -> bytes:
    """The scan kernel's table for ``zones``: an (address, length) pair of u64 per zone."""
    table = array.array("Q")
    for zone in zones:
        table.extend((zone.start, zone.length))
    return table.tobytes()


def _zone_violations(
    zones: Sequence[Zone], firsts: Iterable[int], keep: Callable[[DeviceBuffer], bool] = lambda buf: True
) -> list[RedZoneViolation]:
    """The violations in a scan's results: ``firsts[i]`` is zone ``i``'s first changed offset + 1, or 0."""
    return [
        RedZoneViolation(z.buffer.ptr, z.buffer.nbytes, z.buffer.index, z.buffer.site, z.side, first - 1)
        for z, first in zip(zones, firsts, strict=True)
        if first and keep(z.buffer)
    ]


class GpuBackend:
    """One open device of one backend. A context manager; thread-safe.

    Obtain it from :func:`metrale_core.open_backend`. ``stream=None``
    everywhere means :attr:`default_stream`, a non-blocking stream of this
    backend's own. Every method raises :class:`~metrale_core.MetraleError`
    subclasses only.
    """

    def __init__(
        self,
        name: str,
        ordinal: int,
        settings: MetraleSettings,
        raw: RawDevice,
        *,
        internal_packages: Iterable[str] = (),
    ) -> None:
        self.name: Final = name
        self.ordinal: Final = ordinal
        self.settings: Final = settings
        self._target = raw
        self._raw: RawDevice = cast(RawDevice, _GuardedRaw(raw, self))
        self._internal = CORE_PACKAGES | frozenset(internal_packages)
        self._closed = False
        self._fault: str | None = None
        self._fault_code: tuple[int | None, str | None] = (None, None)
        self._recent: collections.deque[_Launch] = collections.deque(maxlen=8)
        self._metrics = RunMetrics()
        self._registries: weakref.WeakSet[KernelRegistry] = weakref.WeakSet()
        self._observers: list[Callable[[str, RedZoneViolation], object]] = []
        self._scratch: tuple[int, memoryview] | None = None  # pinned buffer for zone reads
        self._scanner: Kernel | Literal[False] | None = None  # None: not tried yet
        self._scan_lock = threading.RLock()
        self._scan_buffers: dict[str, tuple[int, int]] = {}  # role -> (raw arena pointer, bytes)
        self._scan_table_version = -1  # the live-zone table version the device's table buffer holds
        self._queued_scans: list[_QueuedScan] = []  # redzone_scan_queued: scans behind graph launches
        self._queued_table_version = -1  # the live-zone table version last written to a queued scan's slot
        # Red-zone fills queued on the default stream, and how many of them are known done.
        self._fills_issued = 0
        self._fills_settled = 0
        self._lock = threading.RLock()
        self._ledger = Ledger(settings.memory_history)
        self._stats = StatsCounter()
        self._arena_objs: list[Arena] = []  # open Arena sub-allocators
        self._self_ref = weakref.ref(self)  # what buffers hold, for exports
        self._external: dict[int, tuple[DeviceBuffer, object, Callable[[], None] | None]] = {}
        self._exported: dict[int, int] = {}  # creation index -> DLPack tensors not yet released
        self._viewed: dict[int, weakref.WeakSet[DeviceArray]] = {}  # creation index -> views exported
        self._oom_callbacks: list[Callable[[int], object]] = []
        self._watchdogs: list[OomWatchdog] = []
        self._redzones = RedZones(settings)
        self._raw_base: dict[int, int] = {}  # user pointer -> raw pointer, zoned allocations
        self._arenas: dict[int, DeviceBuffer] = {}
        self._host: dict[int, HostBuffer] = {}
        self._handles: dict[int, _Handle] = {}
        self._default_stream = Stream(self, self._raw.stream_create(), default=True)

    # -- plumbing ---------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    @property
    def raw(self) -> RawDevice:
        """The backend's raw layer (for backend subclasses and diagnostics)."""
        return self._target

    @property
    def default_stream(self) -> Stream:
        """This backend's own non-blocking stream, used wherever ``stream=None``."""
        self._check_open()
        return self._default_stream

    @property
    def device_name(self) -> str:
        """The device's name as its backend reports it."""
        self._check_open()
        return self._raw.device_name()

    def _check_not_closed(self) -> None:
        if self._closed:
            raise MetraleError(
                f"backend {self.name}:{self.ordinal} is closed; open a new one with open_backend()"
            )

    def _check_open(self) -> None:
        """Refuse use after close, and after a device fault (the ledger can still be read then)."""
        self._check_not_closed()
        if self._fault is not None:
            raise DeviceFaultError(
                f"backend {self.name}:{self.ordinal} is unusable after a device fault: {self._fault}. "
                f"Close it (close() still tears down) and open a new one, in a new process for CUDA",
                code=self._fault_code[0],
                name=self._fault_code[1],
            )

    def _recent_launches(self) -> str:
        return "; ".join(_describe_launch(launch) for launch in self._recent) or "none"

    def _faulted_by(self, exc: DeviceFaultError) -> DeviceFaultError:
        """Mark the backend faulted (once: the first fault is the one reported) and describe it."""
        with self._lock:
            first = self._fault is None
            if first:
                self._fault = f"{exc.message} (most recent launches, oldest first: {self._recent_launches()})"
                self._fault_code = (exc.code, exc.name)
                _log.error("backend %s:%d faulted: %s", self.name, self.ordinal, self._fault)
        if first:
            return DeviceFaultError(
                f"{self._fault}; the backend is now unusable: close it and open a new one",
                code=exc.code, name=exc.name,
            )
        return DeviceFaultError(f"{exc.message}; the first fault was: {self._fault}", code=exc.code, name=exc.name)

    @property
    def faulted(self) -> str | None:
        """The first device fault this backend met, with the launches before it; ``None`` if none."""
        return self._fault

    def _destroy(self, destroy: Callable[[object], None], raw: object) -> None:
        """Destroy a handle's raw object; after a device fault, where every call fails, quietly."""
        if self._fault is None:
            destroy(raw)
        else:
            self._quietly("destroy after a device fault", destroy, raw)

    def _adopt(self, handle: _H) -> _H:
        with self._lock:
            self._handles[id(handle)] = handle
        return handle

    def _forget_handle(self, handle: _Handle) -> None:
        with self._lock:
            self._handles.pop(id(handle), None)

    @staticmethod
    def _invalid_argument(what: str, expected: str, got: object) -> InvalidArgumentError:
        return InvalidArgumentError(f"{what}: expected {expected}, got {got!r}")

    def _integer(self, value: object, what: str, name: str, *, minimum: int = 0) -> int:
        number = as_index(value)
        if number is None:
            raise self._invalid_argument(what, f"an integer {name}", value)
        if number < minimum:
            raise InvalidArgumentError(f"{what}: {name} must be at least {minimum}, got {number}")
        return number

    def _size(self, nbytes: object, what: str) -> int:
        n = as_index(nbytes)
        if n is None or n <= 0:
            raise InvalidBufferError(f"{what}: nbytes must be a positive integer, got {nbytes!r}")
        return n

    def _stream(self, stream: Stream | None, what: str) -> Stream:
        if stream is None:
            return self._default_stream
        if not isinstance(stream, Stream) or stream._backend is not self:
            raise self._invalid_argument(what, f"a Stream of this backend ({self.name}) or None", stream)
        stream._live()
        return stream

    def _is_live(self, buf: DeviceBuffer) -> bool:
        if buf.kind == "external":
            held = self._external.get(buf.ptr)
            return held is not None and held[0].index == buf.index
        if buf.kind == "arena":
            live = self._arenas.get(buf.ptr)
            if live is not None and live.index == buf.index:
                return True
            return any(arena.holds(buf) for arena in self._arena_objs)
        return self._ledger.holds(buf.ptr, buf.index)

    def _require_live(self, buf: DeviceBuffer, what: str) -> None:
        if not self._is_live(buf):
            raise InvalidBufferError(
                f"{what}: allocation #{buf.index} ({buf.nbytes} bytes at {buf.ptr:#x}, from "
                f"{buf.site}) is not live on backend {self.name}: it was freed, swept, or "
                f"belongs to another backend. Use a live buffer"
            )

    def _span(
        self, target: object, offset: object, nbytes: int | None, what: str
    ) -> tuple[int, int, DeviceBuffer | None]:
        """``(pointer, nbytes, buffer)`` for a device-side operand, bounds checked."""
        off = self._integer(offset, what, "offset")
        if isinstance(target, DeviceBuffer):
            self._require_live(target, what)
            count = target.nbytes - off if nbytes is None else nbytes
            if off > target.nbytes or count < 0 or off + count > target.nbytes:
                raise InvalidBufferError(
                    f"{what}: bytes [{off}, {off + max(count, 0)}) run past allocation "
                    f"#{target.index} of {target.nbytes} bytes; stay within the buffer"
                )
            return target.ptr + off, count, target
        ptr = as_index(target)
        if ptr is None:
            raise self._invalid_argument(what, "a DeviceBuffer or an int device pointer", target)
        if ptr <= 0:
            raise InvalidArgumentError(f"{what}: a device pointer must be positive, got {ptr}")
        if nbytes is None:
            raise InvalidArgumentError(f"{what}: a raw device pointer needs an explicit nbytes")
        return ptr + off, nbytes, None

    def _host_view(self, obj: object, what: str, *, writable: bool) -> tuple[memoryview, HostBuffer | None]:
        if isinstance(obj, HostBuffer):
            if obj._backend is not self or obj.ptr not in self._host:
                raise InvalidBufferError(f"{what}: {obj!r} is not a live host buffer of this backend")
            return obj._view, obj
        try:
            view = memoryview(obj)  # type: ignore[arg-type]
        except TypeError:
            raise self._invalid_argument(what, "a buffer-protocol object or a HostBuffer", obj) from None
        if not view.c_contiguous:
            raise InvalidArgumentError(f"{what}: host memory must be C-contiguous; pass a contiguous copy")
        if writable and view.readonly:
            raise InvalidArgumentError(f"{what}: the host destination is read-only; pass a bytearray or array")
        return view.cast("B") if view.format != "B" or view.ndim != 1 else view, None

    def _issue(
        self,
        stream: Stream | None,
        what: str,
        buffers: Iterable[DeviceBuffer | None],
        work: Callable[[object], None],
        host_buffers: Iterable[HostBuffer | None] = (),
    ) -> None:
        """Run ``work`` on a stream, recording what it touches if the stream captures."""
        target = self._stream(stream, what)
        if self._fills_issued != self._fills_settled and target is not self._default_stream:
            self._settle_fills()
        capture = target._capture
        if capture is not None:
            if capture.invalidated:
                raise invalidated_error(capture, what)
            for buf in buffers:
                if buf is not None:
                    capture.buffers[(buf.ptr, buf.index)] = buf
            for hb in host_buffers:
                if hb is not None:
                    capture.host_buffers[id(hb)] = hb
        work(target._raw)

    def _settle_fills(self) -> None:
        """Wait for the red-zone fills queued on the default stream (see ``_alloc``).

        Not while a capture runs anywhere in the process (no wait is allowed
        then): ``begin_capture`` settles first, and no allocation, so no fill,
        can happen during a capture.
        """
        issued = self._fills_issued
        if issued != self._fills_settled and not active_captures():
            self._raw.stream_synchronize(self._default_stream._raw)
            self._fills_done(issued)

    def _sync_device(self) -> None:
        """Wait for all of the backend's work (``RawDevice.synchronize``); the fills issued before are done."""
        issued = self._fills_issued
        self._raw.synchronize()
        self._fills_done(issued)

    def _fills_done(self, issued: int) -> None:
        """The fills counted by ``issued`` (read before a wait on the default stream) are done."""
        with self._lock:
            self._fills_settled = max(self._fills_settled, issued)

    # -- memory -----------------------------------------------------------------

    def alloc(self, nbytes: int) -> DeviceBuffer:
        """Device memory, on the ledger until ``free`` or ``sweep_unreleased`` takes it off."""
        return self._alloc(nbytes, "device", "alloc")

    def alloc_managed(self, nbytes: int) -> DeviceBuffer:
        """Managed (unified) memory, on the ledger likewise."""
        return self._alloc(nbytes, "managed", "alloc_managed")

    def alloc_arena(self, nbytes: int) -> DeviceBuffer:
        """Device memory never on the ledger; released only by :meth:`free_arena`."""
        return self._alloc(nbytes, "arena", "alloc_arena")

    def _alloc(self, nbytes: int, kind: AllocKind, what: str) -> DeviceBuffer:
        self._check_open()
        forbid_during_capture(what)
        n = self._size(nbytes, what)
        index = next_index()
        site = call_site(self._internal, depth=3)
        layout = self._redzones.layout(n, index) if kind == "device" else Layout(n, 0, 0)
        raw_ptr = self._raw_alloc(layout.raw_bytes, n, kind, what)
        buf = DeviceBuffer(raw_ptr + layout.lead, n, kind, index, site, self._self_ref)
        if layout.lead or layout.trail:
            zones = self._redzones.zones_for(buf, layout)
            try:
                stream = self._default_stream._raw
                for zone in zones:
                    self._raw.memset(zone.start, self._redzones.fill, zone.length, stream)
            except MetraleError:
                self._release_quietly(raw_ptr, kind)
                raise
            with self._lock:
                self._raw_base[buf.ptr] = raw_ptr
                # Work on the default stream runs after the fill; work on any other stream waits for it
                # (_issue), so an overrun is never erased by a late fill. No wait here: alloc stays cheap.
                self._fills_issued += 1
            self._redzones.add(zones)
        if self.settings.redzone_trace_idx == index:
            _log.warning(
                "redzone_trace_idx=%d: %s of %d bytes allocated at %s; full stack:\n%s",
                index, what, n, site, "".join(traceback.format_stack()[:-2]),
            )
        if kind == "arena":
            with self._lock:
                self._arenas[buf.ptr] = buf
        else:
            self._ledger.add(AllocRecord(buf.ptr, n, kind, index, site))
        self._stats.allocated(kind, n)
        return buf

    def _raw_alloc(self, raw_bytes: int, n: int, kind: AllocKind, what: str) -> int:
        """The raw allocation, with reclaim-and-retry: when it runs out of memory, the
        ``on_out_of_memory`` callbacks are asked to free some, and a callback that says
        it did earns another try (at most ``oom_retries``)."""
        retries = 0
        while True:
            try:
                return self._raw.alloc(raw_bytes, kind)
            except OutOfMemoryError as exc:
                if retries < self.settings.oom_retries and self._reclaim(raw_bytes, what):
                    retries += 1
                    self._stats.oom_retries += 1
                    continue
                self._stats.oom_count += 1
                raise self._out_of_memory(exc, n, kind, what, retries) from None

    def _reclaim(self, nbytes: int, what: str) -> bool:
        """Call the ``on_out_of_memory`` callbacks; whether any says it freed memory."""
        freed = False
        for callback in list(self._oom_callbacks):
            try:
                if callback(nbytes):
                    freed = True
            except Exception as exc:  # a callback's bug must not hide the out-of-memory error
                _log.warning("on_out_of_memory callback %r raised %s: %s", callback, type(exc).__name__, exc)
        if freed:
            _log.info("%s of %s: out of memory; a callback freed memory, trying again", what, format_bytes(nbytes))
        return freed

    def _release_quietly(self, raw_ptr: int, kind: AllocKind) -> None:
        try:
            self._raw.free(raw_ptr, kind)
        except MetraleError as exc:
            _log.warning("releasing %#x after a failed allocation also failed: %s", raw_ptr, exc)

    def _out_of_memory(
        self, exc: OutOfMemoryError, n: int, kind: str, what: str, retries: int = 0
    ) -> OutOfMemoryError:
        try:
            info = self.memory_info()
            memory = (
                f"{format_bytes(info.free)} free ({format_bytes(info.effective_free)} effective) "
                f"of {format_bytes(info.total)}"
            )
        except MetraleError:
            memory = "free memory unknown"
        records = self._ledger.snapshot()
        live = sum(r.nbytes for r in records)
        sites = describe_sites(largest_sites(records))
        retried = f"; tried {retries + 1} times after on_out_of_memory callbacks freed memory" if retries else ""
        saved = ""
        folder = self.settings.oom_snapshot_dir
        if folder is not None:
            path = folder / f"metrale-oom-{self.name}-{os.getpid()}-{next_index()}.json"
            try:
                folder.mkdir(parents=True, exist_ok=True)
                self.save_snapshot(path)
                saved = f"; memory snapshot saved to {path} (see it with: metrale report {path} --png oom.png)"
            except (OSError, MetraleError) as err:
                saved = f"; the memory snapshot could not be saved to {path}: {err}"
        return OutOfMemoryError(
            f"{what}({n}) on {self.name}:{self.ordinal} failed: out of device memory asking for "
            f"{format_bytes(n)} ({kind}); {memory}; {format_bytes(live)} live on the ledger in "
            f"{len(records)} allocation(s), largest call sites: {sites}{retried}{saved}. Free buffers "
            f"you no longer need, register an on_out_of_memory callback that can, or ask for less",
            requested=n,
            code=exc.code,
            name=exc.name,
        )

    def alloc_host(self, nbytes: int) -> HostBuffer:
        """Pinned host memory, in a table of its own (not on the ledger)."""
        self._check_open()
        forbid_during_capture("alloc_host")
        n = self._size(nbytes, "alloc_host")
        try:
            ptr, view = self._raw.alloc_host(n)
        except OutOfMemoryError as exc:
            raise OutOfMemoryError(
                f"alloc_host({n}) failed: out of pinned host memory; free host buffers or ask for less",
                requested=n,
                code=exc.code,
                name=exc.name,
            ) from None
        hb = HostBuffer(self, ptr, n, view)
        with self._lock:
            self._host[ptr] = hb
        return hb

    def free(self, buf: DeviceBuffer | HostBuffer) -> None:
        """Free a ``DeviceBuffer`` on the ledger, or a ``HostBuffer``.

        The ledger record comes off first, then the memory is released,
        whatever the release returns. Anything else raises
        :class:`~metrale_core.InvalidBufferError` and changes nothing.
        """
        self._check_open()
        forbid_during_capture("free")
        if isinstance(buf, HostBuffer):
            with self._lock:
                hb = self._host.get(buf.ptr)
                if hb is not buf:
                    raise InvalidBufferError(f"free: {buf!r} is not a live host buffer of this backend")
                del self._host[buf.ptr]
            buf._closed = True
            self._raw.free_host(buf.ptr)
            return
        if not isinstance(buf, DeviceBuffer):
            raise InvalidBufferError(f"free: expected a DeviceBuffer or HostBuffer, got {buf!r}")
        if buf.kind == "arena":
            raise InvalidBufferError(
                f"free: allocation #{buf.index} is arena memory; release it with free_arena(), "
                f"or reset() the Arena it came from"
            )
        if buf.kind == "external":
            raise InvalidBufferError(
                f"free: allocation #{buf.index} is another library's memory (from wrap()); metrale never frees "
                f"it: let go of it with unwrap(), then free it where it came from"
            )
        record = self._ledger.take(buf.ptr, buf.index)
        if record is None:
            raise InvalidBufferError(
                f"free: allocation #{buf.index} ({buf.nbytes} bytes at {buf.ptr:#x}, from "
                f"{buf.site}) is not on this backend's ledger: already freed, swept, or not "
                f"from this backend. Free each buffer once"
            )
        self._stats.released(record.kind, record.nbytes)  # off the ledger: off the stats, whatever the release says
        self._warn_if_graphed(buf)
        self._warn_if_exported(buf)
        with self._lock:
            raw_ptr = self._raw_base.pop(buf.ptr, buf.ptr)
        with self._scan_lock:  # no scan may read this zone once the memory is released
            zones = self._redzones.remove(buf.ptr)
            try:
                # its own zones, read while the culprit is fresh (cuMemFree waits for the device anyway)
                violations = self._read_zones(zones)
            finally:
                self._raw.free(raw_ptr, record.kind)  # type: ignore[arg-type]
        self._report(violations, f"free of allocation #{buf.index}")

    def free_arena(self, buf: DeviceBuffer) -> None:
        """Release an ``alloc_arena`` buffer."""
        self._check_open()
        forbid_during_capture("free_arena")
        if not isinstance(buf, DeviceBuffer) or buf.kind != "arena":
            raise InvalidBufferError(f"free_arena: expected an arena DeviceBuffer, got {buf!r}")
        with self._lock:
            live = self._arenas.get(buf.ptr)
            if live is None or live.index != buf.index:
                if any(arena.holds(buf) for arena in self._arena_objs):
                    raise InvalidBufferError(
                        f"free_arena: allocation #{buf.index} is a piece of an Arena; reset() or close() the arena"
                    )
                raise InvalidBufferError(
                    f"free_arena: arena allocation #{buf.index} is not live on this backend; "
                    f"release each arena buffer once"
                )
            del self._arenas[buf.ptr]
        self._warn_if_graphed(buf)
        self._stats.released("arena", buf.nbytes)
        self._raw.free(buf.ptr, "arena")

    def _warn_if_graphed(self, buf: DeviceBuffer) -> None:
        with self._lock:
            users = [h for h in self._handles.values() if isinstance(h, GraphExec) and buf in h._buffers]
        if users:
            _log.warning(
                "free of allocation #%d (%d bytes from %s) while %d live executable graph(s) "
                "still use it; launching them now raises InvalidBufferError: close them or "
                "capture again",
                buf.index, buf.nbytes, buf.site, len(users),
            )

    # -- the ledger ---------------------------------------------------------------

    def live_alloc_len(self) -> int:
        """How many allocations are on the ledger."""
        self._check_not_closed()
        return len(self._ledger)

    def ledger_probe(self) -> LedgerProbe:
        """A reader of this backend's ledger that outlives the backend."""
        self._check_not_closed()
        return LedgerProbe(self._ledger)

    def sweep_unreleased(self) -> int:
        """Drain the ledger, free each allocation on it, and report; returns how many."""
        self._check_open()
        forbid_during_capture("sweep_unreleased")
        return self._sweep()

    def _sweep(self) -> int:
        records = self._ledger.drain()
        if records:
            total = sum(r.nbytes for r in records)
            _log.warning(
                "sweep on %s:%d: %d allocation(s) totalling %s had no owner; largest sites: %s",
                self.name, self.ordinal, len(records), format_bytes(total),
                describe_sites(largest_sites(records)),
            )
        for rec in records:
            self._stats.released(rec.kind, rec.nbytes)
            with self._lock:
                raw_ptr = self._raw_base.pop(rec.ptr, rec.ptr)
            with self._scan_lock:
                self._redzones.remove(rec.ptr)
                self._quietly(
                    f"sweep: freeing allocation #{rec.index} at {rec.ptr:#x}", self._raw.free, raw_ptr, rec.kind
                )
        return len(records)

    # -- work on streams --------------------------------------------------------

    def memset(
        self,
        dst: DeviceBuffer | int,
        value: int,
        *,
        offset: int = 0,
        nbytes: int | None = None,
        stream: Stream | None = None,
    ) -> None:
        """Set bytes of ``dst`` to ``value`` (0..255) on ``stream``."""
        self._check_open()
        what = "memset"
        byte = as_index(value)
        if byte is None or not 0 <= byte <= 255:
            raise self._invalid_argument(what, "a byte value 0..255", value)
        count = None if nbytes is None else self._size(nbytes, what)
        ptr, count, buf = self._span(dst, offset, count, what)
        self._issue(stream, what, (buf,), lambda s: self._raw.memset(ptr, byte, count, s) if count else None)

    def copy_to_device(
        self,
        dst: DeviceBuffer | int,
        src: Any,
        *,
        offset: int = 0,
        stream: Stream | None = None,
    ) -> None:
        """Copy all of ``src`` (host bytes or a ``HostBuffer``) to ``dst`` at ``offset``."""
        self._check_open()
        what = "copy_to_device"
        view, hb = self._host_view(src, what, writable=False)
        ptr, count, buf = self._span(dst, offset, view.nbytes, what)
        self._issue(
            stream, what, (buf,),
            lambda s: self._raw.copy_htod(ptr, view, s, pinned=hb is not None) if count else None,
            (hb,),
        )

    def copy_to_host(
        self,
        dst: Any,
        src: DeviceBuffer | int,
        *,
        offset: int = 0,
        stream: Stream | None = None,
    ) -> None:
        """Fill all of ``dst`` (writable host memory or a ``HostBuffer``) from ``src`` at ``offset``."""
        self._check_open()
        what = "copy_to_host"
        view, hb = self._host_view(dst, what, writable=True)
        ptr, count, buf = self._span(src, offset, view.nbytes, what)
        self._issue(
            stream, what, (buf,),
            lambda s: self._raw.copy_dtoh(view, ptr, s, pinned=hb is not None) if count else None,
            (hb,),
        )

    def copy_device(
        self,
        dst: DeviceBuffer | int,
        src: DeviceBuffer | int,
        *,
        nbytes: int | None = None,
        dst_offset: int = 0,
        src_offset: int = 0,
        stream: Stream | None = None,
    ) -> None:
        """Copy device to device; ``nbytes=None`` copies the rest of ``src`` from ``src_offset``."""
        self._check_open()
        what = "copy_device"
        count = None if nbytes is None else self._size(nbytes, what)
        src_ptr, count, src_buf = self._span(src, src_offset, count, what)
        dst_ptr, count, dst_buf = self._span(dst, dst_offset, count, what)
        self._issue(
            stream, what, (dst_buf, src_buf),
            lambda s: self._raw.copy_dtod(dst_ptr, src_ptr, count, s) if count else None,
        )

    # -- streams, events, synchronization ---------------------------------------

    def create_stream(self) -> Stream:
        """A new non-blocking stream, owned by this backend."""
        self._check_open()
        return self._adopt(Stream(self, self._raw.stream_create()))

    def create_event(self) -> Event:
        """A new event, owned by this backend."""
        self._check_open()
        return self._adopt(Event(self, self._raw.event_create()))

    def synchronize(self) -> None:
        """Wait for all work of this backend."""
        self._check_open()
        forbid_during_capture("synchronize()")
        self._sync_device()
        self._report_queued_scans()

    def bind_to_thread(self) -> None:
        """Make this backend's context current on the calling thread (for code outside metrale)."""
        self._check_open()
        self._raw.bind_to_thread()

    # -- capture ----------------------------------------------------------------

    def begin_capture(self, stream: Stream | None = None) -> None:
        """Begin capturing ``stream`` in CUDA's global mode: its work is recorded, not run."""
        self._check_open()
        target = self._stream(stream, "begin_capture")
        if target._capture is not None:
            err = error_for_code("CUDA_ERROR_ILLEGAL_STATE", "begin_capture")
            raise CaptureError(
                "begin_capture: this stream is already capturing; call end_capture first",
                code=err.code,
                name=err.name,
            )
        self._settle_fills()  # no wait is allowed once a capture runs
        capture = Capture(target)
        self._raw.begin_capture(target._raw)
        target._capture = capture
        capture.start()

    def end_capture(self, stream: Stream | None = None) -> Graph:
        """End the capture of ``stream`` and return the recorded :class:`Graph`.

        An invalidated capture is ended and discarded, and ``CaptureError`` raised.
        """
        self._check_open()
        target = self._stream(stream, "end_capture")
        capture = target._capture
        if capture is None:
            err = error_for_code("CUDA_ERROR_ILLEGAL_STATE", "end_capture")
            raise CaptureError(
                "end_capture: this stream is not capturing; call begin_capture first",
                code=err.code,
                name=err.name,
            )
        target._capture = None
        capture.finish()
        if capture.invalidated:
            self._discard_raw_capture(target)
            raise invalidated_error(capture, "end_capture")
        return self._adopt(Graph(self, self._raw.end_capture(target._raw), capture))

    def _discard_raw_capture(self, target: Stream) -> None:
        try:
            graph = self._raw.end_capture(target._raw)
        except MetraleError:
            return
        try:
            self._raw.graph_destroy(graph)
        except MetraleError as exc:
            _log.debug("destroying a discarded capture's graph failed: %s", exc)

    def stream_is_capturing(self, stream: Stream | None = None) -> bool:
        """Whether ``stream`` is capturing (also while the capture is invalidated).

        Asks the driver, which also sees captures begun outside metrale;
        under the scale variant the driver is never asked and metrale's own
        record answers.
        """
        self._check_open()
        target = self._stream(stream, "stream_is_capturing")
        if self.settings.scale_variant:
            return target._capture is not None
        return self._raw.is_capturing(target._raw)

    # -- kernels ------------------------------------------------------------------

    def load_modules(self, images: Mapping[str, bytes | str]) -> KernelRegistry:
        """Load named PTX images; returns the registry that hands out their kernels.

        Every image is checked against the device's compute capability first;
        the images the device cannot run are refused together, in one
        :class:`~metrale_core.ArchitectureError`, and nothing is loaded.
        """
        self._check_open()
        forbid_during_capture("load_modules")
        if not isinstance(images, Mapping) or not images:
            raise self._invalid_argument("load_modules", "a non-empty mapping of module name to PTX image", images)
        texts: dict[str, bytes] = {}
        for name, image in images.items():
            if not isinstance(name, str) or not isinstance(image, bytes | bytearray | str):
                raise self._invalid_argument("load_modules", "str names and PTX images as bytes or str", (name, image))
            texts[name] = image.encode() if isinstance(image, str) else bytes(image)
        parsed = {name: parse_ptx(name, text) for name, text in texts.items()}
        check_architecture(parsed, self._raw.compute_capability(), self._raw.device_name())
        loaded: dict[str, object] = {}  # nothing is loaded until every image passed
        try:
            for name, text in texts.items():
                loaded[name] = self._raw.module_load(name, text)
        except MetraleError:
            for module in loaded.values():
                self._quietly("module unload", self._raw.module_unload, module)
            raise
        registry = KernelRegistry(self, parsed, loaded)
        self._registries.add(registry)
        return registry

    def compute_capability(self) -> tuple[int, int]:
        """The device's compute capability, ``(major, minor)``."""
        self._check_open()
        return self._raw.compute_capability()

    def preflight(self, images: Mapping[str, bytes | str]) -> None:
        """Check PTX images against the device without loading them; raises like :meth:`load_modules`."""
        self._check_open()
        parsed = {name: parse_ptx(name, image) for name, image in images.items()}
        check_architecture(parsed, self._raw.compute_capability(), self._raw.device_name())

    def add_kernel_implementations(self, *implementations: KernelImplementation) -> None:
        """Python implementations of kernels, for a backend that runs kernels on the CPU (the fake).

        Backends that run kernels on a device ignore them.
        """
        self._check_open()
        for impl in implementations:
            if not isinstance(impl, KernelImplementation):
                raise self._invalid_argument(
                    "add_kernel_implementations", "functions decorated with @kernel_implementation", impl
                )
        self._raw.add_kernel_implementations(implementations)

    def launch(
        self,
        kernel: Kernel,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: Sequence[object],
        *,
        shared_mem: int = 0,
        stream: Stream | None = None,
    ) -> None:
        """Launch ``kernel`` with ``grid`` x ``block`` threads on ``stream``.

        ``args`` holds one value per kernel parameter: a ``DeviceBuffer``
        (checked live), an ``int`` device pointer (unchecked), or an
        explicitly typed scalar (a numpy scalar or a ctypes value) of the
        parameter's type. Anything else is refused before the driver sees it.
        In a capture the launch is recorded. With ``debug_sync_kernels`` the
        stream is synchronized after the launch (outside captures) and a
        failure names this launch.
        """
        self._check_open()
        what = "launch"
        if not isinstance(kernel, Kernel) or kernel.registry._backend is not self:
            raise self._invalid_argument(what, "a Kernel of a registry of this backend", kernel)
        if kernel.registry.closed:
            raise MetraleError(f"{what}: the registry of {kernel.signature} was closed; load the modules again")
        g = self._dims(grid, "grid", MAX_GRID)
        b = self._dims(block, "block", MAX_BLOCK)
        if b[0] * b[1] * b[2] > MAX_THREADS_PER_BLOCK:
            raise InvalidArgumentError(f"{what}: block {b} has more than {MAX_THREADS_PER_BLOCK} threads")
        shm = self._integer(shared_mem, what, "shared_mem")
        packed = pack_args(kernel, args, what, lambda buf: self._require_live(buf, what))
        target = self._stream(stream, what)
        buffers = [a for a in args if isinstance(a, DeviceBuffer)]
        outside_capture = target._capture is None and not active_captures()
        timing = self.settings.kernel_timing and outside_capture
        start = end = None
        if timing:
            start, end = self._raw.event_create(), self._raw.event_create()
            self._raw.event_record(start, target._raw)
        launched = (kernel, g, b, packed)
        self._recent.append(launched)  # formatted only when a fault is reported: launches are a hot path
        try:
            if target._capture is not None:
                target._capture.registries[id(kernel.registry)] = kernel.registry
            self._issue(target, what, buffers, lambda s: self._raw.launch(kernel._raw, g, b, shm, s, packed))
            if timing:
                self._raw.event_record(end, target._raw)
                self._metrics.pending.append(((kernel.module, kernel.name), start, end))
                if len(self._metrics.pending) > _MAX_PENDING_TIMINGS:
                    self._resolve_timings(wait=False)
            self._metrics.launched((kernel.module, kernel.name))
            if self.settings.debug_sync_kernels and outside_capture:
                self._raw.stream_synchronize(target._raw)
        except MetraleError as exc:
            if isinstance(exc, CaptureError):
                raise
            raise type(exc)(
                f"{what} of {_describe_launch(launched)} failed: {exc.message}", code=exc.code, name=exc.name
            ) from exc

    @staticmethod
    def _dims(value: object, name: str, limits: tuple[int, int, int]) -> tuple[int, int, int]:
        if type(value) is int and 1 <= value <= limits[0]:  # the hot path: one dimension
            return value, 1, 1
        dims = [value] if isinstance(value, int) and not isinstance(value, bool) else value
        if isinstance(dims, str | bytes) or not isinstance(dims, Sequence) or not 1 <= len(dims) <= 3:
            raise InvalidArgumentError(f"launch: {name} must be an int or 1 to 3 ints, got {value!r}")
        out = []
        for d in dims:
            n = as_index(d)
            if n is None:
                raise InvalidArgumentError(f"launch: {name} must hold integers, got {value!r}")
            out.append(n)
        out += [1] * (3 - len(out))
        for n, limit in zip(out, limits, strict=True):
            if not 1 <= n <= limit:
                raise InvalidArgumentError(f"launch: {name} {tuple(out)} is outside 1..{limits} per dimension")
        return out[0], out[1], out[2]

    def run_metrics(self) -> RunMetrics:
        """Kernels looked up, launches per kernel and (with ``kernel_timing``) GPU time, since this backend opened.

        Resolving the timings waits for their events, so this is refused during a capture.
        """
        self._check_open()
        if self._metrics.pending:
            forbid_during_capture("run_metrics()")
            self._resolve_timings(wait=True)
        return self._metrics

    def _resolve_timings(self, *, wait: bool) -> None:
        """Turn timed launches into GPU milliseconds: all of them, or (``wait=False``) those already done.

        Called outside any capture only, where event queries are allowed.
        """
        pending = self._metrics.pending
        while pending:
            key, start, end = pending[0]
            if wait:
                self._raw.event_synchronize(end)
            elif not self._raw.event_query(end):
                break
            pending.pop(0)
            ms = self._raw.event_elapsed_ms(start, end)
            self._metrics.gpu_ms[key] = self._metrics.gpu_ms.get(key, 0.0) + ms
            self._quietly("event destroy", self._raw.event_destroy, start)
            self._quietly("event destroy", self._raw.event_destroy, end)

    # -- red zones and memory -----------------------------------------------------

    def scan_redzones(self) -> list[RedZoneViolation]:
        """Wait for this backend's work, then report every live zone whose bytes changed.

        Each violation goes to the observers, then is logged (``redzone_action="warn"``,
        the default) or raised as one :class:`~metrale_core.RedZoneError`
        (``"raise"``).
        """
        self._check_open()
        forbid_during_capture("scan_redzones()")
        with self._scan_lock:
            violations = self._read_zones()
            self._drop_queued_scans()  # this scan reports every zone the finished ones could have found
        self._report(violations, "scan_redzones()")
        return violations

    def on_redzone_violation(self, observer: Callable[[str, RedZoneViolation], object]) -> None:
        """Call ``observer(backend_name, violation)`` for every violation this backend finds."""
        self._check_open()
        if not callable(observer):
            raise self._invalid_argument("on_redzone_violation", "a callable", observer)
        self._observers.append(observer)

    def _read_zones(self, zones: Sequence[Zone] | None = None) -> list[RedZoneViolation]:
        """Wait for the device, then judge ``zones`` (every live zone when ``None``).

        On the device where the backend runs kernels, else by reads. One scan
        at a time per backend: the scan buffers are shared, and a free waits
        for a scan that may read its zone.
        """
        with self._scan_lock:
            table: bytes | None
            if zones is None:
                self._stats.redzone_scans += 1
                version, zones, table = self._redzones.snapshot(self._scan_table_version)
            else:
                version, table = -1, None
            if not zones:
                return []
            self._sync_device()
            if len(zones) < _DEVICE_SCAN_MIN_ZONES:  # a free's own zones: one read beats three device calls
                return self._scan_by_reads(zones)
            if self._scanner is None:
                self._scanner = self._load_scanner()
            if self._scanner is False:
                return self._scan_by_reads(zones)
            firsts = self._scan_on_device(self._scanner, zones, table, version)
            if firsts is None:
                return []
            return _zone_violations(zones, firsts)

    def _load_scanner(self) -> Kernel | Literal[False]:
        """The shipped ``redzone.redzone_scan`` kernel, or ``False`` where it cannot load (then reads)."""
        try:
            registry = self.load_modules(shipped_modules("redzone"))
            params = registry._images["redzone"].entries["redzone_scan"]
            raw = self._raw.module_function(registry._modules["redzone"], "redzone_scan")
        except MetraleError as exc:
            _log.info("red-zone scans read each zone back: the scan kernel cannot load here (%s)", exc.message)
            return False
        return Kernel(registry, "redzone", "redzone_scan", params, raw)  # not in run_metrics: metrale's own

    def _scan_on_device(
        self, kernel: Kernel, zones: Sequence[Zone], table: bytes | None, version: int
    ) -> list[int] | None:
        """One launch checks every zone; one small copy brings back, per zone, first changed offset + 1 (or 0).

        ``table`` holds the zones' (address, length) pairs, or is ``None``: then
        the device's copy of the live-zone table of ``version`` is used if it
        holds that version, else the table is built from ``zones`` (always
        for ``version`` -1, zones of the caller's choosing). Returns ``None``
        when no zone changed (the common case, judged with one compare of the
        results, not a loop over them).
        """
        n = len(zones)
        table_ptr, grown = self._scan_buffer("table", n * 16)
        result_ptr, _ = self._scan_buffer("result", n * 4)
        stream = self._default_stream._raw
        if table is None and (grown or version < 0 or version != self._scan_table_version):
            table = _zone_table(zones)
        if table is not None:
            self._raw.copy_htod(table_ptr, memoryview(table), stream, pinned=False)
            self._scan_table_version = version  # -1 for a caller's own zones: the next full scan re-copies
        self._launch_scan(kernel, table_ptr, n, result_ptr, stream)
        results = bytearray(n * 4)
        self._raw.copy_dtoh(memoryview(results), result_ptr, stream, pinned=False)
        if results.count(0) == len(results):
            return None
        return list(memoryview(results).cast("I"))

    def _launch_scan(self, kernel: Kernel, table_ptr: int, n: int, result_ptr: int, stream: object) -> None:
        """Queue the scan kernel over the ``n`` zones of the device table at ``table_ptr``."""
        args = pack_args(
            kernel, [table_ptr, ctypes.c_uint32(n), ctypes.c_uint32(self._redzones.fill), result_ptr],
            "red-zone scan", lambda buf: None,
        )
        self._raw.launch(kernel._raw, (n, 1, 1), (256, 1, 1), 0, stream, args)

    def _scan_buffer(self, role: str, nbytes: int) -> tuple[int, bool]:
        """Device scratch for the scan (raw arena memory: on no ledger), kept and grown as needed;
        returns the pointer and whether it was just (re)allocated."""
        with self._lock:
            held = self._scan_buffers.get(role)
            if held is not None and held[1] >= nbytes:
                return held[0], False
            if held is not None:
                self._raw.free(held[0], "arena")
                del self._scan_buffers[role]
            size = max(nbytes * 2, 1 << 16)  # room to grow without a reallocation per scan
            self._scan_buffers[role] = (self._raw.alloc(size, "arena"), size)
            return self._scan_buffers[role][0], True

    def _scan_by_reads(self, zones: Sequence[Zone]) -> list[RedZoneViolation]:
        """The fallback: every zone read into one pinned buffer, one synchronize, judged on the host."""
        total = sum(z.length for z in zones)
        scratch = self._scan_scratch(total)
        stream = self._default_stream._raw
        offset = 0
        for zone in zones:
            self._raw.copy_dtoh(scratch[offset : offset + zone.length], zone.start, stream, pinned=True)
            offset += zone.length
        self._raw.stream_synchronize(stream)
        violations = []
        offset = 0
        for zone in zones:
            violation = self._redzones.judge(zone, bytes(scratch[offset : offset + zone.length]))
            offset += zone.length
            if violation is not None:
                violations.append(violation)
        return violations

    def _scan_scratch(self, nbytes: int) -> memoryview:
        """A pinned host buffer of at least ``nbytes`` for zone reads, kept and grown as needed."""
        with self._lock:
            if self._scratch is None or len(self._scratch[1]) < nbytes:
                if self._scratch is not None:
                    self._raw.free_host(self._scratch[0])
                    self._scratch = None
                self._scratch = self._raw.alloc_host(max(nbytes, 1 << 16))
            return self._scratch[1]

    def _report(self, violations: list[RedZoneViolation], when: str, *, may_raise: bool = True) -> None:
        """Tell the observers, then log or raise, as ``redzone_action`` says."""
        if not violations:
            return
        for violation in violations:
            for observer in self._observers:
                try:
                    observer(self.name, violation)
                except Exception as exc:  # an observer's bug must not hide the violation
                    _log.warning("red-zone observer %r raised %s: %s", observer, type(exc).__name__, exc)
        if self.settings.redzone_action == "raise" and may_raise:
            raise RedZoneError(
                f"{when} found {len(violations)} red-zone violation(s): "
                + "; ".join(v.describe() for v in violations)
                + ". Fix the write past the buffer's bounds (redzone_trace_idx=<index> logs where it was allocated)",
                violations,
            )
        for violation in violations:
            _log.warning("%s (found by %s)", violation.describe(), when)

    def _after_graph_launch(self, stream: Stream | None) -> None:
        self._stats.graph_launches += 1
        if not self.settings.redzone_scan_graphs or active_captures():
            return
        if self.settings.redzone_scan_queued and self._queue_scan(stream):
            return
        self._report(self._read_zones(), "the scan after GraphExec.launch")

    # -- red-zone scans queued behind graph launches (redzone_scan_queued) ------------------------

    def _queue_scan(self, stream: Stream | None) -> bool:
        """Queue a scan of every live zone on ``stream``, behind the graph just launched on it, without
        waiting; report the scans earlier launches queued that have finished (never this launch's own, so
        every backend reports it at the same later call). ``False`` where scans cannot run as kernels
        here (then the caller scans and waits)."""
        finished: list[_Judged] = []
        with self._scan_lock:
            if self._scanner is None:
                self._scanner = self._load_scanner()
            if self._scanner is False:
                return False
            try:
                self._judge_queued_scans(finished, wait=False)  # earlier launches' scans; never this one's
                # the table's bytes only when the zones changed since a slot was last written
                version, zones, table = self._redzones.snapshot(self._queued_table_version)
                if zones:
                    self._stats.redzone_scans += 1
                    n = len(zones)
                    slot = self._scan_slot(n, finished)
                    target = self._stream(stream, "GraphExec.launch")._raw
                    assert slot.host is not None
                    if slot.table_version != version:
                        if table is None:  # unchanged since another slot was written: this one is older
                            table = _zone_table(zones)
                        self._raw.copy_htod(slot.table_ptr, memoryview(table), target, pinned=False)
                        slot.table_version = self._queued_table_version = version
                    self._launch_scan(self._scanner, slot.table_ptr, n, slot.result_ptr, target)
                    self._raw.copy_dtoh(slot.host[1][: n * 4], slot.result_ptr, target, pinned=True)
                    self._raw.event_record(slot.event, target)
                    slot.zones, slot.pending, slot.seq = zones, True, self._stats.graph_launches
                    slot.when = f"graph launch #{slot.seq}"
            except BaseException:
                self._report_judged(finished, may_raise=False)  # logged: the failure to queue is what raises
                raise
        self._report_judged(finished)
        return True

    def _scan_slot(self, n: int, finished: list[_Judged]) -> _QueuedScan:
        """A queued-scan slot not in flight with room for ``n`` zones; when all are in flight, the oldest
        is waited for (its results go to ``finished``)."""
        idle = [slot for slot in self._queued_scans if not slot.pending]
        if not idle and len(self._queued_scans) >= _MAX_QUEUED_SCANS:
            oldest = min(self._queued_scans, key=lambda slot: slot.seq)
            self._judge_queued_scans(finished, wait=True, only=oldest)
            idle = [oldest]
        slot = next((s for s in idle if s.capacity >= n), idle[0] if idle else None)
        if slot is not None and slot.capacity >= n:
            return slot
        if slot is None:
            slot = _QueuedScan(self._raw.event_create())
            self._queued_scans.append(slot)
        self._free_slot_buffers(slot)  # too small (or new): grown, and kept on failure for close() to release
        capacity = max(2 * n, 1024)
        slot.result_ptr = self._raw.alloc(capacity * 4, "arena")
        slot.table_ptr = self._raw.alloc(capacity * 16, "arena")
        slot.host = self._raw.alloc_host(capacity * 4)
        slot.capacity, slot.table_version = capacity, -1
        return slot

    def _free_slot_buffers(self, slot: _QueuedScan) -> None:
        for attr in ("result_ptr", "table_ptr"):
            ptr = getattr(slot, attr)
            if ptr:
                setattr(slot, attr, 0)
                self._quietly("free a scan buffer", self._raw.free, ptr, "arena")
        if slot.host is not None:
            host, slot.host = slot.host, None
            self._quietly("free the scan buffer", self._raw.free_host, host[0])
        slot.capacity = 0

    def _judge_queued_scans(self, finished: list[_Judged], *, wait: bool, only: _QueuedScan | None = None) -> None:
        """Add to ``finished`` the violations found by the queued scans that are done (all of them, waiting,
        when ``wait``), oldest first. A zone whose allocation was freed since is left out: ``free`` read it
        and reported it itself."""
        with self._scan_lock:
            for slot in sorted(self._queued_scans, key=lambda slot: slot.seq):
                if not slot.pending or (only is not None and slot is not only):
                    continue
                if wait:
                    self._raw.event_synchronize(slot.event)
                elif not self._raw.event_query(slot.event):
                    continue
                zones, slot.zones, slot.pending = slot.zones, (), False
                assert slot.host is not None
                results = slot.host[1][: len(zones) * 4]
                if bytes(results).count(0) == len(results):
                    continue
                violations = _zone_violations(zones, results.cast("I"), keep=self._is_live)
                if violations:
                    finished.append((slot.when, violations))

    def _report_judged(self, finished: list[_Judged], *, may_raise: bool = True) -> None:
        """Report the violations of finished queued scans together (one error, naming every launch)."""
        if not finished:
            return
        launches = [when for when, _ in finished]
        named = launches[0] if len(launches) == 1 else ", ".join(launches[:-1]) + " and " + launches[-1]
        scans = "the scan" if len(launches) == 1 else "the scans"
        violations = [v for _, found in finished for v in found]
        self._report(violations, f"{scans} queued after {named} of this backend", may_raise=may_raise)

    def _report_queued_scans(self) -> None:
        """Report the queued scans that have finished, without waiting (at the waits a user makes)."""
        if self._queued_scans and not active_captures():
            finished: list[_Judged] = []
            try:
                self._judge_queued_scans(finished, wait=False)
            finally:
                self._report_judged(finished)

    def _drop_queued_scans(self) -> None:
        """Forget the results of the queued scans that are done: a full scan that has just run (the caller
        holds the scan lock) reports every zone they could have found. Scans still running are kept."""
        for slot in self._queued_scans:
            if slot.pending and self._raw.event_query(slot.event):
                slot.pending, slot.zones = False, ()

    def _release_queued_scans(self) -> None:
        with self._scan_lock:
            for slot in self._queued_scans:
                self._quietly("event destroy", self._raw.event_destroy, slot.event)
                self._free_slot_buffers(slot)
            self._queued_scans.clear()

    def memory_info(self) -> MemoryInfo:
        """Free and total device memory, and what an allocation can really have."""
        self._check_open()
        free, total = self._raw.mem_get_info()
        integrated = self._raw.is_integrated()
        available = read_mem_available() if integrated else None
        return MemoryInfo(
            free=free,
            total=total,
            effective_free=effective_free_bytes(free, available, integrated, total),
            integrated=bool(integrated),
        )

    # -- interop ---------------------------------------------------------------------

    def _export(self, buf: DeviceBuffer, view: DeviceArray, what: str, *, wait: bool = True) -> ForeignMemory:
        """How other libraries address ``buf``: checked live; with ``wait``, after the backend's work."""
        self._check_open()
        self._require_live(buf, what)
        if wait:
            forbid_during_capture(what)
            self._sync_device()
        memory = self._raw.export_memory(buf.ptr, buf.nbytes)
        if buf.kind in ("device", "managed"):  # what free() releases, and so warns about
            with self._lock:
                self._viewed.setdefault(buf.index, weakref.WeakSet()).add(view)
        return memory

    def _export_held(self, index: int, delta: int) -> None:
        """Count the DLPack tensors of allocation ``index`` that a consumer still holds."""
        with self._lock:
            held = self._exported.get(index, 0) + delta
            if held > 0:
                self._exported[index] = held
            else:
                self._exported.pop(index, None)

    def _warn_if_exported(self, buf: DeviceBuffer) -> None:
        with self._lock:
            tensors = self._exported.pop(buf.index, 0)
            views = self._viewed.pop(buf.index, None)
            arrays = len(views) if views is not None else 0
        if tensors or arrays:
            held = " and ".join(
                f"{n} {what}" for n, what in ((arrays, "view(s)"), (tensors, "DLPack tensor(s)")) if n
            )
            _log.warning(
                "free of allocation #%d (%d bytes from %s) while other libraries still hold %s of it: they now "
                "point at freed memory; drop them before freeing",
                buf.index, buf.nbytes, buf.site, held,
            )

    def wrap(self, obj: object) -> DeviceBuffer:
        """Another library's memory as a ``DeviceBuffer`` of kind ``"external"``, without a copy.

        ``obj`` exports the CUDA array interface or DLPack (a CuPy array, a PyTorch tensor) or, on
        a backend whose device memory is host memory (the fake), is a writable C-contiguous
        buffer (a numpy array). metrale's copies, memsets and launches then work on it; it is
        never on the ledger and never freed by metrale: :meth:`unwrap` lets go of it (and of
        ``obj``, which is kept alive until then). Wrapping waits for the device's work, so what
        the producer issued in this context is done.
        """
        self._check_open()
        forbid_during_capture("wrap")
        memory, release = foreign_memory(obj)
        try:
            self._sync_device()
            ptr = self._raw.import_memory(memory)
        except BaseException:
            if release is not None:
                release()
            raise
        site = call_site(self._internal, depth=2)
        buf = DeviceBuffer(ptr, memory.nbytes, "external", next_index(), site, self._self_ref)
        with self._lock:
            self._external[ptr] = (buf, obj, release)
        return buf

    def unwrap(self, buf: DeviceBuffer) -> None:
        """Let go of memory of :meth:`wrap`; the buffer is no longer live here (its owner still frees it)."""
        self._check_open()
        forbid_during_capture("unwrap")
        if not isinstance(buf, DeviceBuffer) or buf.kind != "external":
            raise InvalidBufferError(f"unwrap: expected a DeviceBuffer from wrap(), got {buf!r}")
        with self._lock:
            held = self._external.get(buf.ptr)
            if held is None or held[0].index != buf.index:
                raise InvalidBufferError(f"unwrap: allocation #{buf.index} is not wrapped here; unwrap it once")
            del self._external[buf.ptr]
        self._warn_if_graphed(buf)
        self._forget_external(buf.ptr, held[2])

    def _forget_external(self, ptr: int, release: Callable[[], None] | None) -> None:
        try:
            self._raw.forget_memory(ptr)
        finally:
            if release is not None:
                release()

    # -- memory pressure -------------------------------------------------------------

    def stats(self) -> MemoryStats:
        """Counts and bytes since the backend opened (peaks since the last :meth:`reset_peak`)."""
        self._check_not_closed()
        with self._lock:
            arenas = list(self._arena_objs)
        return self._stats.freeze(arenas)

    def reset_peak(self) -> None:
        """Start the peaks of :meth:`stats` again from the bytes live now."""
        self._check_not_closed()
        self._stats.reset_peak()

    def create_arena(self, capacity: int) -> Arena:
        """An :class:`~metrale_core.Arena` over one new ``alloc_arena`` block of ``capacity`` bytes."""
        self._check_open()
        block = self._alloc(capacity, "arena", "create_arena")
        arena = Arena(block, self._arena_closed)
        with self._lock:
            self._arena_objs.append(arena)
        return arena

    def _arena_closed(self, arena: Arena, block: DeviceBuffer) -> None:
        with self._lock:
            if arena in self._arena_objs:
                self._arena_objs.remove(arena)
                self._stats.arena_allocs += arena.allocs
        if not self._closed:
            self.free_arena(block)

    def on_out_of_memory(self, callback: Callable[[int], object]) -> None:
        """When an allocation runs out of memory, call ``callback(nbytes)``; if it returns a
        true value (it freed memory), the allocation is tried again, at most ``oom_retries`` times."""
        self._check_open()
        if not callable(callback):
            raise self._invalid_argument("on_out_of_memory", "a callable", callback)
        self._oom_callbacks.append(callback)

    def spawn_oom_watchdog(
        self,
        *,
        interval_s: float,
        min_free_bytes: int,
        on_low: Callable[[MemoryInfo], object] | None = None,
    ) -> OomWatchdog:
        """Start an :class:`~metrale_core.OomWatchdog`: a daemon thread that polls
        ``memory_info()`` every ``interval_s`` seconds and warns, once, when
        ``effective_free`` falls under ``min_free_bytes``."""
        self._check_open()
        interval, min_free = check_watchdog_args(interval_s, min_free_bytes, on_low)
        watchdog = OomWatchdog(
            f"{self.name}:{self.ordinal}", self.memory_info,
            lambda: describe_sites(largest_sites(self._ledger.snapshot())),
            interval_s=interval, min_free_bytes=min_free, on_low=on_low,
        )
        with self._lock:
            self._watchdogs = [w for w in self._watchdogs if w.running]
            self._watchdogs.append(watchdog)
        watchdog._start()
        return watchdog

    def save_snapshot(self, path: str | os.PathLike[str]) -> Path:
        """Write the ledger (and its history, with ``memory_history``) and :meth:`stats` to
        ``path`` as JSON, for ``metrale report``; returns the path."""
        self._check_not_closed()
        target = Path(path)
        info: MemoryInfo | None
        try:
            info = self.memory_info()
        except MetraleError:
            info = None
        write_snapshot(target, self.name, self.device_name, self.ordinal, info, self._ledger, self.stats())
        return target

    # -- lifetime -----------------------------------------------------------------

    def close(self) -> None:
        """Abort a capture, sweep the ledger, release everything; idempotent, never raises."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles = list(self._handles.values())
            self._handles.clear()
            arenas = list(self._arenas.values())
            self._arenas.clear()
            hosts = list(self._host.values())
            self._host.clear()
            watchdogs, self._watchdogs = self._watchdogs, []
            external, self._external = self._external, {}
            arena_objs, self._arena_objs = self._arena_objs, []
        for watchdog in watchdogs:
            watchdog.stop()
        for arena in arena_objs:
            arena._take_block()  # its block is among the arena blocks released below
        streams = [h for h in handles if isinstance(h, Stream)] + [self._default_stream]
        for stream in streams:
            capture = stream._capture
            if capture is not None:
                _log.warning("close: aborting the capture in progress on %r", stream)
                stream._capture = None
                capture.finish()
                self._discard_raw_capture(stream)
        self._quietly("synchronize", self._raw.synchronize)
        with self._scan_lock:  # the device is idle: every queued scan is done, and the scan below reports it all
            self._quietly("drop the queued scans", self._drop_queued_scans)
        if self._fault is None and not active_captures():
            try:
                self._report(self._read_zones(), "close()", may_raise=False)
            except MetraleError as exc:
                _log.warning("close: the red-zone scan failed: %s", exc)
        self._sweep()
        for buf in arenas:
            self._quietly("free_arena", self._raw.free, buf.ptr, "arena")
        for ptr, (_, _, release) in external.items():
            self._quietly("unwrap", self._forget_external, ptr, release)
        for hb in hosts:
            hb._closed = True
            self._quietly("free host buffer", self._raw.free_host, hb.ptr)
        if self._scratch is not None:
            self._quietly("free the scan buffer", self._raw.free_host, self._scratch[0])
            self._scratch = None
        for ptr, _ in self._scan_buffers.values():
            self._quietly("free a scan buffer", self._raw.free, ptr, "arena")
        self._scan_buffers.clear()
        self._release_queued_scans()
        for kind in (GraphExec, Graph, Event, Stream):  # dependents first
            for handle in handles:
                if isinstance(handle, kind):
                    handle._closed = True
                    self._quietly(f"destroy {kind.__name__}", getattr(self._raw, kind._destroy_op), handle._raw)
        for registry in list(self._registries):
            registry.close()
        for _, start, end in self._metrics.pending:
            self._quietly("event destroy", self._raw.event_destroy, start)
            self._quietly("event destroy", self._raw.event_destroy, end)
        self._metrics.pending.clear()
        self._default_stream._closed = True
        self._quietly("destroy default stream", self._raw.stream_destroy, self._default_stream._raw)
        try:
            self._target.close()
        except Exception as exc:  # close never raises, whatever a plugin does
            _log.warning("close of %s:%d: the backend's raw close failed: %s", self.name, self.ordinal, exc)

    def _quietly(self, what: str, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except MetraleError as exc:
            # after a device fault every call fails: that is expected, not news
            level = logging.DEBUG if self._fault is not None else logging.WARNING
            _log.log(level, "%s failed: %s", what, exc)

    def __enter__(self) -> GpuBackend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<metrale {type(self).__name__} {self.name}:{self.ordinal} ({state})>"
