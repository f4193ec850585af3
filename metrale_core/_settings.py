"""``MetraleSettings``: the one place metrale reads the environment."""

from __future__ import annotations

import difflib
import logging
import os
import re
from pathlib import Path
from typing import Any, ClassVar, Final, Literal

import pydantic
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ._errors import ConfigError

__all__ = ["MetraleSettings"]

_log = logging.getLogger("metrale.settings")

ENV_PREFIX: Final = "METRALE_"

_SIZE_RE: Final = re.compile(r"^\s*(0[xX][0-9a-fA-F]+|-?\d+)\s*([kmg]i?b|b)?\s*$", re.IGNORECASE)
_UNITS: Final = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


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


class MetraleSettings(BaseSettings):
    """Every setting of metrale, read from ``METRALE_*`` environment variables.

    Construct it once and pass it down: nothing else in metrale reads the
    environment. Keyword arguments override the environment. An empty
    variable counts as unset. Integers may be written in decimal or ``0x``
    hex; sizes (``redzone`` and every ``*_bytes`` field) also accept
    ``KiB``/``MiB``/``GiB``, case-insensitive, with or without a space.
    A bad value raises :class:`~metrale_core.ConfigError` naming the variable.
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
        description="The backend `open_backend()` opens when no name is given: a backend's name, or `auto` (`cuda` "
        "when a CUDA driver and device answer, else `fake`).",
    )
    debug_sync_kernels: bool = Field(
        False,
        description="Synchronize the stream after every kernel launch made outside a capture, so a kernel's fault is "
        "raised by the launch that caused it, naming it; costs a synchronization per launch.",
    )
    redzone: int = Field(
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
        "and `metrale report`; `0` (the default) keeps none.",
    )
    oom_retries: int = Field(
        3, ge=0, le=100,
        description="How many times an allocation that ran out of memory is tried again after an "
        "`on_out_of_memory` callback says it freed memory.",
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
    fake_memory_bytes: int = Field(
        16 << 30, gt=0,
        description="The fake device's capacity; an allocation past it raises `OutOfMemoryError`.",
    )
    fake_integrated: bool = Field(
        False,
        description="The fake reports an integrated device, so `memory_info().effective_free` follows the host's "
        "`MemAvailable`.",
    )
    fake_compute_capability: str = Field(
        "9.0",
        pattern=r"^\d+\.\d+$",
        description="The compute capability the fake reports, `major.minor`; PTX images are checked against it.",
    )
    fake_defer: bool = Field(
        False,
        description="The fake runs stream work only when it must (a synchronize, a query, a pageable copy, "
        "a free), so a missing synchronization reads stale data as on a GPU.",
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except pydantic.ValidationError as exc:
            raise _config_error(exc, set(values)) from None
        _warn_unknown_variables()

    def updated(self, **changes: Any) -> MetraleSettings:
        """A copy with ``changes`` applied and validated (unlike pydantic's ``model_copy``).

        A bad value raises :class:`~metrale_core.ConfigError` naming the field.
        """
        return type(self)(**{**self.model_dump(), **changes})

    @field_validator("redzone", "redzone_min_idx", "redzone_fill", "fake_memory_bytes", mode="before")
    @classmethod
    def _sizes(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        return _parse_int(value, sizes=info.field_name in {"redzone", "fake_memory_bytes"})

    @field_validator("redzone_trace_idx", mode="before")
    @classmethod
    def _index(cls, value: Any) -> Any:
        return None if value is None else _parse_int(value, sizes=False)

    @property
    def scale_variant(self) -> bool:
        """Whether ``target_hw`` selects the scale variant (AMD APUs through a CUDA layer)."""
        return self.target_hw.lower().startswith("strix")


def _warn_unknown_variables() -> None:
    """One WARNING per ``METRALE_*`` variable that names no setting (a typo is otherwise silent)."""
    known = {ENV_PREFIX + name.upper() for name in MetraleSettings.model_fields}
    for variable in sorted(os.environ):
        if variable.startswith(ENV_PREFIX) and variable not in known:
            close = difflib.get_close_matches(variable, sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            _log.warning("%s is not a metrale setting and is ignored%s", variable, hint)


def _config_error(exc: pydantic.ValidationError, keywords: set[str]) -> ConfigError:
    problems = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else "?"
        variable = ENV_PREFIX + field.upper()
        source = f"keyword {field}=" if field in keywords else f"{variable}="
        reason = str(err["msg"]).removeprefix("Value error, ")
        problems.append(f"{source}{err.get('input')!r}: {reason}")
    first = problems[0] if problems else str(exc)
    more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
    return ConfigError(f"invalid setting {first}{more}; fix or unset it (docs/settings.md lists every setting)")
