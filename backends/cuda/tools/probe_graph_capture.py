#!/usr/bin/env python3
"""Which graphs a capture may launch on CUDA (a measurement, not a test): an executable graph launched into another
stream's capture, with and without a memset node, with and without red zones and their in-graph verdict node.
The fake backend must refuse where CUDA refuses (issue 56: ``cuGraphLaunch`` into a capture failed with
``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`` on an H100). One line per case::

    python3 backends/cuda/tools/probe_graph_capture.py
"""

from __future__ import annotations

import os

import numpy as np

from metrale_core import MetraleError, MetraleSettings, open_backend
from metrale_core.kernels import shipped_modules

BACKEND = os.environ.get("PROBE_BACKEND", "cuda")


def case(zones: bool, verdict: bool, memset: bool) -> str:
    """Capture an inner graph, then launch it into the capture of an outer one; what CUDA (or the fake) says."""
    settings = MetraleSettings().updated(
        redzone=64 if zones else 0, redzone_lead=zones, redzone_min_idx=0, redzone_sample=1,
        redzone_scan_graphs=verdict, redzone_scan_queued=False, redzone_action="warn",
    )
    with open_backend(BACKEND, settings=settings) as gpu:
        fill = gpu.load_modules(shipped_modules("vector")).kernel("vector", "fill_u32")
        buf = gpu.alloc(256)
        stream = gpu.create_stream()
        gpu.begin_capture(stream)
        if memset:
            gpu.memset(buf, 0, stream=stream)
        gpu.launch(fill, 1, 64, [buf, np.uint32(64), np.uint32(7)], stream=stream)
        inner = gpu.end_capture(stream).instantiate()
        gpu.begin_capture(stream)
        gpu.launch(fill, 1, 64, [buf, np.uint32(64), np.uint32(9)], stream=stream)
        try:
            inner.launch(stream)
        except MetraleError as exc:
            said = f"refused: {type(exc).__name__}: {str(exc)[:160]}"
        else:
            said = "launched"
        try:
            outer = gpu.end_capture(stream).instantiate()
            outer.launch(stream)
            gpu.synchronize()
            said += "; the outer graph ran"
            outer.close()
        except MetraleError as exc:
            said += f"; the outer graph: {type(exc).__name__}: {str(exc)[:120]}"
        inner.close()
        gpu.free(buf)
    return said


def main() -> None:
    for zones, verdict in ((False, False), (True, False), (True, True)):
        for memset in (False, True):
            label = f"zones {'on' if zones else 'off'}, verdict node {'on' if verdict else 'off'}, " \
                    f"memset node {'yes' if memset else 'no'}"
            try:
                print(f"{label}: {case(zones, verdict, memset)}", flush=True)
            except Exception as exc:  # (a measurement: every case is reported)
                print(f"{label}: FAILED {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()
