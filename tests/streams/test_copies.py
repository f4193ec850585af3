"""Device-to-device copies: an overlapping source and destination is refused on every backend (issue 37, item 5).

CUDA leaves an overlapping copy undefined (on an H100 it left wrong bytes), where the fake did a memmove;
now both refuse it with ``InvalidArgumentError`` before anything is issued, and the buffer is unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from metrale_core import GpuBackend, InvalidArgumentError
from tests._support import read_bytes

N = 4096


def _filled(gpu: GpuBackend) -> tuple[object, bytes]:
    data = np.random.default_rng(37).integers(0, 256, N, dtype=np.uint8).tobytes()
    buf = gpu.alloc(N)
    gpu.copy_to_device(buf, data)
    return buf, data


@pytest.mark.parametrize(("nbytes", "dst_offset", "src_offset"), [(N - 1, 1, 0), (N - 1, 0, 1), (N, 0, 0), (2, 1, 2)])
def test_an_overlapping_copy_is_refused_and_changes_nothing(
    gpu: GpuBackend, nbytes: int, dst_offset: int, src_offset: int
) -> None:
    buf, data = _filled(gpu)
    with pytest.raises(InvalidArgumentError, match=r"^copy_device: the source .* overlap by \d+ bytes; CUDA leaves"):
        gpu.copy_device(buf, buf, nbytes=nbytes, dst_offset=dst_offset, src_offset=src_offset)
    gpu.synchronize()
    assert read_bytes(gpu, buf, N) == data
    gpu.free(buf)


def test_ranges_that_only_touch_are_copied(gpu: GpuBackend) -> None:
    buf, data = _filled(gpu)
    gpu.copy_device(buf, buf, nbytes=N // 2, dst_offset=N // 2, src_offset=0)
    gpu.synchronize()
    assert read_bytes(gpu, buf, N) == data[: N // 2] * 2
    gpu.free(buf)


def test_a_peer_copy_within_one_backend_is_refused_the_same(gpu: GpuBackend) -> None:
    buf, data = _filled(gpu)
    with pytest.raises(InvalidArgumentError, match=r"^copy_peer: the source .* overlap"):
        gpu.copy_peer(buf, buf, nbytes=N - 1, dst_offset=1)
    gpu.synchronize()
    assert read_bytes(gpu, buf, N) == data
    gpu.free(buf)


def test_a_refused_copy_leaves_a_capture_going(gpu: GpuBackend) -> None:
    buf, data = _filled(gpu)
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    with pytest.raises(InvalidArgumentError):
        gpu.copy_device(buf, buf, nbytes=8, dst_offset=4, stream=stream)
    gpu.memset(buf, 7, nbytes=1, stream=stream)
    gpu.end_capture(stream).instantiate().launch(stream)
    stream.synchronize()
    assert read_bytes(gpu, buf, N) == b"\x07" + data[1:]
    gpu.free(buf)
