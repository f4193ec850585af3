"""How a setting's text becomes its value, and how a refused value is told.

- `Size` and `is_size`: sizes in bytes, written in decimal or ``0x`` hex, with ``KiB``/``MiB``/``GiB``;
- `plain_integers`: every plain ``int`` field of a settings model reads decimal or ``0x`` hex;
- `problems` and `config_error`: each refused value as ``source=value: reason``, in one ``ConfigError``.

It knows no model's fields: a model passes its own in.
"""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Final, TypeAlias

import annotated_types
import pydantic
import pydantic_core
from pydantic import BeforeValidator, PlainValidator, WrapValidator
from pydantic_settings import BaseSettings, NoDecode

from .._errors import ConfigError

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

__all__ = ["Packages", "Size", "config_error", "is_size", "plain_integers", "problems"]

_SIZE_RE: Final = re.compile(r"^\s*(0[xX][0-9a-fA-F]+|-?\d+)\s*([kmg]i?b|b)?\s*$", re.IGNORECASE)
_UNITS: Final = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
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


_PACKAGE_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _packages(value: Any) -> Any:
    """Package or module names (``torch``, ``myapp.gpu``), comma-separated in a variable (``none``: none), or a
    sequence of them."""
    if isinstance(value, str):
        text = value.strip()
        value = [] if text.lower() == "none" else [p.strip() for p in text.split(",") if p.strip()]
    if isinstance(value, (list, tuple)):
        for name in value:
            if not (isinstance(name, str) and _PACKAGE_RE.fullmatch(name)):
                raise ValueError(f"expected package or module names (dotted Python identifiers), got {name!r}")
        return tuple(dict.fromkeys(value))
    return value


#: The type of a setting that names packages or modules: ``"torch,myapp.gpu"`` in a variable (``none`` for
#: none), a tuple of names in a keyword.
Packages: TypeAlias = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_packages)]


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


def plain_integers(model: type[BaseSettings], value: Any, info: pydantic.ValidationInfo) -> Any:
    """Every plain integer field of a settings model, the core's and a plugin's, reads as
    [`Size`][metrale_core.plugin.Size] does without the units: decimal or ``0x`` hex, no ``bool`` (a size parses itself,
    with its units)."""
    field = model.model_fields.get(info.field_name or "")
    if field is None or value is None or not _is_integer(field):
        return value
    return _parse_int(value, sizes=False)


def problems(
    exc: pydantic.ValidationError, model: type[BaseSettings], env_prefix: str, keyword_prefix: str,
    keywords: Mapping[str, Any], known: Iterable[str] = (),
) -> list[str]:
    """Each error of ``exc`` as ``source=value: reason``, the source a keyword or a variable, the value as
    the user wrote it, the reason in metrale's words (what is allowed). ``known`` names every keyword, for
    a misspelt one's suggestion (default: the model's fields)."""
    found = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else "?"
        parsed = err.get("input")
        if field in keywords:
            source, written = f"keyword {keyword_prefix}{field}=", keywords[field]
        else:
            variable = f"{env_prefix}{field.upper()}"
            source, written = f"{variable}=", os.environ.get(variable) or parsed
        reason = _reason(err, model.model_fields.get(field), written, known or model.model_fields)
        found.append(f"{source}{written!r}: {reason}")
    return found


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


def config_error(found: list[str]) -> ConfigError:
    first = found[0] if found else "?"
    more = f" (and {len(found) - 1} more: {'; '.join(found[1:])})" if len(found) > 1 else ""
    return ConfigError(f"invalid setting {first}{more}; fix or unset it ({_DOCS})")
