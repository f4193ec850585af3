"""The device context: what every part of one open backend shares.

One small object per open backend, built first and released last. Handles,
registries and the parts hold it, never the facade ([`GpuBackend`][metrale_core.GpuBackend]).

- What it holds: the backend's name, ordinal and settings; the raw layer under two
  names (`DeviceContext.raw`, guarded, and `DeviceContext.plugin`, the plugin's own,
  both under `raise_raw`); the fault latch; the lock for bookkeeping that spans parts.
- `DeviceContext.bind`: the facade, the origin and the export table, given once as
  the facade opens (they are made after the context).
- The gate: every public call enters it (`DeviceContext.enter`, `gated`) and leaves
  it. ``close()`` shuts it (`DeviceContext.shut`): later calls raise
  [`BackendClosedError`][metrale_core.BackendClosedError], and ``close()`` waits for
  the calls inside to leave, but not the closing thread's own (a callback may close
  the backend). A call inside when the gate shut sees `DeviceContext.closed` before it
  commits, and undoes its raw work: nothing it made outlives ``close()``.
- Release: the last step of ``close()`` (`DeviceContext.release`) lets go of the raw
  device and breaks the cycles through the context. A closed backend then holds no
  memory, and reference counting frees it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Concatenate, Final, ParamSpec, Protocol, TypeVar, cast, final

from .._errors import BackendClosedError, DeviceFaultError, MetraleError
from .._settings.model import MetraleSettings
from .._twins import pick
from .capture import abandon_captures
from .gate import Gate
from .guarded import Detached, GuardedRaw
from .raw import RawDevice

if TYPE_CHECKING:
    from .._types import ForeignMemory, LaunchArg, Origin
    from .buffer import BufferOwner, DeviceArray, DeviceBuffer

__all__ = ["CORE_PACKAGES", "DeviceContext", "Launch", "describe_launch", "gated", "gated_read"]

_log = logging.getLogger("metrale")

#: Top-level packages whose frames are never a call site.
CORE_PACKAGES: Final = frozenset({"metrale_core"})

#: How long ``close()`` waits for calls of other threads to leave before it tears down anyway.
_CLOSE_WAIT_S: Final = 60.0

#: A launch as a fault report describes it: module, kernel, grid, block, packed arguments.
Launch = tuple[str, str, tuple[int, int, int], tuple[int, int, int], "Sequence[LaunchArg]"]


def _nothing() -> None:
    """The facade of a context not yet bound."""
    return None


def describe_launch(launch: Launch) -> str:
    module, kernel, grid, block, args = launch
    return f"{module}.{kernel}<<<{grid}, {block}>>>({', '.join(a.describe() for a in args)})"


@final
class _ClosedExports:
    """A closed backend's export table (``DeviceContext.exports`` after ``close()``): exports are refused,
    and the count of DLPack tensors a consumer lets go of has nothing left to count."""

    __slots__ = ("_closed",)

    def __init__(self, closed: str) -> None:
        self._closed = closed

    def export(self, buf: DeviceBuffer, view: DeviceArray, what: str, *, wait: bool = True) -> ForeignMemory:
        raise BackendClosedError(f"{what}: {self._closed}")

    def export_held(self, index: int, delta: int) -> None:
        pass


def _refusal_of(ref: weakref.ref[DeviceContext]) -> Callable[[], MetraleError]:
    """The gate's refusal: the context's own error (held weakly: the gate keeps no cycle through it)."""

    def refusal() -> MetraleError:
        ctx = ref()
        return BackendClosedError("the backend is closed") if ctx is None else ctx.refusal()

    return refusal


@final
class DeviceContext:
    """What the parts of one open backend share. Thread-safe.

    Two names for the raw layer: `raw`, guarded, for every call but the hot paths';
    `plugin`, the plugin's own, for the hot paths. Both refuse after `release`.
    """

    __slots__ = (
        "__weakref__", "_exports", "_facade", "_fault", "_fault_code", "_gate", "_origin", "enter", "internal",
        "leave", "lock", "name", "ordinal", "plugin", "raw", "recent", "ref", "settings",
    )

    def __init__(
        self, name: str, ordinal: int, settings: MetraleSettings, target: RawDevice, internal: frozenset[str]
    ) -> None:
        self.name: Final = name
        self.ordinal: Final = ordinal
        self.settings: Final = settings
        #: What buffers hold: a weak reference to their owner.
        self.ref: Final = weakref.ref(self)
        #: The raw layer as every part calls it: each call's exceptions go through `raise_raw`.
        self.raw: Final = cast(RawDevice, GuardedRaw(target, self.ref, name))
        #: The plugin's raw layer itself, for the hot paths (alloc, free, memset, launch, graph launch).
        #: They call it inside the gate and turn its exceptions with `raise_raw`: a frame less per call.
        self.plugin: RawDevice = target
        #: Top-level packages whose frames are not call sites.
        self.internal: Final = CORE_PACKAGES | internal | frozenset(settings.site_skip)
        #: For bookkeeping that spans parts (short sections; never held across a wait).
        self.lock: Final = threading.RLock()
        #: The last launches, for a fault report (formatted only then: launches are a hot path).
        self.recent: collections.deque[Launch] = collections.deque(maxlen=8)
        self._origin: Origin | None = None  # the three set by bind()
        self._exports: BufferOwner | None = None
        self._facade: Callable[[], object] = _nothing
        self._fault: str | None = None
        self._fault_code: tuple[int | None, str | None] = (None, None)
        #: The gate every public call passes (its compiled twin where built and ``pure`` is off).
        self._gate: Final = pick("gate", Gate, settings.pure)(_refusal_of(self.ref))
        #: Count a call in (``enter(faulted_ok=False)``): refused once closed, and after a fault unless
        #: ``faulted_ok``. The gate's own method: a call into it, no frame of the context's.
        self.enter: Final[Callable[..., None]] = self._gate.enter
        #: Count a call out.
        self.leave: Final[Callable[[], None]] = self._gate.leave

    def bind(self, facade: object, origin: Origin, exports: BufferOwner) -> None:
        """Give the context what is made after it, once, as the facade opens.

        - ``facade``: what ``handle.backend`` answers; held until `release`, weakly after.
        - ``origin``: where this backend's records come from.
        - ``exports``: the export table, through which buffers export themselves.
        """
        assert self._origin is None, "a context is bound once"
        self._facade = lambda: facade  # a handle keeps its backend, as it always did
        self._origin = origin
        self._exports = exports

    # -- state ----------------------------------------------------------------------------

    @property
    def origin(self) -> Origin | None:
        """Where this backend's records come from (``None`` until `bind`)."""
        return self._origin

    @property
    def exports(self) -> BufferOwner | None:
        """The export table (``None`` until `bind`; one that refuses after `release`)."""
        return self._exports

    def facade(self) -> object:
        """The object the user holds (``None`` before `bind`, and once it is gone after `release`)."""
        return self._facade()

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has begun: nothing may be committed any more."""
        return self._gate.closed

    @property
    def gate(self) -> Gate:
        """The gate (for a compiled part that passes it at C level: the allocator's lane)."""
        return self._gate

    @property
    def fault(self) -> str | None:
        """The first device fault, with the launches before it; ``None`` if none."""
        return self._fault

    def closed_message(self) -> str:
        return f"backend {self.name}:{self.ordinal} is closed; open a new one with open_backend()"

    def closed_error(self) -> BackendClosedError:
        return BackendClosedError(self.closed_message())

    def check_open(self) -> None:
        """Refuse use after close, and after a device fault (the ledger can still be read then)."""
        if self._gate.closed or self._fault is not None:
            raise self.refusal()

    def refusal(self) -> MetraleError:
        """The error of a call refused: closed, or unusable after a device fault."""
        if self._gate.closed:
            return self.closed_error()
        return DeviceFaultError(
            f"backend {self.name}:{self.ordinal} is unusable after a device fault: {self._fault}. "
            f"Close it (close() still tears down) and open a new one, in a new process for CUDA",
            code=self._fault_code[0],
            name=self._fault_code[1],
        )

    def faulted_by(self, exc: DeviceFaultError) -> DeviceFaultError:
        """Latch the fault (once: the first fault is the one reported) and describe it.

        The backend's captures leave the process-wide record: a fault is local to its backend.
        """
        with self.lock:
            first = self._fault is None
            if first:
                launches = "; ".join(describe_launch(launch) for launch in self.recent) or "none"
                self._fault = f"{exc.message} (most recent launches, oldest first: {launches})"
                self._fault_code = (exc.code, exc.name)
                self._gate.fault()
                _log.error("backend %s:%d faulted: %s", self.name, self.ordinal, self._fault)
        if first:
            abandon_captures(self, f"backend {self.name}:{self.ordinal} faulted")
            return DeviceFaultError(
                f"{self._fault}; the backend is now unusable: close it and open a new one",
                code=exc.code, name=exc.name,
            )
        return DeviceFaultError(f"{exc.message}; the first fault was: {self._fault}", code=exc.code, name=exc.name)

    def quietly(self, what: str, fn: Callable[..., object], *args: object) -> bool:
        """Call ``fn``; a failure is logged, not raised (teardown, rollback). Whether it succeeded."""
        try:
            fn(*args)
        except MetraleError as exc:
            # after a device fault every call fails: that is expected, not news
            level = logging.DEBUG if self._fault is not None else logging.WARNING
            _log.log(level, "%s failed: %s", what, exc)
            return False
        return True

    # -- the gate ---------------------------------------------------------------------------

    def outside(self) -> contextlib.AbstractContextManager[None]:
        """Run user code (a callback, an observer) as if this thread were outside the gate: a ``close()``
        on another thread does not wait for it (`Gate.outside`)."""
        return self._gate.outside()

    def shut(self) -> bool:
        """Refuse every call from now on and wait for those inside (not this thread's own) to leave.

        ``False`` when it was already shut (``close()`` is idempotent).
        """
        stragglers = self._gate.shut(_CLOSE_WAIT_S)
        if stragglers is None:
            return False
        if stragglers:
            _log.warning(
                "close of %s:%d: %d call(s) of other threads still running after %.0f s; tearing down anyway",
                self.name, self.ordinal, stragglers, _CLOSE_WAIT_S,
            )
        return True

    # -- release -------------------------------------------------------------------------------

    def release(self) -> None:
        """The last step of ``close()``: let go of the raw device and break the cycles through this context.

        A closed backend then holds no device memory, even while something references it. It is
        freed by reference counting once nothing does, not only by the garbage collector.

        - `raw` and `plugin` let go of the raw device: a straggling call raises ``BackendClosedError``.
          The facade keeps it (``GpuBackend.raw``); a handle of a closed backend does not.
        - The facade is held weakly: a handle of a closed backend does not keep the backend.
        - The export table gives way to one that refuses (it held this context: a cycle).
        - The last launches are forgotten.
        """
        closed = self.closed_message()
        cast(GuardedRaw, self.raw).detach(closed)
        self.plugin = cast(RawDevice, Detached(closed))
        facade = self._facade()
        if facade is not None:  # a GpuBackend: it takes weak references
            self._facade = weakref.ref(facade)
        self._exports = _ClosedExports(closed)
        self.recent.clear()

    def __repr__(self) -> str:
        return f"<DeviceContext {self.name}:{self.ordinal}{' (closed)' if self._gate.closed else ''}>"


class HasContext(Protocol):
    @property
    def _ctx(self) -> DeviceContext: ...


_S = TypeVar("_S", bound=HasContext)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def gated(fn: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """Run a public method inside its context's gate (refused once closed or faulted)."""

    @functools.wraps(fn)
    def call(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        ctx = self._ctx
        ctx.enter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            ctx.leave()

    return call


def gated_read(fn: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """As `gated`, for calls that still answer after a device fault (ledger and stats reads)."""

    @functools.wraps(fn)
    def call(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        ctx = self._ctx
        ctx.enter(faulted_ok=True)
        try:
            return fn(self, *args, **kwargs)
        finally:
            ctx.leave()

    return call
