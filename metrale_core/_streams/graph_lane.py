"""The graph lane: ``GraphExec.launch``, the replay of an executable graph, through the gate.

Written once, here, and compiled as well as run as Python (``_graph_lane``, with ``_graph_lane.pxd`` beside it:
docs/building.md). It is the graph front's launch where the launch is the plain one:

- `GraphLane.launch` counts the call in and out of the gate, refuses a closed graph, and finds the graph's operands
  live: its buffers by the ledger (as a whole, skipped while no record came off since they were last found so: the
  ledger's ``taken`` count), its kernels' modules loaded, its host buffers open.
- The plain launch it does itself: operands live, no red-zone check in the graph, no other backend's buffers, the
  default stream or a live stream of this backend with no capture on it, no scan after graphs. Compiled, the gate is
  passed at C level and the plugin called through its C ``graph_launch`` where it offers one
  (``RawDevice.device_calls``; a call it declines is made through the method).
- Every other launch goes to the graph front (`GraphFront.launch_checked`), with what the lane found of its
  operands: the zone guard's part, a capture's record, the error that names an operand gone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

from .._device.context import DeviceContext
from .._device.guarded import raise_raw
from .._device.raw import DEVICE_CALLS
from .._redzones.guard import ZoneGuard

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

if not cython.compiled:  # (compiled: the handles as _fields.pxd lays them out; the plugin's C graph_launch)
    from .._device.buffer import DeviceBuffer
    from .._device.handles import GraphExec, Stream

    def check_fields(lane: str) -> None:
        """(Compiled: refuse to load where the handles' fields are not where the lane reads them in place.)"""

    def graph_launch_calls(lane: GraphLane, plugin: object, name: bytes) -> object | None:
        """The plugin's C functions where they hold ``graph_launch`` (compiled only: as Python, none)."""
        return None

    def call_graph_launch(lane: GraphLane, graph: object, stream: object) -> int:
        """The plugin's C ``graph_launch``: 0 where done, 1 where declined (never called as Python)."""
        return 1

if TYPE_CHECKING:  # (as modules: compiled, ``Ledger`` and ``StatsCounter`` are those _graph_lane.pxd cimports)
    from .._device import stats as counters
    from .._memory import ledger as ledgers

__all__ = ["GraphLane", "GraphLaneParts", "GraphWork"]

check_fields("graph lane")

#: The name of the capsule of the plugin's C functions.
_CAPSULE: Final = DEVICE_CALLS.encode()


class GraphWork(Protocol):
    """What a graph lane asks of the front it fronts (``graphs.GraphFront``)."""

    def launch_checked(self, graph: GraphExec, stream: Stream | None, live: bool) -> None:
        """A launch inside the gate that is not the plain one: the whole work, the errors included (``live``:
        whether the lane found every operand live)."""


class GraphLaneParts(NamedTuple):
    """What the graph front hands its lane: the parts a launch touches, each still its owner's.

    - ``ctx``: the device context (its gate, the plugin).
    - ``ledger``: the holdings' ledger (its ``taken`` count and ``holds_all``: the graph's buffers live).
    - ``stats``: the backend's counters (``graph_launches``).
    - ``guard``: the zone guard (fills to settle before work on another stream).
    - ``default``: the backend's default stream (``stream=None``).
    - ``scan_graphs``: the ``redzone_scan_graphs`` setting (then every launch goes to the front).
    - ``is_live``: the holdings' liveness of one buffer (arena and external memory, which the ledger does not hold).
    """

    ctx: DeviceContext
    ledger: ledgers.Ledger
    stats: counters.StatsCounter
    guard: ZoneGuard
    default: Stream
    scan_graphs: bool
    is_live: Callable[[DeviceBuffer], bool]


class GraphLane:  # (final: _graph_lane.pxd says so to Cython)
    """``GraphExec.launch``: inside the gate, the plain launch here, every other the graph front's."""

    __slots__ = (
        "_calls", "_ctx", "_default", "_gate", "_graphs", "_guard", "_is_live", "_ledger", "_ref", "_scan_graphs",
        "_stats",
    )

    def __init__(self, graphs: GraphWork, parts: GraphLaneParts) -> None:
        ctx = parts.ctx
        self._graphs = graphs
        self._ctx = ctx
        self._gate: Any = ctx.gate  # (compiled: the C gate, passed with enter_c and leave_c)
        self._ledger = parts.ledger
        self._stats = parts.stats
        self._guard = parts.guard
        self._default = parts.default
        self._scan_graphs = parts.scan_graphs
        self._is_live = parts.is_live
        self._ref = ctx.ref
        #: Compiled: the plugin's C functions where they hold ``graph_launch`` (the capsule, kept alive), else None.
        self._calls = graph_launch_calls(self, ctx.plugin, _CAPSULE)

    def launch(self, graph: GraphExec, stream: Stream | None) -> None:
        """``GraphExec.launch``."""
        if cython.compiled:
            cell = self._gate.enter_c(False)
        else:
            self._ctx.enter()
        try:
            if type(graph) is not GraphExec:  # (never: its own method calls it)
                graph._live()
            live = self._live(graph)
            if not live or not self._launch(graph, stream):
                self._graphs.launch_checked(graph, stream, live)
        finally:
            if cython.compiled:
                self._gate.leave_c(cell)
            else:
                self._ctx.leave()

    def _live(self, graph: GraphExec) -> bool:
        """Whether every operand of ``graph`` is known live: its buffers, its kernels' modules, its host buffers (a
        peer's buffer: its own backend says, at the front). A closed graph is refused."""
        if graph._closed:  # (the owner's read of its handle, as `GraphExec.launch` read its own)
            graph._live()  # raises, naming the handle
        if graph.peers:
            return False
        for registry in graph.registries:  # (loops, not any() over a generator: both are short)
            if registry.unloaded:
                return False
        for hb in graph.host_buffers:
            if hb.closed:
                return False
        ledger = self._ledger
        taken = ledger.taken  # read first: a record that comes off during the check shows at the next launch
        if graph.live_at == taken:  # no record came off since its buffers were last found live
            return True
        held = ledger.holds_all(graph.buffers, self._ref)
        if held:
            graph.live_at = taken
            return True
        if held is None:  # arena or external memory among them, each by its own rule
            return all(map(self._is_live, graph.buffers))  # (no generator: compiled, it would cost every launch)
        return False

    def _launch(self, graph: GraphExec, stream: Stream | None) -> bool:
        """The plain launch of a graph whose operands are live: whether it was done (else the front does it)."""
        if graph.check is not None or self._scan_graphs:
            return False
        if stream is None:
            target = self._default
        elif type(stream) is Stream:
            target = stream  # (compiled: its fields read in place)
            if target._ctx is not self._ctx or target._closed or self._closed():  # (as the front resolves one)
                return False
        else:
            return False
        if target.capture is not None:
            return False
        guard = self._guard
        if guard.fills:
            guard.settle_for(target)
        ctx = self._ctx
        graph_raw = graph.raw
        stream_raw = target.raw
        try:
            if self._calls is None or call_graph_launch(self, graph_raw, stream_raw):  # (1: declined)
                ctx.plugin.graph_launch(graph_raw, stream_raw)
        except Exception as exc:
            raise_raw(ctx, ctx.name, "graph_launch", exc)
        self._stats.graph_launches += 1
        return True

    def _closed(self) -> bool:
        """Whether the backend's close has begun (compiled: read at C level)."""
        return self._gate.closed  # type: ignore[no-any-return]  # (compiled: a C read, the gate typed in the .pxd)
