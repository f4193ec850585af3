"""Memory: what one backend allocates, holds, frees and reports.

- `meminfo`: honest free memory (the host's ``MemAvailable`` for integrated devices);
- `records`: what records are made of and where they come from: the creation indexes, origins, `LedgerEvent`;
- `sites`: the call site of an allocation, the first frame outside metrale (one source, compiled as ``_sites``);
- `ledger`: every live allocation with its call site (one source, compiled as ``_ledger``);
- `pool`: `MemoryPool`, device memory carved from segments and cached after free, each piece on the ledger;
- `arena`: the bump sub-allocator over one ``alloc_arena`` block;
- `watch`: who watches a release: the allocator's release observers that have something to watch now;
- `pressure`: the OOM watchdog and the memory summary table;
- `snapshot`: the snapshot file format, written and read in one module;
- `holdings`: what a backend holds now (ledger, arenas, host buffers), liveness and bounds;
- `monitor`: free memory, stats, watchdogs and snapshots, as a backend answers them;
- `exports`: memory handed to other libraries, and theirs taken in;
- `quarantine`: freed zoned blocks, checked, reused and released; the allocator owns it;
- `lane`: ``GpuBackend.alloc`` and ``free``, the hot path of device memory, through the gate;
- `_pool`, `_arena`, `_quarantine`, `_lane`: the compiled twins of `pool`, `arena`, `quarantine` and
  `lane`, each a floor above what it repeats;
- `allocator`: alloc and free of every kind, reclaim-and-retry, arenas, the sweep.

Each module imports only those listed before it (the layer test's floors); the allocator is on top.
"""
