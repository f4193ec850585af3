"""The plugin module named by the entry point: the hooks, and their records."""

from __future__ import annotations

from typing import TYPE_CHECKING

from metrale_core import MetraleSettings
from metrale_core.plugin import BackendRegistration, PluginSettings, hookimpl

from ._settings import TracingSettings

if TYPE_CHECKING:
    from ._device import TracingDevice

# The device (and the fake it wraps, numpy and all) is imported when the backend is registered or
# opened, not when the plugin is loaded: building the settings loads every plugin.


def _open(settings: MetraleSettings, ordinal: int) -> TracingDevice:
    from metrale_fake import FakeDevice

    from ._device import TracingDevice

    own = settings.plugin(TracingSettings)
    # mypy cannot see the primitives _device.py sets on the class after its body
    return TracingDevice(FakeDevice(settings, ordinal), own.max_calls)  # type: ignore[abstract]


@hookimpl
def metrale_backend(settings: MetraleSettings) -> BackendRegistration:
    """The tracing backend: available wherever the fake is."""
    from ._device import TracingBackend

    return BackendRegistration(
        open=_open,
        backend_class=TracingBackend,
        description="the fake device, with every raw call recorded (an example plugin)",
        preference=-10,  # a debugging wrapper: `auto` never opens it while the fake it wraps is there
    )


@hookimpl
def metrale_settings() -> type[PluginSettings]:
    """The tracing backend's settings: ``METRALE_TRACING_MAX_CALLS``."""
    return TracingSettings
