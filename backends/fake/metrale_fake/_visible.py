"""Which fake devices a process sees: ``CUDA_VISIBLE_DEVICES`` read as the CUDA driver reads it (the rules
PyTorch's ``_parse_visible_devices`` encodes for the driver), where the ``follow_visible_devices`` setting is on.

- A list of indexes (``1,0``): each entry read as C's ``strtoul`` reads it (``1gpu2`` is 1, whitespace around it
  ignored); a negative or unreadable entry, or one past the last device, ends the list, and the entries before it
  stay shown.
- A list of UUIDs (it starts with ``FAKE-``, as the driver's with ``GPU-``): each a device's UUID, whole or a unique
  prefix; an entry that is no UUID, or names no device, ends the list.
- A device listed twice shows no device at all.
- The process numbers the devices shown from 0, in the order listed. Unset: every device, in order. Empty: none.
"""

from __future__ import annotations

import re
import uuid

__all__ = ["fake_uuid", "visible_devices"]

_STRTOUL = re.compile(r"[+-]?\d+", re.ASCII)
_UUID_PREFIX = "FAKE-"


def fake_uuid(index: int) -> str:
    """The UUID of fake device ``index`` (its index among all, not among those shown), written as
    ``nvidia-smi -L`` writes a GPU's: ``FAKE-`` and the UUID. The same in every process, as a GPU's is."""
    return f"{_UUID_PREFIX}{uuid.uuid5(uuid.NAMESPACE_OID, f'metrale-fake:{index}')}"


def _strtoul(entry: str) -> int:
    """The number an entry starts with, as ``strtoul`` reads it; -1 where it starts with none (or is negative)."""
    found = _STRTOUL.match(entry.strip())
    if not found:
        return -1
    digits = found.group()
    if len(digits.lstrip("+-")) > 19:  # past any device (and past what int() reads at once)
        return 1 << 64
    return int(digits)


def _by_uuid(entry: str, count: int) -> int | None:
    """The device whose UUID ``entry`` is, whole or a unique prefix; ``None``: no device, or several."""
    if not entry.startswith(_UUID_PREFIX) or len(entry) == len(_UUID_PREFIX):
        return None
    found = [i for i in range(count) if fake_uuid(i).startswith(entry)]
    return found[0] if len(found) == 1 else None


def visible_devices(spec: str | None, count: int) -> tuple[int, ...]:
    """The indexes of the fake devices shown (of ``count``), in the order the process numbers them (its ordinals).

    As the driver: the list is read first (up to its first entry that is no number, or no UUID in a list of UUIDs),
    and an entry listed twice in it shows no device at all; then it is shown up to its first entry that names no
    device (past the last, or an unknown UUID)."""
    if spec is None:
        return tuple(range(count))
    listed: list[str] | list[int]
    if spec.strip().startswith(_UUID_PREFIX):
        names: list[str] = []
        for entry in (e.strip() for e in spec.split(",")):
            if entry in names:
                return ()
            if not entry.startswith(_UUID_PREFIX):
                break
            names.append(entry)
        found = [_by_uuid(name, count) for name in names]
        listed = [-1 if i is None else i for i in found]
    else:
        numbers: list[int] = []
        for entry in spec.split(","):
            n = _strtoul(entry)
            if n in numbers:
                return ()
            if n < 0:
                break
            numbers.append(n)
        listed = numbers
    shown: list[int] = []
    for index in listed:
        if not 0 <= index < count or index in shown:  # (two prefixes of one UUID: one device, listed twice)
            break
        shown.append(index)
    return tuple(shown)
