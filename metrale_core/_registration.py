"""The typed record a backend plugin returns from the ``metrale_backend`` hook."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, final

if TYPE_CHECKING:
    from ._backend import GpuBackend
    from ._device.raw import RawDevice
    from ._settings.model import MetraleSettings

__all__ = ["BackendRegistration"]


def _always_available(settings: MetraleSettings) -> str | None:
    return None


def _no_versions() -> Mapping[str, str]:
    return {}


def _one_device(settings: MetraleSettings) -> int:
    return 1


@final
@dataclasses.dataclass(frozen=True, slots=True)
class BackendRegistration:
    """What a backend plugin provides.

    :param open: builds the backend's raw layer for a device ordinal. It may
        raise [`BackendUnavailableError`][metrale_core.BackendUnavailableError] (or any
        [`MetraleError`][metrale_core.MetraleError]) when the device cannot be opened.
    :param probe: says whether the backend can run here: ``None`` when it can,
        else the reason in words a user can act on. It must be cheap and must
        never raise; a probe that raises counts as unavailable. It runs for
        [`available_backends`][metrale_core.available_backends] (``metrale backends``), for
        ``auto``, and for an open by name only when this backend is the one
        asked for.
    :param backend_class: the class of the backend object
        [`open_backend`][metrale_core.open_backend] returns: [`GpuBackend`][metrale_core.GpuBackend]
        or a subclass that adds methods of its own (the fake adds
        ``inject_fault``). A subclass adds; it does not override the core's
        methods.
    :param description: one line for ``metrale backends``.
    :param preference: how strongly ``auto`` prefers this backend: of the
        backends available here, ``auto`` opens the one with the highest
        preference, and of several with the same, the one whose name comes
        first in alphabetical order. A backend over real hardware declares a
        high one (the CUDA backend declares ``100``), an in-memory or CPU
        backend ``0`` (the fake), a wrapper or debugging backend below ``0``
        (the tracing example declares ``-10``), so that it is opened only by
        name.
    :param versions: the versions of what the backend runs on, beyond its own
        distribution, for ``metrale --version``: a mapping of a name to a
        version in words (the CUDA backend gives ``cuda-bindings`` and
        ``driver``, ``"not found"`` where no driver answers). It runs without a
        probe or an open, so it must be cheap, must work where the backend
        cannot run, and should not raise (one that raises is reported as such).
    :param device_count: how many devices the backend can open here: ordinals ``0 .. count - 1`` (the
        CUDA backend asks the driver, so ``CUDA_VISIBLE_DEVICES`` applies; the fake reads its
        ``device_count`` setting). ``metrale info`` lists them, and
        [`placement`][metrale_core.placement] picks a rank's ordinal among them. It runs only where the
        backend is available (after its probe), and may raise a
        [`MetraleError`][metrale_core.MetraleError]. Optional: one device by default.
    """

    open: Callable[[MetraleSettings, int], RawDevice]
    probe: Callable[[MetraleSettings], str | None] = _always_available
    backend_class: type[GpuBackend] | None = None
    description: str = ""
    preference: int = 0
    versions: Callable[[], Mapping[str, str]] = _no_versions
    device_count: Callable[[MetraleSettings], int] = _one_device
