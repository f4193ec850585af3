"""The lane: the allocator's hot path, device, managed and arena memory from the raw call to the ledger and back.

Written once, here, and compiled as well as run as Python (``_lane``, with ``_lane.pxd`` beside it:
docs/building.md); compiled, ``GpuBackend.alloc`` and ``free`` run at C level, red zones included: the gate, the
capture rule, the handle, the ledger, the stats, the zone table and the quarantine called at C level (their twins'
``.pxd``), a buffer's fields read in place (``_device/_fields.pxd``), the plugin through its C device calls where it
offers them (``RawDevice.device_calls``; ``_lane.pxd``), else through its methods. A C call that declined is made
through the method, which does it or raises.

- `DeviceLane.alloc` and `DeviceLane.free` are ``GpuBackend.alloc`` and ``GpuBackend.free``: they pass the gate.
  `DeviceLane.allocate` is every other allocation of the allocator (managed memory, arena blocks, a
  ``stacklevel``'s site), inside its caller's gate.
- The commit (`DeviceLane._commit`), judged in this one place: the backend is open now, or nothing of the
  allocation remains. A record on the ledger is committed by the ledger under its lock (`Ledger.commit`), which
  the sweep's drain takes too: it is drained at close, or never added. An arena block, which is on no ledger,
  is committed under the holdings' lock, which the close's release of the blocks takes. A zoned allocation's raw
  base goes first, so a sweep that drains its record finds it.
- Raw memory's reclaim-and-retry (``rawmem.py``) serves what the driver refuses; a pool's piece freed with
  ``GpuBackend.free`` goes to the pool front (``pools.py``); a host buffer to the allocator's ``free_host``.
- Red zones: a zoned allocation takes a block kept for reuse from the quarantine or raw memory from the driver,
  fills its zones on the default stream (lead, trail, then a recycled block's bytes, as the zone guard fills),
  and puts them in the zone table before its commit; its free hands it to the quarantine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from .._device.args import positive_size
from .._device.context import DeviceContext
from .._device.guarded import raise_raw
from .._device.handles import HostBuffer
from .._device.raw import DEVICE_CALLS
from .._errors import InvalidBufferError, MetraleError, OutOfMemoryError
from .._redzones.zone import too_big
from .._types import WORD_LIMIT, AllocKind
from .holdings import Holdings
from .rawmem import RawMemory
from .records import INDEXES, INDEXES_LOCK_FREE, next_index

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

if not cython.compiled:  # (compiled: what _lane.pxd cimports, a buffer as _fields.pxd lays it out, the C calls)
    from .._device.buffer import DeviceBuffer
    from .._device.capture import forbid_during_capture
    from .._device.gate import Gate
    from .._device.stats import KIND_DEVICE, StatsCounter
    from .._redzones.layout import RedZones
    from .ledger import Ledger
    from .quarantine import Quarantine
    from .sites import call_site

    make_buffer = DeviceBuffer._make

    def check_fields(lane: str) -> None:
        """(Compiled: refuse to load where the handles' fields are not where the lane reads them in place.)"""

    def lane_calls(lane: DeviceLane, plugin: object, name: bytes, log: logging.Logger) -> object:
        """The plugin's device calls, kept by the lane (compiled only: as Python, none asked for)."""
        return None

    def call_alloc(lane: DeviceLane, nbytes: int) -> int | None:
        """The plugin's C ``alloc``: the address, ``None`` where declined (never called as Python)."""
        return None

    def call_free(lane: DeviceLane, ptr: int) -> bool:
        """The plugin's C ``free``: whether it freed (never called as Python)."""
        return False

    def call_memset(lane: DeviceLane, ptr: int, value: int, nbytes: int, stream: object) -> bool:
        """The plugin's C ``memset``: whether it filled (never called as Python)."""
        return False

if TYPE_CHECKING:  # (as modules where _lane.pxd cimports the class)
    from .._device import stats as counters
    from .._redzones.guard import ZoneGuard
    from . import pools as fronts
    from . import quarantine as quarantines

__all__ = ["DeviceLane"]

check_fields("device lane")

_log = logging.getLogger("metrale")

#: The capsule name of the plugin's device calls.
_CAPSULE_NAME: Final = DEVICE_CALLS.encode()

#: The frames of this module's own on a call site's walk: as Python, the method that asks (compiled: none).
_OWN: Final = 0 if cython.compiled else 1


def _compiled_parts(gate: object, ledger: object, stats: object, zones: object, quarantine: object) -> None:
    """Refuse pure parts for the compiled lane, which calls them at C level (one ``pure`` setting picks them all)."""
    if not isinstance(gate, Gate):
        raise TypeError(f"the compiled lane needs the compiled gate, got {type(gate)!r}: one `pure` setting picks both")
    if not isinstance(ledger, Ledger) or not isinstance(stats, StatsCounter):
        raise TypeError(f"the compiled lane needs the compiled ledger and stats, got {type(ledger)!r} and "
                        f"{type(stats)!r}: one `pure` setting picks them all")
    if zones is not None and (not isinstance(zones, RedZones) or not isinstance(quarantine, Quarantine)):
        raise TypeError(f"the compiled lane needs the compiled zone table and quarantine, got {type(zones)!r} and "
                        f"{type(quarantine)!r}: one `pure` setting picks them all")


class DeviceLane:
    """The allocator's hot path: allocations and frees of device, managed and arena memory, committed here."""

    __slots__ = ("_calls", "_calls_memset", "_capsule", "_ctx", "_fill_stream", "_frames", "_free_host", "_gate",
                 "_guard", "_holdings", "_indexes", "_internal", "_ledger", "_pools", "_quarantine", "_raw",
                 "_raw_base", "_rawmem", "_ref", "_releases", "_stats", "_trace_idx", "_zeroes", "_zones")

    def __init__(
        self, ctx: DeviceContext, holdings: Holdings, stats: counters.StatsCounter, guard: ZoneGuard,
        quarantine: quarantines.Quarantine, raw: RawMemory, pools: fronts.PoolFront,
        free_host: Callable[[HostBuffer, str], None], caller_frames: int = 0,
    ) -> None:
        """``caller_frames``: frames above `alloc` that are the backend's own for certain, passed over by the call
        site's walk without a look (the facade's ``GpuBackend.alloc``, where it runs as Python: it says so)."""
        zones = guard.zones if guard.zones.size > 0 else None
        if cython.compiled:  # (as Python, parts of either build do)
            _compiled_parts(ctx.gate, holdings.ledger, stats, zones, quarantine)
        self._ctx = ctx
        self._gate = ctx.gate
        self._holdings = holdings
        self._ledger = holdings.ledger
        self._raw_base = holdings.raw_base
        self._releases = holdings.releases
        self._stats = stats
        self._guard = guard
        self._quarantine = quarantine
        self._rawmem = raw
        self._pools = pools
        self._free_host = free_host
        self._raw = ctx.raw
        self._ref = ctx.ref
        self._internal = ctx.internal
        self._indexes = INDEXES if INDEXES_LOCK_FREE else None  # (its next item taken at C level, compiled)
        self._frames = _OWN + max(0, caller_frames)
        self._trace_idx = ctx.settings.redzone_trace_idx
        #: Red zones (``None`` where they are off): the table, the default stream's handle where the zones are
        #: filled, and whether a recycled block is zeroed first (fresh memory reads as zeros).
        self._zones = zones
        self._fill_stream = guard.fill_stream
        self._zeroes = bool(ctx.raw.fresh_memory_reads_zeros())
        #: The plugin's C device calls (none as Python): the capsule kept alive as long as the lane calls them
        #: (compiled: their struct in ``_calls``, whether it holds ``memset`` in ``_calls_memset``).
        self._capsule = lane_calls(self, ctx.plugin, _CAPSULE_NAME, _log)

    # -- allocation ---------------------------------------------------------------------------

    def alloc(self, nbytes: object) -> DeviceBuffer:
        """``GpuBackend.alloc``."""
        gate = self._gate
        cell = gate.enter_c(False)
        try:
            forbid_during_capture("alloc", cell.flag)
            return self._alloc(nbytes, "device", "alloc", None, self._frames)
        finally:
            gate.leave_c(cell)

    def allocate(self, nbytes: object, kind: AllocKind, what: str, site: str | None = None) -> DeviceBuffer:
        """Device memory of ``kind`` (managed memory, an arena block, a device allocation whose ``stacklevel``
        named its site), inside the caller's gate: on the ledger unless it is arena memory. ``site``: the caller's
        own choice (``stacklevel``), else the first frame outside metrale and ``site_skip``."""
        forbid_during_capture(what)
        return self._alloc(nbytes, kind, what, site, _OWN)

    def _alloc(self, nbytes: object, kind: AllocKind, what: str, site: str | None, frames: int) -> DeviceBuffer:
        # the size rule (positive_size) with its common case written out
        n = nbytes if type(nbytes) is int and 0 < nbytes < WORD_LIMIT else positive_size(nbytes, what)
        index = next_index() if self._indexes is None else next(self._indexes)
        if site is None:
            site = call_site(self._internal, frames)
        zones = self._zones
        if zones is not None and kind == "device" and index >= zones.min_idx and not index % zones.sample:
            return self._zoned(n, index, site, zones._lead_bytes, what)  # (as `RedZones.layout` lays it out)
        ctx = self._ctx
        try:  # the raw call straight to the plugin (its C call first), with the guarded layer's rule for its errors
            raw_ptr = call_alloc(self, n) if kind == "device" else None
            if raw_ptr is None:  # no C call, or it declined
                raw_ptr = ctx.plugin.alloc(n, kind)
        except OutOfMemoryError as exc:
            raw_ptr = self._rawmem.alloc(n, n, kind, what, exc)
        except Exception as exc:
            raise_raw(ctx, ctx.name, "alloc", exc)
        return self._commit(make_buffer(raw_ptr, n, kind, index, site, self._ref), index, n, kind, raw_ptr, False,
                            site, what)

    def _zoned(self, n: int, index: int, site: str, lead: int, what: str) -> DeviceBuffer:
        """A device allocation that gets red zones (``lead``: its leading band's bytes, 0 for none): a block kept
        for reuse or new raw memory, its zones filled and watched, then its commit."""
        zones = self._zones
        assert zones is not None
        raw_bytes = lead + n + zones.size
        if raw_bytes >= WORD_LIMIT:
            raise too_big(raw_bytes, n, what)
        raw_ptr = self._quarantine.reuse_c(raw_bytes)
        recycled = raw_ptr is not None
        if raw_ptr is None:
            raw_ptr = self._rawmem.alloc(raw_bytes, n, "device", what)
        ptr = raw_ptr + lead
        buf = make_buffer(ptr, n, "device", index, site, self._ref)
        try:  # the zone guard's fills, in its order: lead, trail, then the recycled block's bytes
            if lead:
                self._memset(raw_ptr, zones.fill, lead)
            self._memset(ptr + n, zones.fill, zones.size)
            if recycled and self._zeroes:
                self._memset(ptr, 0, n)
        except MetraleError:
            self._rawmem.release_quietly(raw_ptr, "device")
            raise
        zones.add_c(buf, index, ptr, n)
        return self._commit(buf, index, n, "device", raw_ptr, True, site, what)

    def _memset(self, ptr: int, value: int, nbytes: int) -> None:
        """A fill on the default stream: through the plugin's C ``memset`` where it has one and takes it, else
        through the guarded layer (as the zone guard fills); a typed error either way."""
        done = False
        try:
            done = call_memset(self, ptr, value, nbytes, self._fill_stream)
        except Exception as exc:
            ctx = self._ctx
            raise_raw(ctx, ctx.name, "memset", exc)
        if not done:
            self._raw.memset(ptr, value, nbytes, self._fill_stream)

    def _commit(
        self, buf: DeviceBuffer, index: int, n: int, kind: AllocKind, raw_ptr: int, zoned: bool, site: str, what: str
    ) -> DeviceBuffer:
        """The commit of ``buf`` (its raw memory at ``raw_ptr``): the backend is open now, or nothing of this
        allocation remains (the module's docstring says where each kind is judged). The stats count it first, so
        a sweep's release never comes before."""
        if zoned:
            self._raw_base[index] = raw_ptr
        if kind == "device":
            self._stats.allocated_c(KIND_DEVICE, n)
        else:
            self._stats.allocated(kind, n)
        try:
            if kind == "arena":
                holdings = self._holdings
                with holdings.lock:
                    committed = not self._gate.closed
                    if committed:
                        holdings.arena_blocks[index] = buf
            else:
                committed = self._ledger.commit(index, buf, self._gate)
        except Exception:  # (the history's stack walk or event failed: nothing of it was added)
            self._uncommitted(index, n, kind, raw_ptr, zoned)
            raise
        if not committed:
            self._uncommitted(index, n, kind, raw_ptr, zoned)
            raise self._ctx.closed_error()
        if self._trace_idx is not None and self._trace_idx == index:
            self._rawmem.trace(index, what, n, site)
        return buf

    def _uncommitted(self, index: int, n: int, kind: AllocKind, raw_ptr: int, zoned: bool) -> None:
        """Nothing of an allocation that did not commit remains: off the stats, its zones unwatched, its memory
        released."""
        self._stats.released(kind, n)
        if zoned:
            self._raw_base.pop(index, None)
            self._guard.forget(index)
        self._rawmem.release_quietly(raw_ptr, kind)

    # -- release --------------------------------------------------------------------------------

    def free(self, buf: object) -> None:
        """``GpuBackend.free``: a ``DeviceBuffer`` on the ledger (its record off first, then the memory), a pool's
        piece, or a ``HostBuffer``; from a finalizer that a collection runs in a call of this backend, at the
        thread's next call (`Gate.defer`)."""
        gate = self._gate
        if gate.interrupted():
            gate.defer(self.free, buf)
            return
        cell = gate.enter_c(False)
        try:
            forbid_during_capture("free", cell.flag)  # first: before anything of ``buf`` is read
            handle = buf if type(buf) is DeviceBuffer else None  # (compiled: its fields read in place)
            if handle is not None and handle.kind == "device":  # (the common case)
                self._release(handle, handle.ptr, handle.index, handle.nbytes, handle._owner)
            else:
                self._free_other(buf)
        finally:
            gate.leave_c(cell)

    def _free_other(self, buf: object) -> None:
        """`free` of anything but a device buffer metrale made: a host buffer, a pool's piece, managed memory, or
        the typed error of what ``free()`` never takes."""
        if isinstance(buf, HostBuffer):
            self._free_host(buf, "free")
            return
        if not isinstance(buf, DeviceBuffer):
            raise InvalidBufferError(f"free: expected a DeviceBuffer or HostBuffer, got {buf!r}")
        if buf.kind == "arena":
            with self._holdings.lock:
                block = buf.index in self._holdings.arena_blocks
            if block:
                raise InvalidBufferError(
                    f"free: allocation #{buf.index} is an arena block of alloc_arena(); release it with free_arena()"
                )
            raise InvalidBufferError(
                f"free: allocation #{buf.index} is arena memory: a piece of an Arena is released with the "
                f"Arena's reset() or close(), all pieces at once, and an Arena made by create_arena() with "
                f"its close(); free() never takes arena memory"
            )
        if buf.kind == "pool":
            self._pools.free_piece(None, buf, None, "free")
            return
        if buf.kind == "external":
            raise InvalidBufferError(
                f"free: allocation #{buf.index} is another library's memory (from wrap()); metrale never "
                f"frees it: let go of it with unwrap(), then free it where it came from"
            )
        self._release(buf, buf.ptr, buf.index, buf.nbytes, buf._owner)

    def _release(self, buf: DeviceBuffer, ptr: int, index: int, n: int, owner: object) -> None:
        """The free of device or managed memory: its record off the ledger (refused, changing nothing, where it is
        not there), the stats, the observers, then its memory (a zoned one's to the quarantine)."""
        record = self._ledger.take(index, ptr, n) if owner is self._ref else None
        if record is None:
            raise InvalidBufferError(
                f"free: allocation #{index} ({n} bytes at {ptr:#x}, from {buf.site}) is not on this backend's "
                f"ledger: already freed, swept, or not from this backend. Free each buffer once"
            )
        kind = record.kind  # (the record's: ``buf`` may be an equal handle)
        if kind == "pool":  # an equal handle of a pool's piece: back to its pool
            self._pools.piece_taken(buf, record, None)
            return
        # off the ledger: off the stats, whatever the release says
        if kind == "device":
            self._stats.released_c(KIND_DEVICE, n)
        else:
            self._stats.released(kind, n)
        observers = self._releases.active
        if observers:
            for observer in observers:
                observer(buf)
        memory: AllocKind = "managed" if kind == "managed" else "device"
        if self._zones is not None:
            raw_ptr = self._raw_base.pop(index, None)
            if raw_ptr is not None:  # zoned (a racing free of the same buffer found no record above)
                self._quarantine.free_c(buf, index, n, raw_ptr, memory)
                return
        ctx = self._ctx
        try:  # the raw call straight to the plugin (its C call first), with the guarded layer's rule for its errors
            # (the C free is of device memory only, as the C alloc; managed memory, an equal handle: the method)
            if record is not buf or memory != "device" or not call_free(self, ptr):  # or declined
                ctx.plugin.free(ptr, memory)
        except Exception as exc:
            raise_raw(ctx, ctx.name, "free", exc)
