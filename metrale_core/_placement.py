"""Which device a process of a distributed job opens: [`placement`][metrale_core.placement] reads what the
engine that started it says (torchrun's ``LOCAL_RANK``, Ray's GPU assignment; Dask-CUDA and Ray show each
worker its own device first through ``CUDA_VISIBLE_DEVICES``), and
[`open_for_rank`][metrale_core.open_for_rank] opens one backend on it.

No engine is a dependency: the variables come through the settings
([`MetraleSettings.launch`][metrale_core.MetraleSettings.launch]), and Ray is asked only where the program
has imported it already.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import final

from ._backend import GpuBackend
from ._discovery import device_count, open_backend
from ._errors import BackendUnavailableError, ConfigError, InvalidArgumentError
from ._settings.model import MetraleSettings

__all__ = ["Placement", "assigned_ordinal", "open_for_rank", "placement"]

_log = logging.getLogger("metrale")


@final
@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """The device a process opens, and why.

    :param ordinal: the device ordinal to open (after ``CUDA_VISIBLE_DEVICES``).
    :param device_count: the devices the backend sees here.
    :param rank: the process's rank in the job (``RANK``), or ``None``.
    :param local_rank: its rank on this host (``LOCAL_RANK``), or ``None``.
    :param world_size: the processes in the job (``WORLD_SIZE``), or ``None``.
    :param source: where the ordinal came from, in words (``"LOCAL_RANK=1"``).
    :param shared: whether more processes of this host than devices were started, so some share a device.
    """

    ordinal: int
    device_count: int
    rank: int | None
    local_rank: int | None
    world_size: int | None
    source: str
    shared: bool


def _ray_gpu_ids() -> list[str] | None:
    """The GPUs Ray assigned to this worker, where the program imported Ray and it runs; else ``None``."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None
        ids = ray.get_gpu_ids()
    except Exception as exc:  # Ray outside a worker, or a Ray without these: as if absent
        _log.debug("placement: Ray answered no GPU ids: %s", exc)
        return None
    return [str(i) for i in ids] if ids else None


def assigned_ordinal(ids: Sequence[str | int], visible: str | None) -> tuple[int, str]:
    """The ordinal of the first GPU an engine assigned this process (``ids``: Ray's ``get_gpu_ids()``, ints or
    strings) among the devices ``CUDA_VISIBLE_DEVICES`` shows it, and why, in words.

    - An id the variable lists opens its place in the list: Ray sets the variable to the assigned ids, so
      that is 0; where Ray leaves it alone (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``) it is the id's place
      among the node's devices (ray-project/ray#26493).
    - Ids compare as text, whitespace stripped: an ``int`` and its string are one (ray#28659); a UUID matches
      its entry, or a unique prefix of it (ray#43314).
    - With the variable unset, an integer id is the ordinal itself.

    :raises ConfigError: no id, or one that names none of the devices shown (the message names both).
    :raises InvalidArgumentError: ``ids`` is not a list of ints and strings, or ``visible`` not a string.
    """
    if not isinstance(ids, list | tuple) or not all(type(i) in (int, str) for i in ids):
        raise InvalidArgumentError(f"assigned_ordinal: ids must be a list of GPU ids (ints or strings), got {ids!r}")
    if visible is not None and not isinstance(visible, str):
        raise InvalidArgumentError(f"assigned_ordinal: visible must be CUDA_VISIBLE_DEVICES (a str) or None, got "
                                   f"{visible!r}")
    if not ids:
        raise ConfigError("no GPU is assigned to this process (give the task or actor num_gpus)")
    names = [str(i).strip() for i in ids]
    first = names[0]
    others = f" (of {', '.join(names)}: the first)" if len(names) > 1 else ""
    if visible is None:
        if first.isdecimal():
            return int(first), f"GPU {first}{others}, CUDA_VISIBLE_DEVICES unset: ordinal {int(first)}"
        raise ConfigError(
            f"GPU {first!r} is assigned, but CUDA_VISIBLE_DEVICES is unset, so no ordinal names it: list the node's "
            "GPUs in CUDA_VISIBLE_DEVICES, or open an ordinal with open_backend(ordinal=...)"
        )
    entries = [e.strip() for e in visible.split(",")]
    place = [i for i, e in enumerate(entries) if e == first]
    if not place:  # a UUID given whole on one side and as a prefix on the other
        place = [i for i, e in enumerate(entries) if e and not e.isdecimal() and (e.startswith(first) or
                                                                                 first.startswith(e))]
    if len(place) != 1:
        listed = "lists it twice" if place else "does not list it"
        raise ConfigError(
            f"GPU {first!r} is assigned, but CUDA_VISIBLE_DEVICES={visible!r} {listed} (see ray-project/ray#26493): "
            "let the engine set CUDA_VISIBLE_DEVICES, or open an ordinal with open_backend(ordinal=...)"
        )
    return place[0], f"GPU {first}{others}, entry {place[0]} of CUDA_VISIBLE_DEVICES={visible}"


