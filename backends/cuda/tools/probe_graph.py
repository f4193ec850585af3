#!/usr/bin/env python3
"""Where a graph replay goes on the CUDA backend, layer by layer (a measurement, not a test).

Each row times one more layer of ``GraphExec.launch`` than the row before, in turns, best of many rounds, each round
waited for: the raw ``cuGraphLaunch`` through cuda.bindings, the compiled driver call (``_cdriver``) from Python, the
plugin's method, the graph lane (the gate, the graph's liveness, the stream, the device calls), the handle's
``launch``. The graph is ``KERNELS`` launches of the shipped ``vector_add``, as ``metrale bench``'s (``--kernels 1`` for
one node).
Run on a GPU machine, compiled::

    python3 backends/cuda/tools/probe_graph.py [--kernels N]
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable

from cuda.bindings import driver as drv

from metrale_core import open_backend
from metrale_core.kernels import shipped_modules

ROUNDS = 15
PER_ROUND = 20
N = 4096
BLOCK = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=100)
    kernels = parser.parse_args().kernels
    gpu = open_backend("cuda")
    try:
        plugin = gpu.raw
        c = getattr(plugin, "_c", None)
        kernel = gpu.load_modules(shipped_modules("vector")).kernel("vector", "vector_add")
        stream = gpu.create_stream()
        bufs = [gpu.alloc(4 * N) for _ in range(3)]
        count = ctypes.c_uint32(N)
        gpu.begin_capture(stream)
        for _ in range(kernels):
            gpu.launch(kernel, (N + BLOCK - 1) // BLOCK, BLOCK, (bufs[0], bufs[1], bufs[2], count), stream=stream)
        graph = gpu.end_capture(stream)
        exe = graph.instantiate()
        graph.close()
        lane = gpu._parts.streams.graphs.launch_graph  # (a measurement: the private parts by name)
        e, s = exe.raw, stream.raw
        cdriver = None if c is None else (lambda: c.graph_launch(e.raw, s.raw))  # type: ignore[attr-defined]

        def best_us(fn: Callable[[], object]) -> float:
            for _ in range(5):
                fn()
            stream.synchronize()
            best = float("inf")
            for _ in range(ROUNDS):
                t0 = time.perf_counter()
                for _ in range(PER_ROUND):
                    fn()
                best = min(best, (time.perf_counter() - t0) / PER_ROUND)
                stream.synchronize()
            return best * 1e6

        rows: list[tuple[str, Callable[[], object] | None]] = [
            ("raw cuda.bindings cuGraphLaunch", lambda: drv.cuGraphLaunch(e.handle, s.handle)),  # type: ignore[attr-defined]
            ("compiled driver call from Python (_cdriver)", cdriver),
            ("the plugin's graph_launch", lambda: plugin.graph_launch(e, s)),
            ("the graph lane (gate, liveness, stream, device calls)", lambda: lane(exe, stream)),
            ("GraphExec.launch", lambda: exe.launch(stream)),
        ]
        print(f"{type(plugin).__name__}, lane {type(getattr(lane, '__self__', lane)).__module__}; a graph of "
              f"{kernels} kernels; best of {ROUNDS} rounds of {PER_ROUND}")
        for turn in range(2):
            for name, fn in rows:
                figure = "-" if fn is None else f"{best_us(fn):.2f} us"
                print(f"  turn {turn + 1}  {name:<50} {figure}")
        exe.close()
        stream.close()
        for buf in bufs:
            gpu.free(buf)
    finally:
        gpu.close()


if __name__ == "__main__":
    main()
