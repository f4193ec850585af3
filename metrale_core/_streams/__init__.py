"""Streams: the work a backend issues, and its captures and graphs.

One layer per module, each importing only those before it:

- `.graph_lane`, `._graph_lane`: `GraphLane`: ``GraphExec.launch``, the replay of an executable graph,
  through the gate; its compiled twin;
- `.graphs`: `record` (what a capture touches), `GraphFront`: captures, graphs and graph launches.
  A launch meets the zone guard once, through ``ZoneGuard.graph_launch``;
- `.front`: `StreamFront`: streams, events, the handle table, memsets, copies and peer copies; it
  makes the graph front and hands captures to it;
- `.lane`, `._lane`: `StreamLane`: ``GpuBackend.memset``, a hot path of stream work, through the gate;
  its compiled twin.
"""
