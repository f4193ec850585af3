#!/usr/bin/env python3
"""Where the safety net's cost in ``metrale bench``'s inference-style step goes (a measurement, not a test).

The step of ``metrale bench --only safety`` (arena scratch, a memset, a graph of 128 ``vector_add``, a read back, a
wait) on two backends, red-zone checks off and on (in-graph verdicts judged later), in turns, best and median of many
rounds. Besides the whole step it times its parts: the host time of the graph's ``launch`` alone, of a wait on an
idle stream (what a wait judges), the graph's device time between two events, and the time of the step without its
wait. Run on a GPU machine::

    python3 backends/cuda/tools/probe_safety.py

The step is the bench's own (``SafetyLoop`` of ``metrale_core._commands.bench.launches``), so the probe splits the
very step that ``metrale bench`` times.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from metrale_core import GpuBackend, open_backend
from metrale_core._commands.bench.launches import LOOP_KERNELS, SafetyLoop, capture_adds
from metrale_core.kernels import shipped_modules

#: The backend (``cuda``; ``fake`` to try the script on a machine without a GPU).
BACKEND = os.environ.get("PROBE_BACKEND", "cuda")
ROUNDS = 21
PER_ROUND = 20
MIB = 1 << 20
ELEMENTS = int(os.environ.get("PROBE_ELEMENTS", MIB))  # float32 elements of each buffer, as metrale bench's step


def _loop(gpu: GpuBackend) -> SafetyLoop:
    """The bench's safety step on ``gpu``."""
    return SafetyLoop(gpu, gpu.load_modules(shipped_modules("vector")).kernel("vector", "vector_add"), ELEMENTS)


def _graph_nodes(loop: SafetyLoop) -> str:
    """The nodes of the step's graph, captured once more the same way (the step keeps only its executable graph)."""
    graph = capture_adds(loop.gpu, loop.kernel, loop.stream, loop.bufs, ELEMENTS, LOOP_KERNELS)
    try:
        return _nodes(graph.raw)
    finally:
        graph.close()


def _nodes(raw: object) -> str:
    """The captured graph's nodes by type (``cuGraphGetNodes``; the cuda backend's graph only)."""
    handle = getattr(raw, "handle", None)
    if handle is None:
        return "(not a CUDA graph)"
    from collections import Counter

    from cuda.bindings import driver as drv
    _, _, count = drv.cuGraphGetNodes(handle, 0)
    _, nodes, count = drv.cuGraphGetNodes(handle, count)
    kinds = Counter(str(drv.cuGraphNodeGetType(node)[1]).rsplit(".", 1)[-1] for node in nodes)
    return f"{count} nodes: " + ", ".join(f"{n} {k}" for k, n in kinds.items())


def _times(fn: Callable[[], object], settle: Callable[[], object]) -> tuple[float, float]:
    """Best and median µs per call of ``fn`` over `ROUNDS` rounds of `PER_ROUND`, each round settled."""
    per: list[float] = []
    for _ in range(3):
        fn()
    settle()
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(PER_ROUND):
            fn()
        per.append((time.perf_counter() - t0) / PER_ROUND * 1e6)
        settle()
    return min(per), statistics.median(per)


def main() -> None:
    base = open_backend(BACKEND)
    on = {"redzone": 4096, "redzone_lead": True, "redzone_min_idx": 0, "redzone_scan_graphs": True,
          "redzone_scan_queued": True}
    off = {"redzone": 0, "redzone_lead": False, "redzone_scan_graphs": False}
    loops = {}
    for label, update in (("off", off), ("on", on)):
        gpu = open_backend(BACKEND, settings=base.settings.model_copy(update=update))
        loops[label] = _loop(gpu)
    print(f"redzone_checks (on): {loops['on'].gpu.redzone_checks}")
    for label, loop in loops.items():
        offsets = ", ".join(f"{buf.ptr % (2 << 20):#x}" for buf in loop.bufs)
        print(f"{label}: the graph's {_graph_nodes(loop)}; the buffers' offsets in 2 MiB pages: {offsets}")
    rows: dict[str, dict[str, tuple[float, float]]] = {label: {} for label in loops}
    for _turn in range(2):
        for label, loop in loops.items():
            gpu, stream = loop.gpu, loop.stream
            raw_sync = (lambda g=gpu, s=stream: g.raw.stream_synchronize(s.raw))
            rows[label]["step"] = _times(loop.step, stream.synchronize)

            def launch_only(loop: SafetyLoop = loop) -> None:
                loop.exe.launch(loop.stream)
                loop.gpu.raw.stream_synchronize(loop.stream.raw)  # (waited for outside metrale: no judging)
            rows[label]["launch + raw wait"] = _times(launch_only, stream.synchronize)
            rows[label]["wait, stream idle"] = _times(stream.synchronize, raw_sync)

            def step_no_wait(loop: SafetyLoop = loop) -> None:
                scratch = loop.arena.alloc(MIB)
                loop.gpu.memset(scratch, 0, stream=loop.stream)
                loop.exe.launch(loop.stream)
                loop.gpu.copy_to_host(loop.host, loop.bufs[2], stream=loop.stream)
                loop.gpu.raw.stream_synchronize(loop.stream.raw)
                loop.arena.reset()
            rows[label]["step, raw wait"] = _times(step_no_wait, stream.synchronize)
            start, end = gpu.create_event(), gpu.create_event()
            device = []
            for _ in range(ROUNDS):
                start.record(stream)
                loop.exe.launch(stream)
                end.record(stream)
                end.synchronize()
                device.append(start.elapsed_ms(end) * 1e3)
            rows[label]["graph device time"] = (min(device), statistics.median(device))
            start.close()
            end.close()
    for what in rows["off"]:
        off_best, off_med = rows["off"][what]
        on_best, on_med = rows["on"][what]
        print(f"{what:22s} off best {off_best:8.2f} med {off_med:8.2f} | on best {on_best:8.2f} med {on_med:8.2f}"
              f" | on - off (med) {on_med - off_med:+7.2f} us")
    for loop in loops.values():
        loop.close()
        loop.gpu.close()
    base.close()


if __name__ == "__main__":
    main()
