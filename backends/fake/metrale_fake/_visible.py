"""Which fake devices a process sees: ``CUDA_VISIBLE_DEVICES`` read as the CUDA driver reads it.

- Each entry is a device's index (``1``) or its UUID, whole or a unique prefix (``FAKE-8d87aab1``), as the
  driver takes ``GPU-…``; the process numbers the devices listed from 0, in the order listed.
- The first entry that names no device (out of range, listed twice, unknown, ``MIG-…``) ends the list, as the
  driver stops there: the entries before it stay shown.
- Unset: every device, in order. Empty: none.
"""

from __future__ import annotations

import logging
import uuid

__all__ = ["fake_uuid", "visible_devices"]

_log = logging.getLogger("metrale")


def fake_uuid(index: int) -> str:
    """The UUID of fake device ``index`` (its index among all, not among those shown), written as
    ``nvidia-smi -L`` writes a GPU's: ``FAKE-`` and the UUID. The same in every process, as a GPU's is."""
    return f"FAKE-{uuid.uuid5(uuid.NAMESPACE_OID, f'metrale-fake:{index}')}"


def _index(entry: str, count: int) -> int | None:
    """The device an entry names, or ``None``."""
    try:
        n = int(entry, 10)
    except ValueError:
        pass
    else:
        return n if 0 <= n < count else None
    if entry.startswith("FAKE-") and len(entry) > len("FAKE-"):
        found = [i for i in range(count) if fake_uuid(i).startswith(entry)]
        return found[0] if len(found) == 1 else None
    return None


def visible_devices(spec: str | None, count: int) -> tuple[int, ...]:
    """The indexes of the fake devices shown, in the order the process numbers them (its ordinals)."""
    if spec is None:
        return tuple(range(count))
    shown: list[int] = []
    for entry in (e.strip() for e in spec.split(",")):
        index = _index(entry, count) if entry else None
        if index is None or index in shown:
            if entry or spec.strip():
                _log.debug("fake: CUDA_VISIBLE_DEVICES=%r stops at %r (it names no other fake device of %d), as "
                           "the driver stops", spec, entry, count)
            break
        shown.append(index)
    return tuple(shown)
