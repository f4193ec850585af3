"""The fake backend's plugin: registered through ``metrale.backends`` like any other."""

from __future__ import annotations

from collections.abc import Iterable

from metrale_core import MetraleSettings
from metrale_core.plugin import BackendRegistration, KernelImplementation, PluginSettings, hookimpl

from ._backend import FakeBackend
from ._device import FakeDevice
from ._kernels import SHIPPED
from ._settings import FakeSettings


def _open(settings: MetraleSettings, ordinal: int) -> FakeDevice:
    return FakeDevice(settings, ordinal)


@hookimpl
def metrale_backend(settings: MetraleSettings) -> BackendRegistration:
    """The fake backend: always available."""
    return BackendRegistration(
        open=_open,
        backend_class=FakeBackend,
        description="in-memory device for development and tests without a GPU",
        preference=0,  # auto opens it only where no backend over real hardware is available
    )


@hookimpl
def metrale_settings() -> type[PluginSettings]:
    """The fake's settings, ``METRALE_FAKE_*``: capacity, integrated, compute capability, defer, address reuse."""
    return FakeSettings


@hookimpl
def metrale_kernel_implementations(settings: MetraleSettings) -> Iterable[KernelImplementation]:
    """The fake's implementations of the kernels metrale ships."""
    return SHIPPED
