"""``metrale bench``: each metrale operation timed next to what a user would otherwise call.

Everything runs in one process and one run, so the ratios compare like with like: the operations
of a comparison take turns round by round (the order rotating), and each figure is the median of
its rounds. The raw driver calls come from the backend's [`Baseline`][metrale_core.Baseline] (the
CUDA backend's is ``cuda.bindings``; the fake's is numpy), so no vendor type reaches this package;
CuPy and PyTorch are imported only if installed, and only where the backend's memory is CUDA
device memory (a buffer's ``__dlpack_device__()`` says so), which they can share.

Nothing here asserts a speed: `Goal` records whether a ratio met its target, for a person
to read; goals are a GPU's, so there are none where the device memory is host memory.

One layer per module, each importing only those before it:

- `.model`: `Figure`, `Goal`, `Result`, `BenchReport` (data);
- `.timing`: operations taking turns, medians, ratios, sizes;
- `.peers`: CuPy and PyTorch, found or skipped with the reason;
- `.context`: `Bench`, what a measurement works with;
- `.memory` and `.launches`: the measurements;
- `.breakdown`: where the time of one call goes, step by step, built from the parts' own methods;
- `.run`: `MEASUREMENTS`, `pick` and `run_bench`.
"""

from __future__ import annotations

from .model import BenchReport, Figure, Goal, Result
from .run import MEASUREMENTS, Measurement, pick, run_bench

__all__ = ["MEASUREMENTS", "BenchReport", "Figure", "Goal", "Measurement", "Result", "pick", "run_bench"]
