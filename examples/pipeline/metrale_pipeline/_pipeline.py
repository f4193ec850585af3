"""The pipeline: buffers and pinned staging made once, one step captured into a graph and replayed per batch."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from types import TracebackType
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from metrale_core import DeviceBuffer, GpuBackend, HostBuffer, MetraleError
from metrale_core.kernels import shipped_modules

__all__ = ["BLOCK", "MAX_SIZE", "Pipeline", "PipelineResult", "Vector", "run_pipeline"]

_log = logging.getLogger("metrale_pipeline")

#: Threads per block of each ``vector_add`` launch.
BLOCK = 256
#: The most elements a batch may have: ``vector_add`` takes its length as a ``u32``.
MAX_SIZE = (1 << 32) - 1

Vector = npt.NDArray[np.float32]
_Buf = TypeVar("_Buf", DeviceBuffer, HostBuffer)


class Pipeline:
    """One captured step, ``out = a + b; acc = out + acc``, replayed once per batch on a stream of its own.

    Made once: device buffers ``a``, ``b``, ``out``, ``acc``; pinned staging
    for the batch in and for ``out`` back; a stream; two timing events; the
    graph of one step (copy the staging into ``a``, two ``vector_add``
    launches, copy ``out`` into the staging). [`close`][metrale_pipeline.Pipeline.close] releases all of
    it, newest first, also when construction failed half-way; then nothing
    of the pipeline is left on the backend's ledger.
    """

    def __init__(self, gpu: GpuBackend, b: Vector) -> None:
        if b.dtype != np.float32 or b.ndim != 1 or not 1 <= b.size <= MAX_SIZE:
            raise ValueError(f"b must be a 1-d float32 array of 1 to {MAX_SIZE} elements, got {b.dtype} {b.shape}")
        self._gpu = gpu
        self.size = int(b.size)
        nbytes = 4 * self.size
        self._stack = contextlib.ExitStack()  # each resource is registered as it is made; close() unwinds them
        try:
            registry = gpu.load_modules(shipped_modules("vector"))
            self._stack.callback(registry.close)
            add = registry.kernel("vector", "vector_add")
            stream = self._stream = gpu.create_stream()
            self._stack.callback(stream.close)
            a_dev = self._owned(gpu.alloc(nbytes))
            b_dev = self._owned(gpu.alloc(nbytes))
            out_dev = self._owned(gpu.alloc(nbytes))
            self._acc = self._owned(gpu.alloc(nbytes))
            stage_in = self._owned(gpu.alloc_host(nbytes))
            stage_out = self._owned(gpu.alloc_host(nbytes))
            self._in: Vector = np.frombuffer(stage_in.view(), dtype=np.float32)
            self._out: Vector = np.frombuffer(stage_out.view(), dtype=np.float32)
            self._start, self._end = gpu.create_event(), gpu.create_event()
            self._stack.callback(self._start.close)
            self._stack.callback(self._end.close)

            # Setup on the pipeline's stream (default streams are non-blocking: no implicit order).
            gpu.copy_to_device(b_dev, b, stream=stream)
            gpu.memset(self._acc, 0, stream=stream)
            stream.synchronize()

            n, grid = np.uint32(self.size), (self.size + BLOCK - 1) // BLOCK
            gpu.begin_capture(stream)
            try:
                gpu.copy_to_device(a_dev, stage_in, stream=stream)
                gpu.launch(add, grid, BLOCK, [a_dev, b_dev, out_dev, n], stream=stream)
                gpu.launch(add, grid, BLOCK, [out_dev, self._acc, self._acc, n], stream=stream)
                gpu.copy_to_host(stage_out, out_dev, stream=stream)
            except BaseException:
                with contextlib.suppress(MetraleError):  # end the capture and drop what it recorded
                    gpu.end_capture(stream).close()
                raise
            graph = gpu.end_capture(stream)
            self._stack.callback(graph.close)
            self._exec = graph.instantiate()
            self._stack.callback(self._exec.close)  # closed first: no live graph uses a buffer being freed
        except BaseException:
            self._stack.close()
            raise
        _log.info(
            "pipeline of %d float32 on %s:%d: one step captured (%d device buffers), instantiated",
            self.size, gpu.name, gpu.ordinal, len(self._exec.buffers),
        )

    def _owned(self, buf: _Buf) -> _Buf:
        self._stack.callback(self._gpu.free, buf)
        return buf

    def step(self, batch: Vector) -> tuple[Vector, float]:
        """Run one batch: returns ``batch + b`` (a copy) and the graph's device time in milliseconds."""
        if batch.shape != (self.size,):
            raise ValueError(f"a batch has shape ({self.size},), got {batch.shape}")
        self._in[:] = batch  # safe: the previous step was synchronized, so no copy reads the staging now
        self._start.record(self._stream)
        self._exec.launch(self._stream)
        self._end.record(self._stream)
        self._stream.synchronize()  # the pinned copies are asynchronous: without this, _out is stale
        ms = self._start.elapsed_ms(self._end)
        _log.debug("step on %s: %.3f ms", self._gpu.name, ms)
        return self._out.copy(), ms

    def accumulated(self) -> Vector:
        """``acc``: the sum of every step's output so far."""
        result = np.empty(self.size, dtype=np.float32)
        self._gpu.copy_to_host(result, self._acc, stream=self._stream)  # pageable: complete on return
        return result

    def close(self) -> None:
        """Wait for the stream, then release everything, newest first; idempotent."""
        if self._gpu.closed:  # the backend's close() released all of it already
            self._stack.pop_all()
            return
        try:
            if not self._stream.closed:
                self._stream.synchronize()
        finally:
            self._stack.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineResult:
    """What one run did, checked against numpy."""

    backend: str
    device: str
    size: int
    batch_ms: tuple[float, ...]
    #: Indexes of the batches whose output differed from numpy's ``a + b``.
    bad_batches: tuple[int, ...]
    #: The largest ``|acc - numpy's sum|`` (float32 adds are exact IEEE on both: 0.0 when right).
    acc_max_error: float
    #: ``gpu.live_alloc_len()`` after the pipeline closed, the backend still open: 0 when nothing leaked.
    live_after_close: int
    #: ``gpu.run_metrics().table()``: launches issued (two, at capture; graph replays are not launches).
    metrics_table: str

    @property
    def ok(self) -> bool:
        """Every batch and ``acc`` matched numpy, and the ledger was empty afterwards."""
        return not self.bad_batches and self.acc_max_error == 0.0 and self.live_after_close == 0


