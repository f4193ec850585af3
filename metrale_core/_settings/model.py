"""``MetraleSettings``: the one place metrale reads the environment.

The core's settings are the fields of [`MetraleSettings`][metrale_core.MetraleSettings]. Each installed
plugin may contribute a model of its own, a [`PluginSettings`][metrale_core.plugin.PluginSettings] subclass
returned by its ``metrale_settings`` hook and read from ``METRALE_<NAME>_*``
(``<NAME>`` is the plugin's entry-point name). ``MetraleSettings`` finds those
models through the entry-point group, validates them with the core's fields,
accepts and exposes their values as ``<name>_<field>`` and hands a plugin its
model through [`MetraleSettings.plugin`][metrale_core.MetraleSettings.plugin].
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import re
import sys
import threading
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Final, Literal, TypeAlias, TypeVar

import annotated_types
import pluggy
import pydantic
import pydantic_core
from pydantic import (
    BeforeValidator,
    Field,
    PlainValidator,
    PrivateAttr,
    WrapValidator,
    field_validator,
    model_serializer,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from .._errors import ConfigError, InvalidArgumentError
from .hooks import PROJECT_NAME, settings_hook

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENV_PREFIX",
    "PROJECT_NAME",
    "LaunchEnvironment",
    "MetraleSettings",
    "PluginModel",
    "PluginSettings",
    "Size",
    "backend_entry_points",
    "installed_plugin_settings",
    "is_size",
]

_log = logging.getLogger("metrale.settings")

#: The prefix of every variable metrale reads.
ENV_PREFIX: Final = "METRALE_"
#: The entry-point group every backend registers in, the bundled ones too.
ENTRY_POINT_GROUP: Final = "metrale.backends"

_SIZE_RE: Final = re.compile(r"^\s*(0[xX][0-9a-fA-F]+|-?\d+)\s*([kmg]i?b|b)?\s*$", re.IGNORECASE)
_UNITS: Final = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_NOT_A_NAME: Final = re.compile(r"[^0-9a-z_]")
_DOCS: Final = "docs/settings.md lists every setting"


def _parse_int(value: Any, *, sizes: bool) -> Any:
    """Decimal or ``0x`` hex integers; with ``sizes``, also ``KiB``/``MiB``/``GiB``."""
    if isinstance(value, bool):
        raise ValueError("expected an integer, not a boolean")
    if not isinstance(value, str):
        return value
    match = _SIZE_RE.match(value)
    if match is None:
        expected = "an integer (decimal or 0x hex)"
        if sizes:
            expected += ", optionally with KiB, MiB or GiB"
        raise ValueError(f"expected {expected}")
    digits, unit = match.group(1), match.group(2)
    number = int(digits, 16) if digits.lower().startswith("0x") else int(digits)
    if unit is not None:
        if not sizes:
            raise ValueError("expected a plain integer; units are for sizes only")
        key = unit.lower()
        if key not in _UNITS:
            raise ValueError(f"unknown unit {unit!r}: use KiB, MiB or GiB")
        number *= _UNITS[key]
    return number


def _size(value: Any) -> Any:
    return _parse_int(value, sizes=True)


_SIZE_VALIDATOR: Final = BeforeValidator(_size)

#: The type of a setting that is a size in bytes: an ``int`` written in decimal or
#: ``0x`` hex, optionally with ``KiB``/``MiB``/``GiB`` (``"2 GiB"``, ``"0x10 KiB"``).
Size: TypeAlias = Annotated[int, _SIZE_VALIDATOR]


def is_size(field: FieldInfo) -> bool:
    """Whether a settings field is declared with [`Size`][metrale_core.plugin.Size] (the settings table marks it)."""
    return any(item is _SIZE_VALIDATOR for item in field.metadata)


def _holds_int(field: FieldInfo) -> bool:
    """Whether a field's type is ``int`` or ``int | None``."""
    annotation = field.annotation
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    return annotation is int or set(options) == {int, type(None)}


def _is_integer(field: FieldInfo) -> bool:
    """Whether a field is a plain integer, ``int`` or ``int | None``, that parses no text of its own (no
    validator in its annotation, as [`Size`][metrale_core.plugin.Size] has): those take decimal or ``0x`` hex."""
    return _holds_int(field) and not any(isinstance(item, _OWN_PARSERS) for item in field.metadata)


