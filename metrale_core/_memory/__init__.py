"""Memory: what a backend holds, how it gets it, and how it lets go.

One layer per module, each importing only those before it:

- `.meminfo`, `.ledger`: honest free memory; the allocation ledger (records, call sites);
- `.arena`: `Arena`, the bump sub-allocator over one ``alloc_arena`` block;
- `.pressure`: the OOM watchdog and the memory summary;
- `.snapshot`, `.holdings`: the snapshot file, both ways; what is live, liveness and bounds;
- `.monitor`, `.exports`, `.quarantine`: free memory and snapshots; memory shared with other
  libraries; freed zoned blocks, judged by the zone guard, then reused or released;
- `.allocator`: `Allocator`, alloc and free of every kind. It owns the quarantine: it drains it and
  retries when the device runs out of memory.
"""
