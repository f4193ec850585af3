"""The launch lane: ``GpuBackend.launch``, the hot path of kernel launches, through the gate.

- `LaunchLane.launch` counts the call in and out of the gate and hands the launch to the kernel front
  (`KernelFront.launch`), which does the work (the kernel, the shape, the arguments checked and packed, the stream,
  a capture's record, timing, the errors).
- ``_lane.pyx`` is its compiled twin: it does the common case itself at C level (a kernel of this backend, an
  ``int`` grid and block, arguments the compiled packer packs without the full rule, a live stream of this backend
  with no capture on it, neither ``kernel_timing`` nor ``debug_sync_kernels``) through the plugin's C ``launch``
  where it offers one (``RawDevice.device_calls``), and hands everything else to the front, as this class does with
  every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, final

from .._device.context import DeviceContext, Launch, describe_launch
from .._device.handles import Stream
from .._errors import CaptureError, MetraleError
from .._memory.holdings import Holdings
from .._redzones.guard import ZoneGuard
from .registry import Kernel, RunMetrics

__all__ = ["LaunchLane", "LaunchLaneParts", "LaunchWork", "launch_failed"]


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
        """Every launch inside the gate: the whole work, the errors included."""


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


@final
class LaunchLane:
    """``GpuBackend.launch``: inside the gate, the kernel front's work."""

    __slots__ = ("_ctx", "_kernels")

    def __init__(self, kernels: LaunchWork, parts: LaunchLaneParts) -> None:
        self._kernels = kernels
        self._ctx = parts.ctx

    def launch(
        self, kernel: Kernel, grid: object, block: object, args: Sequence[object], shared_mem: object,
        stream: Stream | None,
    ) -> None:
        """``GpuBackend.launch``."""
        ctx = self._ctx
        ctx.enter()
        try:
            self._kernels.launch(kernel, grid, block, args, shared_mem, stream)
        finally:
            ctx.leave()
