"""Other libraries' streams lent to the zone guard: a pool's piece for such a stream has its zones filled there.

- `BorrowedStreams.get`: the backend's raw stream for a handle (`RawDevice.foreign_stream`), asked once per handle;
  ``None`` where the backend lends none (the guard then fills on the default stream and orders the other stream).
- Fills issued on a borrowed stream are pending until a wait for the device: a check that reads the zones from another
  stream, or another library's stream metrale orders, waits for them first (the guard's ``settle``): a wait for the
  whole device, never for a borrowed handle, which its library may have destroyed since (CuPy's streams go with their
  object) or which names each thread's own stream (2, the per-thread default stream).
"""

from __future__ import annotations

import threading
from typing import final

from .._device.raw import RawDevice
from .._errors import MetraleError

__all__ = ["BorrowedStreams"]


@final
class BorrowedStreams:
    """One backend's borrowed streams, and those with fills issued since the last wait."""

    __slots__ = ("_issued", "_lends", "_lock", "_raw", "_settled", "lent")

    def __init__(self, raw: RawDevice) -> None:
        self._raw = raw
        self._lends = True  # until the backend says CUDA_ERROR_NOT_SUPPORTED
        #: The streams lent so far, by handle: read as it is on the hot path (`get` adds to it).
        self.lent: dict[int, object] = {}
        self._issued = self._settled = 0  # fills issued on borrowed streams, and of those, known done
        self._lock = threading.Lock()

    def get(self, handle: int) -> object | None:
        """Another library's stream ``handle`` (DLPack's numbering; 0 is taken as 1, the legacy default stream) as a
        raw stream of the backend's, or ``None`` where it lends none."""
        stream = self.lent.get(handle)
        if stream is None and self._lends:
            try:
                stream = self._raw.foreign_stream(handle or 1)
            except MetraleError as exc:
                if exc.name != "CUDA_ERROR_NOT_SUPPORTED":
                    raise
                self._lends = False
                return None
            self.lent[handle] = stream
        return stream

    def filled(self) -> None:
        """Fills were issued on a borrowed stream: pending until the next wait for the device (`settle`)."""
        self._issued += 1

    @property
    def pending(self) -> bool:
        return self._issued != self._settled

    def mark(self) -> int:
        """Before a wait for the whole device: the fills issued so far, which it covers (`waited`)."""
        return self._issued

    def waited(self, issued: int) -> None:
        """The wait for the device that began at `mark` (``issued``) returned: a fill issued meanwhile stays pending."""
        with self._lock:
            self._settled = max(self._settled, issued)
