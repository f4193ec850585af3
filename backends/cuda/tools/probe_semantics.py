#!/usr/bin/env python3
"""Measure the real driver's answers that metrale's emulated rules must match.

Standalone: needs only ``cuda.bindings.driver`` and numpy for the driver part;
the second part drives :class:`metrale_cuda.CudaDevice` end to end where
``metrale_core`` imports. Prints one line per measurement, ``(x) what: RESULT``,
for the record. Run on a GPU machine::

    cd backends/cuda && python3 tools/probe_semantics.py
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
from cuda.bindings import driver as drv

KiB = 1024


def rname(res: Any) -> str:
    """A CUresult's name."""
    try:
        return drv.CUresult(int(res)).name
    except Exception:
        return f"CUresult {res!r}"


def first(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) else out


def ok(out: Any, what: str) -> Any:
    """Assert success; return the value(s)."""
    res = first(out)
    if int(res) != 0:
        raise RuntimeError(f"{what}: {rname(res)}")
    if isinstance(out, tuple):
        return out[1] if len(out) == 2 else out[1:]
    return None


def report(label: str, text: str) -> None:
    print(f"{label}: {text}", flush=True)


def section(label: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        report(label, "PROBE FAILED:\n" + traceback.format_exc())


def status_name(stream: Any) -> str:
    err, st = drv.cuStreamIsCapturing(stream)
    return f"{rname(err)}/{drv.CUstreamCaptureStatus(int(st)).name}"


class Probe:
    def __init__(self) -> None:
        ok(drv.cuInit(0), "cuInit")
        self.dev = ok(drv.cuDeviceGet(0), "cuDeviceGet")
        self.ctx = ok(drv.cuDevicePrimaryCtxRetain(self.dev), "retain")
        ok(drv.cuCtxSetCurrent(self.ctx), "set current")
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.s = ok(drv.cuStreamCreate(flags), "stream")
        self.other = ok(drv.cuStreamCreate(flags), "stream")
        self.ptr = int(ok(drv.cuMemAlloc(64 * KiB), "alloc"))
        self.pinned = int(ok(drv.cuMemAllocHost(64 * KiB), "alloc host"))

    def begin(self, stream: Any | None = None) -> None:
        ok(
            drv.cuStreamBeginCapture(stream or self.s, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL),
            "begin capture",
        )

    def end(self, stream: Any | None = None) -> str:
        """End the capture; destroy the graph; the result's name."""
        err, graph = drv.cuStreamEndCapture(stream or self.s)
        if int(err) == 0 and int(graph) != 0:
            drv.cuGraphDestroy(graph)
        return rname(err)

    def during_capture(self, label: str, call: Callable[[], Any], *, after: Callable[[], Any] | None = None) -> None:
        """Begin a capture on ``self.s``, make ``call``, report its result, the status and the end."""
        self.begin()
        out = call()
        res = rname(first(out))
        status = status_name(self.s)
        extra = ""
        if after is not None:
            extra = f"; then memset on the capturing stream -> {rname(first(after()))}"
        end = self.end()
        if isinstance(out, tuple) and len(out) > 1 and int(first(out)) == 0:
            value = out[1]
            if "alloc" in label.lower():  # free what a successful allocation made
                try:
                    if "host" in label.lower():
                        drv.cuMemFreeHost(value)
                    else:
                        drv.cuMemFree(value)
                except Exception:
                    pass
        report(label, f"{res}; capture status after it {status}{extra}; cuStreamEndCapture -> {end}")
        drv.cuCtxSynchronize()

    def memset_on_capture(self) -> Any:
        return drv.cuMemsetD8Async(self.ptr, 1, 16, self.s)


def main() -> None:
    from cuda import bindings

    p = Probe()
    n_devices = ok(drv.cuDeviceGetCount(), "count")

    # (i) versions and device
    def versions() -> None:
        name = ok(drv.cuDeviceGetName(256, p.dev), "name")
        attr = drv.CUdevice_attribute
        major = ok(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, p.dev), "cc")
        minor = ok(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, p.dev), "cc")
        integrated = ok(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_INTEGRATED, p.dev), "integrated")
        version = ok(drv.cuDriverGetVersion(), "driver version")
        text = name.split(b"\x00")[0].decode()
        report(
            "(i) device",
            f"{text!r}, compute capability {major}.{minor}, integrated={integrated}, {n_devices} device(s)",
        )
        report("(i) cuda-bindings", bindings.__version__)
        report("(i) driver CUDA version", f"{version} ({version // 1000}.{version % 1000 // 10})")
        report("(i) python, numpy", f"{sys.version.split()[0]}, {np.__version__}")

    section("(i)", versions)

    # (h) symbols
    def symbols() -> None:
        elapsed = sorted(n for n in dir(drv) if n.startswith("cuEventElapsedTime"))
        inst = sorted(n for n in dir(drv) if n.startswith("cuGraphInstantiate"))
        report("(h) cuEventElapsedTime symbols", ", ".join(elapsed))
        report("(h) cuGraphInstantiate symbols", ", ".join(inst))
        report("(h) cuGraphInstantiate signature", drv.cuGraphInstantiate.__doc__.strip().splitlines()[0])

    section("(h)", symbols)

    # (a) cuMemAlloc during a global-mode capture on another stream (same thread, then another thread)
    section(
        "(a)",
        lambda: p.during_capture(
            "(a) cuMemAlloc during capture (same thread)", lambda: drv.cuMemAlloc(4096), after=p.memset_on_capture
        ),
    )

    def alloc_other_thread() -> None:
        p.begin()
        box: dict[str, Any] = {}

        def worker() -> None:
            drv.cuCtxSetCurrent(p.ctx)
            box["out"] = drv.cuMemAlloc(4096)

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        out = box["out"]
        status = status_name(p.s)
        if int(out[0]) == 0:
            drv.cuMemFree(out[1])
        report(
            "(a) cuMemAlloc during capture (another thread)",
            f"{rname(out[0])}; capture status after it {status}; cuStreamEndCapture -> {p.end()}",
        )
        drv.cuCtxSynchronize()

    section("(a2)", alloc_other_thread)

    # More of the calls the contract forbids during a capture
    def forbidden() -> None:
        victim = int(ok(drv.cuMemAlloc(4096), "alloc"))
        victim_host = int(ok(drv.cuMemAllocHost(4096), "alloc host"))
        ev = ok(drv.cuEventCreate(0), "event")
        ok(drv.cuEventRecord(ev, p.other), "record")
        ok(drv.cuCtxSynchronize(), "sync")
        flags = drv.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL
        scratch = bytearray(256)
        cases: list[tuple[str, Callable[[], Any]]] = [
            ("(a3) cuMemAllocManaged during capture", lambda: drv.cuMemAllocManaged(4096, flags)),
            ("(a3) cuMemAllocHost during capture", lambda: drv.cuMemAllocHost(4096)),
            ("(a3) cuMemFree of a live allocation during capture", lambda: drv.cuMemFree(victim)),
            ("(a3) cuMemFreeHost during capture", lambda: drv.cuMemFreeHost(victim_host)),
            ("(a3) cuMemGetInfo during capture", drv.cuMemGetInfo),
            ("(e) cuStreamQuery(capturing stream) during capture", lambda: drv.cuStreamQuery(p.s)),
            ("(e) cuStreamQuery(other stream) during capture", lambda: drv.cuStreamQuery(p.other)),
            ("(e) cuStreamSynchronize(capturing stream) during capture", lambda: drv.cuStreamSynchronize(p.s)),
            ("(e) cuStreamSynchronize(other stream) during capture", lambda: drv.cuStreamSynchronize(p.other)),
            ("(e) cuEventQuery(event recorded before) during capture", lambda: drv.cuEventQuery(ev)),
            ("(e) cuEventSynchronize(event recorded before) during capture", lambda: drv.cuEventSynchronize(ev)),
            ("(e) cuCtxSynchronize during capture", drv.cuCtxSynchronize),
            ("(e) cuStreamIsCapturing(other stream) during capture", lambda: drv.cuStreamIsCapturing(p.other)),
            (
                "(f) cuStreamWaitEvent(capturing stream, event recorded outside)",
                lambda: drv.cuStreamWaitEvent(p.s, ev, 0),
            ),
            ("(x) cuEventRecord(event, other stream) during capture", lambda: drv.cuEventRecord(ev, p.other)),
            (
                "(x) cuMemsetD8Async on the other stream during capture",
                lambda: drv.cuMemsetD8Async(p.ptr, 0, 16, p.other),
            ),
            (
                "(x) cuMemcpyDtoHAsync into pageable memory on the other stream during capture",
                lambda: drv.cuMemcpyDtoHAsync(scratch, p.ptr, 256, p.other),
            ),
            (
                "(x) cuMemcpyHtoDAsync from pageable memory on the other stream during capture",
                lambda: drv.cuMemcpyHtoDAsync(p.ptr, scratch, 256, p.other),
            ),
            (
                "(x) cuMemcpyHtoDAsync from pinned memory on the other stream during capture",
                lambda: drv.cuMemcpyHtoDAsync(p.ptr, p.pinned, 256, p.other),
            ),
            (
                "(x) cuStreamBeginCapture on the capturing stream again",
                lambda: drv.cuStreamBeginCapture(p.s, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL),
            ),
            ("(x) cuStreamEndCapture(other stream) during capture", lambda: drv.cuStreamEndCapture(p.other)),
        ]
        for label, fn in cases:
            section(label, lambda label=label, fn=fn: p.during_capture(label, fn, after=p.memset_on_capture))
        err, _ = drv.cuStreamEndCapture(p.other)
        report("(x) cuStreamEndCapture on a stream not capturing", rname(err))
        # (c) double free
        drv.cuMemFree(victim)  # may already have been freed above
        fresh = int(ok(drv.cuMemAlloc(4096), "alloc"))
        r1 = drv.cuMemFree(fresh)[0]
        r2 = drv.cuMemFree(fresh)[0]
        report("(c) cuMemFree twice", f"first {rname(r1)}, second {rname(r2)}")
        host = int(ok(drv.cuMemAllocHost(4096), "alloc host"))
        report(
            "(c) cuMemFreeHost twice",
            f"first {rname(drv.cuMemFreeHost(host)[0])}, second {rname(drv.cuMemFreeHost(host)[0])}",
        )
        drv.cuEventDestroy(ev)

    section("(a3-f)", forbidden)

    # (b) memsets outside and straddling an allocation
    def memsets() -> None:
        size = 4096
        buf = int(ok(drv.cuMemAlloc(size), "alloc"))
        r_out = drv.cuMemsetD8Async(0x10, 0, 1, p.other)[0]
        r_straddle = drv.cuMemsetD8Async(buf + size - 1, 0, 2, p.other)[0]
        r_inside = drv.cuMemsetD8Async(buf + size - 1, 0, 1, p.other)[0]
        r_sync = drv.cuStreamSynchronize(p.other)[0]
        report("(b) cuMemsetD8Async at 0x10", rname(r_out))
        report("(b) cuMemsetD8Async [ptr+size-1, +2) of a fresh 4096-byte allocation", rname(r_straddle))
        report("(b) cuMemsetD8Async [ptr+size-1, +1) (the last byte)", f"{rname(r_inside)}; sync {rname(r_sync)}")
        big = int(ok(drv.cuMemAlloc(1000), "alloc"))
        r_pad = drv.cuMemsetD8Async(big + 1000, 0, 8, p.other)[0]
        report("(b) cuMemsetD8Async [ptr+1000, +8) of a 1000-byte allocation (in its rounding)", rname(r_pad))
        r_htod = drv.cuMemcpyHtoDAsync(buf + size - 1, bytes(2), 2, p.other)[0]
        r_dtod = drv.cuMemcpyDtoDAsync(buf + size - 1, buf, 2, p.other)[0]
        report("(b) cuMemcpyHtoDAsync / cuMemcpyDtoDAsync straddling the end", f"{rname(r_htod)} / {rname(r_dtod)}")
        report("(b) stream synchronize afterwards", rname(drv.cuStreamSynchronize(p.other)[0]))
        drv.cuMemFree(buf)
        drv.cuMemFree(big)

    section("(b)", memsets)

    # (d) copies from pageable and pinned memory into a capturing stream
    def copies() -> None:
        pageable = np.arange(256, dtype=np.uint8)
        p.begin()
        r = drv.cuMemcpyHtoDAsync(p.ptr, pageable.ctypes.data, 256, p.s)[0]
        status = status_name(p.s)
        report(
            "(d) cuMemcpyHtoDAsync from pageable numpy memory into a capturing stream",
            f"{rname(r)}; status {status}; cuStreamEndCapture -> {p.end()}",
        )
        p.begin()
        r = drv.cuMemcpyHtoDAsync(p.ptr, p.pinned, 256, p.s)[0]
        report(
            "(d) cuMemcpyHtoDAsync from pinned memory into a capturing stream",
            f"{rname(r)}; cuStreamEndCapture -> {p.end()}",
        )
        out = np.zeros(256, dtype=np.uint8)
        p.begin()
        r = drv.cuMemcpyDtoHAsync(out.ctypes.data, p.ptr, 256, p.s)[0]
        report(
            "(d) cuMemcpyDtoHAsync into pageable numpy memory in a capturing stream",
            f"{rname(r)}; cuStreamEndCapture -> {p.end()}",
        )
        ro = memoryview(bytes(range(200)))
        r = drv.cuMemcpyHtoDAsync(p.ptr, ro, 200, p.other)[0]
        back = bytearray(200)
        r2 = drv.cuMemcpyDtoHAsync(back, p.ptr, 200, p.other)[0]
        drv.cuStreamSynchronize(p.other)
        report(
            "(d) bindings take a read-only memoryview / a bytearray as host pointer",
            f"{rname(r)} / {rname(r2)}; round trip equal: {bytes(back) == bytes(ro)}",
        )
        drv.cuCtxSynchronize()

    section("(d)", copies)

    # (g) is a memset issued to a capturing stream run?
    def capture_runs() -> None:
        ok(drv.cuMemsetD8Async(p.ptr, 0, 4096, p.other), "memset")
        ok(drv.cuStreamSynchronize(p.other), "sync")
        p.begin()
        ok(drv.cuMemsetD8Async(p.ptr, 0xCD, 4096, p.s), "memset in capture")
        err, graph = drv.cuStreamEndCapture(p.s)
        ok((err,), "end capture")
        ok(drv.cuCtxSynchronize(), "sync")
        out = np.zeros(4096, dtype=np.uint8)
        ok(drv.cuMemcpyDtoH(out.ctypes.data, p.ptr, 4096), "read back")
        report("(g) memory after capturing a memset 0xCD, before launch", f"unique bytes {sorted(set(out.tolist()))}")
        exe = ok(drv.cuGraphInstantiate(graph, 0), "instantiate")
        ok(drv.cuGraphLaunch(exe, p.other), "launch")
        ok(drv.cuStreamSynchronize(p.other), "sync")
        ok(drv.cuMemcpyDtoH(out.ctypes.data, p.ptr, 4096), "read back")
        report("(g) after cuGraphLaunch", f"unique bytes {sorted(set(out.tolist()))}")
        drv.cuGraphExecDestroy(exe)
        drv.cuGraphDestroy(graph)

    section("(g)", capture_runs)

    # (j) stream-ordered calls with no current context on the thread
    def no_context() -> None:
        box: dict[str, str] = {}

        def worker() -> None:
            r1 = drv.cuMemsetD8Async(p.ptr, 1, 16, p.other)[0]
            r2 = drv.cuStreamSynchronize(p.other)[0]
            r3 = drv.cuMemAlloc(4096)
            box["r"] = f"memset {rname(r1)}, stream sync {rname(r2)}, cuMemAlloc {rname(r3[0])}"
            if int(r3[0]) == 0:
                drv.cuMemFree(r3[1])

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        report("(j) on a thread with no current context", box["r"])

    section("(j)", no_context)

    # (k) event timing
    def events() -> None:
        a = ok(drv.cuEventCreate(0), "event")
        b = ok(drv.cuEventCreate(0), "event")
        ok(drv.cuEventRecord(a, p.other), "record")
        ok(drv.cuMemsetD8Async(p.ptr, 0, 64 * KiB, p.other), "memset")
        ok(drv.cuEventRecord(b, p.other), "record")
        ok(drv.cuEventSynchronize(b), "sync")
        err, ms = drv.cuEventElapsedTime(a, b)
        report("(k) cuEventElapsedTime", f"{rname(err)} {ms!r} ({type(ms).__name__})")
        c = ok(drv.cuEventCreate(0), "event")
        err, ms = drv.cuEventElapsedTime(a, c)
        report("(k) cuEventElapsedTime with a never-recorded end event", rname(err))
        for e in (a, b, c):
            drv.cuEventDestroy(e)

    section("(k)", events)

    drv.cuCtxSynchronize()
    drv.cuMemFree(p.ptr)
    drv.cuMemFreeHost(p.pinned)
    drv.cuStreamDestroy(p.s)
    drv.cuStreamDestroy(p.other)
    raw_device_checks(p)
    drv.cuDevicePrimaryCtxRelease(p.dev)


