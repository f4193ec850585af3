"""What every part of one open backend shares: the context, the raw layer, the handles.

Each module imports only those on the lines above its own:

- `.args`, `.memory_stats`, `.raw`, `.guarded`, `._lock`: the argument rules (sizes, integers, launch
  dims, shapes); `MemoryStats` and the kinds it counts; `RawDevice` and `Baseline`, what a backend
  implements; the guarded raw layer (`GuardedRaw`, `raise_raw`), which reaches its context through a
  callable; the hot path's lock where it runs as Python (``_lock.pxd``'s C lock where compiled).
- `.stats`, `.buffer`: the counter behind ``stats()`` (compiled as ``_stats`` too); `DeviceBuffer` and
  `DeviceArray`, values that export themselves.
- `.capture_record`, `.capture`, `.handle`: the capture rule book and the record of captures in progress,
  process-wide; a call's own checks of the capture rule (compiled as ``_capture`` too); ``DeviceBuffer._make``
  made fast (compiled as ``_handle`` too).
- `.gate`: the gate every public call passes, counted in and out (compiled as ``_gate`` too).
- `.context`: `DeviceContext`, with the gate, the fault latch and the origin.
- `.handles`: `Stream`, `Event`, `Graph`, `GraphExec`, `HostBuffer`.
"""
