"""The state machine's model and helpers: what the backend should hold, and how a rule reaches it.

The rules (``_memory_rules``, ``_machine``) build on `MachineModel`;
the invariants here check the backend against the model after every step.
"""

from __future__ import annotations

import gc
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant

from .. import (
    Arena,
    BackendNotFoundError,
    DeviceBuffer,
    GpuBackend,
    GraphExec,
    Kernel,
    MemoryPool,
    MetraleError,
    MetraleSettings,
    RedZoneError,
    RedZoneViolation,
    Stream,
    open_backend,
)
from ..kernels import shipped_modules
from ._capabilities import backend_capabilities
from ._faults import FaultInjecting

__all__ = ["ARENA_BYTES", "COLLECT_EVERY", "MAX_BYTES", "Contents", "MachineModel", "Pool"]

MAX_BYTES = 4096
ARENA_BYTES = 16384

#: Programs between two full garbage collections: a closed backend holds no memory and is freed by
#: reference counting, but a plugin's own reference cycles wait for a full collection, and the
#: collector counts objects, not bytes (a cycle holding gigabytes of a device's memory looks small).
COLLECT_EVERY = 25


class Contents:
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


#: Buffers of the model by creation index, each with the bytes it should hold.
Pool = dict[int, tuple[DeviceBuffer, Contents]]


