"""A violation names its suspects (``RedZoneViolation.suspects``, and the report's text): for a graph's verdict (the
check inside it, or a scan after its launch, waited for or queued), the graph's kernel nodes that took an address of
the allocation (its zones included) or of its arena's block, with their place in the graph; for an eager check
(``scan_redzones()``, a free, an arena's reset or close), the backend's last launches that did. Memsets and copies
are not kernels: an overrun by one names none. In both builds (``pure``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import numpy as np
import pytest

from metrale_core import GpuBackend, Kernel, RedZoneError, RedZoneViolation, open_backend
from metrale_core.kernels import shipped_modules
from metrale_core.testing import FaultInjecting
from tests._support import checked_inside
from tests.redzones.test_quarantine import FILL, ZONE, ZONED, _edge, _found, _graph, _launch_expecting

pytestmark = pytest.mark.needs("kernels")

BUILDS = pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure"])


def _open(backend_name: str, pure: bool, **changes: object) -> GpuBackend:
    return open_backend(backend_name, settings=ZONED.updated(pure=pure, **changes))


def _kernels(gpu: GpuBackend) -> tuple[Kernel, Kernel]:
    """``fault.write_u8(address, value)`` and ``vector.fill_u32(p, n, value)``."""
    write = gpu.load_modules(shipped_modules("fault")).kernel("fault", "write_u8")
    fill = gpu.load_modules(shipped_modules("vector")).kernel("vector", "fill_u32")
    return write, fill


def _graph_suspects(
    backend_name: str, pure: bool, side: str, queued: bool, setup: Callable[[GpuBackend], None] | None = None
) -> tuple[str, tuple[str, ...]]:
    """A clean graph (``graph #1``), then a graph of four nodes whose third, ``write_u8``, writes one byte into
    ``side``'s zone of ``buf`` (``graph #2``): the report's text and the suspects of its one violation."""
    with _open(backend_name, pure, redzone_scan_graphs=True, redzone_scan_queued=queued) as gpu:
        if setup is not None:
            setup(gpu)
        write, fill = _kernels(gpu)
        other, buf = gpu.alloc(256), gpu.alloc(100)
        address, offset = _edge(buf, side)
        stream = gpu.create_stream()
        _graph(gpu, stream, lambda: gpu.launch(fill, 1, 64, [other, np.uint32(64), np.uint32(1)], stream=stream))

        def record() -> None:
            gpu.memset(other, 0, stream=stream)  # node 1: no kernel
            gpu.launch(fill, 1, 64, [other, np.uint32(64), np.uint32(7)], stream=stream)  # node 2: another buffer
            gpu.launch(write, 1, 1, [address, np.uint32(0x3C)], stream=stream)  # node 3: the overrun
            gpu.launch(write, 1, 1, [other.ptr + 5, np.uint32(0x3C)], stream=stream)  # node 4: inside `other`

        exe = _graph(gpu, stream, record)
        error = _launch_expecting(gpu, exe, stream, queued)
        assert _found(error.violations) == [(buf.index, side, offset)]
        if checked_inside(gpu):
            assert str(error).startswith("the check inside graph #2 "), "the suspects' graph numbers are the checks'"
        exe.close()
        return str(error), error.violations[0].suspects


@BUILDS
@pytest.mark.parametrize("queued", [False, True], ids=["waited", "queued"])
@pytest.mark.parametrize("side", ["trail", "lead"])
def test_a_graph_s_overrun_names_its_kernel_and_node(backend_name: str, pure: bool, queued: bool, side: str) -> None:
    text, suspects = _graph_suspects(backend_name, pure, side, queued)
    assert suspects == ("write_u8 (node 3 of graph #2)",)
    assert "first changed byte at zone offset" in text and "; suspects: write_u8 (node 3 of graph #2)." in text


@BUILDS
@pytest.mark.parametrize("queued", [False, True], ids=["waited", "queued"])
def test_scans_after_graph_launches_name_the_graph_s_kernels_too(backend_name: str, pure: bool, queued: bool) -> None:
    """Where graphs are not checked inside (here: no mapped host memory), the scan after each launch (waited for,
    or queued behind it) names the same suspects."""

    def no_mapped_memory(gpu: GpuBackend) -> None:
        if not isinstance(gpu, FaultInjecting):
            pytest.skip(f"{backend_name} injects no faults")
        gpu.inject_fault("alloc", code="CUDA_ERROR_NOT_SUPPORTED")  # the first: the checks' mapped page
        assert gpu.redzone_checks.mode == ("queued" if queued else "waited"), gpu.redzone_checks

    text, suspects = _graph_suspects(backend_name, pure, "trail", queued, no_mapped_memory)
    assert suspects == ("write_u8 (node 3 of graph #2)",)
    found_by = "the scan queued after graph launch #1 " if queued else "the scan after GraphExec.launch "
    assert text.startswith(found_by)


@BUILDS
def test_an_eager_launch_s_overrun_is_named_by_the_checks_after_it(backend_name: str, pure: bool) -> None:
    with _open(backend_name, pure, redzone_quarantine_bytes=0) as gpu:
        heard: list[RedZoneViolation] = []
        gpu.on_redzone_violation(lambda name, v: heard.append(v))
        write, fill = _kernels(gpu)
        other, buf = gpu.alloc(256), gpu.alloc(100)
        gpu.launch(write, 1, 1, [buf.ptr - 1, np.uint32(0)])  # one byte into the leading zone
        gpu.launch(fill, 1, 64, [other, np.uint32(64), np.uint32(7)])  # the latest: another buffer
        with pytest.raises(RedZoneError, match=r"^scan_redzones\(\) found") as info:
            gpu.scan_redzones()
        (violation,) = info.value.violations
        assert violation.suspects == ("write_u8 (1 launch before the latest)",)
        assert violation.describe().endswith("; suspects: write_u8 (1 launch before the latest)")
        assert [v.suspects for v in heard] == [violation.suspects], "the observers hear them too"
        gpu.launch(fill, 1, 64, [buf, np.uint32(25), np.uint32(7)])  # in bounds, and now the latest
        with pytest.raises(RedZoneError, match=r"^free of allocation #\d+ found") as info:
            gpu.free(buf)  # its own check (no quarantine)
        assert info.value.violations[0].suspects == (
            "write_u8 (2 launches before the latest)", "fill_u32 (the latest launch)")
        gpu.free(other)


@BUILDS
def test_a_memset_s_overrun_names_no_kernel(backend_name: str, pure: bool) -> None:
    """Memsets and copies are not kernels: a graph's memset past the end names none of the graph's kernels, nor
    does a scan after an eager one (the kernels launched took other buffers)."""
    with _open(backend_name, pure, redzone_scan_graphs=True) as gpu:
        write, fill = _kernels(gpu)
        other, buf = gpu.alloc(256), gpu.alloc(100)
        stream = gpu.create_stream()

        def record() -> None:
            gpu.launch(fill, 1, 64, [other, np.uint32(64), np.uint32(7)], stream=stream)
            gpu.memset(buf.ptr + buf.nbytes, 0, nbytes=2, stream=stream)  # the overrun: a memset node
            gpu.launch(write, 1, 1, [other.ptr, np.uint32(1)], stream=stream)

        exe = _graph(gpu, stream, record)
        error = _launch_expecting(gpu, exe, stream, queued=False)
        assert _found(error.violations) == [(buf.index, "trail", 0)]
        assert error.violations[0].suspects == () and "; suspects:" not in str(error)
        exe.close()
        gpu.memset(buf.ptr + buf.nbytes, FILL, nbytes=2)  # the zone as it was filled
        assert gpu.scan_redzones() == []
        gpu.memset(buf.ptr + buf.nbytes + ZONE - 1, 0, nbytes=1)  # eager now: the zone's last byte
        gpu.launch(write, 1, 1, [other.ptr + 1, np.uint32(1)])
        with pytest.raises(RedZoneError) as info:
            gpu.scan_redzones()
        assert _found(info.value.violations) == [(buf.index, "trail", ZONE - 1)]
        assert info.value.violations[0].suspects == () and "; suspects:" not in str(info.value)


@BUILDS
def test_an_arena_piece_s_suspects_are_the_kernels_of_any_piece_of_its_arena(backend_name: str, pure: bool) -> None:
    with _open(backend_name, pure, redzone_arena=True, redzone_scan_graphs=True) as gpu:
        write, fill = _kernels(gpu)
        outside = gpu.alloc(256)
        stream = gpu.create_stream()
        arena = gpu.create_arena(1 << 16)
        first, piece = arena.alloc(256), arena.alloc(100)

        def record() -> None:
            gpu.launch(fill, 1, 64, [outside, np.uint32(64), np.uint32(7)], stream=stream)  # not of the arena
            gpu.launch(fill, 1, 64, [first, np.uint32(64), np.uint32(7)], stream=stream)  # another piece of it
            gpu.memset(piece.ptr + piece.nbytes, 0, nbytes=1, stream=stream)  # the overrun (a memset: no kernel)

        exe = _graph(gpu, stream, record)
        error = _launch_expecting(gpu, exe, stream, queued=False)
        assert _found(error.violations) == [(piece.index, "trail", 0)]
        assert error.violations[0].suspects == ("fill_u32 (node 2 of graph #1)",)
        exe.close()
        gpu.launch(fill, 1, 64, [first, np.uint32(64), np.uint32(7)])
        gpu.launch(write, 1, 1, [outside.ptr, np.uint32(1)])
        # the last launches: every call of launch, those captured into the graph too
        eager = ("fill_u32 (2 launches before the latest)", "fill_u32 (1 launch before the latest)")
        with pytest.raises(RedZoneError, match=r"^scan_redzones\(\) found") as info:
            gpu.scan_redzones()
        assert info.value.violations[0].suspects == eager
        with pytest.raises(RedZoneError, match=r"^Arena\.close\(\) found") as info:
            arena.close()  # reported once the block went: the arena names it
        assert info.value.violations[0].suspects == eager
        gpu.free(outside)


@BUILDS
def test_a_graph_launched_into_a_capture_names_its_node_in_both(backend_name: str, pure: bool) -> None:
    with _open(backend_name, pure, redzone_scan_graphs=True) as gpu:
        write, fill = _kernels(gpu)
        other, buf = gpu.alloc(256), gpu.alloc(100)
        stream = gpu.create_stream()

        def inner_record() -> None:
            gpu.memset(other, 0, stream=stream)
            gpu.launch(write, 1, 1, [buf.ptr + buf.nbytes, np.uint32(1)], stream=stream)

        inner = _graph(gpu, stream, inner_record)

        def outer_record() -> None:
            gpu.launch(fill, 1, 64, [other, np.uint32(64), np.uint32(7)], stream=stream)
            inner.launch(stream)

        outer = _graph(gpu, stream, outer_record)
        error = _launch_expecting(gpu, outer, stream, queued=False)
        assert error.violations[0].suspects == ("write_u8 (node 2 of graph #1, node 2 of graph #2)",)
        outer.close()
        inner.close()


def _scenario(backend_name: str, pure: bool) -> list[tuple[str, ...]]:
    """The suspects of a graph's verdict and of an eager scan, in one build."""
    with _open(backend_name, pure, redzone_scan_graphs=True) as gpu:
        write, fill = _kernels(gpu)
        other, buf = gpu.alloc(256), gpu.alloc(100)
        stream = gpu.create_stream()

        def record() -> None:
            gpu.launch(fill, 1, 64, [other, np.uint32(64), np.uint32(7)], stream=stream)
            gpu.launch(write, 1, 1, [buf.ptr + buf.nbytes + 3, np.uint32(1)], stream=stream)
            gpu.launch(fill, 1, 25, [buf, np.uint32(25), np.uint32(7)], stream=stream)

        exe = _graph(gpu, stream, record)
        found = [_launch_expecting(gpu, exe, stream, queued=False).violations[0].suspects]
        exe.close()
        gpu.launch(fill, 1, 25, [buf, np.uint32(25), np.uint32(7)])
        gpu.launch(write, 1, 1, [other.ptr, np.uint32(1)])
        with pytest.raises(RedZoneError) as info:
            gpu.scan_redzones()
        found.append(info.value.violations[0].suspects)
        return found


def test_the_compiled_and_pure_builds_name_the_same_suspects(backend_name: str) -> None:
    compiled, pure = _scenario(backend_name, False), _scenario(backend_name, True)
    assert compiled == pure == [
        ("write_u8 (node 2 of graph #1)", "fill_u32 (node 3 of graph #1)"),
        # every call of launch, those captured into the graph too
        ("write_u8 (3 launches before the latest)", "fill_u32 (2 launches before the latest)",
         "fill_u32 (1 launch before the latest)"),
    ]


def test_suspects_are_compared_by_no_one_and_pickle() -> None:
    """Two records of one zone are equal whatever their suspects; a pickle keeps them; a pickle made before
    ``suspects`` (or ``origin``) was a field loads with none."""
    plain = RedZoneViolation(0x1000, 100, 7, "app.py:3", "trail", 0)
    named = RedZoneViolation(0x1000, 100, 7, "app.py:3", "trail", 0, suspects=("write_u8 (node 1 of graph #3)",))
    assert plain == named and plain.suspects == ()
    assert named.describe() == plain.describe() + "; suspects: write_u8 (node 1 of graph #3)"
    again = pickle.loads(pickle.dumps(named))
    assert again == named and again.suspects == named.suspects
    for state in ([0x1000, 100, 7, "app.py:3", "trail", 0], [0x1000, 100, 7, "app.py:3", "trail", 0, None]):
        old = RedZoneViolation.__new__(RedZoneViolation)
        old.__setstate__(state)
        assert old == plain and old.suspects == () and old.origin is None


@BUILDS
def test_a_graph_s_verdict_also_names_the_eager_launch_that_made_the_overrun(backend_name: str, pure: bool) -> None:
    """The review's case: a graph's verdict is a full check, so an overrun made by an eager kernel before the launch
    is found there; its suspects name that launch as well as the graph's node that took the buffer."""
    with _open(backend_name, pure, redzone_scan_graphs=True) as gpu:
        write, fill = _kernels(gpu)
        buf = gpu.alloc(256)
        stream = gpu.create_stream()
        exe = _graph(gpu, stream, lambda: gpu.launch(fill, 1, 64, [buf, np.uint32(64), np.uint32(1)], stream=stream))
        gpu.launch(write, 1, 1, [buf.ptr + buf.nbytes, np.uint32(0x3C)], stream=stream)  # eager: one byte past
        error = _launch_expecting(gpu, exe, stream, False)
        (violation,) = error.violations
        assert "fill_u32 (node 1 of graph #1)" in violation.suspects
        assert any(s.startswith("write_u8 (") and "graph" not in s for s in violation.suspects), violation.suspects
        exe.close()
        gpu.free(buf)