def placement(name: str | None = None, *, settings: MetraleSettings | None = None) -> Placement:
    """The device this process should open on backend ``name`` (``None``: ``settings.backend``).

    In order: a Ray worker with GPUs assigned opens the first of them (`assigned_ordinal`: ordinal 0 where Ray
    set ``CUDA_VISIBLE_DEVICES``); a process with ``LOCAL_RANK`` (torchrun, ``torch.distributed.launch``,
    DeepSpeed, Accelerate), or else ``SLURM_LOCALID`` (``srun``), opens that local rank modulo the device count,
    so more local processes than devices share them round-robin (``shared``; a WARNING says so); otherwise
    ordinal 0, which is also each Dask-CUDA worker's own device. ``CUDA_VISIBLE_DEVICES`` needs nothing more: the
    driver (and the fake) numbers what it shows from 0.

    :raises BackendUnavailableError: the backend cannot run here, or sees no device.
    :raises ConfigError: a launcher variable is malformed (``LOCAL_RANK=first``), or Ray's assignment names no
        device shown.
    """
    settings = settings or MetraleSettings()
    launch = settings.launch
    count = device_count(name, settings=settings)
    if count < 1:
        raise BackendUnavailableError(f"placement: backend {name or settings.backend!r} sees no device here")
    ray_ids = _ray_gpu_ids()
    local, variable = launch.local_rank, "LOCAL_RANK"
    if local is None and launch.slurm_localid is not None:
        local, variable = launch.slurm_localid, "SLURM_LOCALID"
    shared = False
    if ray_ids is not None:
        ordinal, why = assigned_ordinal(ray_ids, launch.cuda_visible_devices)
        source = f"Ray assigned {why}"
        if ordinal >= count:
            raise BackendUnavailableError(f"placement: {source}, but backend {name or settings.backend!r} sees "
                                          f"{count} device(s) here")
        return Placement(ordinal, count, launch.rank, local, launch.world_size, source, False)
    if local is not None:
        ordinal = local % count
        source = f"{variable}={local}" + (f" modulo {count} device(s)" if local >= count else "")
        local_world = launch.local_world_size
        shared = local >= count or (local_world is not None and local_world > count)
        if shared:
            _log.warning(
                "placement: %s processes on this host and %d device(s): ranks share devices (this one, "
                "%s=%d, opens ordinal %d); their memory adds up on each device",
                local_world if local_world is not None else f"more than {local}", count, variable, local, ordinal,
            )
    else:
        ordinal, source = 0, "no launcher variable (LOCAL_RANK, SLURM_LOCALID) is set: the first device"
    if launch.cuda_visible_devices is not None:
        source += f"; CUDA_VISIBLE_DEVICES={launch.cuda_visible_devices}"
    return Placement(ordinal, count, launch.rank, local, launch.world_size, source, shared)


def open_for_rank(name: str | None = None, *, settings: MetraleSettings | None = None) -> GpuBackend:
    """Open backend ``name`` on this process's device, as [`placement`][metrale_core.placement] picks it
    (logged at INFO with where it came from). One backend per process and device: the engine starts the
    processes and carries their messages; metrale opens the right device.

    :raises BackendUnavailableError: the backend cannot run here, or the device cannot be opened.
    :raises ConfigError: a launcher variable is malformed, or Ray's assignment names no device shown.
    """
    settings = settings or MetraleSettings()
    where = placement(name, settings=settings)
    _log.info("open_for_rank: rank %s opens ordinal %d of %d (%s)", where.rank, where.ordinal, where.device_count,
              where.source)
    return open_backend(name, ordinal=where.ordinal, settings=settings)
