"""The state machine's tensor-map rules: make a map over any buffer of the model, launch the shipped TMA copy
between two maps (eager or captured), point a map elsewhere, free the buffer under one.

A map is a 2-D ``uint8`` view, ``rows x cols`` (``cols`` a multiple of 16, so its row stride passes the
driver's rules), with an 8 x 16 box; the copy moves every box of the destination's shape from the same place
of the source, zero where the source ends. The model predicts each refusal: an address off a 16-byte boundary
(``TensorMapError``), a tensor past its buffer or a buffer no longer live (``InvalidBufferError``), and that a
refused call changes nothing.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from .. import (
    DeviceBuffer,
    InvalidBufferError,
    Kernel,
    MetraleError,
    MetraleSettings,
    TensorMap,
    TensorMapError,
    TensorMapSpec,
)
from ._capabilities import backend_capabilities
from ._model import Contents
from ._pool_rules import PoolRules

__all__ = ["TensorMapRules"]

BOX = (8, 16)
TILE_BYTES = BOX[0] * BOX[1]


class _Mapped:
    """A map of the model: the map, and where the model says it points."""

    __slots__ = ("buf", "cols", "offset", "rows", "tmap")

    def __init__(self, tmap: TensorMap, buf: DeviceBuffer, offset: int, rows: int, cols: int) -> None:
        self.tmap, self.buf, self.offset, self.rows, self.cols = tmap, buf, offset, rows, cols


def _spec(rows: int, cols: int) -> TensorMapSpec:
    return TensorMapSpec("uint8", (rows, cols), (cols, 1), BOX)


class TensorMapRules(PoolRules):
    """Rules for tensor maps, on backends that have them and run the shipped TMA kernel (compute 9.0 or later)."""

    def _setup(self, settings: MetraleSettings) -> None:
        super()._setup(settings)
        self.maps: list[_Mapped] = []
        self.tma: Kernel | None = None
        if backend_capabilities(self.gpu.name, settings).has("tensor_maps") and self.gpu.compute_capability() >= (
            9, 0
        ):
            self.tma = self._load_kernel("tma", "tma_copy_2d")

    def _let_go(self) -> None:
        self.maps, self.tma = [], None
        super()._let_go()

    def _holder(self, buf: DeviceBuffer) -> tuple[DeviceBuffer, Contents] | None:
        """The model's entry for ``buf`` while it is live (the very buffer: a new one at its address is not)."""
        held = self._all().get(buf.index)
        return held if held is not None and held[0] is buf else None

    def _place(self, data: st.DataObject) -> tuple[DeviceBuffer, int]:
        """A buffer of the model and an offset into it (some off a 16-byte boundary, some at its end)."""
        buf, _ = self._pick(data, self._all())
        return buf, data.draw(st.sampled_from([0, 0, 16, 32, 8, buf.nbytes]), label="offset")

    @staticmethod
    def _expected(buf: DeviceBuffer, offset: int, rows: int, cols: int) -> type[MetraleError] | None:
        """What a map of ``rows x cols`` bytes at ``offset`` of ``buf`` (live) gets: the driver's alignment
        rule first, then metrale's extent."""
        if offset > buf.nbytes:  # past the buffer: metrale refuses that before the driver's rules
            return InvalidBufferError
        if (buf.ptr + offset) % 16:
            return TensorMapError
        return InvalidBufferError if offset + rows * cols > buf.nbytes else None

    @precondition(lambda self: self.tma is not None and self._all())
    @rule(data=st.data())
    def make_tensor_map(self, data: st.DataObject) -> None:
        buf, offset = self._place(data)
        cols = data.draw(st.sampled_from([16, 32, 48, 64]), label="cols")
        rows = data.draw(st.integers(1, 16), label="rows")
        expected = self._expected(buf, offset, rows, cols)
        records = self.probe.records()
        try:
            tmap = self.gpu.tensor_map(buf, _spec(rows, cols), offset)
        except MetraleError as exc:
            assert type(exc) is expected, f"tensor_map({offset=}, {rows}x{cols}) of {buf} raised {exc!r}"
            assert self.probe.records() == records, "a refused tensor_map changed the ledger"
            return
        assert expected is None, f"tensor_map({offset=}, {rows}x{cols}) of {buf} was not refused ({expected})"
        assert (tmap.buffer, tmap.offset, len(tmap.image)) == (buf, offset, 128)
        self.maps.append(_Mapped(tmap, buf, offset, rows, cols))

    @precondition(lambda self: self.maps and self._all())
    @rule(data=st.data())
    def replace_tensor_map_address(self, data: st.DataObject) -> None:
        mapped = data.draw(st.sampled_from(self.maps), label="map")
        buf, offset = self._place(data)
        expected = self._expected(buf, offset, mapped.rows, mapped.cols)
        before = (mapped.tmap.buffer, mapped.tmap.offset, mapped.tmap.image)
        try:
            mapped.tmap.replace_address(buf, offset)
        except MetraleError as exc:
            assert type(exc) is expected, f"replace_address({offset=}) onto {buf} raised {exc!r}"
            assert (mapped.tmap.buffer, mapped.tmap.offset, mapped.tmap.image) == before, "a refused replace changed it"
            return
        assert expected is None, f"replace_address({offset=}) onto {buf} was not refused ({expected})"
        mapped.buf, mapped.offset = buf, offset

    @precondition(lambda self: self.tma is not None and len(self.maps) > 0)
    @rule(data=st.data(), captured=st.booleans())
    def launch_tensor_maps(self, data: st.DataObject, captured: bool) -> None:
        assert self.tma is not None
        src = data.draw(st.sampled_from(self.maps), label="source map")
        dst = data.draw(st.sampled_from(self.maps), label="destination map")
        held_src, held_dst = self._holder(src.buf), self._holder(dst.buf)
        if held_src is not None and held_dst is not None and src.buf is dst.buf:
            return  # one buffer both ways: the tiles' order is the device's
        grid = (-(-dst.cols // BOX[1]), -(-dst.rows // BOX[0]))
        args = [src.tmap, dst.tmap, _u32(BOX[1]), _u32(BOX[0]), _u32(TILE_BYTES)]
        if held_src is None or held_dst is None:  # a map over a freed buffer: refused before the device sees it
            gone = [m.buf for m in (src, dst) if self._holder(m.buf) is None]
            try:
                self.gpu.launch(self.tma, grid, 32, args, shared_mem=TILE_BYTES)
            except InvalidBufferError as exc:
                assert f"allocation #{gone[0].index}" in str(exc) or f"allocation #{gone[-1].index}" in str(exc)
            else:
                raise AssertionError(f"a launch with a map over freed allocation #{gone[0].index} was not refused")
            assert self.gpu.faulted is None
            return
        if captured:
            self.gpu.default_stream.synchronize()
            stream = self.gpu.create_stream()
            self.gpu.begin_capture(stream)
            self.gpu.launch(self.tma, grid, 32, args, shared_mem=TILE_BYTES, stream=stream)
            graph = self.gpu.end_capture(stream)
            exe = graph.instantiate()
            self._launch_graph(exe, stream)
            stream.synchronize()
            for handle in (exe, graph, stream):
                handle.close()
        else:
            self.gpu.launch(self.tma, grid, 32, args, shared_mem=TILE_BYTES)
        _copy_model(held_src[1], src, held_dst[1], dst)
        held_dst[1].check(self._read(dst.buf), dst.buf)

    @precondition(lambda self: self.tma is not None and any(b.nbytes >= 16 for b, _ in self.live.values()))
    @rule(data=st.data())
    def free_under_a_tensor_map(self, data: st.DataObject) -> None:
        """Free a buffer a map points into (it warns, as for a graph's input): a launch with the map is then
        refused before the device sees it, and the map stays in the model (later launches are refused too)."""
        assert self.tma is not None
        buf, _ = self._pick(data, {i: v for i, v in self.live.items() if v[0].nbytes >= 16})
        tmap = self.gpu.tensor_map(buf, _spec(1, 16))
        self.maps.append(_Mapped(tmap, buf, 0, 1, 16))
        self._free(buf)
        try:
            self.gpu.launch(self.tma, 1, 32, [tmap, tmap, _u32(BOX[1]), _u32(BOX[0]), _u32(TILE_BYTES)],
                            shared_mem=TILE_BYTES)
        except InvalidBufferError as exc:
            assert f"allocation #{buf.index}" in str(exc), f"the refusal names another allocation: {exc}"
        else:
            raise AssertionError(f"a launch with a map over freed allocation #{buf.index} was not refused")
        assert self.gpu.faulted is None


def _copy_model(src_contents: Contents, src: _Mapped, dst_contents: Contents, dst: _Mapped) -> None:
    """What the TMA copy leaves in the destination: each row of its shape from the source's same row, zero past
    the source's rows and columns (the known bytes follow the source's)."""
    for r in range(dst.rows):
        at = dst.offset + r * dst.cols
        width = min(dst.cols, src.cols) if r < src.rows else 0
        if width:
            start = src.offset + r * src.cols
            dst_contents.data[at : at + width] = src_contents.data[start : start + width]
            dst_contents.known[at : at + width] = src_contents.known[start : start + width]
        dst_contents.write(at + width, bytes(dst.cols - width))


def _u32(value: int) -> object:
    import ctypes

    return ctypes.c_uint32(value)

