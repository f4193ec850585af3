"""The tracing backend's own settings: a model read from ``METRALE_TRACING_*``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from metrale_core.plugin import PluginSettings

from ._device import TRACE_LENGTH

__all__ = ["TracingSettings"]


class TracingSettings(PluginSettings):
    """``METRALE_TRACING_MAX_CALLS``, also ``MetraleSettings(tracing_max_calls=...)``."""

    # The prefix is METRALE_ and the entry point's name, `tracing`, in capitals.
    model_config: ClassVar[SettingsConfigDict] = SettingsConfigDict(env_prefix="METRALE_TRACING_")

    max_calls: int = Field(
        TRACE_LENGTH, gt=0, le=10_000_000,
        description="How many raw calls the tracing backend keeps; the oldest are dropped first.",
    )
