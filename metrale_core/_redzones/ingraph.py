"""In-graph red-zone checks: the verdict kernel captured as the last node of every graph, the
device-side zone table it reads, and the verdicts it leaves in mapped host memory.

With red zones and ``redzone_scan_graphs`` on, and where the backend maps pinned host memory
([`alloc_host_mapped`][metrale_core.RawDevice.alloc_host_mapped]), every capture ends with one launch of the
shipped ``redzone.redzone_verdict`` kernel. Its three parameters never change, so the graph is
never instantiated again when zones come and go:

- the *descriptor* (device memory, one per backend): the zone table's address, the zone count,
  the table's version and the fill byte, written with the table;
- the graph's *state* (device memory, 16 bytes): the kernel's block counter, bad-zone
  accumulator and sequence number (launches of one executable graph never overlap, so its
  counter is never shared by two launches at once; two executable graphs of one graph share
  the state, and running them at once on two streams may merge or delay their verdicts);
- the graph's *slot* (mapped pinned host memory, 32 bytes): the verdict (bad zones, the table
  version scanned), then, after ``__threadfence_system()``, the sequence number. The host judges
  a launch by reading those words: no event, no copy, no wait.

The table is written only while no capture runs anywhere, stream-ordered on the stream of the
launch that needs it, after every earlier launch on other streams (an event each) and before
every later one (they wait for the write's event), so no scan ever reads a table being written.
Zones leave the table only once their memory is about to be released, after the device went
idle, and the table is written again at once, so no scan ever reads released memory.

- `open_checks`: the checks of one backend, opened on first use, or why graphs are not checked inside.
- `GraphChecks`: the pages of slots, the table and its writes, the launches issued and judged.
- `GraphCheck`: the check captured into one graph: its slot, its launches.
"""

from __future__ import annotations

import logging
import struct
from typing import TYPE_CHECKING, Final, final

from .._device.capture import GraphKernels, active_captures
from .._device.context import DeviceContext
from .._errors import MetraleError
from .._types import LaunchArg, Param
from .scanner import Scanner

if TYPE_CHECKING:
    from .._device.handles import Stream
    from .layout import RedZones

__all__ = ["GRID", "GraphCheck", "GraphChecks", "open_checks"]

_log = logging.getLogger("metrale")

#: The verdict kernel's grid (blocks beyond the zone count return at once) and block.
GRID: Final = 1024
_BLOCK: Final = 256
_SLOT_BYTES: Final = 32  # u64 words: bad zones, version scanned, sequence number, spare
_STATE_BYTES: Final = 16
_SLOTS_PER_PAGE: Final = 128
_DESC = struct.Struct("<4Q")  # table address, zone count, version, fill


@final
class _Page:
    """Mapped host memory for `_SLOTS_PER_PAGE` slots and the device memory of their states."""

    __slots__ = ("device_ptr", "free", "host_ptr", "state_ptr", "words")

    def __init__(self, host_ptr: int, view: memoryview, device_ptr: int, state_ptr: int) -> None:
        self.host_ptr = host_ptr
        self.words = view.cast("Q")  # each read goes to the memory: the kernel's writes show at once
        self.device_ptr = device_ptr
        self.state_ptr = state_ptr
        self.free = list(range(_SLOTS_PER_PAGE - 1, -1, -1))


