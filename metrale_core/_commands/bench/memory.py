"""The measurements of memory: ledgered allocation against the raw pair (``alloc``), the arena
against CuPy's and PyTorch's pools (``pools``), and copies against the raw driver's (``copy``)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from ... import MetraleError, RawDevice, device_count, open_backend
from .context import Bench
from .model import Figure, Goal, Result
from .peers import find_cupy, find_torch
from .timing import GIB, KIB, MIB, against_first, compare, format_size, to_us, turns

__all__ = ["measure_alloc", "measure_copies", "measure_pools"]


def _pair(alloc: Callable[[int], Any], free: Callable[[Any], object], n: int) -> None:
    free(alloc(n))


def measure_alloc(b: Bench) -> Result:
    """The ledger's cost: metrale's alloc + free against the raw pair, and with a red zone, at two sizes."""
    gpu = b.gpu
    rounds, calls = b.rounds(15), b.calls(400)
    sizes = (64 * KIB, MIB, 64 * MIB)
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
            size = format_size(n)
            raw_label, ledger = f"raw alloc + free {size}", f"metrale {size} (ledger)"
            zone = f"metrale {size}, red zone"
            ops: dict[str, Callable[[], object]] = {}
            if b.baseline is not None:
                ops[raw_label] = b.baseline.alloc_free(n)
            ops[ledger] = functools.partial(_pair, alloc, free, n)
            ops[zone] = functools.partial(_pair, zalloc, zfree, n)
            b.say(f"  {size}: {len(ops)} ways, {rounds} rounds of {calls}")
            medians = turns(ops, rounds=rounds, calls=calls)
            raw = b.raw_figure(raw_label, "us", to_us(medians[raw_label]) if raw_label in medians else None)
            figures.append(raw)
            for label in (ledger, zone):
                us = to_us(medians[label])
                added = f", +{us - raw.value:.2f} us" if raw.value is not None else ""
                note = f"{1e6 / us:,.0f} pairs/s{added}"
                figures.append(compare(Figure(label, "metrale", "us", us, note=note), raw))
            if n == MIB:
                goals.append(Goal("the ledger adds at most 5% to the raw 1 MiB pair", figures[-2].ratio, 1.05, True))
            if n <= MIB:
                zone_us = to_us(medians[zone]) - to_us(medians[ledger])
                goals.append(Goal(f"a red zone adds at most 5 us to a {size} pair (us added)", zone_us, 5.0, True))
    detail = (
        f"host time per pair (red zone: 4 KiB, freed buffers checked in batches from the quarantine, intact blocks "
        f"reused), median of {rounds} rounds of {calls}, 1 MiB kept live"
    )
    return Result("alloc", "ledgered allocation against the raw driver pair", detail, tuple(figures), b.goals(*goals))


def measure_pools(b: Bench) -> Result:
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
    cupy, cupy_source = find_cupy(gpu, b.cuda_memory)
    label = "CuPy MemoryPool.malloc + release"
    if cupy is None:
        skipped.append(Figure(label, "cupy", "us", None, note=cupy_source))
    else:
        with cupy.cuda.Device(gpu.ordinal):
            malloc = cupy.cuda.MemoryPool().malloc
            malloc(n)  # the pool's first block, on the backend's device
        gpu.bind_to_thread()
        ops[label], sources[label] = (lambda: malloc(n)), cupy_source
    torch, torch_source = find_torch(gpu, b.cuda_memory)
    label = "torch.empty + release (caching allocator)"
    if torch is None:
        skipped.append(Figure(label, "torch", "us", None, note=torch_source))
    else:
        empty, u8, device = torch.empty, torch.uint8, torch.device("cuda", gpu.ordinal)
        ops[label], sources[label] = (lambda: empty(n, dtype=u8, device=device)), torch_source
    b.say(f"  {len(ops)} allocators, {rounds} rounds of {calls}")
    try:
        medians = turns(ops, rounds=rounds, calls=calls)
    finally:
        arena.close()
    figures = against_first(list(ops), medians, sources)
    detail = f"{format_size(n)}, host time per allocation and release, median of {rounds} rounds of {calls}"
    return Result("pools", "the arena against the pools of CuPy and PyTorch", detail, (*figures, *skipped))


def measure_copies(b: Bench) -> Result:
    """Copies through metrale against the raw driver's: bandwidth, with the wait for the copy."""
    gpu = b.gpu
    rounds, calls = b.rounds(7), 4
    sizes = {"dtod": b.size(GIB, 64 * MIB), "htod": b.size(256 * MIB, 64 * MIB), "dtoh": b.size(256 * MIB, 64 * MIB)}
    names = {"dtod": "D2D", "htod": "pinned H2D", "dtoh": "pinned D2H"}
    figures: list[Figure] = []
    goals: list[Goal] = []
    for direction, n in sizes.items():
        what = f"{names[direction]} {format_size(n)}"
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
            medians = turns(ops, rounds=rounds, calls=calls, finish=finish)
        finally:
            for obj in allocated:
                gpu.free(obj)
        moved = 2 * n if direction == "dtod" else n  # D2D reads and writes every byte
        rate = {label: moved / seconds / 1e9 for label, seconds in medians.items()}
        raw = b.raw_figure(f"raw {what}", "GB/s", rate.get(f"raw {what}"))
        mine = compare(Figure(f"metrale {what}", "metrale", "GB/s", rate[f"metrale {what}"]), raw)
        figures += [raw, mine]
        goals.append(Goal(f"{names[direction]} at least 97% of the raw copy", mine.ratio, 0.97, at_most=False))
    peer_figures, peer_goal = _peer_copy(b, rounds, calls)
    figures += peer_figures
    goals += peer_goal
    detail = (f"bandwidth (D2D and peer copies count bytes read and written), {calls} copies and a wait per round, "
              f"median of {rounds}")
    return Result("copy", "copies against the raw driver's", detail, tuple(figures), b.goals(*goals))


