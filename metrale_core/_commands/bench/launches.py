"""The measurements of work on a stream: eager memsets and launches against the raw calls
(``eager``), a captured graph against eager launches and PyTorch's graph (``graph``), and the safety
net's cost in an inference-style loop (``safety``)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import statistics
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, Final

from ... import GpuBackend, Graph, GraphExec, Kernel, Stream, open_backend
from ..._errors import MetraleError
from .context import Bench
from .model import Figure, Goal, Result
from .peers import find_torch, torch_graph
from .timing import KIB, MIB, against_first, compare, format_size, to_us, turns

__all__ = [
    "BLOCK", "EAGER_N", "LOOP_KERNELS", "SafetyLoop", "capture_adds", "measure_eager", "measure_graph",
    "measure_safety",
]

BLOCK: Final = 256

#: The float32 elements of the eager measurements' launch (``eager`` and ``eager_breakdown``).
EAGER_N: Final = 4096


def measure_eager(b: Bench) -> Result:
    """One small async memset and one small kernel launch: metrale's host cost over the raw call."""
    gpu = b.gpu
    rounds, calls, n = b.rounds(15), b.calls(256), EAGER_N
    kernel, count, grid, stream = b.vector_add(), ctypes.c_uint32(n), (n + BLOCK - 1) // BLOCK, gpu.default_stream
    memset, launch = gpu.memset, gpu.launch
    with ExitStack() as stack:
        bufs = _buffers(gpu, stack, 3, 4 * n)
        ops: dict[str, Callable[[], object]] = {
            "metrale memset 4 KiB": lambda: memset(bufs[0], 0, nbytes=4 * KIB),
            "metrale launch vector_add": lambda: launch(kernel, grid, BLOCK, (bufs[0], bufs[1], bufs[2], count)),
        }
        settle: dict[str, Callable[[], object]] = {label: stream.synchronize for label in ops}
        if b.baseline is not None:
            ops["raw memset 4 KiB"] = b.baseline.memset(4 * KIB)
            ops["raw launch vector_add"] = b.baseline.vector_add(n)
            settle["raw memset 4 KiB"] = settle["raw launch vector_add"] = b.baseline.synchronize
        b.say(f"  {len(ops)} operations, {rounds} rounds of {calls}")
        medians = turns(ops, rounds=rounds, calls=calls, settle=settle)
        stream.synchronize()
    figures: list[Figure] = []
    for what in ("memset 4 KiB", "launch vector_add"):
        seconds = medians.get(f"raw {what}")
        raw = b.raw_figure(f"raw {what}", "us", None if seconds is None else to_us(seconds))
        mine = compare(Figure(f"metrale {what}", "metrale", "us", to_us(medians[f"metrale {what}"])), raw)
        figures += [raw, mine]
    detail = f"host time per call ({n} float32 elements for the launch), median of {rounds} rounds of {calls}"
    return Result("eager", "eager memset and launch against the raw calls", detail, tuple(figures))


def _buffers(gpu: GpuBackend, stack: ExitStack, count: int, nbytes: int) -> list[Any]:
    """``count`` buffers of ``nbytes``, each freed when ``stack`` closes."""
    bufs = []
    for _ in range(count):
        buf = gpu.alloc(nbytes)
        stack.callback(gpu.free, buf)
        bufs.append(buf)
    return bufs


def capture_adds(gpu: GpuBackend, kernel: Kernel, stream: Stream, bufs: Sequence[Any], n: int, k: int) -> Graph:
    """``k`` launches of ``vector_add`` over ``bufs[:3]`` (``n`` float32 elements) captured on ``stream``: the graph,
    which the caller closes."""
    count = ctypes.c_uint32(n)
    grid = (n + BLOCK - 1) // BLOCK
    gpu.begin_capture(stream)
    try:
        for _ in range(k):
            gpu.launch(kernel, grid, BLOCK, (bufs[0], bufs[1], bufs[2], count), stream=stream)
    except BaseException:
        with contextlib.suppress(MetraleError):
            gpu.end_capture(stream).close()
        raise
    return gpu.end_capture(stream)


