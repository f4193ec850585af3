"""Arenas: a bump sub-allocator over one ``alloc_arena`` block, for short-lived scratch.

The fast path of metrale's memory: ``Arena.alloc`` never calls the driver. Its
buffers are arena memory, never on the ledger; they stay live until the arena's
``reset()`` or ``close()``.

- `Arena`: the public class: the bump allocation of ``bump.py``, as it runs as Python. Its compiled build
  (``_bump``) registers here as a virtual subclass (`Arena` is an ABC with no abstract methods), so
  ``isinstance(x, metrale_core.Arena)`` holds for either; the allocator picks one per backend
  (``_twins.pick("arena", Arena, pure)``).
- `ArenaZones` (``arena_zones.py``): with ``redzone_arena``, the red zones of one arena's pieces.

Run as Python only: the public class is one class, whichever build a backend runs.
"""

from __future__ import annotations

import abc

from .._twins import pick
from .arena_zones import ArenaZones
from .bump import MAX_ALIGN
from .bump import Arena as _Bump

__all__ = ["MAX_ALIGN", "Arena", "ArenaZones"]


class Arena(_Bump, metaclass=abc.ABCMeta):  # (an ABC, nothing abstract: the compiled build registers with it)
    """A sub-allocator over one block of device memory. Made by
    [`GpuBackend.create_arena`][metrale_core.GpuBackend.create_arena].

    ``alloc(nbytes, align=256)`` hands out the next aligned piece of the block
    (a [`DeviceBuffer`][metrale_core.DeviceBuffer] of kind ``"arena"``, usable in every
    operation of its backend); there is no per-buffer free: ``reset()`` takes
    every piece back at once, and ``close()`` releases the block. A buffer from
    before a ``reset()`` is no longer live, and operations on it raise
    [`InvalidBufferError`][metrale_core.InvalidBufferError]. ``reset()`` does not wait for the
    device: synchronize first if work still uses the old pieces. When the block
    has no room, ``alloc`` raises [`ArenaFullError`][metrale_core.ArenaFullError].

    Thread-safe. A context manager (``close()`` on exit).
    """

    __slots__ = ()


# the compiled build, where it was built, is an Arena too
if (_compiled := pick("arena", Arena, pure=False)) is not Arena:
    Arena.register(_compiled)
