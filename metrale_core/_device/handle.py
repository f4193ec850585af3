"""A `DeviceBuffer` made fast, for the hot paths: `make`, the same as ``DeviceBuffer._make``, and its C-level door.

Written once, here, and compiled as well as run as Python (``_handle``, with ``_handle.pxd`` beside it:
docs/building.md); the class itself stays in ``buffer.py``, never compiled (users meet one class in both builds).

- Compiled, `make` builds a real `DeviceBuffer` in place: the type's ``tp_alloc``, then each field stored into its
  slot, at the offset its member descriptor holds (``_slots.pxd``). The offsets are read once, at import, and
  checked: six object slots in the dataclass's order, inside the object, after its header, and a buffer built so
  equal to ``DeviceBuffer(...)``. Where the layout is not that (a changed class, a free-threaded build), it calls
  ``DeviceBuffer._make``, and the log says why once (at debug).
- Other compiled modules ``cimport`` `make_buffer` (`make`, at C level); they read a buffer's fields in place
  through ``_fields.pxd``.
- As Python, `make` is ``DeviceBuffer._make``; ``_twins.pick("handle", DeviceBuffer._make, pure)`` chooses.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Final

from .buffer import DeviceBuffer

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

__all__ = ["DIRECT", "make", "make_buffer"]

_log = logging.getLogger("metrale")

#: DeviceBuffer's fields, in the order `make` takes them and its slots are stored.
_FIELDS: Final = ("ptr", "nbytes", "kind", "index", "site", "_owner")

if not cython.compiled:  # (compiled: _handle.pxd's C, which finds the slots and stores into them in place)
    def keep_layout(cls: type, names: tuple[str, ...]) -> str | None:
        """Why the slots of ``cls`` cannot be stored into in place, or ``None`` (their offsets kept)."""
        return "it runs as Python"

    build_buffer: Final = DeviceBuffer._make


def _layout_problem() -> str | None:
    """Why ``DeviceBuffer``'s slots cannot be stored into directly here, or ``None`` (then their offsets are kept)."""
    if type(DeviceBuffer) is not type or DeviceBuffer.__base__ is not object:
        return "DeviceBuffer has a metaclass or a base class"
    slots = DeviceBuffer.__dict__.get("__slots__")
    if tuple(slots or ()) != _FIELDS or tuple(f.name for f in dataclasses.fields(DeviceBuffer)) != _FIELDS:
        return f"DeviceBuffer's slots are {slots}, not {_FIELDS}"
    if hasattr(DeviceBuffer, "__post_init__") or DeviceBuffer.__new__ is not object.__new__:
        return "DeviceBuffer's construction does more than store its fields"
    return keep_layout(DeviceBuffer, _FIELDS)


def _self_check() -> bool:
    """A buffer built in place is the one ``DeviceBuffer(...)`` builds: the same type, value and repr."""
    owner = object()
    built = build_buffer(4096, 256, "device", 7, "app.py:1", owner)
    made = DeviceBuffer(4096, 256, "device", 7, "app.py:1", owner)
    return type(built) is DeviceBuffer and built == made and repr(built) == repr(made) and built._owner is owner


try:
    _why = _layout_problem()
except Exception as exc:  # a class this module cannot read: the pure path
    _why = f"{type(exc).__name__}: {exc}"
if _why is None and not _self_check():
    _why = "a buffer built in place differed from DeviceBuffer(...)"
if _why is not None and cython.compiled:
    _log.debug("the handle twin calls DeviceBuffer._make: its slots cannot be stored into directly (%s)", _why)
_direct = _why is None

#: Whether `make` stores into ``DeviceBuffer``'s slots directly (else it calls ``DeviceBuffer._make``).
DIRECT: Final = _direct


def make(ptr: int, nbytes: int, kind: str, index: int, site: str, owner: Any = None) -> DeviceBuffer:
    """The same as ``DeviceBuffer._make(ptr, nbytes, kind, index, site, owner)``; compiled, built in place."""
    return make_buffer(ptr, nbytes, kind, index, site, owner)


def make_buffer(ptr: int, nbytes: int, kind: str, index: int, site: str, owner: Any) -> DeviceBuffer:
    """`make`, at C level (other compiled modules cimport it)."""
    if _direct:
        return build_buffer(ptr, nbytes, kind, index, site, owner)
    return DeviceBuffer._make(ptr, nbytes, kind, index, site, owner)

