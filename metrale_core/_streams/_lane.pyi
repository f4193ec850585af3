"""Stub of the compiled twin of `metrale_core._streams.lane.StreamLane` (``_lane.pyx``): the same interface."""

from typing import final

from .._device.handles import Stream
from .._memory.ledger import Ledger
from .front import StreamFront

@final
class StreamLane:
    def __init__(self, streams: StreamFront, ledger: Ledger) -> None: ...
    def memset(self, dst: object, value: object, offset: object, nbytes: object, stream: Stream | None) -> None: ...