def _instantiated(graph: Graph) -> GraphExec:
    """``graph``'s executable graph; the graph itself closed."""
    try:
        return graph.instantiate()
    finally:
        graph.close()


def measure_graph(b: Bench) -> Result:
    """100 small launches: a metrale graph replayed, the same launches issued eagerly, a PyTorch graph."""
    gpu, k, n = b.gpu, 100, 4096
    rounds, calls = b.rounds(15), b.calls(20)
    kernel = b.vector_add()
    count = ctypes.c_uint32(n)
    grid = (n + BLOCK - 1) // BLOCK
    launch = gpu.launch
    device: dict[str, float] = {}
    torch_label = "torch.cuda.CUDAGraph replay"
    with ExitStack() as stack:
        stream = gpu.create_stream()
        stack.callback(stream.close)
        bufs = _buffers(gpu, stack, 3, 4 * n)
        stack.callback(stream.synchronize)  # before the buffers go
        exe = _instantiated(capture_adds(gpu, kernel, stream, bufs, n, k))
        stack.callback(exe.close)
        start, end = gpu.create_event(), gpu.create_event()
        stack.callback(start.close)
        stack.callback(end.close)

        replay = functools.partial(exe.launch, stream)  # (called as the raw launch is: no frame of the bench's own)

        def eager() -> None:
            args = (bufs[0], bufs[1], bufs[2], count)
            for _ in range(k):
                launch(kernel, grid, BLOCK, args, stream=stream)

        def device_us(op: Callable[[], object]) -> float:
            times = []
            for _ in range(rounds + 1):
                start.record(stream)
                op()
                end.record(stream)
                end.synchronize()
                times.append(start.elapsed_ms(end) * 1e3)
            return statistics.median(times[1:])

        raw_label = f"raw graph launch ({gpu.name}'s plugin, same graph)"
        ops: dict[str, Callable[[], object]] = {
            "metrale graph replay": replay,
            raw_label: functools.partial(gpu.raw.graph_launch, exe.raw, stream.raw),
            f"metrale {k} eager launches": eager,
        }
        settle: dict[str, Callable[[], object]] = {label: stream.synchronize for label in ops}
        sources = {label: "metrale" for label in ops}
        sources[raw_label] = "raw"
        torch, torch_source = find_torch(gpu, b.cuda_memory)
        if torch is not None:
            torch_replay, torch_device, torch_sync = torch_graph(torch, gpu.ordinal, k, n, rounds)
            gpu.bind_to_thread()
            ops[torch_label], settle[torch_label], sources[torch_label] = torch_replay, torch_sync, torch_source
        b.say(f"  host time: {len(ops)} ways, {rounds} rounds of {calls}")
        medians = turns(ops, rounds=rounds, calls=calls, settle=settle)
        b.say("  device time, from events")
        device["metrale graph replay"] = device_us(replay)
        device[f"metrale {k} eager launches"] = device_us(eager)
        if torch is not None:
            device[torch_label] = torch_device()
            gpu.bind_to_thread()
    figures = against_first(list(ops), medians, sources)
    if torch is None:
        figures.append(Figure(torch_label, "torch", "us", None, note=torch_source))
    device_reference = Figure("device time: metrale graph", "metrale", "us", device["metrale graph replay"])
    figures.append(device_reference)
    for label, us in device.items():
        if label != "metrale graph replay":
            name = "device time: " + label.replace(" replay", "").replace("metrale ", "")
            figures.append(compare(Figure(name, sources[label], "us", us), device_reference))
    detail = f"{k} launches of vector_add over {n} float32 elements; host time per replay (or per {k} eager launches)"
    return Result("graph", f"a graph of {k} small kernels, replayed", detail, tuple(figures))



#: The launches in the graph of the safety step.
LOOP_KERNELS: Final = 128


