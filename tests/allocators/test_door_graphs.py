"""CUDA graphs under an allocator door: a framework's capture allocates from a private metrale pool per framework
pool (`Door.begin_pool`, `end_pool`, `release_pool`: torch's three pool hooks), which grows during the capture.

On the fake, another library's capture is the raw layer's own (``gpu.raw.begin_capture`` on a borrowed stream, which
metrale's core does not see), as torch's is on CUDA: a capture in global mode, which refuses an ordinary pool's new
segment and lets a pool for captures grow (the thread's capture mode relaxed for it, as torch's allocator does). The
hooks as torch calls them, from C++, are tried in ``test_doorfuncs.py``; torch itself on the GPU in ``test_doors.py``.
"""

from __future__ import annotations

import gc
import logging
import sys

import pytest

from metrale_core import GpuBackend, MetraleError, OutOfMemoryError, open_backend
from metrale_core.allocators import Door
from tests._support import SETTINGS, compiled_twin

CAPTURED = 0x77  # the framework's capturing stream (its handle)
OTHER = 0x99  # another stream of the framework's, not captured


@pytest.fixture(params=["pure", "compiled"])
def make_door(request: pytest.FixtureRequest) -> type[Door]:
    return Door if request.param == "pure" else compiled_twin("door")  # type: ignore[no-any-return]


@pytest.fixture(params=[0, 64], ids=["plain", "zoned"])
def gpu(request: pytest.FixtureRequest) -> GpuBackend:
    """A fake backend, with red zones on every allocation or none."""
    with open_backend("fake", settings=SETTINGS.updated(redzone=request.param)) as gpu:
        yield gpu


def _capture(gpu: GpuBackend) -> object:
    """Begin another library's capture of stream `CAPTURED` (metrale's core does not see it)."""
    stream = gpu.raw.foreign_stream(CAPTURED)
    gpu.raw.begin_capture(stream)
    return stream


def test_a_capture_allocates_from_its_private_pool_and_keeps_it_until_let_go(
    make_door: type[Door], gpu: GpuBackend
) -> None:
    door = make_door(gpu, "test")
    before = door.alloc(4096, CAPTURED)  # a tensor of the model, made before the capture
    door.free(before)
    door.begin_pool((1, 0), lambda stream: stream == CAPTURED)  # (torch: before cudaStreamBeginCapture)
    stream = _capture(gpu)
    line = sys._getframe().f_lineno + 1
    a = door.alloc(4096, CAPTURED)  # a new segment, during the capture
    b = door.alloc(1 << 21, CAPTURED)  # a large piece: a segment of its own
    assert a != before and door.graphs() == 1 and door.failures == 0
    piece = door.piece(a)
    assert piece is not None and piece.site.endswith(f"test_door_graphs.py:{line}")
    door.free(a)  # freed during the capture: back to the graph's pool
    c = door.alloc(4096, CAPTURED)
    # reused inside the same capture, as torch's private pools are; with zones, each piece's memory is the graph's
    assert (c == a) is (gpu.settings.redzone == 0)
    elsewhere = door.alloc(4096, OTHER)  # an allocation the capture does not make: the door's own pool
    assert elsewhere not in (a, b)
    graph = gpu.raw.end_capture(stream)  # the capture is valid: nothing barred ran during it
    door.end_pool((1, 0))
    after = [door.alloc(4096, s) for s in (CAPTURED, OTHER, 0)]
    assert not {a, b, c} & set(after)  # the graph's memory is never handed out outside its pool
    door.free(c)
    door.free(b)
    assert door.graphs() == 1  # the graph lives: its pool is kept
    door.release_pool((1, 0))  # (torch: the graph's reset)
    assert door.graphs() == 0
    for ptr in (*after, elsewhere):
        door.free(ptr)
    gpu.raw.graph_destroy(graph)
    door.close()
    assert gpu.live_alloc_len() == 0 and not gpu.scan_redzones()


