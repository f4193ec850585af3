# cython: language_level=3, binding=True, embedsignature=True
"""The compiled twin of [`LaunchLane`][metrale_core._launch.lane.LaunchLane]: ``GpuBackend.launch``, the common case
done here at C level.

- The common case: a kernel of a registry of this backend, still loaded; an ``int`` grid and block within CUDA's
  limits; ``shared_mem`` an ``int`` that fits 32 bits; arguments the compiled packer packs without the full rule
  (``_pack.pxd``: live buffers of the ledger's for pointers, scalars of a type met before); a live stream of this
  backend, or the default one, with no capture on it; neither ``kernel_timing`` nor ``debug_sync_kernels``.
- Then, as the front does it: the launch kept among the recent ones (a fault report names it), the zones' fills
  settled, the plugin called through its C ``launch`` where it offers one (``RawDevice.device_calls``), else through
  its method, and the launch counted. A C call that declined (``1``) is made through the method; a failure is raised
  as the front raises it (``launch_failed``: it names the launch).
- Everything else goes to the front, which checks it in full and does the work or raises.
"""

cimport cython
from cpython.object cimport PyObject

from .._device._calls cimport DEVICE_CALLS_LAUNCH, device_calls_with, metrale_device_calls_v1, table_of
from .._device._gate cimport Gate, _Cell
from .._memory._ledger cimport Ledger
from ._pack cimport pack_c

from .._device.guarded import raise_raw as _raise_raw
from .._device.handles import Stream as _Stream
from .._device.raw import DEVICE_CALLS as _DEVICE_CALLS
from .._errors import MetraleError as _MetraleError
from .lane import launch_failed as _launch_failed
from .registry import MAX_BLOCK as _MAX_BLOCK
from .registry import MAX_GRID as _MAX_GRID
from .registry import MAX_THREADS_PER_BLOCK as _MAX_THREADS
from .registry import Kernel as _Kernel

cdef bytes _CAPSULE_NAME = _DEVICE_CALLS.encode()
cdef long long _GRID_X = _MAX_GRID[0]
cdef long long _BLOCK_X = min(_MAX_BLOCK[0], _MAX_THREADS)


@cython.final
cdef class LaunchLane:
    """``GpuBackend.launch``: inside the gate, the common case here (compiled twin)."""

    cdef object _kernels
    cdef object _ctx
    cdef Gate _gate
    cdef Ledger _ledger
    cdef object _guard
    cdef object _default
    cdef object _metrics
    cdef object _recent
    cdef object _ref
    cdef bint _plain
    cdef object _capsule  # (keeps the plugin's struct alive)
    cdef metrale_device_calls_v1* _door

    def __init__(self, kernels, parts):
        ctx = parts.ctx
        ledger = parts.holdings.ledger
        if not isinstance(ctx.gate, Gate) or not isinstance(ledger, Ledger):
            raise TypeError(
                f"the compiled launch lane needs the compiled gate and ledger, got {type(ctx.gate)!r} and "
                f"{type(ledger)!r}: one `pure` setting picks them all"
            )
        self._kernels = kernels
        self._ctx = ctx
        self._gate = ctx.gate
        self._ledger = ledger
        self._guard = parts.guard
        self._default = parts.default
        self._metrics = parts.metrics
        self._recent = ctx.recent
        self._ref = ctx.ref
        self._plain = parts.plain
        self._capsule = device_calls_with(ctx.plugin, _CAPSULE_NAME, DEVICE_CALLS_LAUNCH)
        self._door = table_of(self._capsule, _CAPSULE_NAME)

    def launch(self, kernel, grid, block, args, shared_mem, stream):
        """``GpuBackend.launch``."""
        cdef _Cell cell = self._gate.enter_c(False)
        try:
            if not self._launch(kernel, grid, block, args, shared_mem, stream):
                self._kernels.launch(kernel, grid, block, args, shared_mem, stream)
        finally:
            self._gate.leave_c(cell)

    cdef bint _launch(self, object kernel, object grid, object block, object args, object shared_mem,
                      object stream) except -1:
        """The common case: whether it was done (else the front does it)."""
        cdef unsigned int shape[6]
        cdef int rc = 1
        if not self._plain or type(kernel) is not _Kernel:
            return False
        if type(grid) is not int or type(block) is not int or type(shared_mem) is not int:
            return False
        if not (1 <= grid <= _GRID_X and 1 <= block <= _BLOCK_X and 0 <= shared_mem <= 0xFFFFFFFF):
            return False  # (compared as Python ints: nothing converted that might not fit)
        registry = kernel.registry
        if not registry._owned_by(self._ctx) or registry.unloaded:  # (the front's checks, asked of the registry)
            return False
        if stream is None:
            target = self._default
        elif type(stream) is _Stream and stream._ctx is self._ctx and not stream._closed:  # (as the front resolves)
            target = stream
        else:
            return False
        if self._gate.closed_c() or target.capture is not None:
            return False
        packed = pack_c(kernel, args, self._ledger, self._ref)
        if packed is None:
            return False
        g = (grid, 1, 1)
        b = (block, 1, 1)
        launched = (kernel.module, kernel.name, g, b, packed)
        self._recent.append(launched)  # formatted only when a fault is reported
        ctx = self._ctx
        function = kernel.raw
        stream_raw = target.raw
        try:
            guard = self._guard
            if guard.fills:
                guard.settle_for(target)  # (inside: a failed wait is this launch's failure, as the front has it)
            try:
                if self._door is not NULL:
                    shape[0], shape[1], shape[2] = <unsigned int>grid, 1, 1
                    shape[3], shape[4], shape[5] = <unsigned int>block, 1, 1
                    rc = self._door.launch(self._door.state, <PyObject*>function, shape, <unsigned int>shared_mem,
                                           <PyObject*>stream_raw, <PyObject*>packed)
                if rc != 0:  # no door, or it declined
                    ctx.plugin.launch(function, g, b, shared_mem, stream_raw, packed)
            except Exception as exc:
                _raise_raw(ctx, ctx.name, "launch", exc)
        except _MetraleError as exc:
            failed = _launch_failed(exc, launched)
            if failed is exc:
                raise
            raise failed from exc
        self._metrics.launched(kernel.key)
        return True