class SafetyLoop:
    """An inference-style step: per-step scratch from an arena, a captured graph of the shipped
    kernels over a few MiB, and a small read back to the host, waited for. ``kernel`` is the shipped
    ``vector_add`` on ``gpu``, ``n`` the float32 elements of each buffer. ``safety`` times it, and
    ``backends/cuda/tools/probe_safety.py`` splits its cost."""

    def __init__(self, gpu: GpuBackend, kernel: Kernel, n: int) -> None:
        self.gpu = gpu
        self.stream = gpu.create_stream()
        self.kernel = kernel
        self.weights = [gpu.alloc(64 * KIB) for _ in range(32)]  # small live allocations, each with its zones
        self.bufs = [gpu.alloc(4 * n) for _ in range(3)]
        for buf in self.bufs:
            gpu.memset(buf, 0)
        self.arena = gpu.create_arena(8 * MIB)
        self.host = gpu.alloc_host(4 * KIB)
        self.exe = _instantiated(capture_adds(gpu, kernel, self.stream, self.bufs, n, LOOP_KERNELS))

    def step(self) -> None:
        gpu, stream = self.gpu, self.stream
        scratch = self.arena.alloc(MIB)
        gpu.memset(scratch, 0, stream=stream)
        self.exe.launch(stream)
        gpu.copy_to_host(self.host, self.bufs[2], stream=stream)
        stream.synchronize()
        self.arena.reset()

    def close(self) -> None:
        self.stream.synchronize()
        self.exe.close()
        self.arena.close()
        self.gpu.free(self.host)
        for buf in self.bufs + self.weights:
            self.gpu.free(buf)
        self.stream.close()


def measure_safety(b: Bench) -> Result:
    """The safety net's end-to-end cost: the same loop with metrale's checks off and fully on, the scan
    after each graph launch waiting for the device or queued behind the graph."""
    gpu, n = b.gpu, (MIB if b.on_gpu and not b.quick else 64 * KIB)  # float32 elements
    rounds, calls = b.rounds(15), b.calls(40)
    off = gpu.settings.model_copy(update={"redzone": 0, "redzone_lead": False, "redzone_scan_graphs": False})
    on = {"redzone": 4096, "redzone_lead": True, "redzone_min_idx": 0, "redzone_scan_graphs": True}
    configs = {
        "step, checks off": off,
        "step, checks on, verdict waited for": gpu.settings.model_copy(update={**on, "redzone_scan_queued": False}),
        "step, checks on, verdict judged later": gpu.settings.model_copy(update={**on, "redzone_scan_queued": True}),
    }
    with ExitStack() as stack:
        loops: dict[str, SafetyLoop] = {}
        for label, settings in configs.items():
            backend = stack.enter_context(open_backend(gpu.name, ordinal=gpu.ordinal, settings=settings))
            loop = loops[label] = SafetyLoop(backend, b.vector_add(backend), n)
            stack.callback(loop.close)
        b.say(f"  {rounds} rounds of {calls} steps, the three configurations in turns")
        mode = loops["step, checks on, verdict judged later"].gpu.redzone_checks
        medians = turns({label: loop.step for label, loop in loops.items()}, rounds=rounds, calls=calls)
    plain = Figure("step, checks off", "metrale", "us", to_us(medians["step, checks off"]))
    figures = [plain]
    for label in list(configs)[1:]:
        us = to_us(medians[label])
        note = f"+{us - (plain.value or 0):.1f} us a step"
        figures.append(compare(Figure(label, "metrale", "us", us, note=note), plain))
    goals = b.goals(  # waiting for each verdict in launch makes every launch synchronous: shown, not a goal
        Goal("the safety net, verdict judged later, adds under 1% to a step", figures[2].ratio, 1.01, at_most=True),
    )
    detail = (
        f"host time per step: 1 MiB of arena scratch, a graph of {LOOP_KERNELS} vector_add over {format_size(4 * n)} "
        f"buffers, a 4 KiB read back and a wait; checks on: 4 KiB red zones front and back on every allocation, "
        f"every zone checked at every graph launch ({mode}); median of {rounds} rounds of {calls}"
    )
    return Result("safety", "the safety net's cost in an inference-style loop", detail, tuple(figures), goals)
