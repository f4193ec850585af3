"""Where the host time of one call goes: each step of it timed alone, in turns with the whole call.

The steps are built here, from the parts' own methods, never from code kept in the product for the bench:

- `pair_steps`: an unzoned ``alloc`` + ``free`` (``breakdown``): the raw pair, its error handling, the gate,
  the capture rule, the call site, the index and handle, the ledger, the stats, the release observers;
- `memset_steps` and `launch_steps`: an eager ``memset`` and ``launch`` (``eager_breakdown``);
- `measure_breakdown` and `measure_eager_breakdown`: the two measurements.

The ledger, the stats and the run metrics are private instances (the backend's are left alone); the
gate and the release observers are the backend's, through `metrale_core._backend.parts`. The rest of
a whole call is what its steps cost together beyond their parts.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Final

from ... import DeviceBuffer, GpuBackend, Kernel, open_backend
from ..._backend import parts
from ..._device.args import dims
from ..._device.capture import call_entered, call_left, forbid_during_capture
from ..._device.context import Launch
from ..._device.guarded import raise_raw
from ..._device.stats import StatsCounter
from ..._errors import InvalidBufferError
from ..._launch.pack import pack_args
from ..._launch.registry import MAX_BLOCK, MAX_GRID, RunMetrics
from ..._memory.ledger import Ledger
from ..._memory.records import next_index
from ..._memory.sites import call_site_for
from ..._twins import pick
from .context import Bench
from .launches import BLOCK, EAGER_N
from .model import Figure, Result
from .timing import KIB, MIB, share, to_us, turns

__all__ = ["PairSteps", "launch_steps", "measure_breakdown", "measure_eager_breakdown", "memset_steps", "pair_steps"]

Op = Callable[[], object]

_PAIR: Final = "metrale alloc + free 1 MiB"
_RAW_PAIR: Final = "the plugin's raw alloc + free"
_GUARDED_PAIR: Final = "the same with the core's error handling"


@dataclasses.dataclass(frozen=True, slots=True)
class PairSteps:
    """The steps of an ``alloc`` + ``free`` pair, each a callable doing what that step does.

    - ``raw``: the plugin's own pair;
    - ``guarded``: the same with the core's handling of raw errors;
    - ``parts``: the core's steps around it, by label.
    """

    raw: Op
    guarded: Op
    parts: dict[str, Op]


def _gate(gpu: GpuBackend, times: int) -> Op:
    """The backend's gate, entered and left ``times`` times."""
    ctx = parts(gpu).context

    def gate() -> None:
        for _ in range(times):
            ctx.enter()
            ctx.leave()

    return gate


def pair_steps(gpu: GpuBackend, nbytes: int, sample: DeviceBuffer) -> PairSteps:
    """The steps of an unzoned ``alloc`` + ``free`` of ``nbytes`` on ``gpu``; ``sample`` is a live buffer
    of it (the ledger's step adds and takes it on a ledger of its own)."""
    backend = parts(gpu)
    ctx, raw = backend.context, gpu.raw
    internal = ctx.internal
    pure = gpu.settings.pure  # the classes the backend runs: the compiled twins where built
    ledger, stats = pick("ledger", Ledger, pure)(), pick("stats", StatsCounter, pure)()

    def capture_rule() -> None:
        for _ in range(2):
            call_entered()
            forbid_during_capture("probe")
            call_left()

    def guarded() -> None:  # the raw calls as the hot path makes them: errors turned by raise_raw
        try:
            ptr = raw.alloc(nbytes, "device")
        except Exception as exc:
            raise_raw(ctx, ctx.name, "alloc", exc)
        try:
            raw.free(ptr, "device")
        except Exception as exc:
            raise_raw(ctx, ctx.name, "free", exc)

    def index_and_handle() -> None:
        DeviceBuffer._make(1 << 40, nbytes, "device", next_index(), "probe:0", ctx.ref)

    def ledger_pair() -> None:
        ledger.add(sample)
        ledger.take(sample.index, sample.ptr, sample.nbytes)

    def stats_pair() -> None:
        stats.allocated("device", nbytes)
        stats.released("device", nbytes)

    def observers() -> None:
        for observer in backend.release_observers:
            observer(sample)

    return PairSteps(
        raw=lambda: raw.free(raw.alloc(nbytes, "device"), "device"),
        guarded=guarded,
        parts={
            "the gate (enter + leave, twice)": _gate(gpu, 2),
            "the capture rule (check + end, twice)": capture_rule,
            "the call site": functools.partial(call_site_for(pure), internal),
            "index and handle": index_and_handle,
            "ledger (on + off)": ledger_pair,
            "stats (allocated + released)": stats_pair,
            "release observers": observers,
        },
    )