class MachineModel(RuleBasedStateMachine):
    """The backend a program drives, the model of what it should hold, and the invariants between them."""

    #: The backend the machine opens; [`backend_state_machine`][metrale_core.testing.backend_state_machine] binds it.
    backend_name: ClassVar[str | None] = None
    settings: ClassVar[MetraleSettings | None] = None
    #: Programs torn down in this process (every COLLECT_EVERY of them, a full collection).
    programs: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        if self.backend_name is None:
            raise BackendNotFoundError(
                f"{type(self).__name__} is bound to no backend: use backend_state_machine(name)"
            )
        settings = self.settings or MetraleSettings()
        self.gpu: GpuBackend = open_backend(self.backend_name, settings=settings)
        try:
            self._setup(settings)
        except BaseException:
            self.gpu.close()  # no teardown follows a failed __init__: nothing of it may stay open
            raise

    def _setup(self, settings: MetraleSettings) -> None:
        self.probe = self.gpu.ledger_probe()
        self.live: Pool = {}  # device and managed, by index
        self.arena: Pool = {}
        self.stale: list[DeviceBuffer] = []
        self.dirty: dict[tuple[int, str], int] = {}  # (index, side) -> first changed offset
        #: The backend, where it can inject driver failures.
        self.faults: FaultInjecting | None = self.gpu if isinstance(self.gpu, FaultInjecting) else None
        self.can_inject = self.faults is not None
        capabilities = backend_capabilities(self.gpu.name, settings)
        self.shares = capabilities.has("interop")
        self.peers = capabilities.has("peers")
        self.fill = self._load_kernel("vector", "fill_u32")
        self.write_u8 = self._load_kernel("fault", "write_u8")
        rz = self.gpu.settings
        self.redzone = rz.redzone
        self.redzone_min_idx = rz.redzone_min_idx
        self.redzone_lead = rz.redzone_lead
        self.redzone_sample = rz.redzone_sample
        self.quarantine_bound = rz.redzone_quarantine_bytes
        self.quarantine: dict[int, tuple[DeviceBuffer, int]] = {}  # freed zoned buffers by index, with their bytes
        self.qdirty: dict[tuple[int, str], int] = {}  # their changed zones, as ``dirty``
        #: Checked freed blocks kept for reuse: raw bytes (one layout each) -> how many, oldest layout first.
        self.reusable: dict[int, int] = {}
        self.graph_checks = self._graph_checks()
        self.sub: Arena = self.gpu.create_arena(ARENA_BYTES)
        self.pieces: Pool = {}  # live pieces of self.sub, by index
        self.sub_top = 0  # the model of self.sub.used
        self.reclaimed: list[int] = []  # what the on_out_of_memory callback was asked for
        self.reclaim_answer = False
        self.gpu.on_out_of_memory(self._reclaim)
        self.heard: list[RedZoneViolation] = []  # what the violation observer heard (cleared by the rules)
        self.gpu.on_redzone_violation(lambda name, violation: self.heard.append(violation))
        #: A second backend of the same plugin for peer copies, opened by the first rule that needs it.
        self.pool: MemoryPool | None = None  # made at the first pool rule, with a second pool and a stream
        self.other_pool: MemoryPool | None = None
        self.pool_stream: Stream | None = None
        #: Live pieces by index: where each was allocated (`PoolRules.WHERE`: the default stream, pool_stream, or
        #: another library's stream through alloc_on).
        self.piece_streams: dict[int, str] = {}
        self.peer: GpuBackend | None = None
        self.peer_pool: Pool = {}  # its live buffers, by index
        if self.redzone and self.redzone_sample > 1:
            self._align_indexes(self.redzone_sample)

    def _align_indexes(self, n: int) -> None:
        """Creation indexes are the process's, and ``redzone_sample`` zones those that are multiples of ``n``:
        allocate (and free) zone-less buffers until the next index is a multiple of ``n``, so every replay of
        a program zones the same allocations of it (Hypothesis replays a program to shrink it)."""
        while True:
            buf = self.gpu.alloc_managed(1)  # never zoned: its free is immediate, and counted as any other
            self.gpu.free(buf)
            if (buf.index + 1) % n == 0:
                return

    def teardown(self) -> None:
        try:
            try:
                if self.peer is not None:
                    try:
                        for buf, _ in self.peer_pool.values():
                            self.peer.free(buf)
                    finally:
                        self.peer.close()  # whatever a failed rule left (a capture in progress too)
            finally:
                self.gpu.close()
            assert self.probe.live_count() == 0, "the ledger is not empty after close()"
        finally:
            self._let_go()

    def _let_go(self) -> None:
        """After close: drop the backend, the model's handles and contents. Hypothesis keeps a failing
        program's exception, whose traceback holds this machine, for every failure it meets while
        shrinking: hundreds of them. (A closed backend holds its raw device, for ``gpu.raw``; a raw
        device whose ``close()`` keeps its memory would keep it for each of them.)"""
        del self.gpu
        self.peer, self.peer_pool = None, {}
        self.live, self.arena, self.pieces, self.stale, self.dirty = {}, {}, {}, [], {}
        self.quarantine, self.qdirty, self.heard, self.reusable = {}, {}, [], {}
        self.pool = self.other_pool = self.pool_stream = None
        self.piece_streams = {}
        self.fill = self.write_u8 = None
        MachineModel.programs += 1
        if MachineModel.programs % COLLECT_EVERY == 0:
            gc.collect()

    # -- helpers ------------------------------------------------------------------------

    def injector(self) -> FaultInjecting:
        """The backend as `FaultInjecting` (the rules that call this run only where ``can_inject``)."""
        assert self.faults is not None
        return self.faults

    def _load_kernel(self, module: str, name: str) -> Kernel | None:
        """The shipped ``module.name`` (``vector.fill_u32``, ``fault.write_u8``), or ``None`` where the
        backend runs no kernels."""
        try:
            registry = self.gpu.load_modules(shipped_modules(module))
        except MetraleError as exc:
            if exc.name == "CUDA_ERROR_NOT_SUPPORTED":
                return None
            raise
        return registry.kernel(module, name)

    def _graph_checks(self) -> str:
        """How graph launches are checked, by what ``redzone_checks`` says: ``"inside"`` (the verdict kernel
        in every graph: a bad verdict earns a full check, which releases the quarantine), ``"waiting"`` (a
        full check after every launch, waited for), ``"queued"`` (a scan queued behind every launch, judged
        at the next wait: it judges every watched zone, live and quarantined, as the other checks do, and
        releases nothing), or ``""`` (not checked)."""
        if self.redzone == 0 or not self.gpu.settings.redzone_scan_graphs:
            return ""
        mode = self.gpu.redzone_checks.mode
        if mode == "inside":
            return "inside"
        return "queued" if mode == "queued" else "waiting"

    def _all(self) -> Pool:
        return {**self.live, **self.arena, **self.pieces}

    def _reclaim(self, nbytes: int) -> bool:
        self.reclaimed.append(nbytes)
        return self.reclaim_answer

    def _pick(self, data: st.DataObject, pool: Pool) -> tuple[DeviceBuffer, Contents]:
        index = data.draw(st.sampled_from(sorted(pool)), label="buffer")
        return pool[index]

    def _read(self, buf: DeviceBuffer) -> bytes:
        out = bytearray(buf.nbytes)
        self.gpu.copy_to_host(out, buf)
        return bytes(out)

    def _launch_graph(self, exe: GraphExec, stream: Stream) -> None:
        """Launch, expecting the launch's check (see `_graph_checks`) to raise where zones changed and
        the settings say so: at the launch, or with ``redzone_scan_queued`` at the stream's synchronize after
        it. A full check judges the live zones and the quarantined ones, and releases the quarantine."""
        settings = self.gpu.settings
        mode = self.graph_checks
        changed = {**self.dirty, **self.qdirty}
        expected = changed if mode else {}  # every mode judges the quarantined zones too
        drains = mode == "waiting" or (mode == "inside" and bool(changed))
        expect = bool(expected) and settings.redzone_action == "raise"
        try:
            exe.launch(stream)
            if settings.redzone_scan_queued:  # the check is judged later: the wait reports it
                stream.synchronize()
        except RedZoneError as exc:
            assert expect, f"a graph launch raised {exc} with no changed zone in the model"
            got = {(v.index, v.side): v.offset for v in exc.violations}
            assert len(got) == len(exc.violations), f"a zone was reported twice: {exc.violations}"
            assert got == expected, f"the check at a graph launch ({mode}) reported {got}, the model expects {expected}"
        else:
            assert not expect, f"the check at a graph launch ({mode}) missed a changed zone: {expected}"
        if drains:
            self._quarantine_checked()

    def _zoned(self, buf: DeviceBuffer) -> bool:
        return (
            buf.kind in ("device", "pool") and self.redzone > 0 and buf.index >= self.redzone_min_idx
            and buf.index % self.redzone_sample == 0
        )

    def _zone_bytes(self, buf: DeviceBuffer) -> int:
        """What a zoned buffer holds of the device: itself, its trailing zone and its leading one."""
        return self._zone_bytes_of(buf.nbytes)

    def _zone_bytes_of(self, n: int) -> int:
        lead = -(-self.redzone // 256) * 256 if self.redzone_lead else 0
        return n + self.redzone + lead

    def _quarantines(self, buf: DeviceBuffer) -> bool:
        """Whether ``free(buf)`` puts it in the quarantine (rather than checking and releasing it at once)."""
        return self._zoned(buf) and self.quarantine_bound > 0

    def _quarantine_checked(self, *, give_back: bool = False) -> dict[tuple[int, str], int]:
        """The quarantine was checked and let go: what the model expects that check to have found. The
        blocks found intact are kept for reuse, within the bound (``give_back``: none are kept)."""
        found, self.qdirty, entries, self.quarantine = self.qdirty, {}, self.quarantine, {}
        bad = {index for index, _ in found}
        for index, (buf, nbytes) in entries.items():
            if index not in bad and buf.kind == "device":  # (a pool's piece goes back to its pool)
                self.reusable[nbytes] = self.reusable.get(nbytes, 0) + 1
        self._trim(0 if give_back else self.quarantine_bound)
        return found

    def _trim(self, bound: int) -> None:
        """Blocks kept for reuse give way, oldest layout first, until they and the quarantine fit ``bound``."""
        held = sum(nbytes for _, nbytes in self.quarantine.values())
        while self.reusable and sum(n * k for n, k in self.reusable.items()) + held > bound:
            nbytes = next(iter(self.reusable))
            self._take_reusable(nbytes)

    def _allocated(self, buf: DeviceBuffer) -> None:
        """A new allocation: a zoned one takes a kept block of its layout if there is one."""
        if buf.kind == "device" and self._zoned(buf) and self._zone_bytes(buf) in self.reusable:
            self._take_reusable(self._zone_bytes(buf))

    def _take_reusable(self, nbytes: int) -> None:
        self.reusable[nbytes] -= 1
        if not self.reusable[nbytes]:
            del self.reusable[nbytes]

    def _reuses(self, kind: str, n: int) -> bool:
        """Whether an allocation of ``kind`` and ``n`` bytes (zoned if the next index is) would take a kept block."""
        return kind == "device" and self.redzone > 0 and (n + self._zone_bytes_of(0)) in self.reusable

    def _pool_cached(self) -> bool:
        """Whether a pool of the machine caches memory (an allocation out of memory trims it first)."""
        return any(pool is not None and pool.stats().cached_bytes for pool in (self.pool, self.other_pool))

    def _forget(self, buf: DeviceBuffer) -> None:
        self.live.pop(buf.index, None)
        self.arena.pop(buf.index, None)
        self.pieces.pop(buf.index, None)
        self.piece_streams.pop(buf.index, None)
        self.dirty.pop((buf.index, "trail"), None)
        self.dirty.pop((buf.index, "lead"), None)
        self.stale.append(buf)

    # -- invariants -----------------------------------------------------------------------------------

    @invariant()
    def stats_match_model(self) -> None:
        stats = self.gpu.stats()
        for kind in ("device", "managed", "pool"):
            want = sum(b.nbytes for b, _ in self.live.values() if b.kind == kind)
            assert stats.current_bytes[kind] == want, (kind, stats.current_bytes, want)
        blocks = sum(b.nbytes for b, _ in self.arena.values()) + ARENA_BYTES
        assert stats.current_bytes["arena"] == blocks, (stats.current_bytes, blocks)
        assert stats.alloc_count - stats.free_count == len(self.live) + len(self.arena) + 1
        assert stats.peak_total_bytes >= stats.current_total_bytes
        assert all(stats.peak_bytes[k] >= v for k, v in stats.current_bytes.items())
        assert (stats.arena_capacity, stats.arena_used) == (ARENA_BYTES, self.sub_top)
        held = sum(nbytes for _, nbytes in self.quarantine.values())
        assert (stats.redzone_quarantined, stats.redzone_quarantined_bytes) == (len(self.quarantine), held), (
            stats.redzone_quarantined, stats.redzone_quarantined_bytes, len(self.quarantine), held)
        assert stats.redzone_sample == self.redzone_sample
        kept = (sum(self.reusable.values()), sum(n * k for n, k in self.reusable.items()))
        assert (stats.redzone_reusable, stats.redzone_reusable_bytes) == kept, (
            stats.redzone_reusable, stats.redzone_reusable_bytes, kept)

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
