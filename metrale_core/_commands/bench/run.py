"""The measurements ``--only`` picks from, and a whole run of them on one backend."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

from ... import Baseline, GpuBackend, MetraleSettings, open_backend
from ..._errors import InvalidArgumentError, MetraleError
from .breakdown import measure_breakdown, measure_eager_breakdown
from .context import Bench, Progress
from .frameworks import measure_frameworks
from .launches import measure_eager, measure_graph, measure_safety
from .memory import measure_alloc, measure_copies, measure_pools
from .model import BenchReport, Result
from .zones import measure_zones

__all__ = ["MEASUREMENTS", "Measurement", "pick", "run_bench"]


@dataclasses.dataclass(frozen=True, slots=True)
class Measurement:
    """A named measurement ``--only`` can pick."""

    name: str
    title: str
    run: Callable[[Bench], Result]
    #: Whether a run without ``--only`` takes it (``frameworks`` takes minutes: only when named).
    default: bool = True


#: Every measurement, in the order they run.
MEASUREMENTS: Final[tuple[Measurement, ...]] = (
    Measurement("alloc", "ledgered alloc + free against the raw pair", measure_alloc),
    Measurement("breakdown", "where the time of a ledgered alloc + free goes, step by step", measure_breakdown),
    Measurement("pools", "the arena against CuPy's and PyTorch's pools", measure_pools),
    Measurement("copy", "D2D, pinned and peer copies against the raw driver's", measure_copies),
    Measurement("eager", "eager memset and launch against the raw calls", measure_eager),
    Measurement("graph", "a graph of 100 small kernels against eager launches and PyTorch", measure_graph),
    Measurement("safety", "checks off against fully on in an inference-style loop", measure_safety),
    Measurement("zones", "the red-zone scan and in-graph check kernels over many zones", measure_zones),
    Measurement(
        "eager_breakdown", "where the time of an eager memset and launch goes, step by step", measure_eager_breakdown
    ),
    Measurement("frameworks", "a real model's generate with every tensor from metrale, against torch's allocator "
                "(minutes: only with --only)", measure_frameworks, default=False),
)


def pick(only: str | None) -> tuple[Measurement, ...]:
    """The measurements a comma-separated ``--only`` names (every default one when ``None``); refuses unknown
    names."""
    if only is None:
        return tuple(m for m in MEASUREMENTS if m.default)
    names = [name.strip() for name in only.split(",") if name.strip()]
    known = {m.name: m for m in MEASUREMENTS}
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise InvalidArgumentError(
            f"bench --only {only!r}: no measurement named {', '.join(unknown) or 'at all'}; "
            f"choose from {', '.join(known)}"
        )
    return tuple(m for m in MEASUREMENTS if m.name in names)


@contextmanager
def _baseline(gpu: GpuBackend) -> Iterator[tuple[Baseline | None, str]]:
    try:
        baseline = gpu.raw.baseline()
    except MetraleError as exc:
        yield None, f"backend {gpu.name} offers no baseline ({exc.message})"
        return
    try:
        yield baseline, ""
    finally:
        baseline.close()


def _versions(baseline: Baseline | None, pure: bool) -> dict[str, str]:
    from ... import __version__
    from ..._twins import describe  # the compiled twins the bench's backend runs, or why it runs pure Python

    versions = {"metrale": __version__, "code": describe(pure), "python": platform.python_version()}
    if baseline is not None:
        versions.update(baseline.versions)
    for module, name in (("numpy", "numpy"), ("cupy", "cupy"), ("torch", "torch")):
        try:
            imported = __import__(module)
            versions[name] = str(imported.__version__)
        except Exception:  # an absent or broken peer is said so where it is skipped
            continue
    return versions


def run_bench(
    settings: MetraleSettings,
    *,
    only: str | None = None,
    quick: bool = False,
    progress: Progress = lambda line: None,
    step: Callable[[int, int, str], None] | None = None,
) -> BenchReport:
    """Run the measurements ``only`` names (all by default) on the backend ``settings`` pick.

    ``quick`` runs each with a few small rounds: a smoke run whose figures mean little.
    ``progress`` receives a line as each measurement starts and as its parts run; ``step``, where given,
    ``(measurements done, measurements, the one running)`` as each starts and once all are done.
    """
    chosen = pick(only)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    with open_backend(settings=settings) as gpu, _baseline(gpu) as (baseline, why_not):
        bench = Bench(gpu, baseline, why_not, quick, progress)
        results = []
        for i, measurement in enumerate(chosen, 1):
            if step is not None:
                step(i - 1, len(chosen), f"bench: {measurement.name}")
            progress(f"[{i}/{len(chosen)}] {measurement.name}: {measurement.title}")
            # The garbage of the measurements before (a peer's pool or graph) is freed now, not by a
            # collection during this one's capture: a free made then would invalidate it (global mode).
            gc.collect()
            started = time.perf_counter()
            results.append(measurement.run(bench))
            progress(f"      {measurement.name} done in {time.perf_counter() - started:.1f} s")
        if step is not None:
            step(len(chosen), len(chosen), "bench: done")
        versions = _versions(baseline, gpu.settings.pure)
        return BenchReport(date, gpu.name, gpu.device_name, versions, quick, tuple(results))
