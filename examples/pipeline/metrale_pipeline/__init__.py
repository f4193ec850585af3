"""metrale_pipeline: an example host application of metrale, a batched vector pipeline.

What it demonstrates, with the public ``metrale_core`` API and the shipped
``vector`` kernels only, so it runs unchanged on the ``fake`` backend and on
``cuda``:

- **allocate once**: device buffers ``a``, ``b``, ``out``, ``acc`` and pinned
  host staging (``alloc_host``) are made before the first batch and reused;
- **capture once, replay per batch**: one step (a copy from pinned staging
  into ``a``, ``out = a + b``, ``acc = out + acc``, a copy of ``out`` back
  into pinned staging) is captured on a stream of its own, instantiated once,
  and launched for every batch;
- **synchronize before reading pinned memory**: copies to and from a
  ``HostBuffer`` are asynchronous; the stream is synchronized before the
  host reads the result or refills the staging (with ``fake_defer`` the fake
  backend reads stale data, as a GPU would, if that synchronize is missing);
- **time with events**: two events around each graph launch give its device
  time;
- **check everything**: each batch against numpy, and ``acc`` against a
  numpy sum at the end;
- **leave nothing behind**: the pipeline releases everything it made (the
  executable graph before the buffers it uses), and the backend's ledger is
  empty (``live_alloc_len() == 0``) before the backend closes, so its
  teardown sweep has nothing to report.

Use it from Python:

    from metrale_core import open_backend
    from metrale_pipeline import run_pipeline

    with open_backend() as gpu:                  # METRALE_BACKEND, default auto
        result = run_pipeline(gpu, batches=8, size=1 << 16)
    assert result.ok

or from the shell: ``metrale-pipeline --batches 8``. It logs to the logger
``metrale_pipeline``; only the command line prints.
"""

from __future__ import annotations

from ._pipeline import BLOCK, MAX_SIZE, Pipeline, PipelineResult, Vector, run_pipeline

__version__ = "0.2.0"

__all__ = ["BLOCK", "MAX_SIZE", "Pipeline", "PipelineResult", "Vector", "__version__", "run_pipeline"]