def test_the_door_s_own_pool_cannot_grow_during_the_capture_as_cuda_refuses(gpu: GpuBackend) -> None:
    """Without a begun pool, a new segment during another library's global capture is refused and invalidates the
    capture (what the door did before it took torch's pool hooks; CUDA does the same: ``probe_semantics``)."""
    door = Door(gpu, "test")
    stream = _capture(gpu)
    assert door.alloc(4096, CAPTURED) == 0
    assert isinstance(door.last_error, MetraleError) and "capture" in str(door.last_error)
    with pytest.raises(MetraleError, match="invalidated"):
        gpu.raw.end_capture(stream)
    door.close()


def test_a_piece_out_when_the_graph_is_let_go_closes_the_pool_at_its_free(
    make_door: type[Door], gpu: GpuBackend
) -> None:
    door = make_door(gpu, "test")
    door.begin_pool((2, 0), lambda stream: stream == CAPTURED)
    stream = _capture(gpu)
    out = door.alloc(1000, CAPTURED)  # the graph's output, which the application keeps
    gpu.raw.graph_destroy(gpu.raw.end_capture(stream))
    door.end_pool((2, 0))
    door.release_pool((2, 0))
    assert door.graphs() == 1 and door.piece(out) is not None
    door.free(out)
    assert door.graphs() == 0 and door.out() == 0
    door.close()


def test_a_pool_shared_by_two_captures_closes_after_both_let_go(make_door: type[Door], gpu: GpuBackend) -> None:
    door = make_door(gpu, "test")
    for _ in range(2):  # (torch: the second graph captures with pool=first.pool())
        door.begin_pool((3, 0), lambda stream: stream == CAPTURED)
        stream = _capture(gpu)
        door.free(door.alloc(1000, CAPTURED))
        gpu.raw.graph_destroy(gpu.raw.end_capture(stream))
        door.end_pool((3, 0))
    door.release_pool((3, 0))
    assert door.graphs() == 1
    door.release_pool((3, 0))
    assert door.graphs() == 0
    door.close()


def test_a_release_during_a_capture_waits_for_its_end(make_door: type[Door], gpu: GpuBackend) -> None:
    """Closing a pool waits for the device, which no capture allows: a pool let go of while another capture of the
    door is underway closes at that capture's end."""
    door = make_door(gpu, "test")
    door.begin_pool((4, 0), lambda stream: stream == CAPTURED)
    door.end_pool((4, 0))
    door.begin_pool((5, 0), lambda stream: stream == CAPTURED)
    stream = _capture(gpu)
    door.free(door.alloc(1000, CAPTURED))
    door.release_pool((4, 0))
    assert door.graphs() == 2
    gpu.raw.graph_destroy(gpu.raw.end_capture(stream))  # valid: the release waited
    door.end_pool((5, 0))
    assert door.graphs() == 1
    door.release_pool((5, 0))
    assert door.graphs() == 0
    door.close()


def test_a_stream_test_that_fails_refuses_the_allocation(make_door: type[Door], gpu: GpuBackend) -> None:
    door = make_door(gpu, "test")

    def broken(stream: int) -> bool:
        raise RuntimeError("the framework's capture state could not be read")

    door.begin_pool((6, 0), broken)
    assert door.alloc(1000, CAPTURED) == 0
    assert "could not be told" in str(door.last_error) and door.out() == 0
    door.end_pool((6, 0))
    door.release_pool((6, 0))
    assert door.graphs() == 0
    door.close()


def test_closing_the_door_closes_its_private_pools(make_door: type[Door], gpu: GpuBackend) -> None:
    door = make_door(gpu, "test")
    door.begin_pool((7, 0), lambda stream: True)
    door.alloc(1000, CAPTURED)  # (no capture: the test alone routes it)
    door.end_pool((7, 0))
    door.close()
    assert door.graphs() == 0 and gpu.live_alloc_len() == 0


