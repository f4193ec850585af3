"""What every part of one open backend shares: the context, the raw layer, the handles.

Each module imports only those on the lines above its own:

- `.args`, `.stats`, `.raw`, `.guarded`: the argument rules (sizes, integers, launch
  dims, shapes); the memory counters and `MemoryStats`; `RawDevice` and `Baseline`,
  what a backend implements; the guarded raw layer (`GuardedRaw`, `raise_raw`), which
  reaches its context through a callable.
- `.buffer`: `DeviceBuffer` and `DeviceArray`, values that export themselves.
- `.capture`: the capture rule book, process-wide.
- `.context`: `DeviceContext`, with the gate, the fault latch and the origin.
- `.handles`: `Stream`, `Event`, `Graph`, `GraphExec`, `HostBuffer`.
"""