def _live_on(ledger: Ledger) -> Callable[[DeviceBuffer], None]:
    """A launch's liveness check of a buffer argument, against ``ledger``."""

    def live(buf: DeviceBuffer) -> None:
        if not ledger.has(buf):
            raise InvalidBufferError(f"launch: allocation #{buf.index} is not live")

    return live


def memset_steps(gpu: GpuBackend, buf: DeviceBuffer, nbytes: int) -> dict[str, Op]:
    """The steps of an eager ``memset`` of ``nbytes`` of ``buf`` on the default stream."""
    raw, raw_stream, ptr = gpu.raw, gpu.default_stream.raw, buf.ptr
    ledger = pick("ledger", Ledger, gpu.settings.pure)()
    ledger.add(buf)
    return {
        "memset: the plugin's raw memset": lambda: raw.memset(ptr, 0, nbytes, raw_stream),
        "memset: the gate (enter + leave)": _gate(gpu, 1),
        "memset: the liveness check": functools.partial(ledger.has, buf),
    }


def launch_steps(gpu: GpuBackend, kernel: Kernel, grid: int, block: int, args: Sequence[object]) -> dict[str, Op]:
    """The steps of an eager ``launch`` of ``kernel`` on the default stream; the caller holds the buffers."""
    ctx, raw, raw_stream = parts(gpu).context, gpu.raw, gpu.default_stream.raw
    ledger = pick("ledger", Ledger, gpu.settings.pure)()
    for arg in args:
        if isinstance(arg, DeviceBuffer):
            ledger.add(arg)
    live = _live_on(ledger)
    packed = pack_args(kernel, args, "launch", live)
    g, b = dims(grid, "grid", MAX_GRID), dims(block, "block", MAX_BLOCK)
    metrics, function, key = RunMetrics(), kernel.raw, kernel.key
    recent: collections.deque[Launch] = collections.deque(maxlen=8)

    def shape() -> None:
        kernel.registry._owned_by(ctx)
        dims(grid, "grid", MAX_GRID)
        dims(block, "block", MAX_BLOCK)

    def record() -> None:
        recent.append((kernel.module, kernel.name, g, b, packed))
        metrics.launched(key)

    return {
        "launch: the plugin's raw launch (arguments packed)": lambda: raw.launch(function, g, b, 0, raw_stream, packed),
        "launch: the gate (enter + leave)": _gate(gpu, 1),
        "launch: the kernel, grid and block checks": shape,
        "launch: the arguments checked and packed": lambda: pack_args(kernel, args, "launch", live),
        "launch: kept for fault reports, counted": record,
    }


def _pair(alloc: Callable[[int], DeviceBuffer], free: Callable[[DeviceBuffer], None], n: int) -> None:
    free(alloc(n))