def test_no_red_zone_check_runs_while_a_capture_is_underway(make_door: type[Door]) -> None:
    """A check waits for the device, which a capture in global mode forbids (CUDA would invalidate it): while the
    door's capture runs, freed zoned pieces of its own pool wait in the quarantine past its bound and unjudged; the
    first free after the capture judges them, and an overrun among them is found with its site."""
    settings = SETTINGS.updated(redzone=64, redzone_quarantine_bytes=1, redzone_action="warn")  # (a check a free)
    with open_backend("fake", settings=settings) as gpu:
        found: list[object] = []
        gpu.on_redzone_violation(lambda name, violation: found.append(violation))
        door = make_door(gpu, "test")
        line = sys._getframe().f_lineno + 1
        before = [door.alloc(1000, CAPTURED) for _ in range(4)]  # the model's tensors, zoned, made before it
        gpu.memset(before[0] + 1000, 0x5A, nbytes=1)  # an overrun of the first, by one byte
        door.begin_pool((8, 0), lambda stream: stream == CAPTURED)
        stream = _capture(gpu)
        for ptr in before:  # freed during the capture: no check now
            door.free(ptr)
        inside = door.alloc(1000, CAPTURED)
        graph = gpu.raw.end_capture(stream)  # valid: nothing waited for the device during it
        assert not found and door.failures == 0
        door.end_pool((8, 0))
        door.free(door.alloc(1000, OTHER))  # the first free after it: the check of everything held
        assert len(found) == 1 and f"test_door_graphs.py:{line}" in str(found[0])
        door.free(inside)
        door.release_pool((8, 0))
        gpu.raw.graph_destroy(graph)
        door.close()


def test_an_overrun_by_a_replay_is_found_with_the_tensor_s_site(make_door: type[Door]) -> None:
    """With zones on, a capture's piece is zoned at once (on the backend's own stream, not into the capture) and
    stays the graph's after the framework frees it: a replay's overrun of it is found by a scan while the graph
    lives, and again when the graph goes, each time with the tensor's site."""
    with open_backend("fake", settings=SETTINGS.updated(redzone=64, redzone_action="warn")) as gpu:
        found: list[object] = []
        gpu.on_redzone_violation(lambda name, violation: found.append(violation))
        raw = gpu.raw
        door = make_door(gpu, "test")
        door.begin_pool((9, 0), lambda stream: stream == CAPTURED)
        stream = _capture(gpu)
        line = sys._getframe().f_lineno + 1
        tensor = door.alloc(1000, CAPTURED)
        raw.memset(tensor + 1000, 0x5A, 1, stream)  # a kernel of the graph writes one byte past the tensor
        door.free(tensor)  # (torch frees a capture's intermediates inside it)
        graph = raw.end_capture(stream)
        door.end_pool((9, 0))
        assert gpu.scan_redzones() == []  # laid at once, intact: no replay yet
        replay = raw.graph_instantiate(graph)
        raw.graph_launch(replay, stream)
        violations = gpu.scan_redzones()
        assert len(violations) == 1 and f"test_door_graphs.py:{line}" in str(violations[0])
        raw.graph_launch(replay, stream)  # (the warn action laid the zone again: the next replay overruns it again)
        door.release_pool((9, 0))  # the graph goes: its pieces are judged on their way out
        assert len(found) == 2 and f"test_door_graphs.py:{line}" in str(found[1]) and door.graphs() == 0
        raw.graph_exec_destroy(replay)
        raw.graph_destroy(graph)
        door.close()
        assert gpu.live_alloc_len() == 0