#: Validators in a field's annotation that read its input themselves ([`Size`][metrale_core.plugin.Size]'s among them).
_OWN_PARSERS: Final = (BeforeValidator, PlainValidator, WrapValidator)


def _integers(model: type[BaseSettings], value: Any, info: pydantic.ValidationInfo) -> Any:
    """Every plain integer field of a settings model, the core's and a plugin's, reads as
    [`Size`][metrale_core.plugin.Size] does without the units: decimal or ``0x`` hex, no ``bool`` (a size parses itself,
    with its units)."""
    field = model.model_fields.get(info.field_name or "")
    if field is None or value is None or not _is_integer(field):
        return value
    return _parse_int(value, sizes=False)


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
            raise _config_error(_problems(exc, type(self), prefix, "", values)) from exc
        except Exception as exc:  # a plugin's validator may fail in any way
            raise ConfigError(
                f"the settings model {type(self).__qualname__} failed to validate: {type(exc).__name__}: {exc}; "
                f"fix the plugin that declares it"
            ) from exc

    @field_validator("*", mode="before")
    @classmethod
    def _plain_integers(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        return _integers(cls, value, info)


_P = TypeVar("_P", bound=PluginSettings)


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

    def get(self) -> tuple[PluginModel, ...]:
        key, by_name = _ENTRY_POINTS.get()
        with self._lock:
            if self._loading:
                return ()
            if key != self._key:
                self._loading = True
                try:
                    self._models = _load_models(by_name)
                finally:
                    self._loading = False
                self._key = key
            return self._models


def _load_models(by_name: Mapping[str, tuple[importlib.metadata.EntryPoint, ...]]) -> tuple[PluginModel, ...]:
    taken = set(MetraleSettings.model_fields)
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


def installed_plugin_settings() -> tuple[PluginModel, ...]:
    """The settings models of the installed plugins, by name (cached while the entry points stay the same)."""
    return _INSTALLED.get()


class LaunchEnvironment(BaseSettings):
    """What the engine that started this process says of it: the variables torchrun (``torch.distributed``),
    Ray's and Dask's launchers, MPI wrappers and SLURM scripts set, read as they name them (no ``METRALE_``
    prefix). Every field is ``None`` where its variable is unset. metrale reads them, never sets them, and
    needs none of those engines.
    """

    model_config: ClassVar[SettingsConfigDict] = SettingsConfigDict(
        env_prefix="", env_ignore_empty=True, extra="ignore", frozen=True,
    )

    rank: int | None = Field(None, ge=0, description="The process's rank in the whole job (torchrun's `RANK`).")
    local_rank: int | None = Field(None, ge=0, description="The process's rank on this host (torchrun's `LOCAL_RANK`).")
    world_size: int | None = Field(None, ge=1, description="The processes in the job (torchrun's `WORLD_SIZE`).")
    local_world_size: int | None = Field(None, ge=1, description="The processes on this host.")
    cuda_visible_devices: str | None = Field(
        None, description="The devices the CUDA driver shows this process, renumbered from 0 (the driver reads it)."
    )


class MetraleSettings(BaseSettings):
    """Every setting of metrale, read from ``METRALE_*`` environment variables.

    Construct it once and pass it down: nothing else in metrale reads the
    environment. Keyword arguments override the environment. An empty
    variable counts as unset. Every integer setting (a plugin's too) may be
    written in decimal or ``0x`` hex, never as a ``bool``; sizes (``redzone``
    and every ``*_bytes`` field) also accept ``KiB``/``MiB``/``GiB``,
    case-insensitive, with or without a space. A bad value raises
    [`ConfigError`][metrale_core.ConfigError] naming the variable or keyword, the
    value as written and what is allowed; nothing else escapes.

    The settings of installed plugins (``fake_memory_bytes``, from
    ``METRALE_FAKE_MEMORY_BYTES``) are keywords and attributes too, validated
    here; a plugin reads its own with [`plugin`][metrale_core.MetraleSettings.plugin].
    """

    model_config: ClassVar[SettingsConfigDict] = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,
        extra="forbid",
        frozen=True,
        validate_default=True,
    )

    backend: str = Field(
        "auto",
        description="The backend `open_backend()` opens when no name is given: a backend's name, or `auto`: of "
        "the backends available here, the one whose registration declares the highest `preference` (a GPU "
        "backend outranks an in-memory one; a tie goes to the name first in alphabetical order).",
    )
    debug_sync_kernels: bool = Field(
        False,
        description="Synchronize the stream after every kernel launch made outside a capture, so a kernel's fault is "
        "raised by the launch that caused it, naming it; costs a synchronization per launch.",
    )
    redzone: Size = Field(
        0, ge=0,
        description="Bytes of the guard band after each `alloc` buffer; `0` turns red zones off.",
    )
    redzone_min_idx: int = Field(
        0, ge=0, description="Only allocations with a creation index at least this get red zones."
    )
    redzone_fill: int = Field(0xA5, ge=0, le=255, description="The byte red zones are filled with, 0..255.")
    redzone_lead: bool = Field(
        False,
        description="Also guard the front of each zoned allocation; the leading zone is `redzone` rounded up to a "
        "multiple of 256 bytes, so the pointer stays aligned.",
    )
    redzone_trace_idx: int | None = Field(
        None, ge=0, description="Log the full stack of the allocation with this creation index."
    )
    redzone_action: Literal["warn", "raise"] = Field(
        "warn",
        description="What a red-zone violation does: `warn` logs a WARNING on the `metrale` logger, `raise` raises "
        "`RedZoneError` from the call that found it (a scan, a free, a graph launch; never `close()`).",
    )
    redzone_scan_graphs: bool = Field(
        False,
        description="Scan every live red zone after each graph launch (it waits for the device), so an overrun "
        "is reported by the launch of the graph that made it.",
    )
    redzone_quarantine_bytes: Size = Field(
        256 << 20, ge=0,
        description="With red zones on, `free` takes the record off the ledger at once but keeps the memory, its "
        "zones still watched, until a batch of freed buffers is checked and released together: when the "
        "quarantine holds more than this many bytes (zones included) or more than 1,024 buffers, at "
        "`scan_redzones()`, `sweep_unreleased()`, an allocation that runs out of memory, and `close()`. A block "
        "whose zones the check found intact is kept, within the same bound, for the next allocation of its size, "
        "which then needs neither the driver nor a fill. `0` checks and releases each buffer in its own `free`.",
    )
    redzone_sample: int = Field(
        1, ge=1, le=1 << 30,
        description="Give red zones to one allocation in N (those whose creation index is a multiple of N, so a run "
        "is reproducible); `1` zones every allocation.",
    )
    redzone_scan_queued: bool = Field(
        False,
        description="With `redzone_scan_graphs`, queue the scan on the graph's stream behind the graph instead of "
        "waiting for it: the launch returns at once, and the scan's result is reported by the next graph launch "
        "that finds it done, or by the next `synchronize()`, `Stream.synchronize()` or `Event.synchronize()`.",
    )
    kernel_timing: bool = Field(
        False,
        description="Time every kernel launch made outside a capture with a pair of events; `run_metrics()` turns "
        "them into GPU milliseconds per kernel.",
    )
    memory_history: int = Field(
        0, ge=0, le=10_000_000,
        description="Keep the last N allocation events (alloc, free, sweep) on the ledger for `save_snapshot()` "
        "and `metrale report`, 0..10,000,000; `0` (the default) keeps none.",
    )
    oom_retries: int = Field(
        3, ge=0, le=100,
        description="How many times an allocation that ran out of memory is tried again after an "
        "`on_out_of_memory` callback says it freed memory, 0..100.",
    )
    oom_snapshot_dir: Path | None = Field(
        None,
        description="On an out-of-memory error, save a memory snapshot in this folder (created if missing) "
        "and name the file in the error.",
    )
    target_hw: str = Field(
        "",
        description="A value starting with `strix` (any case) selects the scale variant: `stream_is_capturing` "
        "answers from metrale's own record and never asks the driver.",
    )

    _plugins: dict[str, PluginSettings] = PrivateAttr(default_factory=dict)
    _launch: LaunchEnvironment | None = PrivateAttr(default=None)

    def __init__(self, **values: Any) -> None:
        installed = installed_plugin_settings()
        owners = {p.keyword(field): (p.name, field) for p in installed for field in p.model.model_fields}
        ours: dict[str, Any] = {}
        theirs: dict[str, dict[str, Any]] = {p.name: {} for p in installed}
        for key, value in values.items():
            if key in owners:
                plugin, field = owners[key]
                theirs[plugin][field] = value
            else:
                ours[key] = value
        problems: list[str] = []
        try:
            super().__init__(**ours)
        except pydantic.ValidationError as exc:
            problems += _problems(exc, type(self), ENV_PREFIX, "", ours, [*type(self).model_fields, *owners])
        built: dict[str, PluginSettings] = {}
        for p in installed:
            try:
                built[p.name] = p.model(**theirs[p.name])
            except ConfigError as err:
                if not isinstance(err.__cause__, pydantic.ValidationError):
                    raise ConfigError(f"plugin {p.name} ({p.distribution}): {err}") from None
                problems += _problems(err.__cause__, p.model, p.env_prefix, p.keyword(""), theirs[p.name])
        if problems:
            raise _config_error(problems)
        self._plugins = built
        _warn_unknown_variables(installed)

    def updated(self, **changes: Any) -> MetraleSettings:
        """A copy with ``changes`` applied and validated (unlike pydantic's ``model_copy``).

        A bad value raises [`ConfigError`][metrale_core.ConfigError] naming the field.
        """
        return type(self)(**{**self.model_dump(), **changes})

    def plugin(self, model: type[_P]) -> _P:
        """The validated settings of the plugin whose ``metrale_settings`` hook returns ``model``.

        A model no installed plugin declares (a plugin used without its entry
        point) is read from the environment alone, without keywords.
        """
        if not (isinstance(model, type) and issubclass(model, PluginSettings)):
            raise InvalidArgumentError(f"plugin: model must be a PluginSettings subclass, got {model!r}")
        for instance in self._plugins.values():
            if type(instance) is model:
                return instance
        _log.debug("%s is no installed plugin's settings model; read from the environment", model.__qualname__)
        return model()

    @field_validator("*", mode="before")
    @classmethod
    def _plain_integers(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        return _integers(cls, value, info)

    @model_serializer(mode="wrap")
    def _with_plugins(self, handler: pydantic.SerializerFunctionWrapHandler,
                      info: pydantic.SerializationInfo) -> dict[str, Any]:
        data: dict[str, Any] = dict(handler(self))
        for name, instance in self._plugins.items():
            dumped = instance.model_dump(
                mode=info.mode, exclude_unset=info.exclude_unset, exclude_defaults=info.exclude_defaults,
                exclude_none=info.exclude_none, round_trip=info.round_trip,
            )
            for field, value in dumped.items():
                key = f"{name}_{field}"
                if (info.include is None or key in info.include) and (info.exclude is None or key not in info.exclude):
                    data[key] = value
        return data

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        yield from super().__repr_args__()
        for name, instance in self._plugins.items():
            for field in type(instance).model_fields:
                yield f"{name}_{field}", getattr(instance, field)

    if not TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                if name.startswith("_"):
                    raise
            for plugin, instance in self._plugins.items():
                field = name.removeprefix(f"{plugin}_")
                if field != name and field in type(instance).model_fields:
                    return getattr(instance, field)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def launch(self) -> LaunchEnvironment:
        """The engine's variables (`LaunchEnvironment`: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``…), read
        the first time they are asked for. A bad value (``RANK=first``) is a
        [`ConfigError`][metrale_core.ConfigError] naming the variable."""
        if self._launch is None:
            try:
                self._launch = LaunchEnvironment()
            except pydantic.ValidationError as exc:
                raise _config_error(_problems(exc, LaunchEnvironment, "", "", {})) from None
        return self._launch

    @property
    def scale_variant(self) -> bool:
        """Whether ``target_hw`` selects the scale variant (AMD APUs through a CUDA layer)."""
        return self.target_hw.lower().startswith("strix")


def _warn_unknown_variables(installed: Iterable[PluginModel]) -> None:
    """One WARNING per ``METRALE_*`` variable that names no setting (a typo is otherwise silent)."""
    known = {ENV_PREFIX + name.upper() for name in MetraleSettings.model_fields}
    for p in installed:
        known |= {p.env_prefix + field.upper() for field in p.model.model_fields}
    for variable in sorted(os.environ):
        if variable.startswith(ENV_PREFIX) and variable not in known:
            import difflib  # only where there is a misspelt variable to name

            close = difflib.get_close_matches(variable, sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            _log.warning("%s is not a metrale setting and is ignored%s", variable, hint)


def _problems(
    exc: pydantic.ValidationError, model: type[BaseSettings], env_prefix: str, keyword_prefix: str,
    keywords: Mapping[str, Any], known: Iterable[str] = (),
) -> list[str]:
    """Each error of ``exc`` as ``source=value: reason``, the source a keyword or a variable, the value as
    the user wrote it, the reason in metrale's words (what is allowed). ``known`` names every keyword, for
    a misspelt one's suggestion (default: the model's fields)."""
    problems = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else "?"
        parsed = err.get("input")
        if field in keywords:
            source, written = f"keyword {keyword_prefix}{field}=", keywords[field]
        else:
            variable = f"{env_prefix}{field.upper()}"
            source, written = f"{variable}=", os.environ.get(variable) or parsed
        reason = _reason(err, model.model_fields.get(field), written, known or model.model_fields)
        problems.append(f"{source}{written!r}: {reason}")
    return problems


_BOUNDS: Final = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})
_BOOLEANS: Final = "a boolean: 1 or 0, true or false, yes or no, on or off (any case)"


