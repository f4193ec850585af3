"""Where each setting's value came from: its default, a ``METRALE_*`` variable, a ``.env`` file, or a keyword.

- `setting_sources`: one `SettingSource` per setting of a `MetraleSettings` (the core's fields, then each
  installed plugin's), for ``metrale settings``.

It reads the environment through pydantic-settings' own sources (the settings package is the one place
metrale reads it): a field the model was given (``model_fields_set``) is from the variable the env source
finds for it, else from the ``.env`` file a model names (``env_file``), else from a keyword; a field it was not
given is its default. A keyword equal to the default (what ``updated()`` passes for every field) counts as the
default.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final, final

from pydantic_settings import BaseSettings, DotEnvSettingsSource, EnvSettingsSource

from .model import MetraleSettings, installed_plugin_settings

__all__ = ["DEFAULT", "ENVIRONMENT", "KEYWORD", "SettingSource", "setting_sources"]

#: A setting's source, as `SettingSource.source` names it (a ``.env`` file is named by its path).
DEFAULT: Final = "default"
ENVIRONMENT: Final = "environment"
KEYWORD: Final = "keyword"


@final
@dataclasses.dataclass(frozen=True, slots=True)
class SettingSource:
    """One setting: its keyword (``fake_memory_bytes``), variable, value now, and where the value came from."""

    keyword: str
    variable: str
    value: Any  # as model_dump(mode="json") writes it
    source: str  # DEFAULT, ENVIRONMENT, KEYWORD, or ".env file <path>"
    plugin: str | None  # the plugin whose model declares it; None: the core's

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _found(source: EnvSettingsSource, model: type[BaseSettings], name: str) -> bool:
    """Whether ``source`` holds a value for field ``name`` (an empty one counts as unset where the model says)."""
    value, _, _ = source.get_field_value(model.model_fields[name], name)
    return value is not None and not (value == "" and model.model_config.get("env_ignore_empty", False))


def _of(instance: BaseSettings, keyword_prefix: str, plugin: str | None) -> list[SettingSource]:
    model = type(instance)
    env = EnvSettingsSource(model)
    env_file = model.model_config.get("env_file")
    dotenv = DotEnvSettingsSource(model) if env_file else None
    prefix = str(model.model_config.get("env_prefix", ""))
    dumped = instance.model_dump(mode="json")
    listed: list[SettingSource] = []
    for name, field in model.model_fields.items():
        if name not in instance.model_fields_set:
            source = DEFAULT
        elif _found(env, model, name):
            source = ENVIRONMENT
        elif dotenv is not None and _found(dotenv, model, name):
            source = f".env file {env_file}"
        elif not field.is_required() and getattr(instance, name) == field.get_default(call_default_factory=True):
            source = DEFAULT
        else:
            source = KEYWORD
        listed.append(SettingSource(keyword_prefix + name, prefix + name.upper(), dumped[name], source, plugin))
    return listed


def setting_sources(settings: MetraleSettings) -> list[SettingSource]:
    """Every setting of ``settings``, the core's first (in declaration order), then each installed plugin's."""
    listed = _of(settings, "", None)
    for p in installed_plugin_settings():
        listed += _of(settings.plugin(p.model), p.keyword(""), p.name)
    return listed