def test_an_out_of_memory_inside_a_capture_leaves_it_valid(make_door: type[Door]) -> None:
    """Out of memory during a capture, no remedy that waits for the device runs (the quarantine's check, the pools'
    trim): the refusal is an out-of-memory, and the capture stays valid (review of issue 54)."""
    settings = SETTINGS.updated(redzone=64, fake_memory_bytes="8 MiB", redzone_quarantine_bytes=1 << 20)
    with open_backend("fake", settings=settings) as gpu:
        door = make_door(gpu, "test")
        door.free(door.alloc(4096, OTHER))  # (something in the quarantine: a check the remedy would run)
        door.begin_pool((10, 0), lambda stream: stream == CAPTURED)
        stream = _capture(gpu)
        got = [door.alloc(2 << 20, CAPTURED) for _ in range(6)]
        assert got.count(0) >= 1 and isinstance(door.last_error, OutOfMemoryError)
        gpu.raw.graph_destroy(gpu.raw.end_capture(stream))  # valid
        door.end_pool((10, 0))
        for ptr in got:
            door.free(ptr) if ptr else None
        door.release_pool((10, 0))
        assert door.graphs() == 0
        door.close()


def test_a_graph_whose_pieces_were_swept_still_goes(make_door: type[Door]) -> None:
    """A sweep took a graph's kept pieces off the ledger: its release still frees the rest and closes its pool."""
    with open_backend("fake", settings=SETTINGS.updated(redzone=64)) as gpu:
        door = make_door(gpu, "test")
        door.begin_pool((11, 0), lambda stream: stream == CAPTURED)
        stream = _capture(gpu)
        for _ in range(2):
            door.free(door.alloc(1000, CAPTURED))  # kept for the graph
        gpu.raw.graph_destroy(gpu.raw.end_capture(stream))
        door.end_pool((11, 0))
        gpu.sweep_unreleased()
        door.release_pool((11, 0))
        assert door.graphs() == 0 and door.failures == 2  # (each swept piece's free: refused, counted)
        door.close()


def test_a_release_refused_in_a_finalizer_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph's last piece freed by a finalizer that a collection runs inside a metrale call (here, inside the raw
    allocation of another tensor): its pool cannot close there (refused, counted); the door's close closes it."""
    with open_backend("fake", settings=SETTINGS.updated(redzone=0)) as gpu:
        raw_alloc, collect = gpu.raw.alloc, []

        def collecting(nbytes: int, kind: str) -> int:
            if collect:
                gc.collect()
            return raw_alloc(nbytes, kind)  # type: ignore[arg-type]

        monkeypatch.setattr(gpu.raw, "alloc", collecting)  # (before any allocation: a lane keeps what it found)
        door = Door(gpu, "test")
        door.begin_pool((12, 0), lambda stream: stream == CAPTURED)
        last = door.alloc(1000, CAPTURED)
        door.end_pool((12, 0))
        door.release_pool((12, 0))

        class Tensor:  # a framework's tensor, freed by its finalizer
            def __del__(self) -> None:
                door.free(last)

        cycle: list[object] = [Tensor()]
        cycle.append(cycle)
        del cycle
        collect.append(True)
        other = door.alloc(4 << 20, OTHER)  # a new segment: the collection runs inside this call
        collect.clear()
        assert door.graphs() == 1 and door.failures == 1 and "finalizer" in str(door.last_error)
        door.free(other)
        door.close()
        assert door.graphs() == 0 and gpu.live_alloc_len() == 0


#: Red zones with no quarantine (each free checked at once), violations logged.
_NO_QUARANTINE = SETTINGS.updated(redzone=64, redzone_quarantine_bytes=0, redzone_action="warn")


def _overrun_freed_in_a_capture(gpu: GpuBackend, door: Door, pool_id: tuple[int, int]) -> tuple[list[object], object]:
    """Two zoned pieces made before a capture, the first overrun by one byte, both freed inside the capture (begun on
    ``pool_id``, after its first allocation: a capture runs): the violations heard from now on, and the capturing
    stream."""
    found: list[object] = []
    gpu.on_redzone_violation(lambda name, violation: found.append(violation))
    before = [door.alloc(1000, OTHER) for _ in range(2)]
    gpu.memset(before[0] + 1000, 0x5A, nbytes=1)
    door.begin_pool(pool_id, lambda stream: stream == CAPTURED)
    stream = _capture(gpu)
    door.alloc(1000, CAPTURED)
    for ptr in before:
        door.free(ptr)
    return found, stream


