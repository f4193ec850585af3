"""Red zones: guard bands around device allocations, from fill to verdict.

A write past a buffer's end (or before its start) lands in a band of fill bytes. This wing fills the
bands, judges them, checks graph launches, and reports. One layer per module, each importing only
those before it:

- `.zone`: `Zone`, `Layout`: one band, and where a zoned allocation's parts lie (one class for both builds);
- `.borrowed`: `BorrowedStreams`: other libraries' streams lent for the fills of a pool's pieces allocated on them;
- `.layout`: `RedZones`: where the live bands lie, the dense table the scan kernel reads, and judging one
  band read back (compiled as well: ``_layout``);
- `.scanner`: the scan kernel, the one scratch pool, and the reads that stand in (no guard here);
- `.ingraph`: the verdict kernel captured as every graph's last node, its table and verdict slots;
- `.queued`: scans queued behind graph launches, reported through the ``report`` callable given;
- `.report`: `ZoneReport`: each violation's suspects, the observers, then a log line or an error;
- `.guard`: `ZoneGuard`: fills, judging, and ``graph_launch()``, the one way a graph
  launch meets the red zones. It frees no user memory: the quarantine is ``_memory``'s.
"""
