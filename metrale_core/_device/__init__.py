"""What every part of one open backend shares: the context, the raw layer, the handles.

Each module imports only those on the lines above its own:

- `.args`, `.memory_stats`, `.raw`, `.guarded`, `._lock`: the argument rules (sizes,
  integers, launch dims, shapes); `MemoryStats`; `RawDevice` and `Baseline`, what a
  backend implements; the guarded raw layer (`GuardedRaw`, `raise_raw`), which
  reaches its context through a callable; the hot path's lock as Python.
- `.stats`, `.buffer`: the memory counters; `DeviceBuffer` and `DeviceArray`, values
  that export themselves.
- `.capture_record`, `.capture`, `.handle`: the capture rule book and its record,
  process-wide; a call's checks of the rule; `DeviceBuffer` built fast.
- `.gate`: every public call counted in and out.
- `.context`: `DeviceContext`, with the gate, the fault latch and the origin.
- `.handles`: `Stream`, `Event`, `Graph`, `GraphExec`, `HostBuffer`.
"""
