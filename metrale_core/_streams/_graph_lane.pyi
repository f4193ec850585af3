"""Stub of the compiled twin of `metrale_core._streams.graph_lane.GraphLane` (``_graph_lane.pyx``): the same
interface."""

from typing import final

from .._device.handles import GraphExec, Stream
from .graph_lane import GraphLaneParts, GraphWork

@final
class GraphLane:
    def __init__(self, graphs: GraphWork, parts: GraphLaneParts) -> None: ...
    def launch(self, graph: GraphExec, stream: Stream | None) -> None: ...
SLOTS: bool
