"""The graph lane: ``GraphExec.launch``, the replay of an executable graph, through the gate.

- `GraphLane.launch` counts the call in and out of the gate, refuses a closed graph, and hands the launch to the
  graph front (`GraphFront.launch_checked`), which does the work (the graph's operands live, the stream, the zone
  guard, a capture's record, the errors).
- ``_graph_lane.pyx`` is its compiled twin: it does the common case itself at C level (a graph with no red-zone check
  and no other backend's buffers, every operand live by the ledger's count, a live stream of this backend with no
  capture on it, no scan after graphs) through the plugin's C ``graph_launch`` where it offers one
  (``RawDevice.device_calls``), and hands everything else to the front, as this class does with every call.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, final

from .._device.context import DeviceContext
from .._device.handles import GraphExec, Stream
from .._device.stats import StatsCounter
from .._memory.ledger import Ledger
from .._redzones.guard import ZoneGuard

__all__ = ["GraphLane", "GraphLaneParts", "GraphWork"]


class GraphWork(Protocol):
    """What a graph lane asks of the front it fronts (``graphs.GraphFront``)."""

    def launch_checked(self, graph: GraphExec, stream: Stream | None) -> None:
        """Every launch inside the gate: the whole work, the errors included."""


class GraphLaneParts(NamedTuple):
    """What the graph front hands its lane: the parts a launch touches, each still its owner's.

    - ``ctx``: the device context (its gate, the plugin).
    - ``ledger``: the holdings' ledger (its ``taken`` count and ``holds_all``: the graph's buffers live).
    - ``stats``: the backend's counters (``graph_launches``).
    - ``guard``: the zone guard (fills to settle before work on another stream).
    - ``default``: the backend's default stream (``stream=None``).
    - ``scan_graphs``: the ``redzone_scan_graphs`` setting (then every launch goes to the front).
    """

    ctx: DeviceContext
    ledger: Ledger
    stats: StatsCounter
    guard: ZoneGuard
    default: Stream
    scan_graphs: bool


@final
class GraphLane:
    """``GraphExec.launch``: inside the gate, the graph front's work."""

    __slots__ = ("_ctx", "_graphs")

    def __init__(self, graphs: GraphWork, parts: GraphLaneParts) -> None:
        self._graphs = graphs
        self._ctx = parts.ctx

    def launch(self, graph: GraphExec, stream: Stream | None) -> None:
        """``GraphExec.launch``."""
        ctx = self._ctx
        ctx.enter()
        try:
            if graph._closed:  # (the owner's read of its handle, as `GraphExec.launch` read its own)
                graph._live()  # raises, naming the handle
            self._graphs.launch_checked(graph, stream)
        finally:
            ctx.leave()
