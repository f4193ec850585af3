"""Stub of the compiled twin of the capture rule's check (``_capture.pyx``): the same interface."""

from typing import Final

from .capture import _Flag

#: Whether the flag's slots are read and written in place.
SLOTS: Final[bool]


def forbid_during_capture(what: str) -> None: ...
def leave_call(flag: _Flag) -> None: ...
