"""The launch lane: ``GpuBackend.launch``, the hot path of kernel launches, through the gate.

Written once, here, and compiled as well as run as Python (``_lane``, with ``_lane.pxd`` beside it:
docs/building.md). It is the kernel front's launch where the launch is the common one:

- `LaunchLane.launch` counts the call in and out of the gate and launches the common case itself: a kernel of a
  registry of this backend, still loaded; an ``int`` grid and block within CUDA's limits; ``shared_mem`` an ``int``
  that fits 32 bits; arguments `pack_plain` packs (live buffers of the ledger's for pointers, scalars of a type met
  before); the default stream or a live stream of this backend with no capture on it; neither ``kernel_timing`` nor
  ``debug_sync_kernels``.
- Then, as the front does it: the launch kept among the recent ones (a fault report names it), the zones' fills
  settled, the plugin called, the launch counted; a failure names the launch (`launch_failed`).
- Compiled, the gate is passed at C level, the arguments packed at C level (``_pack.pxd``), a stream's fields read in
  place (``_device/_fields.pxd``), and the plugin called through its C ``launch`` where it offers one
  (``RawDevice.device_calls``; a call it declines is made through the method).
- Everything else goes to the kernel front (`KernelFront.launch`), which checks it in full and does the work or
  raises.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

from .._device.context import DeviceContext, Launch, describe_launch
from .._device.guarded import raise_raw
from .._device.raw import DEVICE_CALLS
from .._errors import CaptureError, MetraleError
from .._memory.holdings import Holdings
from .._redzones.guard import ZoneGuard
from .registry import MAX_BLOCK, MAX_GRID, MAX_THREADS_PER_BLOCK, Kernel, RunMetrics

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

if not cython.compiled:  # (compiled: a stream as _fields.pxd lays it out; the packer's and the plugin's C calls)
    from .._device.handles import Stream
    from .pack import pack_plain

    def check_fields(lane: str) -> None:
        """(Compiled: refuse to load where the handles' fields are not where the lane reads them in place.)"""

    def launch_calls(lane: LaunchLane, plugin: object, name: bytes) -> object | None:
        """The plugin's C functions where they hold ``launch`` (compiled only: as Python, none)."""
        return None

    def call_launch(
        lane: LaunchLane, function: object, grid: int, block: int, shared_mem: int, stream: object, args: object
    ) -> int:
        """The plugin's C ``launch``: 0 where done, 1 where declined (never called as Python)."""
        return 1

if TYPE_CHECKING:  # (as a module: compiled, ``Ledger`` is the one _lane.pxd cimports)
    from .._memory import ledger as ledgers

__all__ = ["LaunchLane", "LaunchLaneParts", "LaunchWork", "launch_failed"]

check_fields("launch lane")

#: The name of the capsule of the plugin's C functions.
_CAPSULE: Final = DEVICE_CALLS.encode()
#: The largest ``int`` grid and block of the common case (CUDA's limits in x).
_GRID_X: Final = MAX_GRID[0]
_BLOCK_X: Final = min(MAX_BLOCK[0], MAX_THREADS_PER_BLOCK)


def launch_failed(exc: MetraleError, launched: Launch) -> MetraleError:
    """The error a launch raises where the plugin's launch failed with ``exc``: it names the launch (a capture's
    error stays as it is)."""
    if isinstance(exc, CaptureError):
        return exc
    return type(exc)(f"launch of {describe_launch(launched)} failed: {exc.message}", code=exc.code, name=exc.name)


class LaunchWork(Protocol):
    """What a launch lane asks of the front it fronts (``front.KernelFront``)."""

    def launch(
        self, kernel: Kernel, grid: object, block: object, args: Sequence[object], shared_mem: object,
        stream: Stream | None,
    ) -> None:
        """Every launch inside the gate that is not the common one: the whole work, the errors included."""


class LaunchLaneParts(NamedTuple):
    """What the kernel front hands its lane: the parts a launch touches, each still its owner's.

    - ``ctx``: the device context (its gate, the plugin, the recent launches a fault report names).
    - ``holdings``: what is live (the ledger: a buffer argument's liveness).
    - ``guard``: the zone guard (fills to settle before work on another stream).
    - ``default``: the backend's default stream (``stream=None``).
    - ``metrics``: the run metrics (a launch counted).
    - ``plain``: neither ``kernel_timing`` nor ``debug_sync_kernels`` (else every launch goes to the front).
    """

    ctx: DeviceContext
    holdings: Holdings
    guard: ZoneGuard
    default: Stream
    metrics: RunMetrics
    plain: bool


class LaunchLane:  # (final: _lane.pxd says so to Cython)
    """``GpuBackend.launch``: inside the gate, the common case here, the rest the kernel front's."""

    __slots__ = (
        "_calls", "_ctx", "_default", "_gate", "_guard", "_kernels", "_ledger", "_metrics", "_plain", "_recent",
        "_ref",
    )

    def __init__(self, kernels: LaunchWork, parts: LaunchLaneParts) -> None:
        ctx = parts.ctx
        self._kernels = kernels
        self._ctx = ctx
        self._gate: Any = ctx.gate  # (compiled: the C gate, passed with enter_c and leave_c)
        self._ledger: ledgers.Ledger = parts.holdings.ledger
        self._guard = parts.guard
        self._default = parts.default
        self._metrics = parts.metrics
        self._recent: deque[Launch] = ctx.recent
        self._ref = ctx.ref
        self._plain = parts.plain
        #: Compiled: the plugin's C functions where they hold ``launch`` (the capsule, kept alive), else ``None``.
        self._calls = launch_calls(self, ctx.plugin, _CAPSULE)

    def launch(
        self, kernel: Kernel, grid: object, block: object, args: Sequence[object], shared_mem: object,
        stream: Stream | None,
    ) -> None:
        """``GpuBackend.launch``."""
        if cython.compiled:
            cell = self._gate.enter_c(False)
        else:
            self._ctx.enter()
        try:
            if not self._launch(kernel, grid, block, args, shared_mem, stream):
                self._kernels.launch(kernel, grid, block, args, shared_mem, stream)
        finally:
            if cython.compiled:
                self._gate.leave_c(cell)
            else:
                self._ctx.leave()

    def _launch(
        self, kernel: Kernel, grid: object, block: object, args: Sequence[object], shared_mem: object,
        stream: Stream | None,
    ) -> bool:
        """The common case: whether it was done (else the front does it, or raises)."""
        if not self._plain or type(kernel) is not Kernel:
            return False
        if type(grid) is not int or type(block) is not int or type(shared_mem) is not int:
            return False
        if not (1 <= grid <= _GRID_X and 1 <= block <= _BLOCK_X and 0 <= shared_mem <= 0xFFFFFFFF):
            return False  # (compiled: compared as Python ints, nothing converted that might not fit)
        registry = kernel.registry
        if not registry._owned_by(self._ctx) or registry.unloaded:  # (the front's checks, asked of the registry)
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
        packed = pack_plain(kernel, args, self._ledger, self._ref)
        if packed is None:
            return False
        g = (grid, 1, 1)
        b = (block, 1, 1)
        launched: Launch = (kernel.module, kernel.name, g, b, packed)
        self._recent.append(launched)  # formatted only when a fault is reported
        ctx = self._ctx
        function = kernel.raw
        stream_raw = target.raw
        try:
            guard = self._guard
            if guard.fills:
                guard.settle_for(target)  # (inside: a failed wait is this launch's failure, as the front has it)
            try:
                if self._calls is None or call_launch(self, function, grid, block, shared_mem, stream_raw, packed):
                    ctx.plugin.launch(function, g, b, shared_mem, stream_raw, packed)  # (1: declined, the method)
            except Exception as exc:
                raise_raw(ctx, ctx.name, "launch", exc)
        except MetraleError as exc:
            failed = launch_failed(exc, launched)
            if failed is exc:
                raise
            raise failed from exc
        self._metrics.launched(kernel.key)
        return True

    def _closed(self) -> bool:
        """Whether the backend's close has begun (compiled: read at C level)."""
        return self._gate.closed  # type: ignore[no-any-return]  # (compiled: a C read, the gate typed in the .pxd)
