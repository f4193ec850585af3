"""Conformance testing for any backend: a Hypothesis state machine and a bad-input table.

A backend author runs the same tests metrale runs on its own backends::

    # tests/test_conformance.py of a plugin
    from metrale_core.testing import backend_state_machine

    TestMyBackend = backend_state_machine("mybackend").TestCase

The state machine drives the backend through random programs of
allocations, frees (double frees too), copies, memsets, captures and
replays, capture-rule violations, sweeps, red-zone overruns, an
:class:`~metrale_core.Arena` (pieces, a full arena, resets) and, where the
backend has ``inject_fault``, driver failures and reclaim-and-retry after an
out-of-memory error. After every step it checks the ledger and ``stats()``
against a model and every read against the bytes the model expects.

This module needs ``hypothesis`` (the ``test`` extra).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ._arena import Arena
from ._backend import GpuBackend
from ._discovery import open_backend
from ._errors import (
    ArenaFullError,
    BackendNotFoundError,
    CaptureError,
    DriverError,
    InvalidArgumentError,
    InvalidBufferError,
    MetraleError,
    RedZoneError,
)
from ._handles import GraphExec, HostBuffer, Stream
from ._kernels import Kernel
from ._settings import MetraleSettings
from ._types import DeviceBuffer
from .kernels import shipped_modules

__all__ = [
    "BAD_INPUTS",
    "BackendMachine",
    "BadInput",
    "BadInputFixture",
    "backend_params",
    "backend_state_machine",
    "bad_input_fixture",
    "check_bad_input",
]

_MAX_BYTES = 4096
_ARENA_BYTES = 16384


class _Contents:
    """The bytes a buffer should hold; ``known`` marks bytes that were ever written."""

    __slots__ = ("data", "known")

    def __init__(self, n: int) -> None:
        self.data = bytearray(n)
        self.known = bytearray(n)

    def write(self, offset: int, data: bytes) -> None:
        self.data[offset : offset + len(data)] = data
        self.known[offset : offset + len(data)] = b"\x01" * len(data)

    def check(self, actual: bytes, buf: DeviceBuffer) -> None:
        for i, (want, have, known) in enumerate(zip(self.data, actual, self.known, strict=True)):
            if known and want != have:
                raise AssertionError(
                    f"allocation #{buf.index} ({buf.kind}, {buf.nbytes} bytes): byte {i} reads "
                    f"{have:#04x}, the model expects {want:#04x}"
                )


class BackendMachine(RuleBasedStateMachine):
    """Drives one backend through random programs; see the module docstring."""

    backend_name: ClassVar[str] = "fake"
    settings: ClassVar[MetraleSettings | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.gpu: GpuBackend = open_backend(self.backend_name, settings=self.settings or MetraleSettings())
        self.probe = self.gpu.ledger_probe()
        self.live: dict[int, tuple[DeviceBuffer, _Contents]] = {}  # device and managed, by index
        self.arena: dict[int, tuple[DeviceBuffer, _Contents]] = {}
        self.stale: list[DeviceBuffer] = []
        self.dirty: dict[tuple[int, str], int] = {}  # (index, side) -> first changed offset
        self.can_inject = callable(getattr(self.gpu, "inject_fault", None))
        self.fill = self._load_fill_kernel()
        rz = self.gpu.settings
        self.redzone = rz.redzone
        self.redzone_min_idx = rz.redzone_min_idx
        self.redzone_lead = rz.redzone_lead
        self.sub: Arena = self.gpu.create_arena(_ARENA_BYTES)
        self.pieces: dict[int, tuple[DeviceBuffer, _Contents]] = {}  # live pieces of self.sub, by index
        self.sub_top = 0  # the model of self.sub.used
        self.reclaimed: list[int] = []  # what the on_out_of_memory callback was asked for
        self.reclaim_answer = False
        self.gpu.on_out_of_memory(self._reclaim)

    def teardown(self) -> None:
        self.gpu.close()
        assert self.probe.live_count() == 0, "the ledger is not empty after close()"

    # -- helpers ------------------------------------------------------------------------

    def _load_fill_kernel(self) -> Kernel | None:
        """The shipped ``vector.fill_u32``, or ``None`` where the backend runs no kernels."""
        try:
            registry = self.gpu.load_modules(shipped_modules("vector"))
        except MetraleError as exc:
            if exc.name == "CUDA_ERROR_NOT_SUPPORTED":
                return None
            raise
        return registry.kernel("vector", "fill_u32")

    def _all(self) -> dict[int, tuple[DeviceBuffer, _Contents]]:
        return {**self.live, **self.arena, **self.pieces}

    def _reclaim(self, nbytes: int) -> bool:
        self.reclaimed.append(nbytes)
        return self.reclaim_answer

    def _pick(self, data: st.DataObject, pool: dict[int, tuple[DeviceBuffer, _Contents]]) -> tuple[
        DeviceBuffer, _Contents
    ]:
        index = data.draw(st.sampled_from(sorted(pool)), label="buffer")
        return pool[index]

    def _read(self, buf: DeviceBuffer) -> bytes:
        out = bytearray(buf.nbytes)
        self.gpu.copy_to_host(out, buf)
        return bytes(out)

    def _launch_graph(self, exe: GraphExec, stream: Stream) -> None:
        """Launch, expecting the scan after it to raise where zones changed and the settings say so (with
        ``redzone_scan_queued``, the stream's synchronize after the launch)."""
        settings = self.gpu.settings
        expect = bool(self.dirty) and settings.redzone_scan_graphs and settings.redzone_action == "raise"
        try:
            exe.launch(stream)
            if settings.redzone_scan_queued:  # the scan is queued behind the graph: the wait reports it
                stream.synchronize()
        except RedZoneError as exc:
            assert expect, f"a graph launch raised {exc} with no changed zone in the model"
            assert {(v.index, v.side): v.offset for v in exc.violations} == self.dirty
        else:
            assert not expect, "the scan after a graph launch missed a changed zone"

    def _zoned(self, buf: DeviceBuffer) -> bool:
        return buf.kind == "device" and self.redzone > 0 and buf.index >= self.redzone_min_idx

    def _forget(self, buf: DeviceBuffer) -> None:
        self.live.pop(buf.index, None)
        self.arena.pop(buf.index, None)
        self.pieces.pop(buf.index, None)
        self.dirty.pop((buf.index, "trail"), None)
        self.dirty.pop((buf.index, "lead"), None)
        self.stale.append(buf)

    # -- allocation -----------------------------------------------------------------------

    @rule(kind=st.sampled_from(["device", "managed", "arena"]), n=st.integers(1, _MAX_BYTES))
    def alloc(self, kind: str, n: int) -> None:
        fn = {"device": self.gpu.alloc, "managed": self.gpu.alloc_managed, "arena": self.gpu.alloc_arena}[kind]
        buf = fn(n)
        assert buf.nbytes == n and buf.kind == kind and buf.ptr % 256 == 0 and buf.ptr != 0
        assert buf.index not in self._all(), "a creation index was handed out twice"
        assert buf.site.rpartition(":")[2].isdigit(), f"the call site {buf.site!r} is not file:line"
        (self.arena if kind == "arena" else self.live)[buf.index] = (buf, _Contents(n))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        buf, _ = self._pick(data, self.live)
        dirty = {side: off for (index, side), off in self.dirty.items() if index == buf.index}
        if dirty and self.gpu.settings.redzone_action == "raise":
            try:
                self.gpu.free(buf)
            except RedZoneError as exc:
                assert {v.side: v.offset for v in exc.violations} == dirty, (exc.violations, dirty)
            else:
                raise AssertionError(f"free of allocation #{buf.index}, whose zone changed, did not raise")
        else:
            self.gpu.free(buf)  # a changed zone is logged (redzone_action="warn")
        assert not any(r.index == buf.index for r in self.probe.records()), "free left the record on the ledger"
        self._forget(buf)

    @precondition(lambda self: self.arena)
    @rule(data=st.data())
    def free_arena(self, data: st.DataObject) -> None:
        buf, _ = self._pick(data, self.arena)
        self.gpu.free_arena(buf)
        self._forget(buf)

    @precondition(lambda self: self.stale)
    @rule(data=st.data())
    def free_stale(self, data: st.DataObject) -> None:
        buf = data.draw(st.sampled_from(self.stale), label="stale buffer")
        before = self.probe.records()
        try:
            if buf.kind == "arena":
                self.gpu.free_arena(buf)
            else:
                self.gpu.free(buf)
        except InvalidBufferError:
            pass
        else:
            raise AssertionError(f"freeing stale allocation #{buf.index} twice was not refused")
        assert self.probe.records() == before, "a refused free changed the ledger"

    @precondition(lambda self: self.arena)
    @rule(data=st.data())
    def free_arena_with_free(self, data: st.DataObject) -> None:
        buf, _ = self._pick(data, self.arena)
        try:
            self.gpu.free(buf)
        except InvalidBufferError:
            return
        raise AssertionError("free() of an arena buffer was not refused")

    @rule(n=st.integers(0, _ARENA_BYTES // 2), align=st.sampled_from([1, 16, 256, 4096]))
    def arena_alloc(self, n: int, align: int) -> None:
        base = self.sub.base
        start = (base + self.sub_top + align - 1) // align * align - base
        if start + n > _ARENA_BYTES:
            try:
                self.sub.alloc(n, align=align)
            except ArenaFullError as exc:
                assert (exc.requested, exc.capacity, exc.used) == (n, _ARENA_BYTES, self.sub_top), exc
            else:
                raise AssertionError(f"a full arena ({self.sub_top} of {_ARENA_BYTES} used) gave out {n} bytes")
            assert self.sub.used == self.sub_top, "a refused arena alloc changed the arena"
            return
        buf = self.sub.alloc(n, align=align)
        assert buf.ptr == base + start and buf.nbytes == n and buf.kind == "arena", buf
        assert buf.index not in self._all(), "a creation index was handed out twice"
        self.sub_top = start + n
        if n:
            self.pieces[buf.index] = (buf, _Contents(n))

    @precondition(lambda self: self.pieces or self.sub_top)
    @rule()
    def arena_reset(self) -> None:
        self.sub.reset()
        for buf, _ in list(self.pieces.values()):
            self._forget(buf)
        self.sub_top = 0

    @rule()
    def sweep(self) -> None:
        expected = len(self.live)
        assert self.gpu.sweep_unreleased() == expected
        for buf, _ in list(self.live.values()):
            self._forget(buf)

    # -- data movement ----------------------------------------------------------------------

    @precondition(lambda self: self.live or self.arena)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        buf, contents = self._pick(data, self._all())
        offset = data.draw(st.integers(0, buf.nbytes - 1), label="offset")
        payload = data.draw(st.binary(min_size=1, max_size=buf.nbytes - offset), label="payload")
        pinned = data.draw(st.booleans(), label="pinned")
        if pinned:
            host = self.gpu.alloc_host(len(payload))
            host.view()[:] = payload
            self.gpu.copy_to_device(buf, host, offset=offset)
            self.gpu.default_stream.synchronize()
            self.gpu.free(host)
        else:
            self.gpu.copy_to_device(buf, payload, offset=offset)
        contents.write(offset, payload)

    @precondition(lambda self: self.live or self.arena)
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        buf, contents = self._pick(data, self._all())
        contents.check(self._read(buf), buf)

    @precondition(lambda self: self.live or self.arena)
    @rule(data=st.data(), value=st.integers(0, 255))
    def memset(self, data: st.DataObject, value: int) -> None:
        buf, contents = self._pick(data, self._all())
        offset = data.draw(st.integers(0, buf.nbytes - 1), label="offset")
        n = data.draw(st.integers(1, buf.nbytes - offset), label="nbytes")
        self.gpu.memset(buf, value, offset=offset, nbytes=n)
        contents.write(offset, bytes([value]) * n)

    @precondition(lambda self: self.live or self.arena)
    @rule(data=st.data())
    def copy_device(self, data: st.DataObject) -> None:
        src, src_c = self._pick(data, self._all())
        dst, dst_c = self._pick(data, self._all())
        n = data.draw(st.integers(1, min(src.nbytes, dst.nbytes)), label="nbytes")
        so = data.draw(st.integers(0, src.nbytes - n), label="src_offset")
        do = data.draw(st.integers(0, dst.nbytes - n), label="dst_offset")
        if src.index == dst.index and abs(so - do) < n:
            return  # overlapping copies are undefined in CUDA
        self.gpu.copy_device(dst, src, nbytes=n, dst_offset=do, src_offset=so)
        dst_c.data[do : do + n] = src_c.data[so : so + n]
        dst_c.known[do : do + n] = src_c.known[so : so + n]

    @precondition(lambda self: self.live or self.arena)
    @rule(data=st.data())
    def out_of_bounds(self, data: st.DataObject) -> None:
        buf, _ = self._pick(data, self._all())
        op = data.draw(st.sampled_from(["memset", "write", "read", "copy"]), label="op")
        before = self._read(buf)
        try:
            if op == "memset":
                self.gpu.memset(buf, 1, offset=buf.nbytes, nbytes=1)
            elif op == "write":
                self.gpu.copy_to_device(buf, b"\x01" * (buf.nbytes + 1))
            elif op == "read":
                self.gpu.copy_to_host(bytearray(2), buf, offset=buf.nbytes - 1)
            else:
                self.gpu.copy_device(buf, buf, nbytes=buf.nbytes, dst_offset=1)
        except InvalidBufferError:
            pass
        else:
            raise AssertionError(f"an out-of-bounds {op} on allocation #{buf.index} was not refused")
        assert self._read(buf) == before, "a refused operation changed the buffer"

    @precondition(lambda self: self.stale)
    @rule(data=st.data())
    def use_stale(self, data: st.DataObject) -> None:
        buf = data.draw(st.sampled_from(self.stale), label="stale buffer")
        try:
            self.gpu.memset(buf, 0)
        except InvalidBufferError:
            return
        raise AssertionError(f"a memset of freed allocation #{buf.index} reached the device")

    def _u32_targets(self) -> dict[int, tuple[DeviceBuffer, _Contents]]:
        """Buffers fill_u32 can write: 4 bytes or more, at a 4-byte-aligned address (a u32 store at a
        misaligned address faults the context with CUDA_ERROR_MISALIGNED_ADDRESS, on the fake too)."""
        return {i: v for i, v in self._all().items() if v[0].nbytes >= 4 and v[0].ptr % 4 == 0}

    @precondition(lambda self: self.fill is not None and self._u32_targets())
    @rule(data=st.data(), value=st.integers(0, (1 << 32) - 1), captured=st.booleans())
    def launch_fill(self, data: st.DataObject, value: int, captured: bool) -> None:
        assert self.fill is not None
        pool = self._u32_targets()
        buf, contents = self._pick(data, pool)
        n = data.draw(st.integers(1, buf.nbytes // 4), label="elements")
        args = [buf, _u32(n), _u32(value)]
        grid = -(-n // 128)
        if captured:
            self.gpu.default_stream.synchronize()  # the graph runs on another stream: order it after earlier work
            stream = self.gpu.create_stream()
            self.gpu.begin_capture(stream)
            self.gpu.launch(self.fill, grid, 128, args, stream=stream)
            graph = self.gpu.end_capture(stream)
            exe = graph.instantiate()
            self._launch_graph(exe, stream)
            stream.synchronize()
            exe.close()
            graph.close()
            stream.close()
        else:
            self.gpu.launch(self.fill, grid, 128, args)
        contents.write(0, value.to_bytes(4, "little") * n)

    # -- capture ---------------------------------------------------------------------------

    @precondition(lambda self: self.live or self.arena)
    @rule(data=st.data(), value=st.integers(0, 255))
    def capture_and_replay(self, data: st.DataObject, value: int) -> None:
        buf, contents = self._pick(data, self._all())
        offset = data.draw(st.integers(0, buf.nbytes - 1), label="offset")
        n = data.draw(st.integers(1, buf.nbytes - offset), label="nbytes")
        launches = data.draw(st.integers(0, 2), label="launches")
        before = self._read(buf)
        stream = self.gpu.create_stream()
        self.gpu.begin_capture(stream)
        assert self.gpu.stream_is_capturing(stream)
        self.gpu.memset(buf, value, offset=offset, nbytes=n, stream=stream)
        graph = self.gpu.end_capture(stream)
        assert not self.gpu.stream_is_capturing(stream)
        assert self._read(buf) == before, "work issued to a capturing stream ran"
        exe = graph.instantiate()
        for _ in range(launches):
            self._launch_graph(exe, stream)
        stream.synchronize()
        if launches:
            contents.write(offset, bytes([value]) * n)
        contents.check(self._read(buf), buf)
        exe.close()
        graph.close()
        stream.close()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), forbidden=st.sampled_from(
        ["alloc", "alloc_managed", "alloc_arena", "alloc_host", "free", "free_stale", "alloc_zero",
         "synchronize", "stream_sync", "stream_query", "scan", "sweep"]
    ))
    def capture_violation(self, data: st.DataObject, forbidden: str) -> None:
        buf, _ = self._pick(data, self.live)
        records = self.probe.records()
        before = self._read(buf)
        stream = self.gpu.create_stream()
        self.gpu.begin_capture(stream)
        self.gpu.memset(buf, 0xEE, stream=stream)
        calls: dict[str, Callable[[], object]] = {
            "alloc": lambda: self.gpu.alloc(64),
            "alloc_managed": lambda: self.gpu.alloc_managed(64),
            "alloc_arena": lambda: self.gpu.alloc_arena(64),
            "alloc_host": lambda: self.gpu.alloc_host(64),
            "free": lambda: self.gpu.free(buf),
            "free_stale": lambda: self.gpu.free(DeviceBuffer(1 << 40, 64, "device", -1, "x:1")),
            "alloc_zero": lambda: self.gpu.alloc(0),
            "synchronize": self.gpu.synchronize,
            "stream_sync": self.gpu.default_stream.synchronize,
            "stream_query": stream.query,
            "scan": self.gpu.scan_redzones,
            "sweep": self.gpu.sweep_unreleased,
        }
        _expect(CaptureError, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", calls[forbidden])
        assert self.gpu.stream_is_capturing(stream), "an invalidated capture still counts as capturing"
        _expect(CaptureError, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", lambda: self.gpu.memset(buf, 1, stream=stream))
        _expect(CaptureError, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", lambda: self.gpu.end_capture(stream))
        assert not self.gpu.stream_is_capturing(stream)
        assert self.probe.records() == records, "a refused call during capture changed the ledger"
        assert self._read(buf) == before, "work of a discarded capture ran"
        stream.close()

    # -- red zones -------------------------------------------------------------------------------

    @precondition(lambda self: self.redzone > 0 and any(self._zoned(b) for b, _ in self.live.values()))
    @rule(data=st.data())
    def overrun(self, data: st.DataObject) -> None:
        zoned = {i: v for i, v in self.live.items() if self._zoned(v[0])}
        buf, _ = self._pick(data, zoned)
        sides = ["trail", "lead"] if self.redzone_lead else ["trail"]
        side = data.draw(st.sampled_from(sides), label="side")
        offset = data.draw(st.integers(0, self.redzone - 1), label="zone offset")
        value = data.draw(st.integers(0, 255).filter(lambda v: v != self.gpu.settings.redzone_fill))
        if side == "trail":
            self.gpu.memset(buf.ptr + buf.nbytes + offset, value, nbytes=1)
        else:
            lead = -(-self.redzone // 256) * 256  # the leading band keeps the pointer 256-aligned
            offset = data.draw(st.integers(0, lead - 1), label="lead offset")
            self.gpu.memset(buf.ptr - lead + offset, value, nbytes=1)
        key = (buf.index, side)
        self.dirty[key] = min(offset, self.dirty.get(key, offset))

    @precondition(lambda self: self.redzone > 0)
    @rule()
    def scan(self) -> None:
        try:
            found = self.gpu.scan_redzones()
        except RedZoneError as exc:
            assert self.gpu.settings.redzone_action == "raise" and self.dirty, exc
            found = exc.violations
        else:
            assert not (self.dirty and self.gpu.settings.redzone_action == "raise"), "a scan did not raise"
        for v in found:
            live = self.live.get(v.index)
            assert live is not None, f"a violation was reported for allocation #{v.index}, which is not live"
            assert (v.ptr, v.nbytes, v.site) == (live[0].ptr, live[0].nbytes, live[0].site)
        got = {(v.index, v.side): v.offset for v in found}
        assert len(got) == len(found), f"a zone was reported twice: {found}"
        assert got == self.dirty, f"scan reported {got}, the model expects {self.dirty}"

    # -- injected driver failures -------------------------------------------------------------------

    @precondition(lambda self: self.can_inject)
    @rule(kind=st.sampled_from(["device", "managed", "arena"]), code=st.sampled_from(
        ["CUDA_ERROR_UNKNOWN", "CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_INVALID_VALUE"]))
    def alloc_fails(self, kind: str, code: str) -> None:
        records = self.probe.records()
        self.gpu.inject_fault("alloc", code=code)  # type: ignore[attr-defined]
        fn = {"device": self.gpu.alloc, "managed": self.gpu.alloc_managed, "arena": self.gpu.alloc_arena}[kind]
        try:
            fn(128)
        except MetraleError as exc:
            assert exc.name == code, exc
        else:
            raise AssertionError("an injected alloc failure did not surface")
        assert self.probe.records() == records, "a failed alloc changed the ledger"

    @precondition(lambda self: self.can_inject and self.redzone > 0)
    @rule()
    def redzone_fill_fails(self) -> None:
        records = self.probe.records()
        self.gpu.inject_fault("memset")  # type: ignore[attr-defined]
        try:
            buf = self.gpu.alloc(64)
        except DriverError:
            pass
        else:
            if self._zoned(buf):
                raise AssertionError("a failed red-zone fill did not fail the alloc")
            self.gpu.memset(buf, 0)  # the zone-less alloc left the fault for the next memset
            self.gpu.free(buf)
            return
        assert self.probe.records() == records, "an alloc whose zone fill failed stayed on the ledger"

    @precondition(lambda self: self.can_inject and self.live)
    @rule(data=st.data())
    def free_fails(self, data: st.DataObject) -> None:
        buf, _ = self._pick(data, self.live)
        self.gpu.inject_fault("free")  # type: ignore[attr-defined]
        try:
            self.gpu.free(buf)
        except DriverError:
            pass
        else:
            raise AssertionError("an injected free failure did not surface")
        assert not any(r.index == buf.index for r in self.probe.records()), (
            "free must take the record off before the release, whatever the release returns"
        )
        self._forget(buf)

    @precondition(lambda self: self.can_inject)
    @rule(kind=st.sampled_from(["device", "managed", "arena"]), n=st.integers(1, _MAX_BYTES))
    def alloc_reclaims_and_retries(self, kind: str, n: int) -> None:
        """An allocation that runs out of memory asks the on_out_of_memory callbacks, and one
        that says it freed memory earns another try (here the injected failure is gone by then)."""
        self.gpu.inject_fault("alloc", code="CUDA_ERROR_OUT_OF_MEMORY")  # type: ignore[attr-defined]
        self.reclaim_answer, self.reclaimed = True, []
        try:
            self.alloc(kind, n)
        finally:
            self.reclaim_answer = False
        assert len(self.reclaimed) == 1 and self.reclaimed[0] >= n, self.reclaimed

    # -- interop ---------------------------------------------------------------------------------------

    @precondition(lambda self: self.live or self.arena or self.pieces)
    @rule(data=st.data())
    def export_and_wrap(self, data: st.DataObject) -> None:
        """A buffer exported (DLPack, or the CUDA array interface) and wrapped back is the same memory:
        a write through the wrapped buffer is read through the original."""
        buf, contents = self._pick(data, self._all())
        records = self.probe.records()
        try:
            ext = self.gpu.wrap(buf.view())
        except MetraleError as exc:  # a backend that shares no memory (interop is optional) refuses, changing nothing
            assert exc.name == "CUDA_ERROR_NOT_SUPPORTED", exc
            assert self.probe.records() == records
            return
        assert ext.kind == "external" and ext.nbytes == buf.nbytes and ext.index != buf.index
        assert self.probe.records() == records, "wrap put another library's memory on the ledger"
        offset = data.draw(st.integers(0, buf.nbytes - 1), label="offset")
        value = data.draw(st.integers(0, 255), label="value")
        self.gpu.memset(ext, value, offset=offset, nbytes=1)
        contents.write(offset, bytes([value]))
        contents.check(self._read(buf), buf)
        try:
            self.gpu.free(ext)
        except InvalidBufferError:
            pass
        else:
            raise AssertionError("free() of wrapped memory was not refused")
        self.gpu.unwrap(ext)
        self.stale.append(ext)

    # -- invariants -----------------------------------------------------------------------------------

    @invariant()
    def stats_match_model(self) -> None:
        stats = self.gpu.stats()
        for kind in ("device", "managed"):
            want = sum(b.nbytes for b, _ in self.live.values() if b.kind == kind)
            assert stats.current_bytes[kind] == want, (kind, stats.current_bytes, want)
        blocks = sum(b.nbytes for b, _ in self.arena.values()) + _ARENA_BYTES
        assert stats.current_bytes["arena"] == blocks, (stats.current_bytes, blocks)
        assert stats.alloc_count - stats.free_count == len(self.live) + len(self.arena) + 1
        assert stats.peak_total_bytes >= stats.current_total_bytes
        assert all(stats.peak_bytes[k] >= v for k, v in stats.current_bytes.items())
        assert (stats.arena_capacity, stats.arena_used) == (_ARENA_BYTES, self.sub_top)

    @invariant()
    def ledger_matches_model(self) -> None:
        records = self.probe.records()
        assert self.gpu.live_alloc_len() == len(self.live) == self.probe.live_count()
        assert {r.index for r in records} == set(self.live)
        assert self.probe.live_bytes() == sum(b.nbytes for b, _ in self.live.values())
        for r in records:
            b = self.live[r.index][0]
            assert (r.ptr, r.nbytes, r.kind, r.site) == (b.ptr, b.nbytes, b.kind, b.site)
        assert all(b.kind != "arena" for b in (self.live[r.index][0] for r in records))


def _u32(value: int) -> object:
    """A 32-bit unsigned kernel argument (ctypes: the core needs no numpy)."""
    import ctypes

    return ctypes.c_uint32(value)


def _expect(cls: type[MetraleError], name: str | None, call: Callable[[], object]) -> MetraleError:
    try:
        call()
    except cls as exc:
        assert exc.name == name, f"expected {cls.__name__} {name}, got {exc.name}: {exc}"
        return exc
    raise AssertionError(f"expected {cls.__name__} ({name}), but the call succeeded")


def backend_params(settings: MetraleSettings | None = None, *, expected: tuple[str, ...] = ("cuda",)) -> list[Any]:
    """``pytest.param``s of every discovered backend, for ``@pytest.fixture(params=...)``.

    An unavailable backend, or one of ``expected`` that is not even
    installed, is a param skipped with the reason, so a test report says
    why it did not run there (a machine without a GPU skips ``cuda``).
    """
    import pytest

    from ._discovery import available_backends

    infos = available_backends(settings or MetraleSettings())
    params = []
    for name, info in infos.items():
        marks = [] if info.available else [pytest.mark.skip(reason=f"backend {name} unavailable: {info.reason}")]
        params.append(pytest.param(name, marks=marks, id=name))
    for name in expected:
        if name not in infos:
            skip = pytest.mark.skip(reason=f"backend {name} is not installed")
            params.append(pytest.param(name, marks=[skip], id=name))
    return params


def backend_state_machine(
    name: str, settings: MetraleSettings | None = None
) -> type[BackendMachine]:
    """A :class:`BackendMachine` subclass bound to backend ``name`` and ``settings``.

    ``backend_state_machine("fake").TestCase`` is a ``unittest.TestCase``
    that pytest collects.
    """
    return type(
        f"BackendMachine_{name}",
        (BackendMachine,),
        {"backend_name": name, "settings": settings},
    )


# -- the bad-input table ------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class BadInputFixture:
    """What a bad-input case may use: a backend and a few handles of it."""

    gpu: GpuBackend
    buf: DeviceBuffer
    arena: DeviceBuffer
    freed: DeviceBuffer
    host: HostBuffer
    foreign_stream: Stream


@dataclasses.dataclass(frozen=True, slots=True)
class BadInput:
    """One bad call and the error it must raise, changing nothing."""

    name: str
    call: Callable[[BadInputFixture], Any]
    error: type[MetraleError]


def _cases() -> tuple[BadInput, ...]:
    buf_err, arg_err = InvalidBufferError, InvalidArgumentError
    return (
        BadInput("alloc(0)", lambda f: f.gpu.alloc(0), buf_err),
        BadInput("alloc(-1)", lambda f: f.gpu.alloc(-1), buf_err),
        BadInput("alloc(1.5)", lambda f: f.gpu.alloc(1.5), buf_err),  # type: ignore[arg-type]
        BadInput("alloc(True)", lambda f: f.gpu.alloc(True), buf_err),
        BadInput("alloc('64')", lambda f: f.gpu.alloc("64"), buf_err),  # type: ignore[arg-type]
        BadInput("alloc_managed(0)", lambda f: f.gpu.alloc_managed(0), buf_err),
        BadInput("alloc_arena(-5)", lambda f: f.gpu.alloc_arena(-5), buf_err),
        BadInput("alloc_host(0)", lambda f: f.gpu.alloc_host(0), buf_err),
        BadInput("free(freed)", lambda f: f.gpu.free(f.freed), buf_err),
        BadInput("free(arena)", lambda f: f.gpu.free(f.arena), buf_err),
        BadInput("free(42)", lambda f: f.gpu.free(42), buf_err),  # type: ignore[arg-type]
        BadInput("free_arena(device)", lambda f: f.gpu.free_arena(f.buf), buf_err),
        BadInput("memset value 300", lambda f: f.gpu.memset(f.buf, 300), arg_err),
        BadInput("memset value -1", lambda f: f.gpu.memset(f.buf, -1), arg_err),
        BadInput("memset value 'a'", lambda f: f.gpu.memset(f.buf, "a"), arg_err),  # type: ignore[arg-type]
        BadInput("memset past end", lambda f: f.gpu.memset(f.buf, 1, offset=f.buf.nbytes, nbytes=1), buf_err),
        BadInput("memset nbytes=0", lambda f: f.gpu.memset(f.buf, 1, nbytes=0), buf_err),
        BadInput("copy_device nbytes=-1", lambda f: f.gpu.copy_device(f.buf, f.buf, nbytes=-1), buf_err),
        BadInput("memset negative offset", lambda f: f.gpu.memset(f.buf, 1, offset=-1), arg_err),
        BadInput("memset raw pointer without nbytes", lambda f: f.gpu.memset(f.buf.ptr, 1), arg_err),
        BadInput("memset on another backend's stream", lambda f: f.gpu.memset(f.buf, 1, stream=f.foreign_stream),
                 arg_err),
        BadInput("memset of a freed buffer", lambda f: f.gpu.memset(f.freed, 1), buf_err),
        BadInput("memset raw pointer outside any allocation", lambda f: f.gpu.memset(0x10, 1, nbytes=1), arg_err),
        BadInput("copy_to_device too long",
                 lambda f: f.gpu.copy_to_device(f.buf, bytes(f.buf.nbytes + 1)), buf_err),
        BadInput("copy_to_device not a buffer", lambda f: f.gpu.copy_to_device(f.buf, 12), arg_err),
        BadInput("copy_to_host read-only destination", lambda f: f.gpu.copy_to_host(bytes(8), f.buf), arg_err),
        BadInput("copy_to_host past end", lambda f: f.gpu.copy_to_host(bytearray(2), f.buf, offset=f.buf.nbytes - 1),
                 buf_err),
        BadInput("copy_device past end", lambda f: f.gpu.copy_device(f.buf, f.buf, nbytes=f.buf.nbytes + 1), buf_err),
        BadInput("copy_device from a freed buffer", lambda f: f.gpu.copy_device(f.buf, f.freed, nbytes=1), buf_err),
        BadInput("copy_to_device on a stream that is not a Stream", lambda f: f.gpu.copy_to_device(
            f.buf, b"x", stream=object()), arg_err),  # type: ignore[arg-type]
        BadInput("end_capture on a stream not capturing", lambda f: f.gpu.end_capture(), CaptureError),
        BadInput("open_backend of an unknown name", lambda f: open_backend("no-such-backend"), BackendNotFoundError),
    )


#: At least twenty bad calls, each with its typed error; each must change nothing.
BAD_INPUTS: tuple[BadInput, ...] = _cases()


@contextlib.contextmanager
def bad_input_fixture(gpu: GpuBackend) -> Iterator[BadInputFixture]:
    """The handles the bad-input cases use, on ``gpu`` (a second backend of the same name gives the foreign stream)."""
    with open_backend(gpu.name, ordinal=gpu.ordinal, settings=gpu.settings) as other:
        freed = gpu.alloc(64)
        gpu.free(freed)
        buf = gpu.alloc(256)
        gpu.memset(buf, 0x3C)
        yield BadInputFixture(
            gpu=gpu,
            buf=buf,
            arena=gpu.alloc_arena(128),
            freed=freed,
            host=gpu.alloc_host(64),
            foreign_stream=other.create_stream(),
        )


def check_bad_input(fixture: BadInputFixture, case: BadInput) -> MetraleError:
    """Run ``case`` on ``fixture``; assert its error type and that nothing changed."""
    gpu = fixture.gpu
    probe = gpu.ledger_probe()
    records = probe.records()
    before = bytearray(fixture.buf.nbytes)
    gpu.copy_to_host(before, fixture.buf)
    try:
        case.call(fixture)
    except case.error as exc:
        error = exc
    except MetraleError as exc:
        raise AssertionError(f"{case.name}: expected {case.error.__name__}, got {type(exc).__name__}: {exc}") from exc
    else:
        raise AssertionError(f"{case.name}: expected {case.error.__name__}, but the call succeeded")
    assert str(error), f"{case.name}: the error has no message"
    assert probe.records() == records, f"{case.name}: the refused call changed the ledger"
    after = bytearray(fixture.buf.nbytes)
    gpu.copy_to_host(after, fixture.buf)
    assert after == before, f"{case.name}: the refused call changed the buffer's bytes"
    return error
