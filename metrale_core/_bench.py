"""``metrale bench``: each metrale operation timed next to what a user would otherwise call.

Everything runs in one process and one run, so the ratios compare like with like: the operations
of a comparison take turns round by round (the order rotating), and each figure is the median of
its rounds. The raw driver calls come from the backend's :class:`~metrale_core.Baseline` (the
CUDA backend's is ``cuda.bindings``; the fake's is numpy), so no vendor type reaches this module;
CuPy and PyTorch are imported only if installed, and only on a backend they can share a GPU with.

Nothing here asserts a speed: :class:`Goal` records whether a ratio met its target, for a person
to read.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import functools
import logging
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, Final

from ._backend import GpuBackend
from ._discovery import open_backend
from ._errors import InvalidArgumentError, MetraleError
from ._handles import GraphExec, Stream
from ._kernels import Kernel
from ._raw import Baseline
from ._settings import MetraleSettings
from .kernels import shipped_modules

__all__ = ["MEASUREMENTS", "BenchReport", "Figure", "Goal", "Result", "run_bench"]

_log = logging.getLogger("metrale.bench")

KIB: Final = 1 << 10
MIB: Final = 1 << 20
GIB: Final = 1 << 30
_BLOCK: Final = 256

Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True, slots=True)
class Figure:
    """One timed operation.

    :param label: what was timed, unique within its :class:`Result`.
    :param source: whose code ran: ``"metrale"``, or a peer with its version (``"cupy 14.2.0"``).
    :param unit: ``"us"`` (lower is better) or ``"GB/s"`` (higher is better).
    :param value: the median over the rounds; ``None`` when the figure was skipped.
    :param vs: the label of the figure this one is compared with, if any.
    :param ratio: ``value`` divided by that figure's value.
    :param note: why the figure was skipped, or what it counts.
    """

    label: str
    source: str
    unit: str
    value: float | None
    vs: str | None = None
    ratio: float | None = None
    note: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Goal:
    """A target for one ratio: ``ratio <= bound`` (``at_most``) or ``ratio >= bound``."""

    text: str
    ratio: float | None
    bound: float
    at_most: bool

    @property
    def met(self) -> bool | None:
        """Whether the ratio met the target; ``None`` when a figure was skipped."""
        if self.ratio is None:
            return None
        return self.ratio <= self.bound if self.at_most else self.ratio >= self.bound


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    """One measurement's figures and goals."""

    name: str
    title: str
    detail: str
    figures: tuple[Figure, ...]
    goals: tuple[Goal, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class BenchReport:
    """A whole run: where it ran, with what, and its results."""

    date: str
    backend: str
    device: str
    versions: Mapping[str, str]
    quick: bool
    results: tuple[Result, ...]

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON data."""
        return {
            "date": self.date,
            "backend": self.backend,
            "device": self.device,
            "versions": dict(self.versions),
            "quick": self.quick,
            "results": [
                {
                    "name": r.name,
                    "title": r.title,
                    "detail": r.detail,
                    "figures": [dataclasses.asdict(f) for f in r.figures],
                    "goals": [{**dataclasses.asdict(g), "met": g.met} for g in r.goals],
                }
                for r in self.results
            ],
        }

    def text(self) -> str:
        """The report as the table ``metrale bench`` prints."""
        versions = ", ".join(f"{k} {v}" for k, v in self.versions.items())
        lines = [f"metrale bench on {self.backend}: {self.device} ({self.date})", versions]
        for result in self.results:
            lines += ["", f"{result.name}: {result.title} ({result.detail})"]
            width = max(len(f.label) for f in result.figures)
            source_width = max(len(f.source) for f in result.figures)
            for f in result.figures:
                if f.value is None:
                    lines.append(f"  {f.label:<{width}}  {f.source:<{source_width}}  {'':>12}  {f.note}".rstrip())
                    continue
                value = f"{f.value:10.2f} {f.unit}" if f.unit == "us" else f"{f.value:8.1f} {f.unit}"
                ratio = f"{f.ratio:6.3f}x vs {f.vs}" if f.ratio is not None else ""
                note = f"  ({f.note})" if f.note else ""
                lines.append(f"  {f.label:<{width}}  {f.source:<{source_width}}  {value:>12}  {ratio}{note}".rstrip())
            for goal in result.goals:
                verdict = {True: "met", False: "MISSED", None: "not measured"}[goal.met]
                ratio = "-" if goal.ratio is None else f"{goal.ratio:.3f}x"
                sign = "<=" if goal.at_most else ">="
                lines.append(f"  goal: {goal.text}: {ratio} (target {sign} {goal.bound:g}x): {verdict}")
        return "\n".join(lines)


# -- timing ------------------------------------------------------------------------------------------


def _turns(
    ops: Mapping[str, Callable[[], object]],
    *,
    rounds: int,
    calls: int,
    finish: Mapping[str, Callable[[], object]] | None = None,
    settle: Mapping[str, Callable[[], object]] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each op.

    Each round times ``calls`` calls of every op in turn (the order rotating from round to round,
    after one untimed warm-up round), so a drift of clocks or caches falls on all of them alike.
    ``finish[label]`` runs inside the timing, after the calls (a wait that belongs to the work);
    ``settle[label]`` runs after it, untimed (draining a queue the calls filled).
    """
    finish, settle = finish or {}, settle or {}
    labels = list(ops)
    samples: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(rounds + 1):
        order = labels[r % len(labels):] + labels[: r % len(labels)]
        for label in order:
            op, done, after = ops[label], finish.get(label), settle.get(label)
            start = time.perf_counter()
            for _ in range(calls):
                op()
            if done is not None:
                done()
            elapsed = time.perf_counter() - start
            if after is not None:
                after()
            if r:  # round 0 warms up
                samples[label].append(elapsed / calls)
    return {label: statistics.median(times) for label, times in samples.items()}


def _us(seconds: float) -> float:
    return seconds * 1e6


def _ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


def _format_size(nbytes: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


# -- the peers ------------------------------------------------------------------------------------


def _cupy(gpu: GpuBackend) -> tuple[Any, str]:
    """CuPy, or why it is skipped."""
    if gpu.name != "cuda":
        return None, f"skipped: CuPy needs the cuda backend (this run is on {gpu.name})"
    try:
        import cupy  # type: ignore[import-not-found, import-untyped, unused-ignore]

        if gpu.ordinal >= cupy.cuda.runtime.getDeviceCount():
            return None, f"skipped: CuPy has no CUDA device {gpu.ordinal} here"
    except ImportError:
        return None, "skipped: CuPy is not installed"
    except Exception as exc:  # CuPy without a usable CUDA runtime raises its own errors
        return None, f"skipped: CuPy cannot reach the GPU ({type(exc).__name__}: {exc})"
    finally:
        gpu.bind_to_thread()
    return cupy, f"cupy {cupy.__version__}"


def _torch(gpu: GpuBackend) -> tuple[Any, str]:
    """PyTorch with CUDA, or why it is skipped."""
    if gpu.name != "cuda":
        return None, f"skipped: PyTorch's CUDA needs the cuda backend (this run is on {gpu.name})"
    try:
        import torch  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        return None, "skipped: PyTorch is not installed"
    except Exception as exc:  # a PyTorch built for another CUDA fails to import with its own errors
        return None, f"skipped: PyTorch cannot be imported ({type(exc).__name__}: {exc})"
    try:
        usable = torch.cuda.is_available() and gpu.ordinal < torch.cuda.device_count()
    except Exception as exc:
        return None, f"skipped: PyTorch cannot reach the GPU ({type(exc).__name__}: {exc})"
    finally:
        gpu.bind_to_thread()  # whatever PyTorch made current, metrale's context is current again
    if not usable:
        return None, f"skipped: PyTorch {torch.__version__} has no CUDA device {gpu.ordinal} here"
    return torch, f"torch {torch.__version__}"


# -- what a measurement works with ---------------------------------------------------------------------


class _Bench:
    """The open backend, its baseline, the run's scale and its progress line."""

    def __init__(self, gpu: GpuBackend, baseline: Baseline | None, why_not: str, quick: bool, say: Progress) -> None:
        self.gpu = gpu
        self.baseline = baseline
        self.why_not = why_not  # why there is no baseline
        self.quick = quick
        self.say = say
        self.on_gpu = gpu.name != "fake"

    def rounds(self, full: int) -> int:
        return 2 if self.quick else full

    def calls(self, full: int) -> int:
        return max(1, full // 20) if self.quick else full

    def size(self, gpu: int, fake: int) -> int:
        """A transfer size: large on a GPU, smaller on the fake (host memory), small in a quick run."""
        if self.quick:
            return MIB
        return gpu if self.on_gpu else fake

    def vector_add(self, gpu: GpuBackend | None = None) -> Kernel:
        """The shipped ``vector_add`` on ``gpu`` (the bench's backend by default); the kernel keeps its
        registry, so its module, loaded."""
        target = gpu or self.gpu
        return target.load_modules(shipped_modules("vector")).kernel("vector", "vector_add")

    def goals(self, *goals: Goal) -> tuple[Goal, ...]:
        """The goals, where they mean something: they are the CUDA backend's, so none on the fake."""
        return goals if self.on_gpu else ()

    def raw_figure(self, label: str, unit: str, value: float | None) -> Figure:
        """The baseline's figure ``label``; without a baseline, skipped, saying why."""
        if self.baseline is None or value is None:
            return Figure(label, "baseline", unit, None, note=f"skipped: {self.why_not}")
        return Figure(label, self.baseline.label, unit, value)


def _compare(figure: Figure, reference: Figure) -> Figure:
    return dataclasses.replace(figure, vs=reference.label, ratio=_ratio(figure.value, reference.value))


def _against_first(labels: Sequence[str], medians: Mapping[str, float], sources: Mapping[str, str]) -> list[Figure]:
    """Host times of ``labels`` (medians in seconds), each after the first compared with the first."""
    first = Figure(labels[0], sources[labels[0]], "us", _us(medians[labels[0]]))
    return [first] + [_compare(Figure(label, sources[label], "us", _us(medians[label])), first) for label in labels[1:]]


# -- the measurements ---------------------------------------------------------------------------------


def _pair(alloc: Callable[[int], Any], free: Callable[[Any], object], n: int) -> None:
    free(alloc(n))


def _alloc(b: _Bench) -> Result:
    """The ledger's cost: metrale's alloc + free against the raw pair, and with a red zone, at two sizes."""
    gpu = b.gpu
    rounds, calls = b.rounds(15), b.calls(400)
    sizes = (MIB, 64 * MIB)
    figures: list[Figure] = []
    goals: list[Goal] = []
    with ExitStack() as stack:
        zoned = stack.enter_context(
            open_backend(gpu.name, ordinal=gpu.ordinal, settings=gpu.settings.model_copy(update={"redzone": 4096}))
        )
        for backend in (gpu, zoned):  # a live allocation on each, as in a running application
            stack.callback(backend.free, backend.alloc(MIB))
        alloc, free, zalloc, zfree = gpu.alloc, gpu.free, zoned.alloc, zoned.free
        for n in sizes:
            size = _format_size(n)
            raw_label, ledger = f"raw alloc + free {size}", f"metrale {size} (ledger)"
            zone = f"metrale {size}, red zone"
            ops: dict[str, Callable[[], object]] = {}
            if b.baseline is not None:
                ops[raw_label] = b.baseline.alloc_free(n)
            ops[ledger] = functools.partial(_pair, alloc, free, n)
            ops[zone] = functools.partial(_pair, zalloc, zfree, n)
            b.say(f"  {size}: {len(ops)} ways, {rounds} rounds of {calls}")
            medians = _turns(ops, rounds=rounds, calls=calls)
            raw = b.raw_figure(raw_label, "us", _us(medians[raw_label]) if raw_label in medians else None)
            figures.append(raw)
            for label in (ledger, zone):
                us = _us(medians[label])
                added = f", +{us - raw.value:.2f} us" if raw.value is not None else ""
                note = f"{1e6 / us:,.0f} pairs/s{added}"
                figures.append(_compare(Figure(label, "metrale", "us", us, note=note), raw))
            if n == MIB:
                goals.append(Goal("the ledger adds at most 5% to the raw 1 MiB pair", figures[-2].ratio, 1.05, True))
    detail = f"host time per pair (red zone: 4 KiB), median of {rounds} rounds of {calls}, 1 MiB kept live"
    return Result("alloc", "ledgered allocation against the raw driver pair", detail, tuple(figures), b.goals(*goals))


def _pools(b: _Bench) -> Result:
    """metrale's arena against CuPy's memory pool and PyTorch's caching allocator."""
    gpu, n = b.gpu, MIB
    rounds, calls = b.rounds(15), b.calls(2000)
    arena = gpu.create_arena(64 * MIB)
    ops: dict[str, Callable[[], object]] = {}
    sources: dict[str, str] = {}
    skipped: list[Figure] = []
    alloc, reset = arena.alloc, arena.reset

    def arena_pair() -> None:
        alloc(n)
        reset()

    ops["metrale Arena.alloc + reset"] = arena_pair
    sources["metrale Arena.alloc + reset"] = "metrale"
    cupy, cupy_source = _cupy(gpu)
    label = "CuPy MemoryPool.malloc + release"
    if cupy is None:
        skipped.append(Figure(label, "cupy", "us", None, note=cupy_source))
    else:
        with cupy.cuda.Device(gpu.ordinal):
            malloc = cupy.cuda.MemoryPool().malloc
            malloc(n)  # the pool's first block, on the backend's device
        gpu.bind_to_thread()
        ops[label], sources[label] = (lambda: malloc(n)), cupy_source
    torch, torch_source = _torch(gpu)
    label = "torch.empty + release (caching allocator)"
    if torch is None:
        skipped.append(Figure(label, "torch", "us", None, note=torch_source))
    else:
        empty, u8, device = torch.empty, torch.uint8, torch.device("cuda", gpu.ordinal)
        ops[label], sources[label] = (lambda: empty(n, dtype=u8, device=device)), torch_source
    b.say(f"  {len(ops)} allocators, {rounds} rounds of {calls}")
    try:
        medians = _turns(ops, rounds=rounds, calls=calls)
    finally:
        arena.close()
    figures = _against_first(list(ops), medians, sources)
    detail = f"{_format_size(n)}, host time per allocation and release, median of {rounds} rounds of {calls}"
    return Result("pools", "the arena against the pools of CuPy and PyTorch", detail, (*figures, *skipped))


def _copies(b: _Bench) -> Result:
    """Copies through metrale against the raw driver's: bandwidth, with the wait for the copy."""
    gpu = b.gpu
    rounds, calls = b.rounds(7), 4
    sizes = {"dtod": b.size(GIB, 64 * MIB), "htod": b.size(256 * MIB, 64 * MIB), "dtoh": b.size(256 * MIB, 64 * MIB)}
    names = {"dtod": "D2D", "htod": "pinned H2D", "dtoh": "pinned D2H"}
    figures: list[Figure] = []
    goals: list[Goal] = []
    for direction, n in sizes.items():
        what = f"{names[direction]} {_format_size(n)}"
        b.say(f"  {what}")
        stream = gpu.default_stream
        allocated: list[Any] = []
        try:
            op: Callable[[], object]
            if direction == "dtod":
                dst = gpu.alloc(n)
                allocated.append(dst)
                src = gpu.alloc(n)
                allocated.append(src)
                gpu.memset(src, 1)
                op = functools.partial(gpu.copy_device, dst, src)
            else:
                dev = gpu.alloc(n)
                allocated.append(dev)
                host = gpu.alloc_host(n)
                allocated.append(host)
                if direction == "htod":
                    op = functools.partial(gpu.copy_to_device, dev, host)
                else:
                    op = functools.partial(gpu.copy_to_host, host, dev)
            ops: dict[str, Callable[[], object]] = {f"metrale {what}": op}
            finish: dict[str, Callable[[], object]] = {f"metrale {what}": stream.synchronize}
            if b.baseline is not None:
                ops[f"raw {what}"] = b.baseline.copy(direction, n)  # type: ignore[arg-type]
                finish[f"raw {what}"] = b.baseline.synchronize
            medians = _turns(ops, rounds=rounds, calls=calls, finish=finish)
        finally:
            for obj in allocated:
                gpu.free(obj)
        moved = 2 * n if direction == "dtod" else n  # D2D reads and writes every byte
        rate = {label: moved / seconds / 1e9 for label, seconds in medians.items()}
        raw = b.raw_figure(f"raw {what}", "GB/s", rate.get(f"raw {what}"))
        mine = _compare(Figure(f"metrale {what}", "metrale", "GB/s", rate[f"metrale {what}"]), raw)
        figures += [raw, mine]
        goals.append(Goal(f"{names[direction]} at least 97% of the raw copy", mine.ratio, 0.97, at_most=False))
    detail = f"bandwidth (D2D counts bytes read and written), {calls} copies and a wait per round, median of {rounds}"
    return Result("copy", "copies against the raw driver's", detail, tuple(figures), b.goals(*goals))


def _eager(b: _Bench) -> Result:
    """One small async memset and one small kernel launch: metrale's host cost over the raw call."""
    gpu = b.gpu
    rounds, calls, n = b.rounds(15), b.calls(256), 4096
    kernel = b.vector_add()
    count = ctypes.c_uint32(n)
    grid = (n + _BLOCK - 1) // _BLOCK
    stream = gpu.default_stream
    memset, launch = gpu.memset, gpu.launch
    with ExitStack() as stack:
        bufs = _buffers(gpu, stack, 3, 4 * n)
        ops: dict[str, Callable[[], object]] = {
            "metrale memset 4 KiB": lambda: memset(bufs[0], 0, nbytes=4 * KIB),
            "metrale launch vector_add": lambda: launch(kernel, grid, _BLOCK, (bufs[0], bufs[1], bufs[2], count)),
        }
        settle: dict[str, Callable[[], object]] = {label: stream.synchronize for label in ops}
        if b.baseline is not None:
            ops["raw memset 4 KiB"] = b.baseline.memset(4 * KIB)
            ops["raw launch vector_add"] = b.baseline.vector_add(n)
            settle["raw memset 4 KiB"] = settle["raw launch vector_add"] = b.baseline.synchronize
        b.say(f"  {len(ops)} operations, {rounds} rounds of {calls}")
        medians = _turns(ops, rounds=rounds, calls=calls, settle=settle)
        stream.synchronize()
    figures: list[Figure] = []
    for what in ("memset 4 KiB", "launch vector_add"):
        seconds = medians.get(f"raw {what}")
        raw = b.raw_figure(f"raw {what}", "us", None if seconds is None else _us(seconds))
        mine = _compare(Figure(f"metrale {what}", "metrale", "us", _us(medians[f"metrale {what}"])), raw)
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


def _capture_adds(gpu: GpuBackend, kernel: Kernel, stream: Stream, bufs: Sequence[Any], n: int, k: int) -> GraphExec:
    count = ctypes.c_uint32(n)
    grid = (n + _BLOCK - 1) // _BLOCK
    gpu.begin_capture(stream)
    try:
        for _ in range(k):
            gpu.launch(kernel, grid, _BLOCK, (bufs[0], bufs[1], bufs[2], count), stream=stream)
    except BaseException:
        with contextlib.suppress(MetraleError):
            gpu.end_capture(stream).close()
        raise
    graph = gpu.end_capture(stream)
    try:
        return graph.instantiate()
    finally:
        graph.close()


def _graph(b: _Bench) -> Result:
    """100 small launches: a metrale graph replayed, the same launches issued eagerly, a PyTorch graph."""
    gpu, k, n = b.gpu, 100, 4096
    rounds, calls = b.rounds(15), b.calls(20)
    kernel = b.vector_add()
    count = ctypes.c_uint32(n)
    grid = (n + _BLOCK - 1) // _BLOCK
    launch = gpu.launch
    device: dict[str, float] = {}
    torch_label = "torch.cuda.CUDAGraph replay"
    with ExitStack() as stack:
        stream = gpu.create_stream()
        stack.callback(stream.close)
        bufs = _buffers(gpu, stack, 3, 4 * n)
        stack.callback(stream.synchronize)  # before the buffers go
        exe = _capture_adds(gpu, kernel, stream, bufs, n, k)
        stack.callback(exe.close)
        start, end = gpu.create_event(), gpu.create_event()
        stack.callback(start.close)
        stack.callback(end.close)

        def replay() -> None:
            exe.launch(stream)

        def eager() -> None:
            args = (bufs[0], bufs[1], bufs[2], count)
            for _ in range(k):
                launch(kernel, grid, _BLOCK, args, stream=stream)

        def device_us(op: Callable[[], object]) -> float:
            times = []
            for _ in range(rounds + 1):
                start.record(stream)
                op()
                end.record(stream)
                end.synchronize()
                times.append(start.elapsed_ms(end) * 1e3)
            return statistics.median(times[1:])

        ops: dict[str, Callable[[], object]] = {"metrale graph replay": replay, f"metrale {k} eager launches": eager}
        settle: dict[str, Callable[[], object]] = {label: stream.synchronize for label in ops}
        sources = {label: "metrale" for label in ops}
        torch, torch_source = _torch(gpu)
        if torch is not None:
            torch_replay, torch_device, torch_sync = _torch_graph(torch, gpu.ordinal, k, n, rounds)
            gpu.bind_to_thread()
            ops[torch_label], settle[torch_label], sources[torch_label] = torch_replay, torch_sync, torch_source
        b.say(f"  host time: {len(ops)} ways, {rounds} rounds of {calls}")
        medians = _turns(ops, rounds=rounds, calls=calls, settle=settle)
        b.say("  device time, from events")
        device["metrale graph replay"] = device_us(replay)
        device[f"metrale {k} eager launches"] = device_us(eager)
        if torch is not None:
            device[torch_label] = torch_device()
            gpu.bind_to_thread()
    figures = _against_first(list(ops), medians, sources)
    if torch is None:
        figures.append(Figure(torch_label, "torch", "us", None, note=torch_source))
    device_reference = Figure("device time: metrale graph", "metrale", "us", device["metrale graph replay"])
    figures.append(device_reference)
    for label, us in device.items():
        if label != "metrale graph replay":
            name = "device time: " + label.replace(" replay", "").replace("metrale ", "")
            figures.append(_compare(Figure(name, sources[label], "us", us), device_reference))
    detail = f"{k} launches of vector_add over {n} float32 elements; host time per replay (or per {k} eager launches)"
    return Result("graph", f"a graph of {k} small kernels, replayed", detail, tuple(figures))


def _torch_graph(
    torch: Any, ordinal: int, k: int, n: int, rounds: int
) -> tuple[Callable[[], None], Callable[[], float], Callable[[], None]]:
    """A ``torch.cuda.CUDAGraph`` of ``k`` ``torch.add(a, b, out=c)`` over ``n`` float32 on device ``ordinal``:
    its replay, a function giving its device time per replay from CUDA events, and a wait."""
    on_device = functools.partial(torch.cuda.device, ordinal)
    with on_device():
        a, b_, c = (torch.ones(n, dtype=torch.float32, device=torch.device("cuda", ordinal)) for _ in range(3))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as PyTorch asks
            for _ in range(3):
                torch.add(a, b_, out=c)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(k):
                torch.add(a, b_, out=c)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replay() -> None:  # on another device than the current one only: a device guard costs host time
        with on_device():
            graph.replay()

    if torch.cuda.current_device() == ordinal:
        replay = graph.replay

    def synchronize() -> None:
        torch.cuda.synchronize(ordinal)

    def device_us() -> float:
        times = []
        with on_device():
            for _ in range(rounds + 1):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(float(start.elapsed_time(end)) * 1e3)
        return statistics.median(times[1:])

    return replay, device_us, synchronize


_LOOP_KERNELS: Final = 128


class _Loop:
    """An inference-style step: per-step scratch from an arena, a captured graph of the shipped
    kernels over a few MiB, and a small read back to the host, waited for."""

    def __init__(self, b: _Bench, gpu: GpuBackend, n: int) -> None:
        self.gpu = gpu
        self.stream = gpu.create_stream()
        self.kernel = b.vector_add(gpu)
        self.weights = [gpu.alloc(64 * KIB) for _ in range(32)]  # small live allocations, each with its zones
        self.bufs = [gpu.alloc(4 * n) for _ in range(3)]
        for buf in self.bufs:
            gpu.memset(buf, 0)
        self.arena = gpu.create_arena(8 * MIB)
        self.host = gpu.alloc_host(4 * KIB)
        self.exe = _capture_adds(gpu, self.kernel, self.stream, self.bufs, n, _LOOP_KERNELS)

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


def _safety(b: _Bench) -> Result:
    """The safety net's end-to-end cost: the same loop with metrale's checks off and fully on, the scan
    after each graph launch waiting for the device or queued behind the graph."""
    gpu, n = b.gpu, (MIB if b.on_gpu and not b.quick else 64 * KIB)  # float32 elements
    rounds, calls = b.rounds(15), b.calls(40)
    off = gpu.settings.model_copy(update={"redzone": 0, "redzone_lead": False, "redzone_scan_graphs": False})
    on = {"redzone": 4096, "redzone_lead": True, "redzone_min_idx": 0, "redzone_scan_graphs": True}
    configs = {
        "step, checks off": off,
        "step, checks on, scan waits": gpu.settings.model_copy(update={**on, "redzone_scan_queued": False}),
        "step, checks on, scan queued": gpu.settings.model_copy(update={**on, "redzone_scan_queued": True}),
    }
    with ExitStack() as stack:
        loops: dict[str, _Loop] = {}
        for label, settings in configs.items():
            backend = stack.enter_context(open_backend(gpu.name, ordinal=gpu.ordinal, settings=settings))
            loop = loops[label] = _Loop(b, backend, n)
            stack.callback(loop.close)
        b.say(f"  {rounds} rounds of {calls} steps, the three configurations in turns")
        medians = _turns({label: loop.step for label, loop in loops.items()}, rounds=rounds, calls=calls)
    plain = Figure("step, checks off", "metrale", "us", _us(medians["step, checks off"]))
    figures = [plain]
    for label in list(configs)[1:]:
        us = _us(medians[label])
        note = f"+{us - (plain.value or 0):.1f} us a step"
        figures.append(_compare(Figure(label, "metrale", "us", us, note=note), plain))
    goals = b.goals(
        Goal("the safety net, scans queued, adds under 1% to a step", figures[2].ratio, 1.01, at_most=True),
        Goal("the safety net, scans waiting, adds under 1% to a step", figures[1].ratio, 1.01, at_most=True),
    )
    detail = (
        f"host time per step: 1 MiB of arena scratch, a graph of {_LOOP_KERNELS} vector_add over {_format_size(4 * n)} "
        f"buffers, a 4 KiB read back and a wait; checks on: 4 KiB red zones front and back on every allocation, "
        f"a scan of every zone after every graph launch; median of {rounds} rounds of {calls}"
    )
    return Result("safety", "the safety net's cost in an inference-style loop", detail, tuple(figures), goals)


@dataclasses.dataclass(frozen=True, slots=True)
class Measurement:
    """A named measurement ``--only`` can pick."""

    name: str
    title: str
    run: Callable[[_Bench], Result]


#: Every measurement, in the order they run.
MEASUREMENTS: Final[tuple[Measurement, ...]] = (
    Measurement("alloc", "ledgered alloc + free against the raw pair", _alloc),
    Measurement("pools", "the arena against CuPy's and PyTorch's pools", _pools),
    Measurement("copy", "D2D and pinned copies against the raw driver's", _copies),
    Measurement("eager", "eager memset and launch against the raw calls", _eager),
    Measurement("graph", "a graph of 100 small kernels against eager launches and PyTorch", _graph),
    Measurement("safety", "checks off against fully on in an inference-style loop", _safety),
)


def pick(only: str | None) -> tuple[Measurement, ...]:
    """The measurements a comma-separated ``--only`` names (all when ``None``); refuses unknown names."""
    if only is None:
        return MEASUREMENTS
    names = [name.strip() for name in only.split(",") if name.strip()]
    known = {m.name: m for m in MEASUREMENTS}
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise InvalidArgumentError(
            f"bench --only {only!r}: no measurement named {', '.join(unknown) or 'at all'}; "
            f"choose from {', '.join(known)}"
        )
    return tuple(m for m in MEASUREMENTS if m.name in names)


@contextmanager
def _baseline(gpu: GpuBackend) -> Iterator[tuple[Baseline | None, str]]:
    try:
        baseline = gpu.raw.baseline()
    except MetraleError as exc:
        yield None, f"backend {gpu.name} offers no baseline ({exc.message})"
        return
    try:
        yield baseline, ""
    finally:
        baseline.close()


def _versions(gpu: GpuBackend, baseline: Baseline | None) -> dict[str, str]:
    from . import __version__

    versions = {"metrale": __version__, "python": platform.python_version()}
    if baseline is not None:
        versions.update(baseline.versions)
    for module, name in (("numpy", "numpy"), ("cupy", "cupy"), ("torch", "torch")):
        try:
            imported = __import__(module)
            versions[name] = str(imported.__version__)
        except Exception:  # an absent or broken peer is said so where it is skipped
            continue
    return versions


def run_bench(
    settings: MetraleSettings,
    *,
    only: str | None = None,
    quick: bool = False,
    progress: Progress = lambda line: None,
) -> BenchReport:
    """Run the measurements ``only`` names (all by default) on the backend ``settings`` pick.

    ``quick`` runs each with a few small rounds: a smoke run whose figures mean little.
    ``progress`` receives a line as each measurement starts and as its parts run.
    """
    chosen = pick(only)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    with open_backend(settings=settings) as gpu, _baseline(gpu) as (baseline, why_not):
        bench = _Bench(gpu, baseline, why_not, quick, progress)
        results = []
        for i, measurement in enumerate(chosen, 1):
            progress(f"[{i}/{len(chosen)}] {measurement.name}: {measurement.title}")
            started = time.perf_counter()
            results.append(measurement.run(bench))
            progress(f"      {measurement.name} done in {time.perf_counter() - started:.1f} s")
        return BenchReport(date, gpu.name, gpu.device_name, _versions(gpu, baseline), quick, tuple(results))
