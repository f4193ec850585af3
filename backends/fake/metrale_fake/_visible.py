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

_STRTOUL = re.compile(r"[+-]?\d+")
_UUID_PREFIX = "FAKE-"


def fake_uuid(index: int) -> str:
    """The UUID of fake device ``index`` (its index among all, not among those shown), written as
    ``nvidia-smi -L`` writes a GPU's: ``FAKE-`` and the UUID. The same in every process, as a GPU's is."""
    return f"{_UUID_PREFIX}{uuid.uuid5(uuid.NAMESPACE_OID, f'metrale-fake:{index}')}"


def _strtoul(entry: str) -> int:
    """The number an entry starts with, as ``strtoul`` reads it; -1 where it starts with none."""
    found = _STRTOUL.match(entry.strip())
    return int(found.group()) if found else -1


def _by_uuid(entry: str, count: int) -> int | None:
    """The device whose UUID ``entry`` is, whole or a unique prefix; ``None``: no device, or several."""
    if not entry.startswith(_UUID_PREFIX) or len(entry) == len(_UUID_PREFIX):
        return None
    found = [i for i in range(count) if fake_uuid(i).startswith(entry)]
    return found[0] if len(found) == 1 else None


def visible_devices(spec: str | None, count: int) -> tuple[int, ...]:
    """The indexes of the fake devices shown (of ``count``), in the order the process numbers them (its ordinals)."""
    if spec is None:
        return tuple(range(count))
    entries = spec.split(",")
    shown: list[int] = []
    by_uuid = spec.strip().startswith(_UUID_PREFIX)
    for entry in entries:
        index = _by_uuid(entry.strip(), count) if by_uuid else _strtoul(entry)
        if index is None or not 0 <= index < count:
            break
        if index in shown:  # a device listed twice: the driver shows none
            return ()
        shown.append(index)
    return tuple(shown)
