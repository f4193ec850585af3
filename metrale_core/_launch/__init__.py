"""Kernels of one backend: their registry, their launches and their tensor maps.

- `tensormaps`: `TensorMap` (a TMA descriptor over a buffer) and `TensorMapFront`, its owner;
- `registry`: `Kernel`, `KernelRegistry`, the run metrics, and each launch's arguments checked and packed;
- `front`: `KernelFront`: loading modules after the architecture check, launching, timing launches.

Each module imports only those listed before it; the front is on top.
"""
