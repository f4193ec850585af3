"""Red zones on an arena's pieces (``redzone_arena``): laid out and filled as ``alloc``'s, judged at the arena's
``reset()`` and ``close()``, by ``scan_redzones()`` and inside graphs, each violation naming the piece's own
``Arena.alloc`` site; in both builds of `Arena` (``pure``).
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from metrale_core import (
    Arena,
    ArenaFullError,
    CaptureError,
    DeviceBuffer,
    GpuBackend,
    InvalidBufferError,
    MetraleError,
    RedZoneError,
    RedZoneViolation,
    open_backend,
)
from metrale_core.kernels import shipped_modules
from tests._support import examples
from tests.redzones.test_quarantine import LEAD, ZONE, ZONED, _edge, _found, _graph, _launch_expecting

BUILDS = pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure"])


def _open(backend_name: str, pure: bool, **changes: object) -> GpuBackend:
    return open_backend(backend_name, settings=ZONED.updated(**{"redzone_arena": True, "pure": pure, **changes}))


def _named(violation: RedZoneViolation, piece: DeviceBuffer) -> None:
    """The violation names the piece as it was handed out, with its own ``Arena.alloc`` site."""
    assert (violation.index, violation.ptr, violation.nbytes, violation.site) == (
        piece.index, piece.ptr, piece.nbytes, piece.site)
    assert "test_arena_zones.py:" in violation.site


@BUILDS
@pytest.mark.parametrize("side", ["trail", "lead"])
def test_an_overrun_of_a_piece_is_found_by_its_arena_s_reset(backend_name: str, pure: bool, side: str) -> None:
    with _open(backend_name, pure) as gpu, gpu.create_arena(1 << 20) as arena:
        before, piece, after = arena.alloc(100), arena.alloc(1000), arena.alloc(10)
        line = test_an_overrun_of_a_piece_is_found_by_its_arena_s_reset.__code__.co_firstlineno + 4
        assert piece.site.endswith(f"test_arena_zones.py:{line}")
        assert arena.used >= 3 * (LEAD + ZONE) + 1110
        address, offset = _edge(piece, side)
        gpu.memset(address, 0x00, nbytes=1)
        with pytest.raises(RedZoneError, match=r"^Arena\.reset\(\) found") as info:
            arena.reset()
        assert _found(info.value.violations) == [(piece.index, side, offset)]
        _named(info.value.violations[0], piece)
        # the reset happened: the pieces are gone, their zones off the table, the arena usable again
        assert arena.used == 0 and not any(arena.holds(b) for b in (before, piece, after))
        assert gpu.scan_redzones() == []
        again = arena.alloc(1000)
        assert gpu.scan_redzones() == [] and arena.holds(again)  # the zones filled again: no blame left over
        arena.reset()


@BUILDS
def test_a_live_piece_s_overrun_is_found_by_a_scan(backend_name: str, pure: bool) -> None:
    with _open(backend_name, pure) as gpu:
        arena = gpu.create_arena(1 << 16)
        piece = arena.alloc(300, align=1024)
        assert piece.ptr % 1024 == 0
        gpu.memset(piece.ptr + piece.nbytes + ZONE - 1, 0x00, nbytes=1)  # the zone's last byte
        with pytest.raises(RedZoneError) as info:
            gpu.scan_redzones()
        assert _found(info.value.violations) == [(piece.index, "trail", ZONE - 1)]
        _named(info.value.violations[0], piece)
        with pytest.raises(RedZoneError, match=r"^Arena\.close\(\) found"):  # still there: the close judges too
            arena.close()
        assert arena.closed and gpu.scan_redzones() == []


@BUILDS
def test_writes_inside_the_pieces_are_not_violations(backend_name: str, pure: bool) -> None:
    with _open(backend_name, pure) as gpu, gpu.create_arena(1 << 16) as arena:
        pieces = [arena.alloc(n, align=a) for n, a in ((1, 1), (255, 8), (4096, 4096), (0, 256), (17, 2))]
        for piece in pieces:
            if piece.nbytes:
                gpu.memset(piece, 0x00)
        assert gpu.scan_redzones() == []
        arena.reset()


@BUILDS
def test_a_kernel_s_overrun_of_a_piece_inside_a_graph_is_found(backend_name: str, pure: bool) -> None:
    with _open(backend_name, pure, redzone_scan_graphs=True) as gpu:
        write = gpu.load_modules(shipped_modules("fault")).kernel("fault", "write_u8")
        arena = gpu.create_arena(1 << 16)
        stream = gpu.create_stream()
        piece = arena.alloc(100)
        address, offset = _edge(piece, "trail")
        exe = _graph(gpu, stream, lambda: gpu.launch(write, 1, 1, [address, np.uint32(0x3C)], stream=stream))
        error = _launch_expecting(gpu, exe, stream, False)
        assert _found(error.violations) == [(piece.index, "trail", offset)]
        _named(error.violations[0], piece)
        exe.close()
        with pytest.raises(RedZoneError):
            arena.close()


@BUILDS
def test_one_piece_in_n_is_zoned(backend_name: str, pure: bool) -> None:
    with _open(backend_name, pure, redzone_sample=4, redzone_lead=False) as gpu:
        arena = gpu.create_arena(1 << 20)
        pieces = [arena.alloc(512) for _ in range(16)]
        zoned = [p for p in pieces if p.index % 4 == 0]
        assert len(zoned) == 4
        # a zoned piece's 64-byte trail pushes the next piece to the next multiple of 256
        steps = [b.ptr - a.ptr for a, b in itertools.pairwise(pieces)]
        assert steps == [512 + (256 if a.index % 4 == 0 else 0) for a in pieces[:-1]]
        for piece in pieces:
            gpu.memset(piece.ptr + piece.nbytes, 0x00, nbytes=1)  # past every piece's end
        with pytest.raises(RedZoneError) as info:
            arena.reset()
        assert sorted(v.index for v in info.value.violations) == [p.index for p in zoned]
        arena.close()


@BUILDS
def test_the_warn_action_logs_the_overrun_and_resets(
    backend_name: str, pure: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with _open(backend_name, pure, redzone_action="warn") as gpu, gpu.create_arena(4096) as arena:
        piece = arena.alloc(8)
        gpu.memset(piece.ptr + 8, 0x00, nbytes=2)
        with caplog.at_level(logging.WARNING, logger="metrale"):
            arena.reset()
        said = [r.getMessage() for r in caplog.records if "(found by Arena.reset())" in r.getMessage()]
        assert len(said) == 1 and piece.site in said[0], said
        assert arena.used == 0


@BUILDS
def test_a_piece_made_during_a_capture_has_no_zones_and_a_reset_then_is_refused(
    backend_name: str, pure: bool
) -> None:
    """No fill may be issued while a capture runs, and judging zones waits for the device: a piece made then gets
    none, and a reset of an arena with zoned pieces is refused (``CaptureError``), changing nothing: the capture
    goes on (a debugging setting does not break a program that resets inside a capture)."""
    with _open(backend_name, pure) as gpu:
        arena = gpu.create_arena(1 << 16)
        zoned = arena.alloc(100)
        used = arena.used
        stream = gpu.create_stream()
        gpu.begin_capture(stream)
        plain = arena.alloc(100)
        assert arena.used - used < 100 + LEAD + ZONE  # no zones: at most the alignment's padding
        with pytest.raises(CaptureError, match=r"Arena\.reset of an arena with 1 zoned piece\(s\) is refused"):
            arena.reset()
        gpu.end_capture(stream).close()  # not invalidated: the refusal waited for nothing
        assert arena.holds(zoned) and arena.holds(plain) and arena.used > used
        gpu.memset(zoned.ptr + zoned.nbytes, 0x00, nbytes=1)
        with pytest.raises(RedZoneError) as info:
            arena.reset()
        assert _found(info.value.violations) == [(zoned.index, "trail", 0)]
        arena.close()


@BUILDS
def test_without_the_setting_pieces_have_no_zones(backend_name: str, pure: bool) -> None:
    with _open(backend_name, pure, redzone_arena=False) as gpu, gpu.create_arena(4096) as arena:
        piece = arena.alloc(256)
        assert arena.used == 256
        gpu.memset(piece.ptr + 256, 0x00, nbytes=1)  # the next piece's bytes, no zone
        assert gpu.scan_redzones() == []
        arena.reset()


@BUILDS
def test_the_backend_s_close_judges_the_pieces_of_open_arenas(
    backend_name: str, pure: bool, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = _open(backend_name, pure)
    arena = gpu.create_arena(4096)
    piece = arena.alloc(64)
    gpu.memset(piece.ptr + 64, 0x00, nbytes=1)
    with caplog.at_level(logging.WARNING, logger="metrale"):
        gpu.close()
    said = [r.getMessage() for r in caplog.records if "(found by close())" in r.getMessage()]
    assert len(said) == 1 and piece.site in said[0], said
    assert arena.closed
    with pytest.raises(InvalidBufferError, match="is closed"):
        arena.reset()


@BUILDS
def test_a_full_arena_counts_the_zones(backend_name: str, pure: bool) -> None:
    with _open(backend_name, pure, redzone_lead=False) as gpu, gpu.create_arena(1024) as arena:
        arena.alloc(1024 - ZONE)  # the piece and its trailing zone fill the block
        with pytest.raises(ArenaFullError, match="is full"):
            arena.alloc(1)
        arena.reset()
        with pytest.raises(ArenaFullError, match="is full"):
            arena.alloc(1024 - ZONE + 1)  # one byte more than the block holds with its zone
        assert arena.used == 0


@BUILDS
@hyp_settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=st.lists(st.tuples(st.integers(0, 3000), st.sampled_from([1, 2, 16, 256, 4096])), max_size=12))
def test_pieces_stay_aligned_and_their_zones_apart(
    backend_name: str, pure: bool, shapes: list[tuple[int, int]]
) -> None:
    """Every piece at its alignment, its zones between it and its neighbours; filling every piece whole (as a
    kernel may) leaves every zone intact."""
    with _open(backend_name, pure) as gpu, gpu.create_arena(1 << 16) as arena:
        pieces = [arena.alloc(n, align=a) for n, a in shapes]
        spans = []
        for piece, (n, a) in zip(pieces, shapes, strict=True):
            assert piece.ptr % a == 0 and piece.nbytes == n
            spans.append((piece.ptr - LEAD, piece.ptr + n + ZONE))
            if n:
                gpu.memset(piece, 0x5A)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start
        assert gpu.scan_redzones() == []
        arena.reset()
        assert isinstance(arena, Arena)


@BUILDS
def test_the_backend_s_close_after_a_fault_with_zoned_pieces_does_not_raise(pure: bool) -> None:
    """The review's case: at the backend's close the pieces' zones are forgotten, nothing written to the device
    (the in-graph checks' table included), so a faulted backend still closes whole."""
    gpu = _open("fake", pure, redzone_scan_graphs=True)  # (the fake injects faults)
    stream = gpu.create_stream()
    buf = gpu.alloc(64)
    exe = _graph(gpu, stream, lambda: gpu.memset(buf, 0, stream=stream))
    exe.launch(stream)  # the in-graph checks are open
    arena = gpu.create_arena(4096)
    arena.alloc(100)
    gpu.inject_fault("memcpy")
    gpu.inject_fault("synchronize")
    with pytest.raises(MetraleError):
        gpu.synchronize()
    gpu.close()  # never raises
    assert gpu.closed and arena.closed
