"""The hot path's lock where it runs as Python: what ``_lock.pxd`` declares in C for the compiled one-source modules.

- `new_lock`, `acquire_lock`, `release_lock`: a ``threading.Lock``, its ``acquire`` and its ``release``, called as
  functions (``_thread``'s own, so a call makes no Python frame).
- A one-source module imports them only where it runs as Python (``if not cython.compiled:``); compiled, it
  ``cimport``s the C lock of the same names through its ``.pxd``.
"""

from __future__ import annotations

import _thread
from typing import Final

__all__ = ["acquire_lock", "new_lock", "release_lock"]

new_lock: Final = _thread.allocate_lock
acquire_lock: Final = _thread.LockType.acquire
release_lock: Final = _thread.LockType.release
