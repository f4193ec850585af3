"""What every part of one open backend shares: the context, the raw layer, the handles.

Each module imports only those on the lines above its own:

- `.args`, `.stats`, `.raw`, `.guarded`, `._lock`: the argument rules (sizes, integers, launch
  dims, shapes); the memory counters and `MemoryStats`; `RawDevice` and `Baseline`,
  what a backend implements; the guarded raw layer (`GuardedRaw`, `raise_raw`), which
  reaches its context through a callable; the hot path's lock where it runs as Python
  (``_lock.pxd``'s C lock where compiled).
- `.buffer`, `._stats`: `DeviceBuffer` and `DeviceArray`, values that export themselves; the
  stats counter's compiled twin.
- `.capture`, `._handle`: the capture rule book, process-wide; the compiled twin of
  ``DeviceBuffer._make``.
- `.gate`, `._gate`, `._capture`: the gate every public call passes, counted in and out; the
  compiled twins of the gate and of the capture rule's check.
- `.context`: `DeviceContext`, with the gate, the fault latch and the origin.
- `.handles`: `Stream`, `Event`, `Graph`, `GraphExec`, `HostBuffer`.
"""
