"""The measurement of red-zone checks themselves (``zones``): the scan kernel and the in-graph
verdict kernel over many zones (device time, between two events), and ``scan_redzones()`` over
the same zones (host time, waiting included)."""

from __future__ import annotations

import ctypes
import functools
import struct
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Final

from ... import GpuBackend, Kernel, MetraleError, Stream, open_backend
from ...kernels import shipped_modules
from .context import Bench
from .model import Figure, Goal, Result
from .timing import KIB, to_us

__all__ = ["measure_zones"]

_ZONE = 4 * KIB
_GRID = 1024  # the in-graph check's grid (metrale_core._redzones.ingraph.GRID)


#: Launches captured into the graph whose replay is timed: the device time of one is the replay's over this.
_REPLAYS: Final = 20


def _device_us(gpu: GpuBackend, launch: Callable[[Stream], None], repeat: int) -> float:
    """Median device time of one ``launch(stream)`` (one kernel), in microseconds: `_REPLAYS` of them
    captured into a graph, replayed between two events, so no host time shows between the kernels."""
    stream = gpu.create_stream()
    start, end = gpu.create_event(), gpu.create_event()
    gpu.begin_capture(stream)
    for _ in range(_REPLAYS):
        launch(stream)
    graph = gpu.end_capture(stream)
    exe = graph.instantiate()
    try:
        times = []
        for _ in range(repeat):
            start.record(stream)
            exe.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_ms(end) * 1000.0 / _REPLAYS)
        times.sort()
        return times[len(times) // 2]
    finally:
        exe.close()
        graph.close()
        start.close()
        end.close()
        stream.close()


class _Zones:
    """``count`` zones of 4 KiB laid out as metrale's are (trailing zones of live buffers), with the
    tables the two kernels read."""

    def __init__(self, gpu: GpuBackend, count: int) -> None:
        self.gpu = gpu
        self.count = count
        self.bufs = [gpu.alloc(256) for _ in range(count)]
        fill = gpu.settings.redzone_fill
        pairs = b"".join(struct.pack("<2Q", buf.ptr + buf.nbytes, _ZONE) for buf in self.bufs)
        self.table = gpu.alloc(max(len(pairs), 16))
        gpu.copy_to_device(self.table, pairs)
        self.result = gpu.alloc(4 * count)
        self.desc = gpu.alloc(32)
        gpu.copy_to_device(self.desc, struct.pack("<4Q", self.table.ptr, count, 1, fill))
        self.state = gpu.alloc(16)
        gpu.memset(self.state, 0)
        self.slot = gpu.alloc(32)
        gpu.synchronize()

    def scan(self, kernel: Kernel, stream: Stream) -> None:
        fill = ctypes.c_uint32(self.gpu.settings.redzone_fill)
        self.gpu.launch(kernel, self.count, 256, [self.table, ctypes.c_uint32(self.count), fill, self.result],
                        stream=stream)

    def verdict(self, kernel: Kernel, stream: Stream) -> None:
        self.gpu.launch(kernel, _GRID, 256, [self.desc, self.state, self.slot], stream=stream)

    def close(self) -> None:
        for buf in [*self.bufs, self.table, self.result, self.desc, self.state, self.slot]:
            self.gpu.free(buf)


def _kernels(gpu: GpuBackend) -> tuple[Kernel, Kernel | None]:
    registry = gpu.load_modules(shipped_modules("redzone"))
    scan = registry.kernel("redzone", "redzone_scan")
    try:
        verdict: Kernel | None = registry.kernel("redzone", "redzone_verdict")
    except MetraleError:  # an older module without the in-graph kernel
        verdict = None
    return scan, verdict


def measure_zones(b: Bench) -> Result:
    """The checks themselves: device time of the scan and verdict kernels, host time of ``scan_redzones()``."""
    counts = (1_000, 10_000) if b.on_gpu and not b.quick else (100, 1_000)
    repeat = 5 if b.quick else 25
    figures: list[Figure] = []
    goals: list[Goal] = []
    settings = b.gpu.settings.model_copy(
        update={"redzone": _ZONE, "redzone_lead": False, "redzone_quarantine_bytes": 0, "redzone_scan_graphs": False}
    )
    with ExitStack() as stack:
        gpu = stack.enter_context(open_backend(b.gpu.name, ordinal=b.gpu.ordinal, settings=settings))
        try:
            scan, verdict = _kernels(gpu)
        except MetraleError as exc:  # a backend that runs no kernels
            note = f"skipped: {exc}"
            return Result("zones", "red-zone checks over many zones", note,
                          (Figure("scan kernel", "metrale", "us", None, note=note),))
        for count in counts:
            zones = _Zones(gpu, count)
            stack.callback(zones.close)
            b.say(f"  {count:,} zones: the scan kernel, the verdict kernel, scan_redzones()")
            us = _device_us(gpu, functools.partial(zones.scan, scan), repeat)
            figures.append(Figure(f"scan kernel, {count:,} zones (device time)", "metrale", "us", us,
                                  note=f"{count * _ZONE / us / 1e3:,.0f} GB/s"))
            if count == 10_000:
                goals.append(Goal("10,000 zones of 4 KiB scan in at most 50 us of device time", us, 50.0, True))
            if verdict is not None:
                us = _device_us(gpu, functools.partial(zones.verdict, verdict), repeat)
                figures.append(Figure(f"in-graph verdict kernel, {count:,} zones (device time)", "metrale", "us", us,
                                      note=f"{count * _ZONE / us / 1e3:,.0f} GB/s"))
                if count == 1_000:
                    goals.append(Goal("the in-graph check of 1,000 zones takes at most 5 us of device time", us,
                                      5.0, True))
            host = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                gpu.scan_redzones()
                host.append(time.perf_counter() - t0)
            host.sort()
            figures.append(Figure(f"scan_redzones(), {count:,} live zones (host time)", "metrale", "us",
                                  to_us(host[len(host) // 2]), note="waits for the device, launches, copies back"))
    detail = (
        f"zones of {_ZONE // KIB} KiB after 256-byte buffers; device time: {_REPLAYS} launches in a graph, replayed "
        f"between two events; median of {repeat}"
    )
    return Result("zones", "red-zone checks over many zones", detail, tuple(figures), b.goals(*goals))

