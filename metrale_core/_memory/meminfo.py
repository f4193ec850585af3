"""Honest free memory: the host's ``MemAvailable`` for integrated devices."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

__all__ = ["effective_free_bytes", "parse_mem_available", "read_mem_available"]

_log = logging.getLogger("metrale.memory")

MEMINFO: Final = Path("/proc/meminfo")


def parse_mem_available(text: str) -> int | None:
    """``MemAvailable`` in bytes from the text of ``/proc/meminfo``; ``None`` if absent."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            if len(fields) < 2 or not fields[1].isdigit():
                return None
            unit = fields[2].lower() if len(fields) > 2 else "kb"
            scale = 1024 if unit == "kb" else 1
            return int(fields[1]) * scale
    return None


def read_mem_available(path: Path = MEMINFO) -> int | None:
    """The host's ``MemAvailable`` in bytes; ``None`` where it cannot be read."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        _log.debug("cannot read %s: %s", path, exc)
        return None
    return parse_mem_available(text)


def effective_free_bytes(
    cu_free: int, mem_available: int | None, integrated: bool | None, total: int
) -> int:
    """The device memory an allocation can really have.

    On an integrated device (``integrated is True``) the driver's "free" is
    the kernel's MemFree, which page cache keeps low; the host's
    ``MemAvailable``, capped at the device's ``total``, is what can be had.
    Anywhere else, or when either query went unanswered (``None``), the
    device's own reading stands: an unanswered query never adds host memory.
    """
    if integrated is True and mem_available is not None:
        return min(mem_available, total)
    return cu_free
