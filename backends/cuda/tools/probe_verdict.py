#!/usr/bin/env python3
"""What the in-graph red-zone verdict costs the device, and which of its parts (a measurement, not a test).

Raw cuda.bindings and the shipped kernels' sources only, metrale not imported: a graph of ``KERNELS`` shipped
``vector_add`` over 1 Mi float32 elements (as ``metrale bench --only safety``'s step), then one more node of each
variant below, timed between two events per launch (device time) and as a whole step (the launch, a 4 KiB read
back, a wait: host time), in turns, medians of many launches. ``ZONES`` zones of 4 KiB, filled, in a table in device
memory, as metrale writes it.

- ``none``: no node (the reference).
- ``shipped/G``: the shipped ``redzone_verdict`` with a grid of G blocks (metrale launches 1024).
- ``nofence/G``: the same kernel without ``__threadfence_system`` (its slot order is then not guaranteed).
- ``devslot/G``: the shipped kernel writing its slot into device memory instead of mapped host memory.
- ``empty``: an empty kernel node, grid 1: what any node costs.
- ``side``: no node; the shipped kernel launched after the graph on a second stream that waits for the graph
  (an event), so the step's read back and wait do not wait for it.
- ``zoned``, ``zoned+shipped/1024``: no node, and the shipped node, over buffers laid out as red zones lay them
  out (each allocated 8 KiB larger, the kernels' pointer 4 KiB in); ``padded``: the same allocations, the pointer
  at their start; ``zoned2m``: each allocated 2 MiB + 4 KiB larger, the pointer 2 MiB in (a 2 MiB page's start,
  its lead zone the 4 KiB before). They tell the layout's share of a checked graph's device time from the node's.

Needs ``nvcc`` on the PATH. Run on a GPU machine::

    python3 backends/cuda/tools/probe_verdict.py
"""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cuda.bindings import driver as drv

KERNELS = 128
N = 1 << 20
BLOCK = 256
ZONES = int(os.environ.get("PROBE_ZONES", "80"))
ZONE = 4096
FILL = 0xA5
LAUNCHES = 200
TURNS = 3


def ok(result: tuple[Any, ...]) -> Any:
    err, *rest = result
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def ptx(source: str) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        cu, out = Path(tmp, "k.cu"), Path(tmp, "k.ptx")
        cu.write_text(source)
        subprocess.run(["nvcc", "-ptx", "-arch=compute_75", "-o", str(out), str(cu)], check=True)
        return out.read_bytes() + b"\0"