def _peer_copy(b: Bench, rounds: int, calls: int) -> tuple[list[Figure], list[Goal]]:
    """``copy_peer`` from a second backend of the same plugin (ordinal 1 where there are two devices, else
    another backend on this device) against the baseline's ``copy_peer`` (``cuMemcpyPeerAsync``)."""
    gpu = b.gpu
    n = b.size(GIB, 64 * MIB)
    try:
        count = device_count(gpu.name, settings=gpu.settings)
    except MetraleError:
        count = 1
    ordinal = (gpu.ordinal + 1) % count if count > 1 else gpu.ordinal
    what = f"peer copy {format_size(n)} from ordinal {ordinal}"
    if type(gpu.raw).copy_peer is RawDevice.copy_peer:  # (no row: metrale's own figures are always measured)
        b.say(f"  {what}: skipped, backend {gpu.name} copies between no devices")
        return [], []
    b.say(f"  {what}")
    with ExitStack() as stack:
        peer = stack.enter_context(open_backend(gpu.name, ordinal=ordinal, settings=gpu.settings))
        src, dst = peer.alloc(n), gpu.alloc(n)
        stack.callback(peer.free, src)
        stack.callback(gpu.free, dst)
        peer.memset(src, 1)
        peer.synchronize()
        if ordinal != gpu.ordinal:
            with contextlib.suppress(MetraleError):  # the direct path where there is one; else through the host
                gpu.enable_peer_access(peer)
        ops: dict[str, Callable[[], object]] = {f"metrale {what}": functools.partial(gpu.copy_peer, dst, src)}
        finish: dict[str, Callable[[], object]] = {f"metrale {what}": gpu.default_stream.synchronize}
        raw_value: str | None = None
        if b.baseline is not None:
            try:
                ops[f"raw {what}"] = b.baseline.copy_peer(n, ordinal)
                finish[f"raw {what}"] = b.baseline.synchronize
            except MetraleError as exc:
                if exc.name != "CUDA_ERROR_NOT_SUPPORTED":
                    raise
                raw_value = f"the baseline has no peer copy: {exc}"
        medians = turns(ops, rounds=rounds, calls=calls, finish=finish)
    rate = {label: 2 * n / seconds / 1e9 for label, seconds in medians.items()}
    if raw_value is not None:
        raw = Figure(f"raw {what}", "baseline", "GB/s", None, note=f"skipped: {raw_value}")
    else:
        raw = b.raw_figure(f"raw {what}", "GB/s", rate.get(f"raw {what}"))
    mine = compare(Figure(f"metrale {what}", "metrale", "GB/s", rate[f"metrale {what}"]), raw)
    return [raw, mine], [Goal("peer copy at least 97% of the raw copy", mine.ratio, 0.97, at_most=False)]
