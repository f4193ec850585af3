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

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import pydantic
from pydantic import Field, PrivateAttr, field_validator, model_serializer
from pydantic_settings import BaseSettings, SettingsConfigDict

from .._errors import ConfigError, InvalidArgumentError
from .parsing import Packages, Size, config_error, plain_integers, problems
from .plugins import ENV_PREFIX, PluginModel, PluginSettings, installed_models

__all__ = ["LaunchEnvironment", "MetraleSettings", "installed_plugin_settings"]

_log = logging.getLogger("metrale.settings")

_P = TypeVar("_P", bound=PluginSettings)


def installed_plugin_settings() -> tuple[PluginModel, ...]:
    """The settings models of the installed plugins, by name (cached while the entry points stay the same)."""
    return installed_models(MetraleSettings.model_fields)


class LaunchEnvironment(BaseSettings):
    """What the engine that started this process says of it: the variables torchrun (``torch.distributed``),
    Ray's and Dask's launchers, MPI wrappers and SLURM scripts set, read as they name them (no ``METRALE_``
    prefix). Every field is ``None`` where its variable is unset. metrale reads them, never sets them, and
    needs none of those engines. Keyword arguments override the variables. As in
    [`MetraleSettings`][metrale_core.MetraleSettings], an integer is decimal or ``0x`` hex, never a ``bool``, and a
    bad value, a keyword's or a variable's, or an unknown keyword raises [`ConfigError`][metrale_core.ConfigError]
    naming it.
    """

    # Empty variables are read, not ignored: `CUDA_VISIBLE_DEVICES=""` shows no device (the validator below
    # reads an empty number as unset).
    model_config: ClassVar[SettingsConfigDict] = SettingsConfigDict(
        env_prefix="", env_ignore_empty=False, extra="forbid", frozen=True,
    )

    rank: int | None = Field(None, ge=0, description="The process's rank in the whole job (torchrun's `RANK`).")
    local_rank: int | None = Field(None, ge=0, description="The process's rank on this host (torchrun's `LOCAL_RANK`).")
    world_size: int | None = Field(None, ge=1, description="The processes in the job (torchrun's `WORLD_SIZE`).")
    local_world_size: int | None = Field(None, ge=1, description="The processes on this host.")
    cuda_visible_devices: str | None = Field(
        None, description="The devices the CUDA driver shows this process, renumbered from 0 (the driver reads it; "
        "the fake backend too). Empty: no device, as the driver reads it.",
    )
    slurm_localid: int | None = Field(
        None, ge=0, description="The task's rank on its node under Slurm (`srun`'s `SLURM_LOCALID`): the local rank "
        "where no `LOCAL_RANK` is set.",
    )
    metrale_worker: str | None = Field(
        None, min_length=1, description="The engine's name for this process (a Dask worker's address, a Ray actor's "
        "id), carried in every record's origin: metrale's Dask plugin and `open_for_actor` give it "
        "(`MetraleSettings.with_launch`); a launcher may set `METRALE_WORKER`.",
    )
    metrale_device_share: float | None = Field(
        None, gt=0, le=1, description="The part of its device the engine gave this process (Ray's fractional "
        "`num_gpus`): below 1, other processes share the device, as the origin and out-of-memory reports say. "
        "`open_for_actor` gives it; a launcher may set `METRALE_DEVICE_SHARE`.",
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except pydantic.ValidationError as exc:
            raise config_error(problems(exc, type(self), "", "", values)) from None

    @field_validator("*", mode="before")
    @classmethod
    def _plain_integers(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        if isinstance(value, str) and not value.strip() and info.field_name != "cuda_visible_devices":
            return None  # an empty variable is unset, but for the devices shown
        return plain_integers(cls, value, info)


def _read_alone(name: str, values: dict[str, Any]) -> Any:
    """Field ``name`` of `LaunchEnvironment` read from its variable alone (``values`` given, every other variable
    overridden as unset), so another's bad value does not stop it.

    :raises ConfigError: its own variable is bad.
    """
    others = {k: None for k in LaunchEnvironment.model_fields if k != name}
    return getattr(LaunchEnvironment(**(others | values)), name)


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
    pure: bool = Field(
        False,
        description="Run the pure-Python modules even where their compiled twins were built (the reference, and "
        "what a differential test compares the twins with). `metrale --version` says which code runs.",
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
        "`RedZoneError` from the call that found it: `scan_redzones()`, a graph launch, `sweep_unreleased()`, an "
        "arena's `reset()` or `close()`, or the `free` whose buffer pushed the quarantine past "
        "`redzone_quarantine_bytes` and so checked its batch of freed buffers (each `free` when that is `0`); "
        "never the backend's `close()`, nor an allocation that ran out of memory (both log it).",
    )
    redzone_scan_graphs: bool = Field(
        False,
        description="Check the red zones around every graph launch (inside the captured graph where the backend "
        "can, else by a scan after each launch), so an overrun is reported by the launch of the graph that made "
        "it. Off, zones are checked only when the quarantine of freed buffers is checked (see "
        "`redzone_quarantine_bytes`), at `scan_redzones()` and at `close()`.",
    )
    redzone_quarantine_bytes: Size = Field(
        256 << 20, ge=0,
        description="With red zones on, `free` takes the record off the ledger at once but keeps the memory, its "
        "zones still watched, until a batch of freed buffers is checked and released together: when the "
        "quarantine holds more than this many bytes (zones included) or more than 1,024 buffers, at "
        "`scan_redzones()`, `sweep_unreleased()`, an allocation that runs out of memory, and `close()`. A block "
        "whose zones the check found intact is kept, within the same bound, for the next allocation of its size, "
        "which then needs no driver allocation, only the fill of its zones. `0` checks and releases each buffer "
        "in its own `free`.",
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
    redzone_arena: bool = Field(
        False,
        description="Give red zones to the pieces of every `Arena` too, laid out as `alloc`'s (`redzone_lead` and "
        "`redzone_sample` apply): filled on the default stream at `Arena.alloc`, judged at the arena's `reset()` "
        "and `close()` (which then wait for the device, and are refused while a capture runs) and by every full "
        "check meanwhile. A piece made while a capture runs gets none (no fill may be issued then).",
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
    memory_history_frames: int = Field(
        0, ge=0, le=64,
        description="With `memory_history`, keep up to N frames of each allocation's stack in its event (the first "
        "frame outside metrale and `site_skip` first, which is the call site unless a `stacklevel` named one of "
        "its callers; then its callers, metrale's and `site_skip`'s frames passed over), 0..64: snapshots carry "
        "them, and `metrale report --torch-snapshot` writes them as the allocation's frames. A walk of the "
        "caller's frames per allocation: a cost for debugging runs. `0` (the default) keeps the call site only.",
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
    site_skip: Packages = Field(
        ("torch", "transformers", "accelerate", "triton", "cupy", "cupyx"),
        description="Packages (`torch`) or modules and their submodules (`myapp.gpu`) whose frames an "
        "allocation's call site passes over, comma-separated (`none`: none): the site is the first frame outside "
        "them and outside metrale, as `warnings.warn`'s `skip_file_prefixes` skips. The default names the "
        "frameworks whose tensors the allocator doors serve, so a tensor's site is the application's line; add "
        "your own helper modules to have their callers named instead.",
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
        found: list[str] = []
        try:
            super().__init__(**ours)
        except pydantic.ValidationError as exc:
            found += problems(exc, type(self), ENV_PREFIX, "", ours, [*type(self).model_fields, *owners])
        built: dict[str, PluginSettings] = {}
        for p in installed:
            try:
                built[p.name] = p.model(**theirs[p.name])
            except ConfigError as err:
                if not isinstance(err.__cause__, pydantic.ValidationError):
                    raise ConfigError(f"plugin {p.name} ({p.distribution}): {err}") from None
                found += problems(err.__cause__, p.model, p.env_prefix, p.keyword(""), theirs[p.name])
        if found:
            raise config_error(found)
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
        return plain_integers(cls, value, info)

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
            self._launch = LaunchEnvironment()
        return self._launch

    @property
    def visible_devices(self) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` (`launch`'s), read even where another of the engine's variables is bad
        (``LOCAL_RANK=-1`` stops a placement, not a plain open): what a backend that numbers its devices as the
        driver does (the fake) reads."""
        try:
            return self.launch.cuda_visible_devices
        except ConfigError:
            return _read_alone("cuda_visible_devices", {})  # type: ignore[no-any-return]

    def with_launch(self, **values: Any) -> MetraleSettings:
        """These settings with the engine's variables of `launch` overridden by ``values`` (keywords of
        [`LaunchEnvironment`][metrale_core.LaunchEnvironment]: ``metrale_worker="tcp://10.0.0.2:4242"``); the
        rest still read from the environment. What an engine's glue (the Dask plugin, ``open_for_actor``) hands
        [`open_backend`][metrale_core.open_backend], so the origin names the worker; these settings are unchanged.

        A bad variable the values leave to the environment (``LOCAL_RANK=-1``) is logged at WARNING and read as
        unset, as a plain open reads it: it stops a placement, not this.

        :raises ConfigError: a value is bad, or names no variable.
        """
        if self._launch is not None:
            values = {name: getattr(self._launch, name) for name in self._launch.model_fields_set} | values
        unset = dict.fromkeys(LaunchEnvironment.model_fields)
        LaunchEnvironment(**(unset | values))  # the values alone: a bad one raises here
        try:
            launch = LaunchEnvironment(**values)
        except ConfigError as exc:  # a variable's: each read alone, the bad ones as unset
            _log.warning("with_launch: %s (read as unset)", exc)
            read: dict[str, Any] = {}
            for name in unset.keys() - values.keys():
                try:
                    read[name] = _read_alone(name, values)
                except ConfigError:
                    read[name] = None
            launch = LaunchEnvironment(**(unset | read | values))
        copy = self.model_copy()
        copy._launch = launch
        return copy

    @property
    def scale_variant(self) -> bool:
        """Whether ``target_hw`` selects the scale variant (AMD APUs through a CUDA layer)."""
        return self.target_hw.lower().startswith("strix")


def _warn_unknown_variables(installed: Iterable[PluginModel]) -> None:
    """One WARNING per ``METRALE_*`` variable that names no setting (a typo is otherwise silent)."""
    known = {ENV_PREFIX + name.upper() for name in MetraleSettings.model_fields}
    known |= {name.upper() for name in LaunchEnvironment.model_fields if name.upper().startswith(ENV_PREFIX)}
    for p in installed:
        known |= {p.env_prefix + field.upper() for field in p.model.model_fields}
    for variable in sorted(os.environ):
        if variable.startswith(ENV_PREFIX) and variable not in known:
            import difflib  # only where there is a misspelt variable to name

            close = difflib.get_close_matches(variable, sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            _log.warning("%s is not a metrale setting and is ignored%s", variable, hint)
