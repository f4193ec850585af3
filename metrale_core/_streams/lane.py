"""The stream lane: ``GpuBackend.memset``, a hot path of stream work, through the gate.

- `StreamLane.memset` counts the call in and out of the gate and hands it to the stream front, which does the work
  (the checks, the stream, a capture's record, the zones' fills, the errors).
- ``_lane.pyx`` is its compiled twin: it does the common case itself at C level (a live device buffer of this
  backend, plain ints, the default stream, no capture on it, no red zones, a plugin with a C ``memset``: see
  ``RawDevice.device_calls``) and hands everything else to the front, as this class does with every call.
"""

from __future__ import annotations

from typing import final

from .._device.handles import Stream
from .._memory.ledger import Ledger
from .front import StreamFront

__all__ = ["StreamLane"]


@final
class StreamLane:
    """``GpuBackend.memset``: inside the gate, the stream front's work."""

    __slots__ = ("_ctx", "_streams")

    def __init__(self, streams: StreamFront, ledger: Ledger) -> None:
        self._streams = streams
        self._ctx = streams.ctx

    def memset(self, dst: object, value: object, offset: object, nbytes: object, stream: Stream | None) -> None:
        """``GpuBackend.memset``."""
        ctx = self._ctx
        ctx.enter()
        try:
            self._streams.memset(dst, value, offset, nbytes, stream)
        finally:
            ctx.leave()
