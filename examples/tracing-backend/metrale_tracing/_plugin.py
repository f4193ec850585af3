"""The plugin module named by the entry point: one hook, one registration record."""

from __future__ import annotations

from metrale_core import BackendRegistration, MetraleSettings, hookimpl
from metrale_fake import FakeDevice

from ._device import TracingBackend, TracingDevice


def _open(settings: MetraleSettings, ordinal: int) -> TracingDevice:
    # mypy cannot see the primitives _device.py sets on the class after its body
    return TracingDevice(FakeDevice(settings, ordinal))  # type: ignore[abstract]


@hookimpl
def metrale_backend(settings: MetraleSettings) -> BackendRegistration:
    """The tracing backend: available wherever the fake is."""
    return BackendRegistration(
        open=_open,
        backend_class=TracingBackend,
        description="the fake device, with every raw call recorded (an example plugin)",
    )