@final
class GraphCheck:
    """The check captured into one graph (shared by its executable graphs): its slot, and how many
    of its launches the host issued and has judged."""

    __slots__ = ("_at", "_page", "judged", "kernels", "launched", "nested", "number", "refs")

    def __init__(self, page: _Page, index: int, number: int) -> None:
        self._page = page
        self._at = index * (_SLOT_BYTES // 8)
        #: Its graph's number (``graph #N``).
        self.number = number
        #: Its graph's kernel nodes (set as its capture ends): the suspects of what its verdict finds.
        self.kernels = GraphKernels(number, ())
        seq = page.words[self._at + 2]
        #: Launches issued (from the slot's sequence number on, as a slot is reused).
        self.launched = seq
        #: The sequence number last judged.
        self.judged = seq
        #: Handles (the graph and its executable graphs) that hold it.
        self.refs = 1
        #: Launched into another capture: other graphs replay it, so its slot is never reused.
        self.nested = False

    @property
    def index(self) -> int:
        return self._at // (_SLOT_BYTES // 8)

    @property
    def seq(self) -> int:
        """Verdicts written so far (the kernel writes it last)."""
        return self._page.words[self._at + 2]

    @property
    def bad(self) -> int:
        """Bad zones of the latest verdict."""
        return self._page.words[self._at]

    @property
    def version(self) -> int:
        """The zone-table version the latest verdict scanned."""
        return self._page.words[self._at + 1]

    def args(self, desc: Param, state: Param, slot: Param, desc_ptr: int) -> list[LaunchArg]:
        state_ptr = self._page.state_ptr + self.index * _STATE_BYTES
        slot_ptr = self._page.device_ptr + self._at * 8
        return [
            LaunchArg(desc, desc_ptr.to_bytes(8, "little"), desc_ptr),
            LaunchArg(state, state_ptr.to_bytes(8, "little"), state_ptr),
            LaunchArg(slot, slot_ptr.to_bytes(8, "little"), slot_ptr),
        ]


@final
class GraphChecks:
    """The in-graph checks of one backend (the zone guard's). Callers hold the guard's lock."""

    __slots__ = (
        "_capacity", "_ctx", "_desc_ptr", "_function", "_hop", "_number", "_ordered", "_pages", "_params",
        "_pending", "_raw", "_readers", "_retiring", "_table_ptr", "_write_event", "_written", "_zones",
    )

    def __init__(self, ctx: DeviceContext, zones: RedZones, function: object, params: tuple[Param, ...]) -> None:
        self._ctx = ctx
        self._raw = ctx.raw
        self._zones = zones
        self._function = function
        self._params = params  # .u64 desc, .u64 state, .u64 slot
        self._pages: list[_Page] = []
        self._desc_ptr = 0
        self._table_ptr = 0
        self._capacity = 0
        self._written = -1  # the table version the device holds; -1: none yet
        self._write_event: object | None = None
        self._hop: object | None = None
        self._readers: set[Stream] = set()  # streams that launched checked graphs since the last write
        self._ordered: set[Stream] = set()  # streams ordered after the last write
        self._pending: dict[int, GraphCheck] = {}  # id -> a check with launches not judged
        self._retiring: list[GraphCheck] = []  # dropped with launches still in flight: slots not free yet
        self._number = 0

    def open(self, default: Stream) -> None:
        """Allocate the descriptor, the events and the first page; raises where the backend cannot
        (``CUDA_ERROR_NOT_SUPPORTED``: it maps no host memory). Nothing is kept on a failure."""
        try:
            self._new_page(default)
            self._desc_ptr = self._raw.alloc(256, "arena")
            self._write_event = self._raw.event_create()
            self._hop = self._raw.event_create()
        except MetraleError:
            self.release()
            raise

    def _new_page(self, default: Stream) -> _Page:
        raw = self._raw
        host_ptr, view, device_ptr = raw.alloc_host_mapped(_SLOTS_PER_PAGE * _SLOT_BYTES)
        try:
            state_ptr = raw.alloc(_SLOTS_PER_PAGE * _STATE_BYTES, "arena")
        except MetraleError:
            self._ctx.quietly("free a red-zone verdict page", raw.free_host, host_ptr)
            raise
        page = _Page(host_ptr, view, device_ptr, state_ptr)
        self._pages.append(page)  # released with the others, whatever comes next
        view[:] = bytes(len(view))
        raw.memset(state_ptr, 0, _SLOTS_PER_PAGE * _STATE_BYTES, default.raw)
        raw.stream_synchronize(default.raw)  # zeroed before any graph can run its check
        return page

    # -- captures --------------------------------------------------------------------------

    def reserve(self, default: Stream, number: int = 0) -> GraphCheck | None:
        """A check for a capture about to begin (before its record is entered: allocations are
        allowed unless another capture runs); ``None`` where none can be had now. ``number``: its graph's
        (``graph #N``, the backend's count of captures); 0: these checks' own count."""
        self._retiring = [c for c in self._retiring if not self._recycle(c)]
        page = next((p for p in self._pages if p.free), None)
        idle = not active_captures()
        if page is None:
            if not idle:
                _log.info("red zones: no free in-graph check slot while another capture runs; this graph is not "
                          "checked inside (scan_redzones() still checks its zones)")
                return None
            page = self._new_page(default)
        if idle and self._written != self._zones.version:
            self._write(default)  # launches of this graph while captures run need no write then
        self._number += 1
        return GraphCheck(page, page.free.pop(), number or self._number)

    def seal(self, check: GraphCheck, stream: object) -> None:
        """Append the verdict kernel to the capture on raw ``stream``: the graph's last node."""
        desc, state, slot = self._params
        self._raw.launch(self._function, (GRID, 1, 1), (_BLOCK, 1, 1), 0, stream,
                         check.args(desc, state, slot, self._desc_ptr))

    def drop(self, check: GraphCheck) -> None:
        """A handle holding ``check`` closed; the last one frees its slot once its launches are done."""
        check.refs -= 1
        if check.refs > 0:
            return
        if not self._recycle(check):  # still pending: its verdict is judged all the same, then its slot goes
            self._retiring.append(check)

    def _recycle(self, check: GraphCheck) -> bool:
        if check.nested:
            return True  # other graphs replay its node: the slot stays taken, never reused
        if check.seq < check.launched or id(check) in self._pending:
            return False
        check._page.free.append(check.index)
        return True

    # -- launches ----------------------------------------------------------------------------

    def before_launch(self, check: GraphCheck, stream: Stream) -> None:
        """Before a checked graph is launched on ``stream``: the table current and ordered before it."""
        if stream.capture is not None:
            check.nested = True  # replayed by the graph being captured: judged with it, counted by none
            return
        if self._written != self._zones.version and not active_captures():
            self._write(stream)
        elif self._written >= 0 and stream not in self._ordered:
            assert self._write_event is not None
            self._raw.stream_wait_event(stream.raw, self._write_event)
            self._ordered.add(stream)
        self._readers.add(stream)

    def launched(self, check: GraphCheck, stream: Stream) -> None:
        if stream.capture is None:
            check.launched += 1
            self._pending[id(check)] = check

    def finished(self, only: GraphCheck | None = None) -> list[GraphCheck]:
        """The checks (of ``only``, or all) whose every issued launch has left its verdict, taken off the
        pending list; each one's `GraphCheck.judged` moves to its sequence number, and those whose
        latest verdict found bad zones are returned."""
        bad: list[GraphCheck] = []
        for key, check in list(self._pending.items()):
            if only is not None and check is not only:
                continue
            seq = check.seq
            if seq < check.launched:
                continue
            del self._pending[key]
            if seq > check.judged:
                check.judged = seq
                if check.bad:
                    bad.append(check)
        return bad

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    # -- the table -----------------------------------------------------------------------------

    def zones_released(self, default: Stream) -> None:
        """Zones left the table and their memory goes (the device is idle): write the table now, so no
        launch made later, even while a capture runs somewhere, reads the old one."""
        if self._written >= 0 and self._written != self._zones.version:
            self._readers.clear()
            self._write(default)

    def _write(self, stream: Stream) -> None:
        """Write the table and the descriptor on ``stream``, after every launch on other streams since
        the last write; later launches on other streams wait for it (`before_launch`)."""
        raw = self._raw
        assert self._write_event is not None and self._hop is not None
        version, count, table = self._zones.table()
        readers = [r for r in self._readers if r is not stream]
        if any(r.closed for r in readers):  # its work may still run, and its stream can no longer be recorded
            raw.synchronize()
            readers = []
        for reader in readers:
            raw.event_record(self._hop, reader.raw)
            raw.stream_wait_event(stream.raw, self._hop)
        if len(table) > self._capacity:
            if self._table_ptr:
                raw.synchronize()  # every scan reading the old table is done before it goes
                self._ctx.quietly("free the red-zone table", raw.free, self._table_ptr, "arena")
                self._table_ptr, self._capacity = 0, 0
            capacity = max(2 * len(table), 1 << 14)
            self._table_ptr = raw.alloc(capacity, "arena")
            self._capacity = capacity
        if table:
            raw.copy_htod(self._table_ptr, memoryview(table), stream.raw, pinned=False)
        desc = _DESC.pack(self._table_ptr, count, version, self._zones.fill)
        raw.copy_htod(self._desc_ptr, memoryview(desc), stream.raw, pinned=False)
        raw.event_record(self._write_event, stream.raw)
        self._written = version
        self._readers = set()
        self._ordered = {stream}

    # -- close -----------------------------------------------------------------------------------

    def release(self) -> None:
        """Release the pages, the table, the descriptor and the events (at close: the device is idle)."""
        ctx, raw = self._ctx, self._raw
        for page in self._pages:
            ctx.quietly("free a red-zone verdict page", raw.free_host, page.host_ptr)
            ctx.quietly("free red-zone verdict states", raw.free, page.state_ptr, "arena")
        self._pages.clear()
        for ptr in (self._table_ptr, self._desc_ptr):
            if ptr:
                ctx.quietly("free the red-zone table", raw.free, ptr, "arena")
        self._table_ptr = self._desc_ptr = self._capacity = 0
        for event in (self._write_event, self._hop):
            if event is not None:
                ctx.quietly("event destroy", raw.event_destroy, event)
        self._write_event = self._hop = None
        self._pending.clear()
        self._retiring.clear()
        self._readers.clear()
        self._ordered.clear()


def open_checks(ctx: DeviceContext, zones: RedZones, scanner: Scanner, default: Stream) -> GraphChecks | str | None:
    """The in-graph checks of one backend, opened; else why graphs are not checked inside.

    - ``"off"``: red zones or ``redzone_scan_graphs`` are off.
    - Another reason: the backend cannot (no kernels, no verdict kernel, no mapped host memory).
      The queued scans stand in.
    - ``None``: a capture runs; opening allocates, so it is tried again at the next one.
    """
    settings = ctx.settings
    if settings.redzone == 0 or not settings.redzone_scan_graphs:
        return "off"
    kernel = scanner.kernel()
    if kernel is False:
        return "the scan kernel cannot run here"
    if kernel.verdict is None:
        return "no in-graph check kernel"
    if active_captures():
        return None
    function, params = kernel.verdict
    checks = GraphChecks(ctx, zones, function, params)
    try:
        checks.open(default)
    except MetraleError as exc:
        off = f"no mapped host memory here ({exc.message})"
        _log.info("red zones: graphs are checked by scans queued behind each launch, not inside the graph: %s", off)
        return off
    return checks