def test_with_no_quarantine_a_capture_s_frees_are_checked_at_its_end(make_door: type[Door]) -> None:
    """No quarantine (each free checked at once): the frees a capture deferred are checked at its end (review of
    issue 54: they waited for an out-of-memory or a scan)."""
    with open_backend("fake", settings=_NO_QUARANTINE) as gpu:
        door = make_door(gpu, "test")
        found, stream = _overrun_freed_in_a_capture(gpu, door, (13, 0))
        assert not found
        gpu.raw.graph_destroy(gpu.raw.end_capture(stream))
        door.end_pool((13, 0))
        assert len(found) == 1
        door.close()


def test_a_pool_used_without_a_capture_keeps_nothing_for_a_graph(make_door: type[Door]) -> None:
    """``torch.cuda.use_mem_pool`` begins a pool with no capture: its pieces go back at their free (nothing kept for
    a graph), and the backend's checks resume at its first allocation."""
    settings = SETTINGS.updated(redzone=64, redzone_quarantine_bytes=0)
    with open_backend("fake", settings=settings) as gpu:
        door = make_door(gpu, "test")
        door.begin_pool((14, 0), lambda stream: True)
        for _ in range(50):
            door.free(door.alloc(1 << 20, CAPTURED))
        assert door.out() == 0 and gpu.live_alloc_len() == 0
        door.end_pool((14, 0))
        door.release_pool((14, 0))
        assert door.graphs() == 0
        door.close()


def test_the_check_at_a_capture_s_end_waits_for_a_capture_of_metrale_s_own() -> None:
    """The check of what a capture deferred waits for the device: where a capture of metrale's own runs when the
    framework's ends, it is left to the next free past the bound, and metrale's capture stays valid (second review
    of issue 54)."""
    with open_backend("fake", settings=_NO_QUARANTINE) as gpu:
        door = Door(gpu, "test")
        found, stream = _overrun_freed_in_a_capture(gpu, door, (15, 0))
        gpu.raw.graph_destroy(gpu.raw.end_capture(stream))
        own = gpu.create_stream()
        gpu.begin_capture(own)  # metrale's own capture, as the framework's hook ends
        door.end_pool((15, 0))
        assert not found
        gpu.end_capture(own)  # valid: nothing waited for the device during it
        door.free(door.alloc(1000, OTHER))  # the next free past the bound checks what waited
        assert len(found) == 1
        door.close()


def test_an_overrun_found_when_a_graph_goes_is_counted_under_raise(caplog: pytest.LogCaptureFixture) -> None:
    """``redzone_action="raise"``: an overrun of a graph's kept piece, found when the graph goes, is logged and
    counted by the door (nothing may raise into the framework's hook), and the release goes on (second review)."""
    settings = SETTINGS.updated(redzone=64, redzone_quarantine_bytes=0, redzone_action="raise")
    with open_backend("fake", settings=settings) as gpu:
        door = Door(gpu, "test")
        door.begin_pool((16, 0), lambda stream: stream == CAPTURED)
        stream = _capture(gpu)
        pieces = [door.alloc(1000, CAPTURED) for _ in range(2)]
        gpu.raw.graph_destroy(gpu.raw.end_capture(stream))
        door.end_pool((16, 0))
        gpu.memset(pieces[1] + 1000, 0x5A, nbytes=1)
        for ptr in pieces:
            door.free(ptr)  # kept for the graph
        with caplog.at_level(logging.ERROR, logger="metrale"):
            door.release_pool((16, 0))
        assert door.graphs() == 0 and door.failures == 1 and "graph release refused" in caplog.text
        assert gpu.live_alloc_len() == 0
        door.close()
