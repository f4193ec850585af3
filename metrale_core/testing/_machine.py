"""The conformance state machine: [`BackendMachine`][metrale_core.testing.BackendMachine], the memory rules and the
tensor-map rules with the rules for kernel launches, captures, red zones, injected driver failures and interop."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from .. import (
    CaptureError,
    DeviceBuffer,
    DriverError,
    InvalidBufferError,
    MetraleError,
    RedZoneError,
)
from .._redzones.report import FOUND_KEPT
from ._model import MAX_BYTES, Pool
from ._tensormap_rules import TensorMapRules

__all__ = ["BackendMachine"]


class BackendMachine(TensorMapRules):
    """Drives one backend through random programs; see the ``metrale_core.testing`` docstring.

    ``backend_state_machine(name, settings)`` binds it to a backend (it sets
    ``backend_name`` and ``settings``); unbound, it raises ``BackendNotFoundError``.
    """

    def _u32_targets(self) -> Pool:
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

    def _plant(self, data: st.DataObject, buf: DeviceBuffer) -> tuple[int, str, int, int]:
        """A byte to change in a zone of ``buf``: its address, the side, its offset in the zone, the value."""
        sides = ["trail", "lead"] if self.redzone_lead else ["trail"]
        side = data.draw(st.sampled_from(sides), label="side")
        value = data.draw(st.integers(0, 255).filter(lambda v: v != self.gpu.settings.redzone_fill), label="value")
        if side == "trail":
            offset = data.draw(st.integers(0, self.redzone - 1), label="zone offset")
            return buf.ptr + buf.nbytes + offset, side, offset, value
        lead = -(-self.redzone // 256) * 256  # the leading band keeps the pointer 256-aligned
        offset = data.draw(st.integers(0, lead - 1), label="lead offset")
        return buf.ptr - lead + offset, side, offset, value

    @staticmethod
    def _changed(dirty: dict[tuple[int, str], int], buf: DeviceBuffer, side: str, offset: int) -> None:
        key = (buf.index, side)
        dirty[key] = min(offset, dirty.get(key, offset))

    def _zoned_live(self) -> Pool:
        return {i: v for i, v in self.live.items() if self._zoned(v[0])}

    @precondition(lambda self: self.redzone > 0 and self._zoned_live())
    @rule(data=st.data())
    def overrun(self, data: st.DataObject) -> None:
        buf, _ = self._pick(data, self._zoned_live())
        address, side, offset, value = self._plant(data, buf)
        self.gpu.memset(address, value, nbytes=1)
        self._changed(self.dirty, buf, side, offset)

    @precondition(lambda self: self.quarantine)
    @rule(data=st.data())
    def overrun_in_quarantine(self, data: st.DataObject) -> None:
        """A write into a zone of a freed buffer waiting in quarantine (its memory is still allocated, so
        the raw memset is legal): the next check of the quarantine must find it."""
        index = data.draw(st.sampled_from(sorted(self.quarantine)), label="quarantined buffer")
        buf = self.quarantine[index][0]
        address, side, offset, value = self._plant(data, buf)
        self.gpu.memset(address, value, nbytes=1)
        self._changed(self.qdirty, buf, side, offset)

    @precondition(lambda self: self.graph_checks and self._zoned_live())
    @rule(data=st.data())
    def overrun_in_graph(self, data: st.DataObject) -> None:
        """A graph that writes one byte into a live zone (a captured raw memset, or a ``fault.write_u8``
        launch where kernels run): the launch's check must report it, with every other changed zone."""
        buf, _ = self._pick(data, self._zoned_live())
        address, side, offset, value = self._plant(data, buf)
        by_kernel = self.write_u8 is not None and data.draw(st.booleans(), label="by a kernel")
        self.gpu.default_stream.synchronize()  # the graph runs on another stream: order it after earlier work
        stream = self.gpu.create_stream()
        self.gpu.begin_capture(stream)
        if by_kernel:
            assert self.write_u8 is not None
            self.gpu.launch(self.write_u8, 1, 1, [address, _u32(value)], stream=stream)
        else:
            self.gpu.memset(address, value, nbytes=1, stream=stream)
        graph = self.gpu.end_capture(stream)
        exe = graph.instantiate()
        self._changed(self.dirty, buf, side, offset)  # the graph's own write: its check sees it
        self._launch_graph(exe, stream)
        stream.synchronize()
        exe.close()
        graph.close()
        stream.close()

    @precondition(lambda self: self.redzone > 0)
    @rule()
    def scan(self) -> None:
        changed = {**self.dirty, **self.qdirty}
        held = {index: buf for index, (buf, _) in self.quarantine.items()}
        try:
            found = self.gpu.scan_redzones()
        except RedZoneError as exc:
            assert self.gpu.settings.redzone_action == "raise" and changed, exc
            found = exc.violations
        else:
            assert not (changed and self.gpu.settings.redzone_action == "raise"), "a scan did not raise"
        self._quarantine_checked()
        for v in found:
            owner = self.live[v.index][0] if v.index in self.live else held.get(v.index)
            assert owner is not None, f"a violation was reported for #{v.index}, neither live nor in quarantine"
            assert (v.ptr, v.nbytes, v.site) == (owner.ptr, owner.nbytes, owner.site)
        got = {(v.index, v.side): v.offset for v in found}
        assert len(got) == len(found), f"a zone was reported twice: {found}"
        assert got == changed, f"scan reported {got}, the model expects {changed}"
        # the backend's report (what an engine gathers) keeps each zone found, once, named by the backend
        kept = self.gpu.ledger_report().violations
        keys = [(v.index, v.side) for v in kept]
        assert len(keys) == len(set(keys)), f"ledger_report() names a zone twice: {kept}"
        assert set(got) <= set(keys) or len(keys) >= FOUND_KEPT, f"ledger_report() lost a violation: {got} {keys}"
        assert all(v.origin == self.gpu.origin for v in kept), "a reported violation names another backend"

    # -- injected driver failures -------------------------------------------------------------------

    @precondition(lambda self: self.can_inject)
    @rule(kind=st.sampled_from(["device", "managed", "arena"]), code=st.sampled_from(
        ["CUDA_ERROR_UNKNOWN", "CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_INVALID_VALUE"]))
    def alloc_fails(self, kind: str, code: str) -> None:
        if code == "CUDA_ERROR_OUT_OF_MEMORY" and (self.quarantine or self.reusable or self._pool_cached()):
            return  # the quarantine is released (the pools trimmed) and the allocation tried again
        if self._reuses(kind, 128):
            return  # a checked block kept for reuse: the driver is not asked
        records = self.probe.records()
        self.injector().inject_fault("alloc", code=code)
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
        """A zone fill that fails fails the allocation and leaves nothing on the ledger; a block kept for
        reuse is filled again too, and one whose fill failed goes back to the driver."""
        recycled = self._reuses("device", 64)
        records = self.probe.records()
        self.injector().inject_fault("memset")
        try:
            buf = self.gpu.alloc(64)
        except DriverError:
            if recycled:
                self._take_reusable(self._zone_bytes_of(64))
        else:
            if self._zoned(buf):
                raise AssertionError("a failed red-zone fill did not fail the alloc")
            try:
                self.gpu.memset(buf, 0)  # the zone-less alloc (sampled out) left the fault for the next memset
            except DriverError:
                pass
            else:
                raise AssertionError("the injected memset failure did not surface at the next memset")
            self.gpu.free(buf)
            if self._quarantines(buf):  # never: it had no zones
                raise AssertionError("a zone-less buffer went to quarantine")
            return
        assert self.probe.records() == records, "an alloc whose zone fill failed stayed on the ledger"

    @precondition(lambda self: self.can_inject and (self.quarantine or self.reusable))
    @rule(kind=st.sampled_from(["device", "managed", "arena"]))
    def alloc_drains_the_quarantine(self, kind: str) -> None:
        """Out of memory with buffers in quarantine or blocks kept for reuse: the quarantine is checked
        (logged, never raised), all of it released with the kept blocks, and the allocation tried again
        before any on_out_of_memory callback is asked."""
        if self._reuses(kind, 128):
            return  # a kept block serves it: the driver is not asked
        self.injector().inject_fault("alloc", code="CUDA_ERROR_OUT_OF_MEMORY")
        self.reclaimed, self.heard[:] = [], []
        self.alloc(kind, 128)
        assert self.reclaimed == [], "the callbacks were asked before the quarantine was released"
        found = self._quarantine_checked(give_back=True)
        heard = {(v.index, v.side): v.offset for v in self.heard}
        assert heard == found, f"the check of the quarantine out of memory reported {self.heard}, expected {found}"

    def _frees_at_once(self) -> Pool:
        """Live buffers whose ``free`` reaches the raw free at once (not into the quarantine)."""
        return {i: v for i, v in self.live.items() if not self._quarantines(v[0]) and v[0].kind != "pool"}

    @precondition(lambda self: self.can_inject and self._frees_at_once())
    @rule(data=st.data())
    def free_fails(self, data: st.DataObject) -> None:
        buf, _ = self._pick(data, self._frees_at_once())
        self.injector().inject_fault("free")
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
    @rule(kind=st.sampled_from(["device", "managed", "arena"]), n=st.integers(1, MAX_BYTES))
    def alloc_reclaims_and_retries(self, kind: str, n: int) -> None:
        """An allocation that runs out of memory asks the on_out_of_memory callbacks, and one
        that says it freed memory earns another try (here the injected failure is gone by then);
        buffers in quarantine are released first, and then no callback is asked."""
        if self.quarantine or self.reusable or self._pool_cached():
            return  # alloc_drains_the_quarantine, alloc_trims_the_pools
        self.injector().inject_fault("alloc", code="CUDA_ERROR_OUT_OF_MEMORY")
        self.reclaim_answer, self.reclaimed = True, []
        try:
            self.alloc(kind, n)
        finally:
            self.reclaim_answer = False
        assert len(self.reclaimed) == 1 and self.reclaimed[0] >= n, self.reclaimed

    # -- interop ---------------------------------------------------------------------------------------

    @precondition(lambda self: self.shares and (self.live or self.arena or self.pieces))
    @rule(data=st.data())
    def export_and_wrap(self, data: st.DataObject) -> None:
        """A buffer exported (DLPack, or the CUDA array interface) and wrapped back is the same memory:
        a write through the wrapped buffer is read through the original. Left out on a backend that
        shares no memory (interop is optional: see ``backend_capabilities``)."""
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
