"""The fake backend's plugin: registered through ``metrale.backends`` like any other."""

from __future__ import annotations

from collections.abc import Iterable

from metrale_core import BackendRegistration, KernelImplementation, MetraleSettings, hookimpl

from ._backend import FakeBackend
from ._device import FakeDevice
from ._kernels import SHIPPED


def _open(settings: MetraleSettings, ordinal: int) -> FakeDevice:
    return FakeDevice(settings, ordinal)


@hookimpl
def metrale_backend(settings: MetraleSettings) -> BackendRegistration:
    """The fake backend: always available."""
    return BackendRegistration(
        open=_open,
        backend_class=FakeBackend,
        description="in-memory device for development and tests without a GPU",
    )


@hookimpl
def metrale_kernel_implementations(settings: MetraleSettings) -> Iterable[KernelImplementation]:
    """The fake's implementations of the kernels metrale ships."""
    return SHIPPED
