"""The state machine's rules for a caching memory pool: pieces on the ledger, freed and reused, trimmed.

The pool's pieces live in the model's ``live`` table beside ``alloc``'s buffers, so every memory rule (frees with
``GpuBackend.free``, data movement, out-of-bounds, stale handles over reused addresses, sweeps) takes them too.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from .. import DeviceBuffer, InvalidBufferError, MemoryPool
from .._memory.pool import size_class
from ._memory_rules import MemoryRules
from ._model import MAX_BYTES, Contents

__all__ = ["PoolRules"]


#: Where a piece is allocated: the default stream, a stream of the backend, or another library's stream (its raw
#: handle, `MemoryPool.alloc_on`: the allocator doors' way, which the compiled pool lane serves at C level).
WHERE = ("default", "stream", "foreign")
_FOREIGN = 2  # (CUDA's per-thread default stream: a real handle, which a zoned piece's fill is ordered before)


class PoolRules(MemoryRules):
    """A pool of the backend (and a second one, for frees sent to the wrong pool), on the default stream, one
    more, and another library's."""

    def _pool(self) -> MemoryPool:
        if self.pool is None:
            self.pool = self.gpu.create_pool()
            self.other_pool = self.gpu.create_pool()
            self.pool_stream = self.gpu.create_stream()
        return self.pool

    def _pool_pieces(self) -> list[DeviceBuffer]:
        return [buf for buf, _ in self.live.values() if buf.kind == "pool"]

    def _quarantined_pieces(self) -> list[DeviceBuffer]:
        """Pieces freed with red zones that wait in the quarantine for their check (then back to their pool)."""
        return [buf for buf, _ in self.quarantine.values() if buf.kind == "pool"]

    def _extent(self, buf: DeviceBuffer) -> tuple[int, int]:
        """Where a piece lies in its segment, its zones included: its start and its bytes (size class)."""
        if not self._zoned(buf):
            return buf.ptr, size_class(buf.nbytes)
        lead = self._zone_bytes(buf) - buf.nbytes - self.redzone
        return buf.ptr - lead, size_class(self._zone_bytes(buf))

    def _pool_alloc(self, n: int, where: str) -> DeviceBuffer:
        assert self.pool is not None
        if where == "foreign":
            return self.pool.alloc_on(n, _FOREIGN)
        return self.pool.alloc(n, stream=self.pool_stream if where == "stream" else None)

    @rule(n=st.integers(1, MAX_BYTES), where=st.sampled_from(WHERE))
    def pool_alloc(self, n: int, where: str) -> None:
        pool = self._pool()
        before = pool.stats()
        buf = self._pool_alloc(n, where)
        assert buf.nbytes == n and buf.kind == "pool" and buf.ptr % 256 == 0 and buf.ptr != 0
        assert buf.index not in self._all(), "a creation index was handed out twice"
        assert buf.site.rpartition(":")[2].isdigit(), f"the call site {buf.site!r} is not file:line"
        (start, size) = self._extent(buf)
        for other in self._pool_pieces() + self._quarantined_pieces():  # no two pieces out share a byte
            (other_start, other_size) = self._extent(other)
            assert start + size <= other_start or other_start + other_size <= start, (
                f"piece #{buf.index} overlaps piece #{other.index}")
        after = pool.stats()
        assert after.hits + after.misses == before.hits + before.misses + 1
        self.live[buf.index] = (buf, Contents(n))
        self.piece_streams[buf.index] = where

    @precondition(lambda self: any(b.kind == "pool" for b, _ in self.live.values()))
    @rule(data=st.data(), again=st.booleans())
    def pool_free_and_reuse(self, data: st.DataObject, again: bool) -> None:
        """``MemoryPool.free``; then, ``again``, an allocation of the same size on the same stream takes the very
        piece back (at its address), and the freed handle stays refused. A zoned piece waiting in the quarantine
        for its check is not back in its pool yet."""
        assert self.pool is not None
        piece = data.draw(st.sampled_from(self._pool_pieces()), label="piece")
        where = self.piece_streams.pop(piece.index, "default")
        self._free(piece, self.pool.free)
        if not again or piece.index in self.quarantine:
            return
        fresh = self._pool_alloc(piece.nbytes, where)
        if self._zoned(fresh) != self._zoned(piece):  # (one in N zoned: another size, another piece)
            self.live[fresh.index] = (fresh, Contents(fresh.nbytes))
            self.piece_streams[fresh.index] = where
            return
        assert fresh.ptr == piece.ptr, "a piece freed on a stream was not reused by that stream's next allocation"
        self.live[fresh.index] = (fresh, Contents(fresh.nbytes))
        self.piece_streams[fresh.index] = where
        self.gpu.memset(fresh, 0x5A)
        self.live[fresh.index][1].write(0, b"\x5a" * fresh.nbytes)
        for op in ("memset", "free"):
            try:
                if op == "memset":
                    self.gpu.memset(piece, 0)
                else:
                    self.gpu.free(piece)
            except InvalidBufferError:
                pass
            else:
                raise AssertionError(f"a {op} of freed piece #{piece.index} was not refused once its address was "
                                     f"handed out again")
        self.live[fresh.index][1].check(self._read(fresh), fresh)

    def _zoned_pieces(self) -> list[DeviceBuffer]:
        return [buf for buf in self._pool_pieces() if self._zoned(buf)]

    @precondition(lambda self: self._zoned_pieces())
    @rule(data=st.data())
    def pool_reuse_with_zones_in_place(self, data: st.DataObject) -> None:
        """A zoned piece freed, then a piece of another size of its size class on its stream: where its free judged it
        at once (no quarantine), the very block comes back with its zones in place, and only the bytes the new size
        moves are filled. Its zones are then as exact as fresh ones: `scan` finds no change, and `overrun` what was
        planted, with the new owner's site (issue 54)."""
        assert self.pool is not None
        piece = data.draw(st.sampled_from(self._zoned_pieces()), label="zoned piece")
        where = self.piece_streams.pop(piece.index, "default")
        self._free(piece, self.pool.free)
        if piece.index in self.quarantine:  # (back in its pool only once a batch is judged)
            return
        extra = self._zone_bytes(piece) - piece.nbytes  # its zones
        top = size_class(self._zone_bytes(piece))
        n = data.draw(st.integers(max(1, top - 511 - extra), top - extra), label="new size, same size class")
        fresh = self._pool_alloc(n, where)
        self.live[fresh.index] = (fresh, Contents(n))
        self.piece_streams[fresh.index] = where
        if self._zoned(fresh):  # (one piece in N zoned: an unzoned one takes another key of the cache)
            assert fresh.ptr == piece.ptr, "a judged zoned piece was not reused by the next zoned piece of its class"

    @precondition(lambda self: not (self.quarantine or self.reusable))
    @rule(data=st.data())
    def pool_for_another_library_s_capture(self, data: st.DataObject) -> None:
        """Another library's capture in global mode (begun on the raw layer: the core does not see it) allocates from
        a pool made for it (``create_pool(for_capture=True)``, the torch door's per graph): the pool grows during the
        capture, pieces freed inside it wait unjudged (`MemoryPool.capturing`), and the capture stays valid: nothing
        the core did waited for the device or took memory the driver refuses then. Closing the pool judges what it
        held (intact) and gives its memory back (issue 54)."""
        raw = self.gpu.raw
        stream, pool = raw.stream_create(), self.gpu.create_pool(for_capture=True)
        before = self.gpu.live_alloc_len()
        sizes = data.draw(st.lists(st.integers(1, MAX_BYTES), min_size=1, max_size=4), label="sizes in the capture")
        freed = data.draw(st.integers(0, len(sizes)), label="freed inside it")
        raw.begin_capture(stream)
        pool.capturing(True)
        try:
            pieces = [pool.alloc_on(n, 0x7A7A) for n in sizes]
            for piece in pieces[:freed]:
                pool.free(piece)
        finally:
            try:
                graph = raw.end_capture(stream)  # (raises where the capture was invalidated)
            finally:
                pool.capturing(False)  # (after the capture's end, as torch's end hook: what waited is checked now)
        raw.graph_destroy(graph)
        raw.stream_destroy(stream)
        assert self.gpu.live_alloc_len() == before + len(sizes) - freed
        for piece in pieces[freed:]:
            pool.free(piece)
        pool.close()
        assert self.gpu.live_alloc_len() == before and pool.stats().segments == 0

    @precondition(lambda self: any(b.kind == "pool" for b, _ in self.live.values()))
    @rule(data=st.data())
    def pool_record_stream_then_free(self, data: st.DataObject) -> None:
        """``MemoryPool.record_stream``: a piece used on another library's stream too is not taken again by its own
        stream's next allocation of its size (only after a wait for the device); once freed, the call is refused
        and changes nothing."""
        assert self.pool is not None
        piece = data.draw(st.sampled_from(self._pool_pieces()), label="piece")
        where = self.piece_streams.pop(piece.index, "default")
        self.pool.record_stream(piece, 0x5151)
        self._free(piece, self.pool.free)
        before = self.pool.stats()
        try:
            self.pool.record_stream(piece, 0x5151)
        except InvalidBufferError:
            pass
        else:
            raise AssertionError(f"record_stream of freed piece #{piece.index} was not refused")
        assert self.pool.stats() == before
        fresh = self._pool_alloc(piece.nbytes, where)
        self.live[fresh.index] = (fresh, Contents(fresh.nbytes))
        self.piece_streams[fresh.index] = where
        assert fresh.ptr != piece.ptr or self._zoned(fresh) != self._zoned(piece), (
            f"piece #{piece.index}, used on another stream too, was taken again before any wait for the device")

    @precondition(lambda self: any(b.kind == "pool" for b, _ in self.live.values()))
    @rule(data=st.data())
    def pool_free_in_the_wrong_pool(self, data: st.DataObject) -> None:
        assert self.other_pool is not None
        piece = data.draw(st.sampled_from(self._pool_pieces()), label="piece")
        before = self.gpu.live_alloc_len()
        try:
            self.other_pool.free(piece)
        except InvalidBufferError:
            pass
        else:
            raise AssertionError(f"piece #{piece.index} was freed by another pool")
        assert self.gpu.live_alloc_len() == before

    @precondition(lambda self: self.pool is not None)
    @rule(keep=st.sampled_from([0, 4096, 1 << 30]))
    def pool_trim(self, keep: int) -> None:
        assert self.pool is not None
        before = self.pool.stats()
        given = self.pool.trim(keep)
        after = self.pool.stats()
        assert given == after.given_back - before.given_back >= 0
        assert after.segment_bytes == before.segment_bytes - given
        assert (after.pieces, after.piece_bytes) == (before.pieces, before.piece_bytes)
        if given:
            assert after.cached_bytes < before.cached_bytes
        if keep == 0:  # every segment none of whose pieces is out went back
            assert after.segments <= after.pieces and (after.cached_bytes == 0 or after.pieces), after

    @precondition(lambda self: self.can_inject and self._pool_cached() and not (self.quarantine or self.reusable))
    @rule(kind=st.sampled_from(["device", "managed", "arena"]))
    def alloc_trims_the_pools(self, kind: str) -> None:
        """Out of memory with memory cached in a pool: the pools give their free segments back and the allocation
        is tried again before any on_out_of_memory callback is asked."""
        assert self.pool is not None
        before = self.pool.stats()
        self.injector().inject_fault("alloc", code="CUDA_ERROR_OUT_OF_MEMORY")
        self.reclaimed = []
        self.alloc(kind, 128)
        assert self.reclaimed == [], "the callbacks were asked before the pools were trimmed"
        after = self.pool.stats()
        assert after.segments <= after.pieces and after.given_back >= before.given_back, (before, after)

    @invariant()
    def pool_matches_model(self) -> None:
        if self.pool is None:
            return
        stats = self.pool.stats()
        pieces = self._pool_pieces()
        out = pieces + self._quarantined_pieces()
        assert stats.pieces == len(out), (stats, len(out))
        assert stats.piece_bytes == sum(self._extent(b)[1] for b in out), stats
        assert stats.cached_bytes + stats.piece_bytes <= stats.segment_bytes, stats
        assert self.gpu.stats().current_bytes["pool"] == sum(b.nbytes for b in pieces)
