"""A tiny host application of metrale: batches of feature rows scored on the GPU, ``scores = features + bias``.

- `Scorer` holds the model on the device: the bias row (``alloc``, uploaded once), metrale's shipped ``vector``
  kernels and a stream of its own. [`Scorer.close`][batch_scorer.Scorer.close] releases all of it.
- `Scorer.score` runs one batch: device buffers made for the batch, its rows up in one copy, one ``vector_add``
  launch per row (raw pointers into the batch), the scores back through pinned staging, then the batch's buffers
  freed, on the error path too.
- `score_batches` is the loop a service runs: one scorer, every batch, closed at the end.

It uses the public ``metrale_core`` API only, so it runs unchanged on the fake backend and on CUDA; its tests
(``tests/test_app.py``) use metrale's pytest fixture, ``metrale_backend``.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

import numpy as np
import numpy.typing as npt

from metrale_core import GpuBackend
from metrale_core.kernels import shipped_modules

__all__ = ["BLOCK", "Scorer", "score_batches"]

#: Threads per block of each ``vector_add`` launch.
BLOCK = 256

Rows = npt.NDArray[np.float32]


class Scorer:
    """The bias row on the device, the ``vector_add`` kernel, a stream: one model, scoring batch after batch."""

    def __init__(self, gpu: GpuBackend, bias: Rows) -> None:
        if bias.dtype != np.float32 or bias.ndim != 1 or bias.size == 0:
            raise ValueError(f"bias must be a 1-d float32 array, not empty; got {bias.dtype} {bias.shape}")
        self._gpu = gpu
        self.width = int(bias.size)
        self._kernels = gpu.load_modules(shipped_modules("vector"))
        self._add = self._kernels.kernel("vector", "vector_add")
        self._stream = gpu.create_stream()
        self._bias = gpu.alloc(bias.nbytes)
        gpu.copy_to_device(self._bias, bias, stream=self._stream)  # pageable: complete when it returns

    def score(self, batch: Rows) -> Rows:
        """The scores of one batch of rows (``batch + bias``, row by row), a new array."""
        if batch.dtype != np.float32 or batch.ndim != 2 or batch.shape[1] != self.width or batch.shape[0] == 0:
            raise ValueError(f"a batch is float32 of shape (rows, {self.width}); got {batch.dtype} {batch.shape}")
        gpu, stream = self._gpu, self._stream
        rows, row_bytes = batch.shape[0], 4 * self.width
        features = gpu.alloc(batch.nbytes)
        scores = gpu.alloc(batch.nbytes)
        staging = gpu.alloc_host(batch.nbytes)
        try:
            gpu.copy_to_device(features, np.ascontiguousarray(batch), stream=stream)
            grid = (self.width + BLOCK - 1) // BLOCK
            n = np.uint32(self.width)
            for row in range(rows):  # one launch a row, on raw pointers into the batch's buffers
                at = row * row_bytes
                gpu.launch(self._add, grid, BLOCK, [features.ptr + at, self._bias, scores.ptr + at, n], stream=stream)
            gpu.copy_to_host(staging, scores, stream=stream)
            stream.synchronize()  # the copy into pinned staging is asynchronous: wait before reading it
            return np.frombuffer(staging.view(), dtype=np.float32).reshape(rows, self.width).copy()
        finally:
            for buf in (staging, scores, features):
                gpu.free(buf)

    def close(self) -> None:
        """Release the bias, the stream and the kernels; idempotent."""
        if self._gpu.closed or self._stream.closed:
            return
        self._stream.synchronize()
        self._gpu.free(self._bias)
        self._stream.close()
        self._kernels.close()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def score_batches(gpu: GpuBackend, bias: Rows, batches: Iterable[Rows]) -> list[Rows]:
    """Score every batch with one `Scorer`, closed at the end."""
    with Scorer(gpu, bias) as scorer:
        return [scorer.score(batch) for batch in batches]
