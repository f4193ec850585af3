"""The argument rules: what every public call accepts, decided in one place.

Each rule returns the value as the core uses it, or raises the typed error. Nothing
is changed before a rule has passed.

- `invalid_argument`: the error for an argument of the wrong kind.
- `positive_size`: a byte count (``alloc``, copies, memsets, host buffers).
- `integer`: an ``int`` with a lower bound (offsets, shared memory).
- `dims`: a launch's grid or block, as three dimensions within limits.
- `shape`: a view's shape, as a tuple of counts.
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from typing import Final

from .._errors import InvalidArgumentError, InvalidBufferError
from .._types import WORD_LIMIT, as_index

__all__ = ["MAX_DIMS", "dims", "integer", "invalid_argument", "positive_size", "shape"]

#: The most dimensions a view may have (numpy's limit; CuPy's and PyTorch's are the same or lower).
MAX_DIMS: Final = 64


def invalid_argument(what: str, expected: str, got: object) -> InvalidArgumentError:
    """The error for an argument of the wrong kind: what was expected, and what was given."""
    return InvalidArgumentError(f"{what}: expected {expected}, got {got!r}")


def positive_size(nbytes: object, what: str) -> int:
    """``nbytes`` as a positive ``int`` that fits 64 bits, or the typed error.

    - Not a positive integer: ``InvalidBufferError``, before any backend sees it.
    - Past CUDA's 64-bit ``size_t``: ``InvalidArgumentError``.
    - A size that fits but cannot be had is the backend's ``OutOfMemoryError``.
    """
    n = as_index(nbytes)
    if n is None or n <= 0:
        raise InvalidBufferError(f"{what}: nbytes must be a positive integer, got {nbytes!r}")
    if n >= WORD_LIMIT:
        raise InvalidArgumentError(
            f"{what}: {n} bytes do not fit 64 bits (CUDA's size_t); no device or host can hold them: ask for less"
        )
    return n


def integer(value: object, what: str, name: str, *, minimum: int = 0) -> int:
    """``value`` as an ``int`` of at least ``minimum``, or the typed error naming ``name``."""
    number = as_index(value)
    if number is None:
        raise invalid_argument(what, f"an integer {name}", value)
    if number < minimum:
        raise InvalidArgumentError(f"{what}: {name} must be at least {minimum}, got {number}")
    return number


def flag(value: object, what: str, name: str) -> bool:
    """``value`` where it is ``True`` or ``False`` (not a number that reads as one), or the typed error naming
    ``name``."""
    if type(value) is not bool:
        raise invalid_argument(what, f"True or False for {name}", value)
    return value


def dims(value: object, name: str, limits: tuple[int, int, int]) -> tuple[int, int, int]:
    """A launch's ``grid`` or ``block`` (``name``): an int or 1 to 3 ints, each from 1 to its limit."""
    if type(value) is int and 1 <= value <= limits[0]:  # the hot path: one dimension
        return value, 1, 1
    parts = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(parts, str | bytes) or not isinstance(parts, Sequence) or not 1 <= len(parts) <= 3:
        raise InvalidArgumentError(f"launch: {name} must be an int or 1 to 3 ints, got {value!r}")
    out = []
    for d in parts:
        n = as_index(d)
        if n is None:
            raise InvalidArgumentError(f"launch: {name} must hold integers, got {value!r}")
        out.append(n)
    out += [1] * (3 - len(out))
    for n, limit in zip(out, limits, strict=True):
        if not 1 <= n <= limit:
            raise InvalidArgumentError(f"launch: {name} {tuple(out)} is outside 1..{limits} per dimension")
    return out[0], out[1], out[2]


def shape(value: object) -> tuple[int, ...]:
    """A view's shape as a tuple of counts, each >= 0.

    - Taken: an integer, or a sequence (not ``str``/``bytes``) of integers.
    - Integers are what ``operator.index`` takes (numpy's too), never ``bool``.
    - Refused: a float, a string, ``None``, a nested sequence.
    - Refused too: a set or a mapping (no order), an iterator (used up once read).
    """
    one = as_index(value)
    parts: list[int | None] = [None]
    if one is not None:
        parts = [one]
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray | memoryview):
        try:
            if len(value) <= MAX_DIMS:
                parts = [as_index(d) for d in value]
        except Exception:  # a sequence that fails to be read is no shape
            parts = [None]
    if any(d is None or d < 0 for d in parts):
        raise InvalidArgumentError(
            f"view: shape must be an integer or a tuple of integers >= 0 (at most {MAX_DIMS} of them), "
            f"got {reprlib.repr(value)}"
        )
    return tuple(d for d in parts if d is not None)
