"""Streams: the work a backend issues, and its captures and graphs.

One layer per module, each importing only those before it:

- `.graphs`: `record` (what a capture touches), `GraphFront`: captures, graphs and graph launches.
  A launch meets the zone guard once, through ``ZoneGuard.graph_launch``;
- `.front`: `StreamFront`: streams, events, the handle table, memsets, copies and peer copies; it
  makes the graph front and hands captures to it.
"""
