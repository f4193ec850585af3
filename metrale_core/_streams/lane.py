"""The stream lane: ``GpuBackend.memset``, a hot path of stream work, through the gate.

Written once, here, and compiled as well as run as Python (``_lane``, with ``_lane.pxd`` beside it:
docs/building.md). It is the stream front's memset where the call is the common one:

- `StreamLane.memset` counts the call in and out of the gate and sets the bytes itself in the common case: a live
  buffer of this backend, plain ints in range, the default stream or a live stream of this backend, no capture on
  it. The zones' fills are settled first where red zones are on.
- Compiled, the gate is passed at C level (``_gate.pxd``), the liveness asked of the compiled ledger
  (``_ledger.pxd``), and the bytes set through the plugin's C ``memset`` where it offers one
  (``RawDevice.device_calls``; a call it declines is made through the method).
- Everything else goes to the stream front (`StreamFront.memset`): the checks and their errors, a capture's record,
  a raw pointer, another stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from .._device.guarded import raise_raw
from .._device.raw import DEVICE_CALLS
from .front import StreamFront

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

if not cython.compiled:  # (compiled: the handles as _fields.pxd lays them out; the plugin's C memset, _lane.pxd)
    from .._device.buffer import DeviceBuffer
    from .._device.handles import Stream

    def check_fields(lane: str) -> None:
        """(Compiled: refuse to load where the handles' fields are not where the lane reads them in place.)"""

    def memset_calls(lane: StreamLane, plugin: object, name: bytes) -> object | None:
        """The plugin's C functions where they hold ``memset`` (compiled only: as Python, none)."""
        return None

    def call_memset(lane: StreamLane, ptr: int, value: int, nbytes: int, stream: object) -> int:
        """The plugin's C ``memset``: 0 where done, 1 where declined (never called as Python)."""
        return 1

if TYPE_CHECKING:  # (as a module: compiled, ``Ledger`` is the one _lane.pxd cimports)
    from .._memory import ledger as ledgers

__all__ = ["StreamLane"]

check_fields("stream lane")

#: The name of the capsule of the plugin's C functions.
_CAPSULE: Final = DEVICE_CALLS.encode()


class StreamLane:  # (final: _lane.pxd says so to Cython)
    """``GpuBackend.memset``: inside the gate, the common case here, the rest the stream front's."""

    __slots__ = ("_calls", "_ctx", "_default", "_gate", "_guard", "_holdings", "_ledger", "_ref", "_streams")

    def __init__(self, streams: StreamFront, ledger: ledgers.Ledger) -> None:
        ctx = streams.ctx
        self._streams = streams
        self._ctx = ctx
        self._gate: Any = ctx.gate  # (compiled: the C gate, passed with enter_c and leave_c)
        self._ledger = ledger
        self._holdings = streams.holdings
        self._ref = ctx.ref
        self._default = streams.default
        self._guard = streams.guard
        #: Compiled: the plugin's C functions where they hold ``memset`` (the capsule, kept alive), else ``None``.
        self._calls = memset_calls(self, ctx.plugin, _CAPSULE)

    def memset(self, dst: object, value: object, offset: object, nbytes: object, stream: Stream | None) -> None:
        """``GpuBackend.memset``."""
        if cython.compiled:
            cell = self._gate.enter_c(False)
        else:
            self._ctx.enter()
        try:
            if not self._memset(dst, value, offset, nbytes, stream):
                self._streams.memset(dst, value, offset, nbytes, stream)
        finally:
            if cython.compiled:
                self._gate.leave_c(cell)
            else:
                self._ctx.leave()

    def _memset(self, dst: object, value: object, offset: object, nbytes: object, stream: Stream | None) -> bool:
        """The common case: whether it was done (else the front does it, or raises)."""
        if (
            type(dst) is not DeviceBuffer or type(value) is not int or type(offset) is not int
            or (nbytes is not None and type(nbytes) is not int) or not 0 <= value <= 255
        ):
            return False
        buf = dst  # (compiled: its fields read in place)
        if not ((buf._owner is self._ref and self._ledger.has_index(buf.index, buf)) or self._holdings.is_live(buf)):
            return False
        size = buf.nbytes
        count: int = size - offset if nbytes is None else nbytes
        if offset < 0 or count <= 0 or offset > size - count:
            return False
        if stream is None:
            target = self._default
        elif type(stream) is Stream:
            target = stream  # (compiled: its fields read in place)
            if target._ctx is not self._ctx or target._closed or self._closed():  # (as the front resolves one)
                return False
        else:
            return False
        if target.capture is not None:
            return False
        guard = self._guard
        if guard.fills:
            guard.settle_for(target)
        ctx = self._ctx
        ptr = buf.ptr + offset
        raw = target.raw
        try:
            if self._calls is None or call_memset(self, ptr, value, count, raw):  # (1: declined, the method does it)
                ctx.plugin.memset(ptr, value, count, raw)
        except Exception as exc:
            raise_raw(ctx, ctx.name, "memset", exc)
        return True

    def _closed(self) -> bool:
        """Whether the backend's close has begun (compiled: read at C level)."""
        return self._gate.closed  # type: ignore[no-any-return]  # (compiled: a C read, the gate typed in the .pxd)
