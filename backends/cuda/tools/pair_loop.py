#!/usr/bin/env python3
"""A ledgered 1 MiB alloc + free, repeated, for a profiler (``perf record -g python3 -X perf ...``)."""

from __future__ import annotations

import sys

from metrale_core import open_backend

with open_backend("cuda") as gpu:
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 300_000):
        gpu.free(gpu.alloc(1 << 20))
