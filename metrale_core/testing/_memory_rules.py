"""The state machine's rules for memory: allocations of every kind, frees, an arena, sweeps and data movement."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from .. import (
    ArenaFullError,
    DeviceBuffer,
    GpuBackend,
    InvalidArgumentError,
    InvalidBufferError,
    RedZoneError,
    device_count,
    open_backend,
)
from .._memory.quarantine import QUARANTINE_MAX_BUFFERS
from ._model import ARENA_BYTES, MAX_BYTES, Contents, MachineModel

__all__ = ["MemoryRules"]

#: How to allocate again a stale buffer's kind (wrapped memory is not allocated by metrale).
_REALLOC = {"device": "alloc", "managed": "alloc_managed", "arena": "alloc_arena", "pool": "pool"}


def _helper(gpu: GpuBackend, kind: str, n: int) -> DeviceBuffer:
    """An application's allocating helper, naming its caller as the site."""
    fn = {"device": gpu.alloc, "managed": gpu.alloc_managed, "arena": gpu.alloc_arena}[kind]
    return fn(n, stacklevel=2)


class MemoryRules(MachineModel):
    """Allocations, frees (double and of the wrong kind too), the arena, sweeps, copies, memsets, stale handles."""

    # -- allocation -----------------------------------------------------------------------

    @rule(kind=st.sampled_from(["device", "managed", "arena"]), n=st.integers(1, MAX_BYTES))
    def alloc(self, kind: str, n: int) -> None:
        fn = {"device": self.gpu.alloc, "managed": self.gpu.alloc_managed, "arena": self.gpu.alloc_arena}[kind]
        buf = fn(n)
        self._allocated(buf)
        assert buf.nbytes == n and buf.kind == kind and buf.ptr % 256 == 0 and buf.ptr != 0
        assert buf.index not in self._all(), "a creation index was handed out twice"
        assert buf.site.rpartition(":")[2].isdigit(), f"the call site {buf.site!r} is not file:line"
        (self.arena if kind == "arena" else self.live)[buf.index] = (buf, Contents(n))

    @rule(kind=st.sampled_from(["device", "managed", "arena"]), n=st.integers(1, MAX_BYTES))
    def alloc_through_a_helper(self, kind: str, n: int) -> None:
        """An application's own allocating helper passes ``stacklevel=2``: the site is the helper's caller's line
        (this rule's), on every backend and build, and the allocation is otherwise as any other."""
        line = sys._getframe().f_lineno + 1
        buf = _helper(self.gpu, kind, n)
        assert buf.site.endswith(f"{Path(__file__).name}:{line}"), (buf.site, line)
        self._allocated(buf)
        assert buf.nbytes == n and buf.kind == kind and buf.index not in self._all()
        (self.arena if kind == "arena" else self.live)[buf.index] = (buf, Contents(n))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        buf, _ = self._pick(data, self.live)
        self._free(buf)

    @precondition(lambda self: len(self.live) > 1)
    @rule(data=st.data())
    def free_several(self, data: st.DataObject) -> None:
        """Frees in a row, so the quarantine fills past its bound and a free checks the whole batch."""
        picked = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=2, unique=True), label="buffers")
        for index in picked:
            self._free(self.live[index][0])

    def _free(self, buf: DeviceBuffer, call: Callable[[DeviceBuffer], None] | None = None) -> None:
        """Free ``buf`` with ``call`` (``GpuBackend.free`` if ``None``), the quarantine and the reports modelled."""
        free = self.gpu.free if call is None else call
        dirty = {(index, side): off for (index, side), off in self.dirty.items() if index == buf.index}
        if self._quarantines(buf):  # into the quarantine; past its bound, the whole batch is checked
            self.quarantine[buf.index] = (buf, self._zone_bytes(buf))
            self.qdirty.update(dirty)
            self._trim(self.quarantine_bound)  # kept blocks give way to the quarantine
            held = sum(nbytes for _, nbytes in self.quarantine.values())
            drained = held > self.quarantine_bound or len(self.quarantine) > QUARANTINE_MAX_BUFFERS
            expected = self._quarantine_checked() if drained else {}
        else:
            expected = dirty
        self.heard.clear()
        if expected and self.gpu.settings.redzone_action == "raise":
            try:
                free(buf)
            except RedZoneError as exc:
                assert {(v.index, v.side): v.offset for v in exc.violations} == expected, (exc.violations, expected)
            else:
                raise AssertionError(f"free of allocation #{buf.index}, which found changed zones, did not raise")
        else:
            free(buf)  # a changed zone is logged (redzone_action="warn")
        heard = {(v.index, v.side): v.offset for v in self.heard}
        assert heard == expected and len(heard) == len(self.heard), f"free reported {self.heard}, expected {expected}"
        stats = self.gpu.stats()
        held = sum(nbytes for _, nbytes in self.quarantine.values())
        assert (stats.redzone_quarantined, stats.redzone_quarantined_bytes) == (len(self.quarantine), held), (
            f"after free of #{buf.index}: the quarantine holds {stats.redzone_quarantined} buffers "
            f"({stats.redzone_quarantined_bytes} bytes), the model {len(self.quarantine)} ({held} bytes)")
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

    @rule(n=st.integers(0, ARENA_BYTES // 2), align=st.sampled_from([1, 16, 256, 4096]))
    def arena_alloc(self, n: int, align: int) -> None:
        base = self.sub.base
        start = (base + self.sub_top + align - 1) // align * align - base
        if start + n > ARENA_BYTES:
            try:
                self.sub.alloc(n, align=align)
            except ArenaFullError as exc:
                assert (exc.requested, exc.capacity, exc.used) == (n, ARENA_BYTES, self.sub_top), exc
            else:
                raise AssertionError(f"a full arena ({self.sub_top} of {ARENA_BYTES} used) gave out {n} bytes")
            assert self.sub.used == self.sub_top, "a refused arena alloc changed the arena"
            return
        buf = self.sub.alloc(n, align=align)
        assert buf.ptr == base + start and buf.nbytes == n and buf.kind == "arena", buf
        assert buf.index not in self._all(), "a creation index was handed out twice"
        self.sub_top = start + n
        if n:
            self.pieces[buf.index] = (buf, Contents(n))

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
        # one check judges the quarantine (then released) and the zones of the live buffers it sweeps
        found = {**self._quarantine_checked(give_back=True), **self.dirty}
        self.heard.clear()
        if found and self.gpu.settings.redzone_action == "raise":
            try:
                self.gpu.sweep_unreleased()
            except RedZoneError as exc:
                assert {(v.index, v.side): v.offset for v in exc.violations} == found
            else:
                raise AssertionError("the sweep's check of the quarantine did not raise")
            expected = 0  # the sweep raised after it swept the ledger
        assert self.gpu.sweep_unreleased() == expected
        heard = {(v.index, v.side): v.offset for v in self.heard}
        assert heard == found and len(heard) == len(self.heard), f"the sweep reported {self.heard}, expected {found}"
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
        if src.index == dst.index and abs(so - do) < n:  # CUDA leaves it undefined: every backend refuses it
            before = self._read(src)
            try:
                self.gpu.copy_device(dst, src, nbytes=n, dst_offset=do, src_offset=so)
            except InvalidArgumentError:
                pass
            else:
                raise AssertionError(f"an overlapping copy within allocation #{src.index} was not refused")
            assert self._read(src) == before, "a refused overlapping copy changed the buffer"
            return
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

    @precondition(lambda self: any(b.kind in _REALLOC for b in self.stale))
    @rule(data=st.data(), op=st.sampled_from(["memset", "write", "read", "copy", "free"]))
    def stale_over_reused_address(self, data: st.DataObject, op: str) -> None:
        """Allocate again with a stale handle's kind and size: the allocator may hand its address out again
        (CUDA does at once; the fake reuses the most recently freed range of a size class). The stale handle
        is still refused, whatever its address now holds, and the new allocation is untouched."""
        stale = data.draw(st.sampled_from([b for b in self.stale if b.kind in _REALLOC]), label="stale buffer")
        if stale.kind == "pool":  # a pool hands the freed piece's address out again at once (same size, stream)
            assert self.pool is not None
            fresh = self.pool.alloc(stale.nbytes)
            self.piece_streams[fresh.index] = "default"
        else:
            fresh = getattr(self.gpu, _REALLOC[stale.kind])(stale.nbytes)
        self._allocated(fresh)
        contents = Contents(fresh.nbytes)
        (self.arena if fresh.kind == "arena" else self.live)[fresh.index] = (fresh, contents)
        self.gpu.memset(fresh, 0xA5)
        contents.write(0, b"\xa5" * fresh.nbytes)
        try:
            if op == "memset":
                self.gpu.memset(stale, 0)
            elif op == "write":
                self.gpu.copy_to_device(stale, bytes(stale.nbytes))
            elif op == "read":
                self.gpu.copy_to_host(bytearray(stale.nbytes), stale)
            elif op == "copy":
                self.gpu.copy_device(stale, fresh, nbytes=min(stale.nbytes, fresh.nbytes))
            elif stale.kind == "arena":
                self.gpu.free_arena(stale)
            else:
                self.gpu.free(stale)
        except InvalidBufferError:
            pass
        else:
            where = "its own address" if fresh.ptr == stale.ptr else "another address"
            raise AssertionError(f"a {op} through stale allocation #{stale.index} (a new one now at {where}) "
                                 f"was not refused")
        contents.check(self._read(fresh), fresh)

    # -- peer copies: a second backend of the same plugin (another device where there is one) ------------

    def _peer_backend(self) -> GpuBackend:
        """The second backend, opened on first use: ordinal 1 where the backend counts two devices or more,
        else another backend on ordinal 0 (on CUDA the same device; on the fake another fake device)."""
        if self.peer is None:
            settings = self.gpu.settings
            ordinal = 1 if device_count(self.gpu.name, settings=settings) > 1 else 0
            self.peer = open_backend(self.gpu.name, ordinal=ordinal, settings=settings)
        return self.peer

    @precondition(lambda self: self.peers and len(self.peer_pool) < 4)
    @rule(n=st.integers(1, MAX_BYTES), value=st.integers(0, 255))
    def peer_alloc(self, n: int, value: int) -> None:
        peer = self._peer_backend()
        buf = peer.alloc(n)
        peer.memset(buf, value)
        peer.synchronize()
        contents = Contents(n)
        contents.write(0, bytes([value]) * n)
        self.peer_pool[buf.index] = (buf, contents)

    @precondition(lambda self: self.peers)
    @rule(data=st.data(), into_peer=st.booleans(), captured=st.booleans())
    def peer_copy(self, data: st.DataObject, into_peer: bool, captured: bool) -> None:
        """``copy_peer`` either way between this backend and the peer, eager or captured and replayed; out of
        bounds it is refused and changes nothing. A captured copy from a peer buffer freed since is refused
        at launch."""
        peer = self._peer_backend()
        if not self.live:  # (buffers of its own where a program has none yet: peer copies need no other rule)
            self.alloc("device", data.draw(st.integers(1, MAX_BYTES), label="a buffer here"))
        if not self.peer_pool:
            self.peer_alloc(data.draw(st.integers(1, MAX_BYTES), label="a peer buffer"), 0x5A)
        mine, mine_contents = self._pick(data, self.live)
        theirs, their_contents = self._pick(data, self.peer_pool)
        if into_peer:
            dst_gpu, dst, dst_contents, src_gpu, src, src_contents = peer, theirs, their_contents, self.gpu, mine, \
                mine_contents
        else:
            dst_gpu, dst, dst_contents, src_gpu, src, src_contents = self.gpu, mine, mine_contents, peer, theirs, \
                their_contents
        src_offset = data.draw(st.integers(0, src.nbytes - 1), label="src_offset")
        n = data.draw(st.integers(1, src.nbytes - src_offset), label="nbytes")
        dst_offset = data.draw(st.integers(0, dst.nbytes - 1), label="dst_offset")
        src_gpu.synchronize()  # the copy reads what the source's earlier work wrote: order it first
        dst_gpu.synchronize()
        before = self._read_on(dst_gpu, dst)
        if dst_offset + n > dst.nbytes:
            try:
                dst_gpu.copy_peer(dst, src, n, dst_offset=dst_offset, src_offset=src_offset)
            except InvalidBufferError:
                pass
            else:
                raise AssertionError(f"copy_peer of {n} bytes at offset {dst_offset} of {dst.nbytes} was not refused")
            dst_gpu.synchronize()
            assert self._read_on(dst_gpu, dst) == before, "a refused copy_peer changed its destination"
            return
        if not captured:
            dst_gpu.copy_peer(dst, src, n, dst_offset=dst_offset, src_offset=src_offset)
            dst_gpu.synchronize()
        else:
            stream = dst_gpu.create_stream()
            dst_gpu.begin_capture(stream)
            dst_gpu.copy_peer(dst, src, n, dst_offset=dst_offset, src_offset=src_offset, stream=stream)
            graph = dst_gpu.end_capture(stream)
            assert self._read_on(dst_gpu, dst) == before, "work issued to a capturing stream ran"
            exe = graph.instantiate()
            if dst_gpu is self.gpu:
                self._launch_graph(exe, stream)
            else:
                exe.launch(stream)
            stream.synchronize()
            if not into_peer and data.draw(st.booleans(), label="free the source, then launch"):
                peer.free(src)
                del self.peer_pool[src.index]
                try:
                    exe.launch(stream)
                except InvalidBufferError:
                    pass
                else:
                    raise AssertionError("a graph copying from a freed buffer of another backend launched")
            exe.close()
            graph.close()
            stream.close()
        dst_contents.data[dst_offset : dst_offset + n] = src_contents.data[src_offset : src_offset + n]
        dst_contents.known[dst_offset : dst_offset + n] = src_contents.known[src_offset : src_offset + n]
        dst_contents.check(self._read_on(dst_gpu, dst), dst)

    @precondition(lambda self: self.peer_pool)
    @rule(data=st.data())
    def peer_free(self, data: st.DataObject) -> None:
        buf, contents = self._pick(data, self.peer_pool)
        contents.check(self._read_on(self._peer_backend(), buf), buf)
        self._peer_backend().free(buf)
        del self.peer_pool[buf.index]

    def _read_on(self, gpu: GpuBackend, buf: DeviceBuffer) -> bytes:
        out = bytearray(buf.nbytes)
        gpu.copy_to_host(out, buf)
        return bytes(out)
