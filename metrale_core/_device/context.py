"""The device context: what every part of one open backend shares.

One small object per open backend, built first and released last. It holds the
backend's name, ordinal and settings, the raw layer as the core calls it (every
raw call watched, see `GuardedRaw`; the hot paths call the plugin itself,
`DeviceContext.plugin`, under the same rule, `raise_raw`), the fault
latch, the closed state, the gate that makes ``close()`` safe against every other
call from any thread, and the lock for bookkeeping that spans parts. Handles, registries and the
collaborators hold the context, never the facade ([`GpuBackend`][metrale_core.GpuBackend]).

The gate: every public call enters it (`DeviceContext.enter`, the
`gated` decorator) and leaves it when it returns. ``close()`` shuts it
(`DeviceContext.shut`): from then on every call is refused with
[`BackendClosedError`][metrale_core.BackendClosedError], and ``close()`` waits for the calls
already inside to leave, except the closing thread's own (a callback that closes
the backend from inside one of its calls). A call that was inside when the gate
shut sees `DeviceContext.closed` before it commits anything and undoes its
raw work, so nothing it made outlives ``close()``.

Release: the last step of ``close()`` (`DeviceContext.release`) drops what the
core still holds of the raw device and breaks the reference cycles through the
context, so a closed backend holds no memory and is freed by reference counting.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Final, NoReturn, ParamSpec, Protocol, TypeVar, cast

from .._errors import BackendClosedError, DeviceFaultError, DriverError, InvalidArgumentError, MetraleError
from .._settings.model import MetraleSettings
from .._types import Origin
from .capture import abandon_captures, leave_call, resume_calls, suspend_calls, thread_calls
from .raw import RawDevice

if TYPE_CHECKING:
    from .._types import ForeignMemory, LaunchArg
    from .buffer import BufferOwner, DeviceArray, DeviceBuffer

__all__ = ["CORE_PACKAGES", "DeviceContext", "GuardedRaw", "Launch", "gated", "invalid_argument", "raise_raw"]

_log = logging.getLogger("metrale")

#: Top-level packages whose frames are never a call site.
CORE_PACKAGES: Final = frozenset({"metrale_core"})

#: How long ``close()`` waits for calls of other threads to leave before it tears down anyway.
_CLOSE_WAIT_S: Final = 60.0

#: A launch as a fault report describes it: module, kernel, grid, block, packed arguments.
Launch = tuple[str, str, tuple[int, int, int], tuple[int, int, int], "Sequence[LaunchArg]"]


def describe_launch(launch: Launch) -> str:
    module, kernel, grid, block, args = launch
    return f"{module}.{kernel}<<<{grid}, {block}>>>({', '.join(a.describe() for a in args)})"


def invalid_argument(what: str, expected: str, got: object) -> InvalidArgumentError:
    """The error for an argument of the wrong kind: what was expected, and what was given."""
    return InvalidArgumentError(f"{what}: expected {expected}, got {got!r}")


class GuardedRaw:
    """The raw layer as the core calls it: one place that watches every raw call.

    A foreign exception (a plugin's bug) becomes a ``DriverError`` naming the
    call, so none reaches the user; a ``DeviceFaultError`` latches the context's
    fault, so every later call reports the first fault.

    It holds its context weakly (the context holds it), so neither keeps the other
    alive; `detach` (at ``close()``) lets go of the raw device: from then on
    every raw call raises [`BackendClosedError`][metrale_core.BackendClosedError].
    """

    def __init__(self, target: RawDevice, context: DeviceContext) -> None:
        self._target: object = target
        self._context: Callable[[], DeviceContext | None] = context.ref
        self._name = context.name

    def __getattr__(self, name: str) -> Any:
        target = self._target
        attr = getattr(target, name)
        if not callable(attr):
            return attr
        ref, who = self._context, self._name

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except Exception as exc:
                raise_raw(ref(), who, name, exc)

        if self._target is target:  # not detached meanwhile (close() on another thread)
            self.__dict__[name] = call  # looked up once per name
        return call

    def detach(self, closed: str) -> None:
        """Let go of the raw device and of every method of it looked up so far (at ``close()``);
        later calls raise ``BackendClosedError(closed)``."""
        name = self._name
        self.__dict__.clear()
        self._target = _Detached(closed)
        self._context = _dead_ref
        self._name = name


def raise_raw(context: DeviceContext | None, who: str, name: str, exc: Exception) -> NoReturn:
    """Raise what a raw call's exception becomes, decided here for every raw call (the guarded layer's
    and the hot paths' that call the plugin directly, `DeviceContext.plugin`; call it in the
    ``except`` block): a ``DeviceFaultError`` latches the context's fault; any other ``MetraleError``
    goes on as it is (its cause kept); a foreign exception (a plugin's bug) becomes a ``DriverError``
    naming the call, caused by it."""
    if isinstance(exc, DeviceFaultError):
        if context is None:  # pragma: no cover - a part holds the context while it calls
            raise exc
        raise context.faulted_by(exc) from None
    if isinstance(exc, MetraleError):
        raise exc
    raise DriverError(
        f"the {who} backend's raw {name}() raised {type(exc).__name__}: {exc}; this is a bug in that backend"
    ) from exc


def _dead_ref() -> None:
    """What a detached ``GuardedRaw`` holds instead of its context."""
    return None


class _Detached:
    """A closed backend's raw layer: every primitive raises ``BackendClosedError``."""

    __slots__ = ("_closed",)

    def __init__(self, closed: str) -> None:
        self._closed = closed

    def __getattr__(self, name: str) -> Callable[..., NoReturn]:
        closed = self._closed

        def refuse(*args: object, **kwargs: object) -> NoReturn:
            raise BackendClosedError(f"raw {name}(): {closed}")

        return refuse


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


class _Cell:
    """How many calls of one context one thread is inside (``depth``), and that thread's flag of the
    capture rule (``flag``: ``_capture``'s, of every backend; the gate counts the thread's calls there
    too, so a call reads one thread-local). ``depth`` is written only by its thread (on a
    free-threaded build under the gate's lock) and read by ``close()`` on another."""

    __slots__ = ("__weakref__", "depth", "flag")

    def __init__(self) -> None:
        self.depth = 0
        self.flag = thread_calls()


class _Depth(threading.local):
    """Per thread: its `_Cell` of this context (made at the thread's first call, and added to
    the context's cells under the gate's lock)."""

    def __init__(self, cells: weakref.WeakSet[_Cell], lock: threading.Lock) -> None:
        self.cell = _Cell()
        with lock:
            cells.add(self.cell)


#: Whether the gate counts without a lock: under the GIL, a cell's store and the ``closed`` flag's load
#: are seen in order by ``close()`` on another thread; a free-threaded build takes the lock instead.
_LOCK_FREE: Final = getattr(sys, "_is_gil_enabled", lambda: True)()


class DeviceContext:
    """What the parts of one open backend share. Thread-safe."""

    __slots__ = (
        "__weakref__", "_cells", "_closed", "_depth", "_fault", "_fault_code", "_gate", "_gate_lock", "_target",
        "_target_ref", "exports", "facade", "internal", "lock", "name", "ordinal", "origin", "plugin", "raw", "recent",
        "ref", "settings",
    )

    def __init__(
        self, name: str, ordinal: int, settings: MetraleSettings, target: RawDevice, internal: frozenset[str]
    ) -> None:
        self.name: Final = name
        self.ordinal: Final = ordinal
        self.settings: Final = settings
        self._target: RawDevice | None = target  # held strongly until release(); see target
        self._target_ref: Callable[[], RawDevice | None] = lambda: None
        #: What buffers hold: a weak reference to their owner.
        self.ref: Final = weakref.ref(self)
        #: The raw layer as every part calls it.
        self.raw: Final = cast(RawDevice, GuardedRaw(target, self))
        #: The plugin's raw layer itself, for the hot paths (alloc, free, memset, launch, graph launch),
        #: which call it inside the gate and turn its exceptions with `raise_raw`, as `raw`
        #: does for every other call: a frame less per raw call. At `release` it refuses, as ``raw``.
        self.plugin: RawDevice = target
        #: Top-level packages whose frames are not call sites.
        self.internal: Final = CORE_PACKAGES | internal
        #: For bookkeeping that spans parts (short sections; never held across a wait).
        self.lock: Final = threading.RLock()
        #: Where this backend's records come from (the facade sets it as it opens).
        self.origin: Origin | None = None
        #: The export table, once built (buffers export themselves through it).
        self.exports: BufferOwner | None = None
        #: A weak reference to the object the user holds (what ``handle.backend`` answers).
        self.facade: Callable[[], object] = lambda: None
        #: The last launches, for a fault report (formatted only then: launches are a hot path).
        self.recent: collections.deque[Launch] = collections.deque(maxlen=8)
        self._fault: str | None = None
        self._fault_code: tuple[int | None, str | None] = (None, None)
        self._closed = False
        self._gate_lock = threading.Lock()  # the gate's counts; taken bare on the hot path (a C-level lock)
        self._gate = threading.Condition(self._gate_lock)  # for close(), waiting for calls to leave
        self._cells: weakref.WeakSet[_Cell] = weakref.WeakSet()  # every thread's (a thread's goes with it)
        self._depth = _Depth(self._cells, self._gate_lock)

    # -- state ----------------------------------------------------------------------------

    @property
    def target(self) -> RawDevice:
        """The plugin's raw layer itself, for diagnostics and the final close.

        After `release` the context holds it only weakly (whoever holds it, the facade, keeps
        it): a closed backend's handles do not keep a raw device, nor the memory it holds, alive.
        """
        target = self._target if self._target is not None else self._target_ref()
        if target is None:  # released, and nothing else holds it: only a handle's context outlives it
            return cast(RawDevice, _Detached(self.closed_message()))
        return target

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has begun: nothing may be committed any more."""
        return self._closed

    @property
    def fault(self) -> str | None:
        """The first device fault, with the launches before it; ``None`` if none."""
        return self._fault

    def closed_message(self) -> str:
        return f"backend {self.name}:{self.ordinal} is closed; open a new one with open_backend()"

    def closed_error(self) -> BackendClosedError:
        return BackendClosedError(self.closed_message())

    def check_not_closed(self) -> None:
        if self._closed:
            raise self.closed_error()

    def check_open(self) -> None:
        """Refuse use after close, and after a device fault (the ledger can still be read then)."""
        if self._closed:
            raise self.closed_error()
        if self._fault is not None:
            raise DeviceFaultError(
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
                _log.error("backend %s:%d faulted: %s", self.name, self.ordinal, self._fault)
        if first:
            abandon_captures(self, f"backend {self.name}:{self.ordinal} faulted")
            return DeviceFaultError(
                f"{self._fault}; the backend is now unusable: close it and open a new one",
                code=exc.code, name=exc.name,
            )
        return DeviceFaultError(f"{exc.message}; the first fault was: {self._fault}", code=exc.code, name=exc.name)

    def quietly(self, what: str, fn: Callable[..., object], *args: object) -> None:
        """Call ``fn``; a failure is logged, not raised (teardown, rollback)."""
        try:
            fn(*args)
        except MetraleError as exc:
            # after a device fault every call fails: that is expected, not news
            level = logging.DEBUG if self._fault is not None else logging.WARNING
            _log.log(level, "%s failed: %s", what, exc)

    # -- the gate ---------------------------------------------------------------------------

    def enter(self, *, faulted_ok: bool = False) -> None:
        """Count a call in; refused once closed (and after a fault unless ``faulted_ok``).

        No lock: the thread's own count goes up first, then ``closed`` is read; `shut` sets
        ``closed`` first, then reads the counts, so either this call is refused or ``close()``
        waits for it."""
        cell = self._depth.cell
        if _LOCK_FREE:
            cell.depth += 1
            closed = self._closed
        else:  # pragma: no cover - free-threaded builds only
            with self._gate_lock:
                cell.depth += 1
                closed = self._closed
        if closed:
            self._count_out(cell)
            raise self.closed_error()
        cell.flag.calls += 1  # _capture.call_entered(), with the flag at hand
        if self._fault is not None and not faulted_ok:
            self.leave()
            self.check_open()

    def leave(self) -> None:
        """Count a call out."""
        cell = self._depth.cell
        flag = cell.flag
        calls = flag.calls
        if calls > 1:  # not the thread's outermost metrale call: only the count changes
            flag.calls = calls - 1
        elif flag.inside:  # leaving the outermost call ends its barred call: its driver calls are over
            leave_call(flag)
        else:  # the outermost call, in no barred call (flag.inside is only this thread's to set)
            flag.calls = 0
        if _LOCK_FREE:
            cell.depth -= 1
            if self._closed:  # a close() may be waiting for this call
                with self._gate:
                    self._gate.notify_all()
        else:  # pragma: no cover - free-threaded builds only
            self._count_out(cell)

    def _count_out(self, cell: _Cell) -> None:
        if _LOCK_FREE:
            cell.depth -= 1
        else:  # pragma: no cover - free-threaded builds only
            with self._gate_lock:
                cell.depth -= 1
        if self._closed:  # a close() may be waiting for this call
            with self._gate:
                self._gate.notify_all()

    def _others_inside(self, own: _Cell) -> int:
        """Under the gate's lock: how many calls other threads are inside."""
        return sum(cell.depth for cell in list(self._cells) if cell is not own)

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Run user code (a callback, an observer) as if this thread were outside the gate: a ``close()``
        on another thread does not wait for it. Counted in again after it (whether or not the backend
        closed meanwhile; the caller checks `closed` before it commits anything)."""
        cell = self._depth.cell
        depth = cell.depth
        with self._gate:
            cell.depth = 0
            if self._closed:
                self._gate.notify_all()
        calls = suspend_calls()  # user code is in no barred call: captures on other threads need not wait for it
        try:
            yield
        finally:
            resume_calls(calls)
            with self._gate:
                cell.depth = depth

    def shut(self) -> bool:
        """Refuse every call from now on and wait for those inside (not this thread's own) to leave.

        ``False`` when it was already shut (``close()`` is idempotent).
        """
        own = self._depth.cell
        with self._gate:
            if self._closed:
                return False
            self._closed = True
            if not self._gate.wait_for(lambda: self._others_inside(own) == 0, timeout=_CLOSE_WAIT_S):
                _log.warning(
                    "close of %s:%d: %d call(s) of other threads still running after %.0f s; tearing down anyway",
                    self.name, self.ordinal, self._others_inside(own), _CLOSE_WAIT_S,
                )
        return True

    # -- release -------------------------------------------------------------------------------

    def release(self) -> None:
        """The last step of ``close()``: drop every reference the core holds to the raw device and to
        what holds memory, and the cycles through this context, so that a closed backend holds no
        device memory even while something still references it, and is freed by reference counting
        (not only by the garbage collector) once nothing does.

        The guarded raw layer lets go of the raw device (a straggling call raises
        ``BackendClosedError``); this context keeps it only weakly, the facade weakly too (a handle of
        a closed backend does not keep the backend), and the export table gives way to one that
        refuses (it held this context: a cycle); the last launches are forgotten.
        """
        closed = self.closed_message()
        cast(GuardedRaw, self.raw).detach(closed)
        self.plugin = cast(RawDevice, _Detached(closed))
        target, self._target = self._target, None
        if target is not None:
            try:
                self._target_ref = weakref.ref(target)
            except TypeError:  # a raw device without __weakref__ (slots): keep it
                self._target = target
        facade = self.facade()
        if facade is not None:  # a GpuBackend: it takes weak references
            self.facade = weakref.ref(facade)
        self.exports = _ClosedExports(closed)
        self.recent.clear()

    def __repr__(self) -> str:
        return f"<DeviceContext {self.name}:{self.ordinal}{' (closed)' if self._closed else ''}>"


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
