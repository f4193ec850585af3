"""Release observers switched on by their fronts (`ReleaseWatch`): a free with no executable graph, export or tensor
map alive calls none, and each front switches its own on while it holds such a thing (white-box: ``_holdings``).
The warnings themselves are tested where each front is (``test_capture.py``, ``test_interop.py``,
``test_tensor_maps.py``)."""

from __future__ import annotations

import gc
import logging

import numpy as np
import pytest

from metrale_core import GpuBackend
from metrale_core._memory.watch import ReleaseWatch


def _active(gpu: GpuBackend) -> list[str]:
    return [observer.__name__ for observer in gpu._parts.holdings.releases.active]


def test_the_switch_keeps_each_observer_once_and_in_order() -> None:
    watch, seen = ReleaseWatch(), []
    first, second = seen.append, lambda buf: None
    for observer, on in [(first, True), (second, True), (first, True), (first, False), (first, False), (first, True)]:
        watch.watch(observer, on)  # type: ignore[arg-type]
    assert watch.active == (second, first)


def test_a_front_switches_its_observer_while_it_holds_something(
    fake: GpuBackend, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = fake
    assert _active(gpu) == []
    buf, other = gpu.alloc(128), gpu.alloc(128)
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    gpu.memset(buf, 1, stream=stream)
    exe = gpu.end_capture(stream).instantiate()
    assert _active(gpu) == ["warn_if_graphed"]
    with caplog.at_level(logging.WARNING, logger="metrale"):
        gpu.free(buf)
    assert "executable graph" in caplog.text
    exe.close()
    assert _active(gpu) == []
    held = np.from_dlpack(other)
    assert _active(gpu) == ["warn_if_exported"]
    del held
    gc.collect()
    gpu.free(other)  # the last exported buffer: its observer switches itself off
    assert _active(gpu) == []


@pytest.mark.parametrize("pure", [True, False], ids=["pure", "compiled"])
def test_an_observer_switching_itself_off_leaves_the_next_one_called(
    pure: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The review's case: an export seen and gone, then a graph of the same buffer: the export table's observer
    switches itself off during the free, and the graph's observer, after it, still warns."""
    from metrale_core import open_backend
    from tests._support import SETTINGS

    with open_backend("fake", settings=SETTINGS.updated(pure=pure)) as gpu:
        buf = gpu.alloc(128)
        held = np.from_dlpack(buf)
        del held
        gc.collect()
        stream = gpu.create_stream()
        gpu.begin_capture(stream)
        gpu.memset(buf, 1, stream=stream)
        exe = gpu.end_capture(stream).instantiate()
        assert _active(gpu) == ["warn_if_exported", "warn_if_graphed"]
        with caplog.at_level(logging.WARNING, logger="metrale"):
            gpu.free(buf)
        assert "1 live executable graph(s) still use it" in caplog.text
        assert _active(gpu) == ["warn_if_graphed"]
        exe.close()


@pytest.mark.parametrize("pure", [True, False], ids=["pure", "compiled"])
def test_views_gone_switch_the_export_observer_off_at_the_next_free(pure: bool) -> None:
    """The third review's case: a view handed out once (``np.asarray``) and dropped leaves an empty record of views;
    the next free clears it, and the observer switches off (it stayed on for good before)."""
    from metrale_core import open_backend
    from tests._support import SETTINGS

    with open_backend("fake", settings=SETTINGS.updated(pure=pure)) as gpu:
        weights, other = gpu.alloc(256), gpu.alloc(256)
        view = np.asarray(weights)
        assert _active(gpu) == ["warn_if_exported"]
        del view
        gc.collect()
        gpu.free(other)
        assert _active(gpu) == []
        gpu.free(weights)


@pytest.mark.parametrize("pure", [True, False], ids=["pure", "compiled"])
def test_an_equal_handle_of_another_kind_is_freed_as_its_record_says(pure: bool) -> None:
    """A copy of a managed allocation's handle that says ``device`` is freed as the managed memory it is, on both
    builds (the compiled lane's fast path takes only the very handle it handed out)."""
    import dataclasses

    from metrale_core import open_backend
    from tests._support import SETTINGS

    with open_backend("fake", settings=SETTINGS.updated(pure=pure, redzone=0)) as gpu:
        managed = gpu.alloc_managed(4096)
        gpu.free(dataclasses.replace(managed, kind="device"))
        stats = gpu.stats()
        assert (gpu.live_alloc_len(), stats.current_bytes["managed"], stats.current_bytes["device"]) == (0, 0, 0)