def main() -> None:
    ok(drv.cuInit(0))
    dev = ok(drv.cuDeviceGet(0))
    ctx = ok(drv.cuDevicePrimaryCtxRetain(dev))
    ok(drv.cuCtxSetCurrent(ctx))
    name = ok(drv.cuDeviceGetName(64, dev))
    kernels = Path(__file__).resolve().parents[3] / "metrale_core" / "kernels"
    shipped_cu = (kernels / "redzone.cu").read_text()
    nofence_cu = shipped_cu.replace("__threadfence_system();", "")
    assert nofence_cu != shipped_cu
    empty_cu = 'extern "C" __global__ void empty_node(const unsigned long long* a, unsigned long long* b, ' \
               'unsigned long long* c) {}\n'

    def function(image: bytes, fn: bytes) -> object:
        module = ok(drv.cuModuleLoadData(image))
        return ok(drv.cuModuleGetFunction(module, fn))

    vector_add = function((kernels / "vector.ptx").read_bytes() + b"\0", b"vector_add")
    verdict = function(ptx(shipped_cu), b"redzone_verdict")
    verdict_nofence = function(ptx(nofence_cu), b"redzone_verdict")
    empty = function(ptx(empty_cu), b"empty_node")

    stream = ok(drv.cuStreamCreate(1))
    side = ok(drv.cuStreamCreate(1))
    after_graph = ok(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING))
    start = ok(drv.cuEventCreate(0))
    end = ok(drv.cuEventCreate(0))
    a, b, c = (int(ok(drv.cuMemAlloc(4 * N))) for _ in range(3))
    zoned_bases = [int(ok(drv.cuMemAlloc(4 * N + 2 * ZONE))) for _ in range(3)]
    for p in (a, b, c, *zoned_bases):
        ok(drv.cuMemsetD8(p, 0, 4 * N))
    padded = tuple(zoned_bases)
    zoned = tuple(p + ZONE for p in zoned_bases)
    big_bases = [int(ok(drv.cuMemAlloc(4 * N + (2 << 20) + ZONE))) for _ in range(3)]
    zoned2m = tuple(p + (2 << 20) for p in big_bases)
    for p in zoned2m:
        ok(drv.cuMemsetD8(p, 0, 4 * N))
    print("offsets in 2 MiB pages: plain", [hex(p % (2 << 20)) for p in (a, b, c)], "zoned",
          [hex(p % (2 << 20)) for p in zoned], "zoned2m", [hex(p % (2 << 20)) for p in zoned2m])
    # zones: ZONES zones of 4 KiB, 40 KiB apart, filled
    spacing = 10 * ZONE
    zone_mem = int(ok(drv.cuMemAlloc(ZONES * spacing)))
    ok(drv.cuMemsetD8(zone_mem, FILL, ZONES * spacing))
    table = (ctypes.c_uint64 * (2 * ZONES))()
    for z in range(ZONES):
        table[2 * z], table[2 * z + 1] = zone_mem + z * spacing, ZONE
    table_ptr = int(ok(drv.cuMemAlloc(16 * ZONES)))
    ok(drv.cuMemcpyHtoD(table_ptr, ctypes.addressof(table), 16 * ZONES))
    desc = (ctypes.c_uint64 * 4)(table_ptr, ZONES, 1, FILL)
    desc_ptr = int(ok(drv.cuMemAlloc(32)))
    ok(drv.cuMemcpyHtoD(desc_ptr, ctypes.addressof(desc), 32))
    host_slot = int(ok(drv.cuMemHostAlloc(4096, drv.CU_MEMHOSTALLOC_DEVICEMAP)))
    ctypes.memset(host_slot, 0, 4096)
    mapped_slot = int(ok(drv.cuMemHostGetDevicePointer(host_slot, 0)))
    dev_slots = int(ok(drv.cuMemAlloc(4096)))
    states = int(ok(drv.cuMemAlloc(4096)))
    ok(drv.cuMemsetD8(dev_slots, 0, 4096))
    ok(drv.cuMemsetD8(states, 0, 4096))
    readback = int(ok(drv.cuMemHostAlloc(4096, 0)))
    ok(drv.cuCtxSynchronize())

    add_types = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32)
    ptr3 = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    state_at = iter(range(states, states + 4096, 16))
    slot_at = iter(range(0, 4096, 32))

    def check_args(slot_base: int) -> tuple[object, ...]:
        return ((desc_ptr, next(state_at), slot_base + next(slot_at)), ptr3)

    def graph(extra: Callable[[object], None] | None, bufs: tuple[int, int, int] = (a, b, c)) -> object:
        ok(drv.cuStreamBeginCapture(stream, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        for _ in range(KERNELS):
            ok(drv.cuLaunchKernel(vector_add, (N + BLOCK - 1) // BLOCK, 1, 1, BLOCK, 1, 1, 0, stream,
                                  ((*bufs, N), add_types), 0))
        if extra is not None:
            extra(stream)
        g = ok(drv.cuStreamEndCapture(stream))
        return ok(drv.cuGraphInstantiate(g, 0))

    def node(fn: object, grid: int, slot_base: int) -> Callable[[object], None]:
        args = check_args(slot_base)
        return lambda s: ok(drv.cuLaunchKernel(fn, grid, 1, 1, BLOCK, 1, 1, 0, s, args, 0))

    variants: dict[str, object] = {"none": graph(None), "empty": graph(node(empty, 1, mapped_slot))}
    for grid in (1024, 132, 16, 4):
        variants[f"shipped/{grid}"] = graph(node(verdict, grid, mapped_slot))
    for grid in (1024, 16):
        variants[f"nofence/{grid}"] = graph(node(verdict_nofence, grid, mapped_slot))
        variants[f"devslot/{grid}"] = graph(node(verdict, grid, dev_slots))
    variants["zoned"] = graph(None, zoned)
    variants["padded"] = graph(None, padded)
    variants["zoned2m"] = graph(None, zoned2m)
    variants["zoned+shipped/1024"] = graph(node(verdict, 1024, mapped_slot), zoned)
    side_args = check_args(mapped_slot)

    def launch(label: str) -> None:
        if label == "side":
            ok(drv.cuGraphLaunch(variants["none"], stream))
            ok(drv.cuEventRecord(after_graph, stream))
            ok(drv.cuStreamWaitEvent(side, after_graph, 0))
            ok(drv.cuLaunchKernel(verdict, 16, 1, 1, BLOCK, 1, 1, 0, side, side_args, 0))
        else:
            ok(drv.cuGraphLaunch(variants[label], stream))

    labels = [*variants, "side"]

    def device_us(label: str) -> float:
        times = []
        for _ in range(LAUNCHES // 4):
            ok(drv.cuEventRecord(start, stream))
            launch(label)
            ok(drv.cuEventRecord(end, stream))
            ok(drv.cuEventSynchronize(end))
            times.append(ok(drv.cuEventElapsedTime(start, end)) * 1e3)
        ok(drv.cuCtxSynchronize())
        return float(statistics.median(times))

    def step_us(label: str) -> float:
        times = []
        for _ in range(LAUNCHES // 4):
            t0 = time.perf_counter()
            launch(label)
            ok(drv.cuMemcpyDtoHAsync(readback, c, 4096, stream))
            ok(drv.cuStreamSynchronize(stream))
            times.append((time.perf_counter() - t0) * 1e6)
        ok(drv.cuCtxSynchronize())
        return statistics.median(times)

    for label in labels:  # warm up
        device_us(label)
    print(f"{name.decode(errors='replace').rstrip(chr(0))}: a graph of {KERNELS} vector_add over {N} float32, "
          f"then the node; {ZONES} zones of {ZONE} bytes; medians of {LAUNCHES // 4} launches, {TURNS} turns")
    devs: dict[str, list[float]] = {label: [] for label in labels}
    step: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(TURNS):
        for label in labels:
            devs[label].append(device_us(label))
            step[label].append(step_us(label))
    base_dev, base_step = statistics.median(devs["none"]), statistics.median(step["none"])
    print(f"  {'variant':<20} {'device us':>10} {'vs none':>8} {'step us':>10} {'vs none':>8}")
    for label in labels:
        d, s = statistics.median(devs[label]), statistics.median(step[label])
        print(f"  {label:<20} {d:10.2f} {d - base_dev:+8.2f} {s:10.2f} {s - base_step:+8.2f}"
              f"   (turns: dev {' '.join(f'{x:.1f}' for x in devs[label])})")
    words = (ctypes.c_uint64 * 3).from_address(host_slot)
    print(f"  first mapped slot: bad {words[0]}, version {words[1]}, seq {words[2]}")


if __name__ == "__main__":
    main()
