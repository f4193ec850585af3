"""Kernels of one backend: their registry, their launches and their tensor maps.

- `tensormaps`: `TensorMap` (a TMA descriptor over a buffer) and `TensorMapFront`, its owner;
- `registry`: `Kernel`, `KernelRegistry`, the run metrics, and each launch's arguments checked and packed;
- `pack`: ``pack_args``, each launch's arguments checked and packed (one source, compiled as ``_pack``);
- `lane`: `LaunchLane`: ``GpuBackend.launch``, the hot path of kernel launches, through the gate (one source,
  compiled as ``_lane``);
- `front`: `KernelFront`: loading modules after the architecture check, launching, timing launches.

Each module imports only those listed before it; the front is on top.
"""
