"""Plugins' settings: the model a plugin declares, and the entry-point scan that finds it.

- `PluginSettings`: the base of a plugin's settings model, read from ``METRALE_<NAME>_*``;
- `backend_entry_points`: the entry points of ``metrale.backends``, scanned once per state of ``sys.path``;
- `installed_models`: each installed plugin's model (`PluginModel`), loaded once per scan.

It knows no field of ``MetraleSettings``: the model passes its field names in.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import re
import sys
import threading
from collections.abc import Collection, Mapping
from typing import Any, ClassVar, Final, final

import pluggy
import pydantic
from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .._errors import ConfigError
from .hooks import PROJECT_NAME, alone, hookspec
from .parsing import config_error, plain_integers, problems

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENV_PREFIX",
    "PROJECT_NAME",
    "PluginModel",
    "PluginSettings",
    "backend_entry_points",
    "installed_models",
    "metrale_settings",
    "settings_hook",
]

_log = logging.getLogger("metrale.settings")

#: The prefix of every variable metrale reads.
ENV_PREFIX: Final = "METRALE_"
#: The entry-point group every backend registers in, the bundled ones too.
ENTRY_POINT_GROUP: Final = "metrale.backends"

_NOT_A_NAME: Final = re.compile(r"[^0-9a-z_]")


class PluginSettings(BaseSettings):
    """The base of a plugin's own settings: a pydantic-settings model read from ``METRALE_<NAME>_*``.

    A subclass names its prefix, ``METRALE_`` and the plugin's entry-point name
    in capitals, and declares fields as ``MetraleSettings`` does:

        class FakeSettings(PluginSettings):
            model_config = SettingsConfigDict(env_prefix="METRALE_FAKE_")

            memory_bytes: Size = Field(16 << 30, gt=0, description="...")

    and the plugin's ``metrale_settings`` hook returns the class. Its fields
    are then settings like the core's: ``METRALE_FAKE_MEMORY_BYTES``, the
    keyword and attribute ``fake_memory_bytes`` of [`MetraleSettings`][metrale_core.MetraleSettings],
    a row of the settings table, and known to the unknown-variable warning.
    Models are frozen, refuse unknown keywords, count an empty variable as
    unset, read every plain ``int`` field in decimal or ``0x`` hex as the
    core's integers are, and a bad value raises [`ConfigError`][metrale_core.ConfigError].
    """

    model_config: ClassVar[SettingsConfigDict] = SettingsConfigDict(
        env_ignore_empty=True,
        extra="forbid",
        frozen=True,
        validate_default=True,
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except pydantic.ValidationError as exc:
            # chained, so that MetraleSettings can name its own keywords for the same problems
            prefix = str(type(self).model_config.get("env_prefix", ""))
            raise config_error(problems(exc, type(self), prefix, "", values)) from exc
        except Exception as exc:  # a plugin's validator may fail in any way
            raise ConfigError(
                f"the settings model {type(self).__qualname__} failed to validate: {type(exc).__name__}: {exc}; "
                f"fix the plugin that declares it"
            ) from exc

    @field_validator("*", mode="before")
    @classmethod
    def _plain_integers(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        return plain_integers(cls, value, info)



@dataclasses.dataclass(frozen=True, slots=True)
class PluginModel:
    """An installed plugin's settings model: ``name`` is its keyword prefix (the entry point's name)."""

    name: str
    model: type[PluginSettings]
    distribution: str | None

    @property
    def env_prefix(self) -> str:
        return f"{ENV_PREFIX}{self.name.upper()}_"

    def keyword(self, field: str) -> str:
        return f"{self.name}_{field}"


class _EntryPoints:
    """The entry points of ``metrale.backends`` by name, scanned once per state of ``sys.path``.

    The state is each ``sys.path`` entry with its modification time, so a path added or removed, or a
    distribution installed into or removed from a folder on it (pip adds and removes whole dist-info
    folders), is seen by the next call; settings and discovery share one scan. An ``entry_points.txt``
    edited in place inside a dist-info folder that stays is not seen until the path's state changes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[tuple[str, int | None], ...] | None = None
        self._by_name: dict[str, tuple[importlib.metadata.EntryPoint, ...]] = {}

    @staticmethod
    def key() -> tuple[tuple[str, int | None], ...]:
        """The state of ``sys.path`` a scan is good for."""
        state = []
        for entry in sys.path:
            try:
                mtime: int | None = os.stat(entry or os.getcwd()).st_mtime_ns
            except (OSError, TypeError, ValueError):
                mtime = None
            state.append((entry or os.getcwd(), mtime))
        return tuple(state)

    def get(self) -> tuple[tuple[tuple[str, int | None], ...], dict[str, tuple[importlib.metadata.EntryPoint, ...]]]:
        key = self.key()
        with self._lock:
            if key != self._key:
                by_name: dict[str, list[importlib.metadata.EntryPoint]] = {}
                for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                    by_name.setdefault(ep.name, []).append(ep)
                self._by_name = {name: tuple(eps) for name, eps in by_name.items()}
                self._key = key
            return key, self._by_name


_ENTRY_POINTS: Final = _EntryPoints()


def backend_entry_points() -> dict[str, tuple[importlib.metadata.EntryPoint, ...]]:
    """The installed entry points of ``metrale.backends``, by name (several where distributions clash).

    Cached while ``sys.path`` and the folders on it stay as they were.
    """
    return dict(_ENTRY_POINTS.get()[1])


