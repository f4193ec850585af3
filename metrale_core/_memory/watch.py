"""Who watches a release: the allocator's release observers that have something to watch now.

- A front that can warn of a freed buffer still in use (executable graphs, exports, tensor maps) switches its
  observer on as it starts to hold such a thing, and off once it holds none, each under its own lock.
- The allocator and its lane call the observers switched on as a buffer is released: in the common case (no
  graphs, exports or maps) the list is empty, and a free calls nothing.
- An observer left on longer than needed only costs its quick check: a front switches off lazily, in its observer.
- ``active`` is a tuple, replaced (never changed) by each switch: a free calls the observers of the tuple it read,
  all of them, even where one switches itself off meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import final

from .._device.buffer import DeviceBuffer

__all__ = ["ReleaseWatch"]

Observer = Callable[[DeviceBuffer], None]


@final
class ReleaseWatch:
    """The release observers switched on; thread-safe. ``active`` is a tuple, replaced by each switch."""

    __slots__ = ("_lock", "active")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: The observers to call as a buffer is released, in the order they were switched on.
        self.active: tuple[Observer, ...] = ()

    def watch(self, observer: Observer, on: bool) -> None:
        """Switch ``observer`` on (at most once in the list) or off; the caller holds its own lock."""
        with self._lock:
            present = observer in self.active  # (bound methods compare by their object and function)
            if on and not present:
                self.active = (*self.active, observer)
            elif not on and present:
                self.active = tuple(o for o in self.active if o != observer)
