"""Memory: what one backend allocates, holds, frees and reports.

- `meminfo`: honest free memory (the host's ``MemAvailable`` for integrated devices);
- `records`: what records are made of and where they come from: the creation indexes, origins, `LedgerEvent`;
- `sites`: the call site of an allocation, the first frame outside metrale (one source, compiled as ``_sites``);
- `ledger`: every live allocation with its call site (one source, compiled as ``_ledger``);
- `poolstats`: `PoolStats`, what a pool reports (one class for both builds);
- `pool`: `MemoryPool`, device memory carved from segments and cached after free; it grows itself on a miss
  through the callable it is given (one source, compiled as ``_pool``);
- `arena_zones`: the red zones of an arena's pieces;
- `bump`: the bump sub-allocator over one ``alloc_arena`` block (one source, compiled as ``_bump``);
- `arena`: the public `Arena`, the bump allocation as it runs as Python;
- `watch`: who watches a release: the allocator's release observers that have something to watch now;
- `pressure`: the OOM watchdog and the memory summary table;
- `snapshot`: the snapshot file format, written and read in one module;
- `holdings`: what a backend holds now (ledger, arenas, host buffers), liveness and bounds;
- `monitor`: free memory, stats, watchdogs and snapshots, as a backend answers them;
- `exports`: memory handed to other libraries, and theirs taken in;
- `quarantine`: freed zoned blocks, checked, reused and released; the allocator owns it;
- `rawmem`: raw memory with reclaim-and-retry and the out-of-memory report; pools register their trimmers;
- `pools`: the pool front, the ledger's side of each pool's pieces (one source, compiled as ``_pools``);
- `lane`: ``GpuBackend.alloc`` and ``free``, every allocation of device, managed and arena memory and the commit
  rule, through the gate (one source, compiled as ``_lane``);
- `allocator`: device, managed, host and arena memory and the sweep, over raw memory, the pool front and the lane.

Each module imports only those listed before it (the layer test's floors); the allocator is on top.
"""