class _InstalledModels:
    """The plugins' settings models, found once per state of the entry points.

    Loading a plugin may construct settings (at its import); that inner
    construction sees no plugin models rather than looping.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._loading = False
        self._key: tuple[tuple[str, int | None], ...] | None = None
        self._models: tuple[PluginModel, ...] = ()

    def get(self, core_fields: Collection[str]) -> tuple[PluginModel, ...]:
        key, by_name = _ENTRY_POINTS.get()
        with self._lock:
            if self._loading:
                return ()
            if key != self._key:
                self._loading = True
                try:
                    self._models = _load_models(by_name, core_fields)
                finally:
                    self._loading = False
                self._key = key
            return self._models


def _load_models(
    by_name: Mapping[str, tuple[importlib.metadata.EntryPoint, ...]], core_fields: Collection[str]
) -> tuple[PluginModel, ...]:
    taken = set(core_fields)
    models: list[PluginModel] = []
    for name, eps in sorted(by_name.items()):
        if len(eps) != 1:
            continue  # a name clash: discovery reports it
        found = _model_of(name, eps[0])
        if found is None:
            continue
        keywords = {found.keyword(field) for field in found.model.model_fields}
        clash = sorted(keywords & taken)
        if clash:
            _log.warning("plugin %s (%s): its settings are ignored: %s already name other settings",
                         name, found.distribution, ", ".join(clash))
            continue
        taken |= keywords
        models.append(found)
    return tuple(models)


@hookspec
def metrale_settings() -> type[PluginSettings] | None:
    """Declare the plugin's own settings: a [`PluginSettings`][metrale_core.plugin.PluginSettings] subclass.

    Called for each plugin on its own, once per process (again only when
    ``sys.path`` changes), when the first [`MetraleSettings`][metrale_core.MetraleSettings]
    is built; it takes no settings, since it says what they are. The model's
    ``env_prefix`` must be ``METRALE_`` and the entry point's name in capitals
    (``METRALE_FAKE_`` for ``fake``). Each field ``memory_bytes`` of it is then
    the variable ``METRALE_FAKE_MEMORY_BYTES`` and the keyword and attribute
    ``fake_memory_bytes`` of ``MetraleSettings``, validated with the core's
    settings, listed in the settings table and known to the unknown-variable
    warning; the plugin reads its values with ``settings.plugin(FakeSettings)``.
    A hook that raises, returns anything but one such class, or whose model
    names a setting the core or another plugin already has, is skipped with a
    WARNING naming the plugin, and the others stand.

    **Results:** one per plugin; not combined.

    :returns: the plugin's [`PluginSettings`][metrale_core.plugin.PluginSettings]
        subclass, or ``None`` when it has no settings of its own.
    """


@final
class _SettingsSpec:
    """The spec the settings scan registers a plugin against (the other hooks are discovery's)."""

    metrale_settings = staticmethod(metrale_settings)


def settings_hook(plugin: object, name: str) -> list[object]:
    """The results of ``plugin``'s ``metrale_settings`` (registered as ``name``), through `alone` (`hooks`).

    :raises pluggy.PluginValidationError: its implementation does not fit the spec.
    :raises Exception: whatever the hook raised.
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(_SettingsSpec)
    pm.register(plugin, name=name)
    return list(alone(pm, "metrale_settings", plugin)())


def _model_of(name: str, ep: importlib.metadata.EntryPoint) -> PluginModel | None:
    """The settings model of one plugin, or ``None`` (a plugin that fails is reported by discovery)."""
    dist = getattr(ep, "dist", None)
    distribution = None if dist is None else str(dist.name)
    try:
        plugin = ep.load()
    except Exception:  # a plugin's import may fail in any way; `metrale backends` says why
        _log.debug("plugin %s did not load; it contributes no settings", name, exc_info=True)
        return None
    try:
        results = settings_hook(plugin, name)
    except pluggy.PluginValidationError as exc:
        _log.warning("plugin %s (%s): metrale_settings does not fit the hook's spec: %s; its settings are ignored",
                     name, distribution, " ".join(str(exc).split()))
        return None
    except Exception as exc:
        _log.warning("plugin %s (%s): metrale_settings raised %s: %s; its settings are ignored",
                     name, distribution, type(exc).__name__, exc)
        return None
    models = [r for r in results if r is not None]
    if not models:
        return None
    model = models[0]
    if len(models) > 1 or not (isinstance(model, type) and issubclass(model, PluginSettings)):
        _log.warning("plugin %s (%s): metrale_settings returned %r; it must return one PluginSettings "
                     "subclass; its settings are ignored", name, distribution, models)
        return None
    found = PluginModel(_NOT_A_NAME.sub("_", name.lower()), model, distribution)
    declared = str(model.model_config.get("env_prefix", ""))
    if declared.upper() != found.env_prefix:
        _log.warning("plugin %s (%s): %s reads %r; it must read %r (the entry point's name); its settings "
                     "are ignored", name, distribution, model.__qualname__, declared, found.env_prefix)
        return None
    return found


_INSTALLED: Final = _InstalledModels()


def installed_models(core_fields: Collection[str]) -> tuple[PluginModel, ...]:
    """The settings models of the installed plugins, by name (cached while the entry points stay the same);
    a model that would take one of ``core_fields`` (the core's settings) is ignored, with a warning."""
    return _INSTALLED.get(core_fields)
