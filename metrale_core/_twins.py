"""Compiled twins: the hot path's classes and functions, each written once and built with Cython as well as run as
Python (issue 53; docs/building.md).

- A twin is a module ``X.py`` compiled again as ``_X``, from the same file, with ``_X.pxd`` beside it (its C
  types, its methods called at C level): the same interface and behaviour, C-level fields and locks. Where the
  compiled code is a C ABI, not a faster copy of Python (the allocator doors' C functions), the twin is a
  hand-written ``_X.pyx``. The build compiles every twin where a C compiler is found, and installs the pure
  modules alone where none is.
- `pick` is how an owner chooses: the twin where it was built and the backend's ``pure`` setting is off
  (``METRALE_PURE=1``), else the pure class or function. Each backend chooses once, when it opens, so a
  differential test runs both in one process.
- `built` says which twins this installation has: ``metrale --version``, ``metrale info`` and ``metrale bench``
  print it.
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from typing import Final, TypeVar

__all__ = ["TWINS", "built", "describe", "older_than_source", "pick"]

#: Each twin: its name, and the module and the class or function that hold it (the pure one is its owner's to pass).
TWINS: Final = {
    "ledger": ("metrale_core._memory._ledger", "Ledger"),
    "stats": ("metrale_core._device._stats", "StatsCounter"),
    "gate": ("metrale_core._device._gate", "Gate"),
    "lane": ("metrale_core._memory._lane", "DeviceLane"),
    "stream_lane": ("metrale_core._streams._lane", "StreamLane"),
    "graph_lane": ("metrale_core._streams._graph_lane", "GraphLane"),
    "launch_lane": ("metrale_core._launch._lane", "LaunchLane"),
    "pack": ("metrale_core._launch._pack", "pack_args"),
    "handle": ("metrale_core._device._handle", "make"),  # DeviceBuffer._make's; other twins cimport make_buffer
    "arena": ("metrale_core._memory._bump", "Arena"),  # (the public Arena is arena.py's: bump.py as Python)
    "pool": ("metrale_core._memory._pool", "MemoryPool"),
    "pool_front": ("metrale_core._memory._pools", "PoolFront"),
    "zones": ("metrale_core._redzones._layout", "RedZones"),
    "quarantine": ("metrale_core._memory._quarantine", "Quarantine"),
    "site": ("metrale_core._memory._sites", "call_site"),
    "door": ("metrale_core.allocators._door", "Door"),
    "doorfuncs": ("metrale_core.allocators._doorfuncs", "c_functions"),  # the allocator doors' C functions
}

_T = TypeVar("_T")
_log = logging.getLogger("metrale")
_loaded: dict[str, object | None] = {}


def _load(name: str) -> object | None:
    """The compiled class or function of twin ``name``, or ``None`` where it was not built (loaded once)."""
    if name not in _loaded:
        module, attr = TWINS[name]
        try:
            _loaded[name] = getattr(importlib.import_module(module), attr)
        except ImportError:  # not built here: the pure code runs
            _loaded[name] = None
        except Exception as exc:  # a twin that fails as it loads: the pure code runs, and the log says why
            _log.warning("the compiled twin %s (%s) failed to load, the pure code runs: %s: %s", name, module,
                         type(exc).__name__, exc)
            _loaded[name] = None
    return _loaded[name]


def pick(name: str, reference: _T, pure: bool) -> _T:
    """The class or function to run for twin ``name``: its compiled twin where built and ``pure`` is off, else
    ``reference``, the pure class or function (the twin has the same interface: its stub and the differential
    tests hold it to that)."""
    twin = None if pure else _load(name)
    return reference if twin is None else twin  # type: ignore[return-value]


def built() -> dict[str, bool]:
    """Per twin, whether it was compiled for this installation."""
    return {name: _load(name) is not None for name in TWINS}


def older_than_source(module: str) -> bool:
    """Whether the loaded compiled ``module`` (``_X``) is older than its source beside it (``X.py``, or ``_X.pyx``
    where it is a C ABI), or than its ``_X.pxd``: an in-tree build not redone, which would run old code. ``False``
    where there is no such source (an installed wheel carries no ``.pyx``; an installed ``X.py`` is as old as the
    build beside it)."""
    built_at = Path(getattr(sys.modules.get(module), "__file__", None) or "")
    stem = built_at.name.partition(".")[0]
    try:
        made = built_at.stat().st_mtime
    except OSError:
        return False
    sources = (built_at.with_name(stem + ".pyx"), built_at.with_name(stem.removeprefix("_") + ".py"),
               built_at.with_name(stem + ".pxd"))
    for source in sources:
        try:
            if source.stat().st_mtime > made:
                return True
        except OSError:
            continue
    return False


def describe(pure: bool) -> str:
    """Which code a backend with this ``pure`` setting runs, in words: ``compiled twins: ledger``, or why pure."""
    if pure:
        return "pure Python (the setting pure, METRALE_PURE=1)"
    names = [name for name, ok in built().items() if ok]
    if not names:
        return "pure Python (no compiled twins were built here: the install found no C compiler or no Cython)"
    stale = [name for name in names if older_than_source(TWINS[name][0])]
    note = f"; STALE, older than their source: {', '.join(stale)} (reinstall to rebuild)" if stale else ""
    return f"compiled twins: {', '.join(names)}{note}"
