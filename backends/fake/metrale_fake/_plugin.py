"""The fake backend's plugin: registered through ``metrale.backends`` like any other."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from metrale_core import BackendUnavailableError, MetraleSettings, cuda_code
from metrale_core.plugin import BackendRegistration, KernelImplementation, PluginSettings, hookimpl

from ._settings import FakeSettings
from ._visible import visible_devices

if TYPE_CHECKING:
    from ._device import FakeDevice

# The device, the backend class and the kernels (numpy and all) are imported when the backend is
# registered or opened, not when the plugin is loaded: building the settings loads every plugin.


def _open(settings: MetraleSettings, ordinal: int) -> FakeDevice:
    shown = _shown(settings)
    own = settings.plugin(FakeSettings)
    if not shown:  # as cuInit answers where CUDA_VISIBLE_DEVICES shows nothing
        raise BackendUnavailableError(
            f"no fake device is visible: CUDA_VISIBLE_DEVICES={settings.visible_devices!r} shows none of the fake's "
            f"{own.device_count} (it lists indexes 0..{own.device_count - 1} or FAKE- UUIDs, each once, as the "
            "driver reads them). Where it names real GPUs, set METRALE_FAKE_FOLLOW_VISIBLE_DEVICES=0 (or "
            "METRALE_FAKE_DEVICE_COUNT past the highest index)",
            code=cuda_code("CUDA_ERROR_NO_DEVICE"), name="CUDA_ERROR_NO_DEVICE",
        )
    count = len(shown)
    if not 0 <= ordinal < count:  # as the CUDA backend refuses it
        limit = "METRALE_FAKE_DEVICE_COUNT sets how many"
        if own.follow_visible_devices and settings.visible_devices is not None:
            limit += f"; CUDA_VISIBLE_DEVICES={settings.visible_devices} shows {count}"
        raise BackendUnavailableError(
            f"fake device {ordinal} does not exist: the fake has {count} device(s), ordinals 0..{count - 1} "
            f"({limit})",
            code=cuda_code("CUDA_ERROR_INVALID_DEVICE"), name="CUDA_ERROR_INVALID_DEVICE",
        )
    from ._device import FakeDevice

    return FakeDevice(settings, ordinal, shown[ordinal])


def _shown(settings: MetraleSettings) -> tuple[int, ...]:
    """The fake devices this process sees, by index, in ordinal order (``CUDA_VISIBLE_DEVICES``, as the driver,
    where ``follow_visible_devices`` is on)."""
    own = settings.plugin(FakeSettings)
    return visible_devices(settings.visible_devices if own.follow_visible_devices else None, own.device_count)


def _device_count(settings: MetraleSettings) -> int:
    return len(_shown(settings))


@hookimpl
def metrale_backend(settings: MetraleSettings) -> BackendRegistration:
    """The fake backend: always available."""
    from ._backend import FakeBackend

    return BackendRegistration(
        open=_open,
        backend_class=FakeBackend,
        description="in-memory device for development and tests without a GPU",
        preference=0,  # auto opens it only where no backend over real hardware is available
        device_count=_device_count,
    )


@hookimpl
def metrale_settings() -> type[PluginSettings]:
    """The fake's settings, ``METRALE_FAKE_*``: capacity, integrated, compute capability, defer, address reuse."""
    return FakeSettings


@hookimpl
def metrale_kernel_implementations(settings: MetraleSettings) -> Iterable[KernelImplementation]:
    """The fake's implementations of the kernels metrale ships."""
    from ._kernels import SHIPPED

    return SHIPPED