def measure_breakdown(b: Bench) -> Result:
    """Where the host time of a ledgered 1 MiB alloc + free goes: each step timed alone, in turns with the
    whole pair; the rest is what the steps cost together beyond their parts (calls between them)."""
    gpu, n = b.gpu, MIB
    rounds, calls = b.rounds(15), b.calls(400)
    settings = gpu.settings.model_copy(update={"redzone": 0})
    with open_backend(gpu.name, ordinal=gpu.ordinal, settings=settings) as plain:
        keep = plain.alloc(MIB)  # a live allocation, as in a running application
        steps = pair_steps(plain, n, keep)
        ops: dict[str, Op] = {_PAIR: functools.partial(_pair, plain.alloc, plain.free, n), _RAW_PAIR: steps.raw,
                              _GUARDED_PAIR: steps.guarded, **steps.parts}
        b.say(f"  {len(ops)} steps, {rounds} rounds of {calls}")
        medians = turns(ops, rounds=rounds, calls=calls)
        plain.free(keep)
    total = to_us(medians[_PAIR])
    figures = [Figure(_PAIR, "metrale", "us", total, note="the whole pair")]
    raw = to_us(medians[_RAW_PAIR])
    figures.append(Figure(_RAW_PAIR, "metrale", "us", raw, note=f"{raw / total:.0%} of the pair"))
    guard = to_us(medians[_GUARDED_PAIR]) - raw
    figures.append(share("the core's handling of raw errors", guard, total))
    mine = _steps(steps.parts, medians, total, "pair")
    figures += mine
    rest = total - raw - guard - sum(f.value or 0.0 for f in mine)
    figures.append(share("the rest (calls and checks between the steps)", rest, total))
    detail = (f"host time of each step of a ledgered 1 MiB pair without red zones, timed alone; median of "
              f"{rounds} rounds of {calls}, in turns with the whole pair")
    return Result("breakdown", "where the time of a ledgered alloc + free goes", detail, tuple(figures), ())


def _steps(steps: dict[str, Op], medians: dict[str, float], total: float, whole: str) -> list[Figure]:
    """A figure per step: its host time and its share of the ``whole`` (``total`` microseconds)."""
    figures = []
    for label in steps:
        us = to_us(medians[label])
        figures.append(Figure(label, "metrale", "us", us, note=f"{us / total:.0%} of the {whole}"))
    return figures


def measure_eager_breakdown(b: Bench) -> Result:
    """Where the host time of an eager memset and launch goes: each step timed alone, in turns with the
    whole call (as ``breakdown`` does for the pair); the rest is what the steps cost together beyond
    their parts (the calls between them, the bounds and stream checks)."""
    gpu = b.gpu
    rounds, calls, n = b.rounds(15), b.calls(256), EAGER_N
    kernel, count, grid, stream = b.vector_add(), ctypes.c_uint32(n), (n + BLOCK - 1) // BLOCK, gpu.default_stream
    with ExitStack() as stack:
        bufs = []
        for _ in range(3):
            buf = gpu.alloc(4 * n)
            stack.callback(gpu.free, buf)
            bufs.append(buf)
        args = (bufs[0], bufs[1], bufs[2], count)
        calls_steps = {
            "metrale memset 4 KiB": (
                lambda: gpu.memset(bufs[0], 0, nbytes=4 * KIB), memset_steps(gpu, bufs[0], 4 * KIB)
            ),
            "metrale launch vector_add": (
                lambda: gpu.launch(kernel, grid, BLOCK, args), launch_steps(gpu, kernel, grid, BLOCK, args)
            ),
        }
        ops: dict[str, Op] = {whole: call for whole, (call, _) in calls_steps.items()}
        for _, steps in calls_steps.values():
            ops.update(steps)
        b.say(f"  {len(ops)} steps, {rounds} rounds of {calls}")
        medians = turns(ops, rounds=rounds, calls=calls, settle=dict.fromkeys(ops, stream.synchronize))
        stream.synchronize()
    figures: list[Figure] = []
    for (whole, (_, steps)), prefix in zip(calls_steps.items(), ("memset: ", "launch: "), strict=True):
        total = to_us(medians[whole])
        figures.append(Figure(whole, "metrale", "us", total, note="the whole call"))
        mine = _steps(steps, medians, total, "call")
        figures += mine
        rest = total - sum(f.value or 0.0 for f in mine)
        figures.append(share(f"{prefix}the rest (calls and checks between the steps)", rest, total, "call"))
    detail = (f"host time of each step of an eager 4 KiB memset and a launch over {n} float32 elements, timed "
              f"alone; median of {rounds} rounds of {calls}, in turns with the whole calls")
    return Result("eager_breakdown", "where the time of an eager memset and launch goes", detail, tuple(figures))