def _reason(err: pydantic_core.ErrorDetails, field: FieldInfo | None, written: object, known: Iterable[str]) -> str:
    """Why a value was refused, as ``expected ...`` like metrale's own parsing says it."""
    kind, parsed = err["type"], err.get("input")
    if kind in _BOUNDS and field is not None:
        got = "" if str(parsed) == str(written) else f", got {parsed!r}"
        return f"expected {_allowed(field)}{got}"
    if kind in ("bool_parsing", "bool_type"):
        return f"expected {_BOOLEANS}"
    if kind == "extra_forbidden":
        import difflib

        close = difflib.get_close_matches(str(err["loc"][0]) if err["loc"] else "", sorted(known), n=1)
        return "no such setting" + (f" (did you mean {close[0]}?)" if close else "")
    if kind == "path_type":
        return "expected a path (text)"
    if kind == "string_pattern_mismatch":
        return f"expected text matching the pattern {(err.get('ctx') or {}).get('pattern')!r}"
    message = str(err["msg"]).removeprefix("Value error, ")
    if message.startswith("Input should be "):
        return "expected " + message.removeprefix("Input should be ")
    return message


def _allowed(field: FieldInfo) -> str:
    """The values a bounded field allows, in words: ``an integer from 0 to 100``, ``a size in bytes of at least 1``."""
    low: Any = None
    high: Any = None
    strict_low = strict_high = False
    for item in field.metadata:
        if isinstance(item, annotated_types.Ge):
            low = item.ge
        elif isinstance(item, annotated_types.Gt):
            low, strict_low = item.gt, True
        elif isinstance(item, annotated_types.Le):
            high = item.le
        elif isinstance(item, annotated_types.Lt):
            high, strict_high = item.lt, True
    whole = _holds_int(field)
    if whole:  # bounds of an integer are inclusive: > 0 is >= 1
        low = low + 1 if strict_low and low is not None else low
        high = high - 1 if strict_high and high is not None else high
        strict_low = strict_high = False
    what = "a size in bytes" if is_size(field) else "an integer" if whole else "a number"
    if low is not None and high is not None and not (strict_low or strict_high):
        return f"{what} from {low} to {high}"
    limits = []
    if low is not None:
        limits.append(f"greater than {low}" if strict_low else f"of at least {low}")
    if high is not None:
        limits.append(f"less than {high}" if strict_high else f"of at most {high}")
    return f"{what} {' and '.join(limits)}" if limits else what


def _config_error(problems: list[str]) -> ConfigError:
    first = problems[0] if problems else "?"
    more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
    return ConfigError(f"invalid setting {first}{more}; fix or unset it ({_DOCS})")
