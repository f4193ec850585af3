"""metrale on every Dask worker: [`MetraleSetup`][metrale_core.dask.MetraleSetup], a worker plugin, and
[`gather_reports`][metrale_core.dask.gather_reports], every worker's ledger merged on the client.

- `MetraleSetup` opens one backend per worker, on the worker's device: ordinal 0 of what its
  ``CUDA_VISIBLE_DEVICES`` shows (Dask-CUDA puts each worker's GPU first; the fake reads the variable as the
  driver does). Each record's origin names the worker by its address.
- Optionally it installs the PyTorch and CuPy allocators (``allocators=("torch", "cupy")``) on that backend, so
  every tensor of the worker's tasks is on its ledger.
- A task reaches the backend with [`worker_backend`][metrale_core.dask.worker_backend].
- At the worker's teardown it judges the red zones, sweeps, logs the report (a WARNING where something leaked or
  overran) and, where ``snapshot_dir`` is given, keeps it there as a memory snapshot (``metrale report`` merges
  them).
- `gather_reports(client)` asks every worker for its report (``client.run``) and merges them
  ([`merge_reports`][metrale_core.merge_reports]): a line per worker (its address, host, pid and device), the
  largest call sites, leaks and every red-zone violation. A worker that cannot answer (it died) is named in a
  WARNING; the others' reports are whole. ``sweep=True``, at the end of a job, first drains each worker's
  ledger, so what is still on it counts as leaked.

Dask is no dependency of metrale: this module imports ``distributed`` (``pip install "metrale[dask]"``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, final

from ._discovery import open_backend
from ._errors import ConfigError, InvalidArgumentError, MetraleError, MissingPackageError, RedZoneError
from ._reports.merge import LedgerReport, MergedReport, merge_reports
from ._settings.model import MetraleSettings

try:
    import distributed
    from distributed.diagnostics.plugin import WorkerPlugin
except ImportError:  # pragma: no cover (CI installs it)
    raise MissingPackageError(
        'metrale_core.dask needs Dask\'s distributed: pip install "metrale[dask]" (or pip install distributed)'
    ) from None

if TYPE_CHECKING:
    from ._backend import GpuBackend
    from .allocators.door import Door

__all__ = ["PLUGIN_NAME", "MetraleSetup", "gather_reports", "worker_backend"]

_log = logging.getLogger("metrale")

#: The name the plugin is registered under on every worker (``worker.plugins[PLUGIN_NAME]``).
PLUGIN_NAME: Final = "metrale"

#: The allocator doors a worker may install, by name.
ALLOCATORS: Final = ("torch", "cupy")


@final
class MetraleSetup(WorkerPlugin):  # type: ignore[misc,unused-ignore]  # (Any where distributed is absent)
    """A Dask worker plugin: one metrale backend per worker, on its device.

    Register it once: ``client.register_plugin(MetraleSetup(redzone=4096))``; workers that join later get it
    too. Keywords other than the ones below are settings (``MetraleSettings`` keywords: ``redzone=4096``,
    ``fake_device_count=2``), applied on each worker over its ``METRALE_*`` variables.

    :param backend: the backend to open (``None``: the ``backend`` setting, ``auto`` by default).
    :param allocators: the framework doors to install on it: ``"torch"``, ``"cupy"``, or both.
    :param snapshot_dir: where each worker saves its memory snapshot at teardown (``None``: nowhere).
    :raises ConfigError: an allocator is unknown, or a setting is bad (checked here, before any worker sees it).
    """

    name = PLUGIN_NAME  # (distributed reads it)
    idempotent = False  # a new registration replaces the old: its workers close theirs first

    def __init__(
        self, backend: str | None = None, *, allocators: Iterable[str] = (), snapshot_dir: str | os.PathLike[str]
        | None = None, **settings: Any,
    ) -> None:
        if isinstance(allocators, str):
            allocators = (allocators,)
        try:
            wanted = tuple(allocators)
        except TypeError:
            raise ConfigError(f"MetraleSetup: allocators must be names among {list(ALLOCATORS)}, got "
                              f"{allocators!r}") from None
        unknown = [a for a in wanted if a not in ALLOCATORS]
        if unknown:
            raise ConfigError(f"MetraleSetup: unknown allocator(s) {unknown}: choose from {list(ALLOCATORS)}")
        MetraleSettings(**settings)  # a bad keyword or value is refused here, on the client
        self._backend = backend
        self._allocators = tuple(dict.fromkeys(wanted))
        self._snapshot_dir = None if snapshot_dir is None else str(snapshot_dir)
        self._settings = dict(settings)
        self._gpu: GpuBackend | None = None
        self._doors: list[Door] = []

    def __getstate__(self) -> dict[str, Any]:
        """What travels to the workers: the configuration, never an open backend."""
        return {"backend": self._backend, "allocators": self._allocators, "snapshot_dir": self._snapshot_dir,
                "settings": self._settings}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self._backend = state["backend"]
        self._allocators = state["allocators"]
        self._snapshot_dir = state["snapshot_dir"]
        self._settings = dict(state["settings"])
        self._gpu = None
        self._doors = []

    @property
    def backend(self) -> GpuBackend:
        """The worker's backend (on the worker, once set up).

        :raises ConfigError: the plugin is not set up on this worker (on the client, or after teardown).
        """
        if self._gpu is None:
            raise ConfigError("MetraleSetup: no backend here: the plugin is not set up on this process (a task "
                              "reaches its worker's with metrale_core.dask.worker_backend())")
        return self._gpu

    def setup(self, worker: Any) -> None:
        """Open the backend on the worker's device, named by the worker's address, and install the doors."""
        settings = MetraleSettings(**self._settings).with_launch(metrale_worker=str(worker.address))
        gpu = open_backend(self._backend, ordinal=0, settings=settings)
        try:
            for name in self._allocators:
                module = _door_module(name)
                self._doors.append(module.install(gpu))
        except BaseException:
            self._close_doors()
            gpu.close()
            raise
        self._gpu = gpu
        _log.info("metrale on Dask worker %s: %s opened (%s)", worker.address, gpu.origin.describe(),
                  ", ".join(self._allocators) or "no allocator door")

    def report(self, *, sweep: bool = False) -> LedgerReport:
        """This worker's report now: its red zones judged (a scan), its ledger drained where ``sweep`` says (every
        allocation still on it freed and counted as leaked: for the end of a job only), then its ledger, leaks,
        counters and violations (`GpuBackend.ledger_report`)."""
        return _judged(self.backend, sweep=sweep)

    def teardown(self, worker: Any) -> None:
        """Judge the zones, sweep, log the report (a WARNING where anything leaked or overran), save the snapshot
        where ``snapshot_dir`` says, and close the backend. Nothing here raises: a worker closes either way."""
        gpu, self._gpu = self._gpu, None
        if gpu is None:
            return
        try:
            report = _judged(gpu, sweep=True)
            bad = report.swept or report.live or report.violations
            (_log.warning if bad else _log.info)(
                "metrale on Dask worker %s at teardown:\n%s", worker.address, merge_reports([report]).render()
            )
            if self._snapshot_dir is not None:
                folder = Path(self._snapshot_dir)
                folder.mkdir(parents=True, exist_ok=True)
                o = report.origin  # (two workers of one process, or a plugin registered again: distinct files)
                gpu.save_snapshot(folder / f"metrale-{o.host}-{o.pid}-{o.instance}.json")
        except (MetraleError, OSError) as exc:
            _log.warning("metrale on Dask worker %s: the report at teardown failed: %s", worker.address, exc)
        finally:
            self._close_doors()
            gpu.close()

    def _close_doors(self) -> None:
        doors, self._doors = self._doors, []
        for door in doors:
            try:
                door.close()
            except MetraleError as exc:
                _log.warning("metrale on Dask: closing the %s door failed: %s", door, exc)


def _judged(gpu: GpuBackend, *, sweep: bool) -> LedgerReport:
    # (redzone_action="raise": a check that finds a violation raises, after it kept it for the report)
    with contextlib.suppress(RedZoneError):
        gpu.scan_redzones()
    if sweep:
        with contextlib.suppress(RedZoneError):  # the sweep is done when its check raises
            gpu.sweep_unreleased()
    return gpu.ledger_report()


def _door_module(name: str) -> Any:
    if name == "torch":
        from .allocators import torch

        return torch
    from .allocators import cupy

    return cupy


def _plugin(worker: Any) -> MetraleSetup:
    plugin = worker.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, MetraleSetup):
        raise ConfigError(
            f"Dask worker {worker.address} has no metrale plugin: register it first, "
            "client.register_plugin(metrale_core.dask.MetraleSetup())"
        )
    return plugin


def worker_backend() -> GpuBackend:
    """The backend of the Dask worker running this task (its `MetraleSetup`).

    :raises ConfigError: not inside a Dask task, or the worker has no `MetraleSetup`.
    """
    try:
        worker = distributed.get_worker()
    except ValueError:
        worker = None
    if worker is None:  # raised outside the except: its context (distributed's LookupError of a ContextVar) cannot
        # be pickled, and the error could not travel from a worker (client.run) to the client as a ConfigError
        raise ConfigError("worker_backend: not inside a Dask task (no worker runs this code)")
    return _plugin(worker).backend


def _worker_report(dask_worker: Any, sweep: bool) -> LedgerReport:
    return _plugin(dask_worker).report(sweep=sweep)


def gather_reports(
    client: Any, *, sweep: bool = False, workers: list[str] | None = None, top: int = 10
) -> MergedReport:
    """Every worker's report (`MetraleSetup.report`: its zones judged), merged on the client: a line per worker with
    its address, host, pid and device, the largest call sites and leaks across the cluster, and every red-zone
    violation with the worker that found it.

    - ``sweep``: ``False`` (the default) leaves the workers' memory alone: what is allocated shows as live.
      ``True``, at the end of a job, first drains each worker's ledger: every allocation still on it is freed
      and counted as leaked (`GpuBackend.sweep_unreleased`). Never while tasks still use their buffers.
    - ``workers``: the addresses to ask (``None``: all).
    - A worker that cannot answer (it died, or has no plugin) is named in a WARNING and left out: the others'
      reports are whole.

    :raises ConfigError: no worker answered.
    :raises InvalidArgumentError: ``top`` is not a positive integer (before any worker is asked).
    """
    if type(top) is not int or top < 1:
        raise InvalidArgumentError(f"gather_reports: top must be a positive integer, got {top!r}")
    # sweep by keyword: client.run passes the worker as the keyword dask_worker, so a positional argument would
    # land on dask_worker too (a TypeError on every worker)
    answers = client.run(_worker_report, sweep=sweep, workers=workers, on_error="return")
    reports: list[LedgerReport] = []
    for address, answer in sorted(answers.items()):
        if isinstance(answer, LedgerReport):
            reports.append(answer)
        else:
            _log.warning("gather_reports: Dask worker %s gave no report (%s: %s); merged the others'", address,
                         type(answer).__name__, answer)
    if not reports:
        raise ConfigError(f"gather_reports: no Dask worker gave a report ({len(answers)} asked)")
    return merge_reports(reports, top=top)
