"""The launch lane and the packer's twin (issue 38), on both builds: what the compiled common case must keep of the
front's behaviour, each test a case a review found (a reference leaked per argument, a registry kept alive, a failed
wait not named as the launch's failure)."""

from __future__ import annotations

import ctypes
import gc
import re
import sys
import weakref
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_core import DeviceBuffer, GpuBackend, MetraleError, open_backend
from metrale_core._launch.pack import pack_args
from metrale_core._types import LaunchArg
from metrale_core.kernels import shipped_modules
from tests._support import SETTINGS, compiled_twin, examples

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


# -- the same random launches through both builds ------------------------------------------------------------------

_ARG = st.sampled_from(["live", "live", "freed", "pointer", "np_u32", "ctypes_u32", "np_f32", "none", "foreign"])
_LAUNCHES = st.lists(
    st.tuples(
        st.sampled_from([1, 2, 0, 2**31, (1, 1), True, "np_int", 1.5]),  # grid
        st.sampled_from([32, 256, 1024, 1025, (32, 1), 0]),  # block
        st.tuples(_ARG, _ARG, _ARG, _ARG),
        st.sampled_from([0, 16, -1, 2**32]),  # shared_mem
        st.sampled_from([None, "own", "closed", "foreign"]),  # stream
    ),
    min_size=1, max_size=8,
)


def _run_launches(build: str, launches: list[tuple[Any, ...]]) -> list[object]:
    """Each launch's outcome (its error's type and message, addresses masked), then the launch counts."""
    out: list[object] = []
    with _backend(build) as gpu, open_backend("fake", settings=SETTINGS.updated(pure=build == "pure")) as other:
        kernel = gpu.load_modules(shipped_modules("vector")).kernel("vector", "vector_add")
        n = 64
        bufs = _three(gpu, n)
        freed = gpu.alloc(4 * n)
        gpu.free(freed)
        foreign = other.alloc(4 * n)
        stream, closed, foreign_stream = gpu.create_stream(), gpu.create_stream(), other.create_stream()
        closed.close()
        values: dict[str, Any] = {
            "freed": freed, "pointer": bufs[0].ptr, "np_u32": np.uint32(n), "ctypes_u32": ctypes.c_uint32(n),
            "np_f32": np.float32(1.0), "none": None, "foreign": foreign,
        }
        streams = {None: None, "own": stream, "closed": closed, "foreign": foreign_stream}
        for grid, block, arg_kinds, shared_mem, which in launches:
            args = [bufs[i % 3] if kind == "live" else values[kind] for i, kind in enumerate(arg_kinds)]
            shape = np.int64(1) if grid == "np_int" else grid
            try:
                gpu.launch(kernel, shape, block, args, shared_mem=shared_mem, stream=streams[which])
                out.append("ok")
            except MetraleError as exc:
                out.append((type(exc).__name__, re.sub(r"0x[0-9a-f]+|#\d+", "N", str(exc))))  # (the process's)
        gpu.synchronize()
        out.append(dict(gpu.run_metrics().launches))
        out.append(len(gpu._ctx.recent))
        for s in (stream, foreign_stream):
            s.close()
        for buf in bufs:
            gpu.free(buf)
        other.free(foreign)
    return out


@settings(max_examples=examples(60), deadline=None)
@given(launches=_LAUNCHES)
def test_the_launch_lane_twin_answers_as_the_pure_lane(launches: list[tuple[Any, ...]]) -> None:
    compiled_twin("launch_lane")
    assert _run_launches("compiled", launches) == _run_launches("pure", launches)