def run_pipeline(gpu: GpuBackend, *, batches: int, size: int, seed: int = 0) -> PipelineResult:
    """Run ``batches`` batches of ``size`` random float32 through a [`Pipeline`][metrale_pipeline.Pipeline] on
    ``gpu``."""
    if batches < 1 or not 1 <= size <= MAX_SIZE:
        raise ValueError(f"batches must be at least 1 and size 1 to {MAX_SIZE}, got {batches} and {size}")
    rng = np.random.default_rng(seed)
    b = rng.standard_normal(size, dtype=np.float32)
    expected_acc = np.zeros(size, dtype=np.float32)
    batch_ms: list[float] = []
    bad: list[int] = []
    with Pipeline(gpu, b) as pipeline:
        for index in range(batches):
            batch = rng.standard_normal(size, dtype=np.float32)
            out, ms = pipeline.step(batch)
            expected = batch + b
            if not np.array_equal(out, expected):
                _log.warning("batch %d: %d of %d elements differ from numpy", index, (out != expected).sum(), size)
                bad.append(index)
            expected_acc += expected
            batch_ms.append(ms)
        acc = pipeline.accumulated()
    error = float(np.max(np.abs(acc - expected_acc)))
    live = gpu.live_alloc_len()
    if live:
        _log.warning("%d allocation(s) left on the ledger after the pipeline closed", live)
    return PipelineResult(
        backend=f"{gpu.name}:{gpu.ordinal}",
        device=gpu.device_name,
        size=size,
        batch_ms=tuple(batch_ms),
        bad_batches=tuple(bad),
        acc_max_error=error,
        live_after_close=live,
        metrics_table=gpu.run_metrics().table(),
    )
