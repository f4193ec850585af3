"""metrale in Ray's tasks and actors: [`open_for_actor`][metrale_core.ray.open_for_actor] opens the device
Ray assigned to the calling task or actor.

- The device: the first GPU of ``ray.get_gpu_ids()`` found among the devices ``CUDA_VISIBLE_DEVICES`` shows
  (`assigned_ordinal`): ids as ints or strings alike, GPU UUIDs, and Ray's ids where Ray left the variable alone.
- The origin names the actor (``ray actor <id>``; a task's worker, ``ray worker <id>``), and a fractional
  assignment (``num_gpus=0.5``: several actors on one device): the origin says the share, and an out-of-memory
  error the bytes other processes hold on the device.
- Gathering is Ray's: each actor returns ``gpu.ledger_report()`` (plain values), and the driver merges
  ``ray.get(...)`` of them with [`merge_reports`][metrale_core.merge_reports].

Ray is no dependency of metrale: this module imports ``ray`` when called (``pip install "metrale[ray]"``).
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from ._discovery import open_backend
from ._errors import ConfigError, MissingPackageError
from ._placement import assigned_ordinal
from ._settings.model import MetraleSettings

if TYPE_CHECKING:
    from ._backend import GpuBackend

__all__ = ["open_for_actor"]

_log = logging.getLogger("metrale")


def _ray() -> Any:
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise MissingPackageError(
            'metrale_core.ray needs Ray: pip install "metrale[ray]" (or pip install ray)'
        ) from None


def _assignment(ray: Any) -> tuple[list[str], float | None, str]:
    """Ray's GPU ids for this worker (as strings), its share of a GPU (``None``: whole ones) and its name."""
    if not ray.is_initialized():
        raise ConfigError("open_for_actor: Ray is not initialized here: call it inside a Ray task or actor")
    context = ray.get_runtime_context()
    ids = [str(i) for i in ray.get_gpu_ids()]
    share = None
    if ids:  # none in Ray's driver, whose get_assigned_resources() fails an assert: assigned_ordinal says "no GPU"
        gpus = context.get_assigned_resources().get("GPU")
        share = float(gpus) if gpus is not None and 0 < float(gpus) < 1 else None
    actor = context.get_actor_id()
    name = f"ray actor {actor}" if actor else f"ray worker {context.get_worker_id()}"
    return ids, share, name


def open_for_actor(name: str | None = None, *, settings: MetraleSettings | None = None) -> GpuBackend:
    """Open backend ``name`` (``None``: the ``backend`` setting) on the GPU Ray assigned to the calling task or
    actor (the first, where it has several), its origin naming the actor and any fractional share.

    :raises ConfigError: not inside a Ray task or actor, none has a GPU assigned (give it ``num_gpus``), or the
        GPU Ray assigned is not among the devices ``CUDA_VISIBLE_DEVICES`` shows (the message names both).
    :raises MissingPackageError: Ray is not installed.
    :raises BackendUnavailableError: the backend cannot run here, or cannot open that device.
    """
    ray = _ray()
    settings = settings or MetraleSettings()
    ids, share, worker = _assignment(ray)
    try:
        ordinal, why = assigned_ordinal(ids, settings.visible_devices)
    except ConfigError as exc:
        raise ConfigError(f"open_for_actor: {exc}") from None
    launch: dict[str, Any] = {"metrale_worker": worker}
    if share is not None:
        launch["metrale_device_share"] = share
    gpu = open_backend(name, ordinal=ordinal, settings=settings.with_launch(**launch))
    _log.info("open_for_actor: %s opens ordinal %d (Ray assigned %s%s)", worker, ordinal, why,
              f", {share:g} of it" if share is not None else "")
    return gpu
