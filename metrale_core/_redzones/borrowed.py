"""Other libraries' streams lent to the zone guard: a pool's piece for such a stream has its zones filled there.

- `BorrowedStreams.get`: the backend's raw stream for a handle (`RawDevice.foreign_stream`), asked once per handle;
  ``None`` where the backend lends none (the guard then fills on the default stream and orders the other stream).
- Fills issued on a borrowed stream are pending until a wait for it or for the device: a check that reads the zones
  from another stream waits for them first (`BorrowedStreams.settle`).
"""

from __future__ import annotations

from typing import final

from .._device.raw import RawDevice
from .._errors import MetraleError

__all__ = ["BorrowedStreams"]


@final
class BorrowedStreams:
    """One backend's borrowed streams, and those with fills issued since the last wait."""

    __slots__ = ("_lends", "_pending", "_raw", "lent")

    def __init__(self, raw: RawDevice) -> None:
        self._raw = raw
        self._lends = True  # until the backend says CUDA_ERROR_NOT_SUPPORTED
        #: The streams lent so far, by handle: read as it is on the hot path (`get` adds to it).
        self.lent: dict[int, object] = {}
        self._pending: dict[int, object] = {}

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

    def filled(self, handle: int, stream: object) -> None:
        """Fills were issued on ``stream`` (borrowed for ``handle``): pending until the next wait."""
        self._pending[handle] = stream  # (one dict item set: atomic)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def settle(self) -> None:
        """Wait for the fills pending on borrowed streams."""
        for handle, stream in list(self._pending.items()):
            self._raw.stream_synchronize(stream)
            self._pending.pop(handle, None)

    def mark(self) -> list[int]:
        """Before a wait for the whole device: the streams whose pending fills it covers (`waited`)."""
        return list(self._pending)

    def waited(self, handles: list[int]) -> None:
        """The wait for the device that began at `mark` returned."""
        for handle in handles:
            self._pending.pop(handle, None)
