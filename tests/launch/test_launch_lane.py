"""The launch lane and the packer's twin (issue 38), on both builds: what the compiled common case must keep of the
front's behaviour, each test a case a review found (a reference leaked per argument, a registry kept alive, a failed
wait not named as the launch's failure)."""

from __future__ import annotations

import gc
import re
import sys
import weakref

import numpy as np
import pytest

from metrale_core import DeviceBuffer, GpuBackend, MetraleError, open_backend
from metrale_core._launch.registry import pack_args
from metrale_core._types import LaunchArg
from metrale_core.kernels import shipped_modules
from tests._support import SETTINGS, compiled_twin

BUILDS = ["pure", "compiled"]


def _backend(build: str, **settings: object) -> GpuBackend:
    if build == "compiled":
        compiled_twin("launch_lane")
    return open_backend("fake", settings=SETTINGS.updated(pure=build == "pure", **settings))


def _three(gpu: GpuBackend, n: int = 256) -> list[DeviceBuffer]:
    return [gpu.alloc(4 * n) for _ in range(3)]


def test_the_packer_twin_s_arguments_are_the_pure_ones_and_hold_no_extra_reference() -> None:
    twin = compiled_twin("pack")
    with open_backend("fake", settings=SETTINGS.updated(pure=False)) as gpu:
        kernel = gpu.load_modules(shipped_modules("vector")).kernel("vector", "vector_add")
        bufs = _three(gpu)
        args = [*bufs, np.uint32(256)]
        pure = pack_args(kernel, args, "launch", lambda buf: None)
        for packs in kernel._packs:  # (the buffers' packed arguments made again, by the twin)
            packs.clear()
        compiled = twin(kernel, args, "launch", lambda buf: None)
        for packs in kernel._packs:  # (neither list's arguments kept there now: their references compared)
            packs.clear()
        assert compiled == pure and [repr(a) for a in compiled] == [repr(a) for a in pure]
        assert all(type(a) is LaunchArg for a in compiled)
        assert [sys.getrefcount(a) for a in compiled] == [sys.getrefcount(a) for a in pure]
        del compiled, pure
        gc.collect()
        counted = sum(type(o) is LaunchArg for o in gc.get_objects())
        for _ in range(1000):
            twin(kernel, args, "launch", lambda buf: None)
        gc.collect()
        assert sum(type(o) is LaunchArg for o in gc.get_objects()) <= counted + 3  # (the buffers' kept ones)
        for buf in bufs:
            gpu.free(buf)


@pytest.mark.parametrize("build", BUILDS)
def test_a_registry_launched_from_is_collected_once_dropped(build: str) -> None:
    """Its modules unload when the registry and its kernels are garbage: a launch keeps neither."""
    with _backend(build) as gpu:
        registry = gpu.load_modules(shipped_modules("vector"))
        kernel = registry.kernel("vector", "vector_add")
        bufs = _three(gpu)
        for _ in range(2):  # (the second with the scalar's type met: the lane's own path)
            gpu.launch(kernel, 1, 256, [*bufs, np.uint32(256)])
        gone = weakref.ref(registry)
        del registry, kernel
        gc.collect()
        assert gone() is None
        for buf in bufs:
            gpu.free(buf)


def test_a_failed_wait_for_the_fills_is_the_launch_s_failure_in_both_builds() -> None:
    """Red zones on, a launch on another stream waits for the fills first: a failed wait names the launch."""
    said = []
    for build in BUILDS:
        with _backend(build, redzone=64) as gpu:
            kernel = gpu.load_modules(shipped_modules("vector")).kernel("vector", "vector_add")
            stream = gpu.create_stream()
            bufs = _three(gpu)
            gpu.launch(kernel, 1, 256, [*bufs, np.uint32(256)], stream=stream)
            gpu.synchronize()
            fresh = gpu.alloc(1024)  # its fill queued on the default stream
            gpu.inject_fault("synchronize")
            with pytest.raises(MetraleError) as caught:
                gpu.launch(kernel, 1, 256, [fresh, bufs[1], bufs[2], np.uint32(256)], stream=stream)
            said.append((type(caught.value), re.sub(r"0x[0-9a-f]+", "ADDR", str(caught.value))))
            assert gpu.run_metrics().launches[("vector", "vector_add")] == 1
            gpu.synchronize()
            for buf in [*bufs, fresh]:
                gpu.free(buf)
            stream.close()
    assert said[0] == said[1] and said[0][1].startswith("launch of vector.vector_add<<<"), said