def raw_device_checks(p: Probe) -> None:
    """Drive metrale_cuda.CudaDevice end to end (needs metrale_core importable)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, here)
    try:
        from metrale_core import MetraleError
        from metrale_cuda._device import CudaDevice
    except Exception as exc:
        report("(r) CudaDevice", f"not importable here ({type(exc).__name__}: {exc}); skipped")
        return

    def run() -> None:
        dev = CudaDevice.open(0)
        report(
            "(r) CudaDevice.open(0)",
            f"{dev!r} {dev.device_name()!r} integrated={dev.is_integrated()} mem_get_info={dev.mem_get_info()}",
        )
        s = dev.stream_create()
        ptr = dev.alloc(1 << 20, "device")
        dev.memset(ptr, 0x5A, 1 << 20, s)
        src = bytes(range(256)) * 16
        dev.copy_htod(ptr, memoryview(src), s, pinned=False)
        back = bytearray(len(src))
        dev.copy_dtoh(memoryview(back), ptr, s, pinned=False)
        dev.stream_synchronize(s)
        tail = bytearray(16)
        dev.copy_dtoh(memoryview(tail), ptr + len(src), s, pinned=False)
        dev.stream_synchronize(s)
        report("(r) memset + pageable round trip", f"equal={bytes(back) == src} tail={set(tail)}")
        hptr, hview = dev.alloc_host(4096)
        hview[:] = bytes([7]) * 4096
        dev.copy_htod(ptr, hview, s, pinned=True)
        dev.copy_dtod(ptr + 8192, ptr, 4096, s)
        out_ptr, out_view = dev.alloc_host(4096)
        dev.copy_dtoh(out_view, ptr + 8192, s, pinned=True)
        pending = len(s.keep)  # type: ignore[attr-defined]
        done = dev.stream_query(s)
        dev.stream_synchronize(s)
        report(
            "(r) pinned copies + dtod",
            f"ok={set(out_view.tobytes()) == {7}} view format={hview.format!r} "
            f"held before sync={pending} query={done} held after sync={len(s.keep)}",
        )  # type: ignore[attr-defined]
        managed = dev.alloc(4096, "managed")
        dev.memset(managed, 3, 4096, s)
        dev.synchronize()
        report("(r) managed alloc + memset", f"ptr={managed:#x} byte0={ctypes_read(managed)}")
        dev.free(managed, "managed")
        # capture a memset graph, instantiate, launch
        dev.memset(ptr, 0, 4096, s)
        dev.stream_synchronize(s)
        dev.begin_capture(s)
        capturing = dev.is_capturing(s)
        dev.memset(ptr, 0xEE, 4096, s)
        dev.copy_htod(ptr + 4096, hview, s, pinned=True)
        graph = dev.end_capture(s)
        exe = dev.graph_instantiate(graph)
        ev0, ev1 = dev.event_create(), dev.event_create()
        dev.event_record(ev0, s)
        dev.graph_launch(exe, s)
        dev.event_record(ev1, s)
        dev.event_synchronize(ev1)
        ms = dev.event_elapsed_ms(ev0, ev1)
        dev.copy_dtoh(out_view, ptr, s, pinned=True)
        dev.stream_synchronize(s)
        report(
            "(r) capture + instantiate + launch",
            f"capturing={capturing} after={dev.is_capturing(s)} "
            f"result={set(out_view.tobytes())} graph keeps {len(graph.keep)} host object(s) "  # type: ignore[attr-defined]
            f"elapsed={ms:.4f} ms event_query={dev.event_query(ev1)}",
        )

        def double_free() -> None:
            q = dev.alloc(4096, "device")
            dev.free(q, "device")
            dev.free(q, "device")

        # errors
        for label, fn in [
            ("memset at 0x10", lambda: dev.memset(0x10, 0, 1, s)),
            ("alloc 1 PiB", lambda: dev.alloc(1 << 50, "device")),
            ("double free", double_free),
            ("memset value 300", lambda: dev.memset(ptr, 300, 1, s)),
        ]:
            try:
                fn()
                report(f"(r) error: {label}", "no error")
            except MetraleError as exc:
                report(f"(r) error: {label}", f"{type(exc).__name__} {exc.name} {exc}")
        dev.begin_capture(s)
        try:
            dev.alloc(4096, "device")
        except MetraleError as exc:
            report("(r) alloc during capture", f"{type(exc).__name__} {exc.name}")
        try:
            dev.end_capture(s)
        except MetraleError as exc:
            report("(r) end_capture after it", f"{type(exc).__name__} {exc.name}")
        report("(r) is_capturing after the failed end", str(dev.is_capturing(s)))
        # threads
        box: list[str] = []

        def worker() -> None:
            try:
                q = dev.alloc(4096, "device")
                st = dev.stream_create()
                dev.memset(q, 1, 4096, st)
                dev.stream_synchronize(st)
                dev.stream_destroy(st)
                dev.free(q, "device")
                box.append("ok")
            except Exception as exc:
                box.append(f"{type(exc).__name__}: {exc}")

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        report("(r) from another thread (no bind_to_thread)", box[0])
        # overhead: CudaDevice.memset vs the raw binding
        n = 5000
        h = s.handle  # type: ignore[attr-defined]
        dev.stream_synchronize(s)
        t0 = time.perf_counter()
        for _ in range(n):
            drv.cuMemsetD8Async(ptr, 0, 256, h)
        t1 = time.perf_counter()
        dev.stream_synchronize(s)
        t2 = time.perf_counter()
        for _ in range(n):
            dev.memset(ptr, 0, 256, s)
        t3 = time.perf_counter()
        dev.stream_synchronize(s)
        t4 = time.perf_counter()
        for _ in range(n):
            drv.cuStreamQuery(h)
        t5 = time.perf_counter()
        for _ in range(n):
            dev.stream_query(s)
        t6 = time.perf_counter()
        report(
            "(r) per-call time, raw cuMemsetD8Async vs CudaDevice.memset",
            f"{(t1 - t0) / n * 1e6:.2f} us vs {(t3 - t2) / n * 1e6:.2f} us",
        )
        report(
            "(r) per-call time, raw cuStreamQuery vs CudaDevice.stream_query",
            f"{(t5 - t4) / n * 1e6:.2f} us vs {(t6 - t5) / n * 1e6:.2f} us",
        )
        dev.graph_exec_destroy(exe)
        dev.graph_destroy(graph)
        dev.event_destroy(ev0)
        dev.event_destroy(ev1)
        dev.free_host(hptr)
        dev.free_host(out_ptr)
        dev.free(ptr, "device")
        dev.stream_destroy(s)
        other = CudaDevice.open(0)
        dev.close()
        dev.close()
        report("(r) close twice", "no exception")
        s2 = other.stream_create()
        q = other.alloc(4096, "device")
        other.memset(q, 0, 4096, s2)
        other.stream_synchronize(s2)
        other.free(q, "device")
        other.stream_destroy(s2)
        other.close()
        report("(r) a second CudaDevice on ordinal 0 outlives the first's close", "ok")
        try:
            CudaDevice.open(99)
        except MetraleError as exc:
            report("(r) open(99)", f"{type(exc).__name__}: {exc}")

    section("(r)", run)


def ctypes_read(ptr: int) -> int:
    out = np.zeros(1, dtype=np.uint8)
    drv.cuMemcpyDtoH(out.ctypes.data, ptr, 1)
    return int(out[0])


if __name__ == "__main__":
    main()
