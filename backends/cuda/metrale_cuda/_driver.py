"""The one gate between metrale and ``cuda.bindings.driver``.

Every driver call goes through `call`, `call1`, `invoke` or
`call_teardown`; every ``CUresult`` goes through `check`. A foreign
exception (the bindings' ``DynamicLibNotFoundError`` when no driver library
is installed, a ``RuntimeError`` for a symbol the driver lacks, a
``TypeError`` or ``OverflowError`` for an argument the bindings refuse) is
converted by `foreign_error`, so only [`MetraleError`][metrale_core.MetraleError]
leaves this package.

The symbols whose names differ between cuda-bindings 12.x and 13.x are looked
up once, here. So are `bound` and `bound_checked`, the decorators that make a
device's context current before its method calls the driver (``THREAD`` records
the context this package last made current on each thread).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, Concatenate, Final, ParamSpec, Protocol, TypeVar

from metrale_core import (
    BackendUnavailableError,
    DriverError,
    InvalidArgumentError,
    MetraleError,
    error_for_code,
)

try:
    from cuda.bindings import driver as drv
except ImportError as exc:  # pragma: no cover - depends on the environment
    drv = None
    IMPORT_ERROR: ImportError | None = exc
else:
    IMPORT_ERROR = None

__all__ = [
    "IMPORT_ERROR",
    "THREAD",
    "Bindable",
    "bound",
    "bound_checked",
    "NO_DRIVER_LIBRARY",
    "TEARDOWN_NOOPS",
    "call",
    "call1",
    "call_ready",
    "call_sized",
    "call_teardown",
    "check",
    "drv",
    "foreign_error",
    "init_driver",
    "invoke",
    "teardown_failed",
]

_log = logging.getLogger("metrale.cuda")

#: The reason given when the bindings cannot load ``libcuda``.
NO_DRIVER_LIBRARY: Final = (
    "no NVIDIA driver library (libcuda.so) was found: install the NVIDIA driver, or use METRALE_BACKEND=fake"
)

#: Results that mean "the driver or the context is already gone": a destroy,
#: free or close that meets one has nothing left to do (a close after a
#: fault, or at interpreter exit).
TEARDOWN_NOOPS: Final[frozenset[int]] = frozenset(
    {
        4,  # CUDA_ERROR_DEINITIALIZED
        709,  # CUDA_ERROR_CONTEXT_IS_DESTROYED
    }
)

_NOT_READY: Final = 600  # CUDA_ERROR_NOT_READY


def _driver_error_name(code: int) -> str | None:
    """``cuGetErrorName`` for ``code``, or ``None`` where the driver cannot say."""
    if drv is None:
        return None
    try:
        err, name = drv.cuGetErrorName(drv.CUresult(code))
    except Exception:
        return None
    if err or not name:
        return None
    return name.decode() if isinstance(name, bytes) else str(name)


def check(result: int, what: str, *, requested: int = 0) -> None:
    """Raise the metrale error for a failed ``CUresult``; return on ``CUDA_SUCCESS``.

    The one place a driver result becomes an exception: the class, ``code`` and
    ``name`` come from [`metrale_core.error_for_code`][metrale_core.error_for_code], with the driver's
    own name for a code metrale's table does not know.
    """
    if not result:  # CUresult is an int enum; CUDA_SUCCESS is 0
        return
    code = int(result)
    raise error_for_code(code, what, requested=requested, driver_name=_driver_error_name(code))


def foreign_error(exc: BaseException, what: str) -> MetraleError:
    """The metrale error for an exception the bindings raised instead of returning a result."""
    kind = type(exc).__name__
    text = str(exc)
    if kind in ("DynamicLibNotFoundError", "DynamicLibNotAvailableError") or (
        isinstance(exc, RuntimeError) and ("libcuda" in text or "dlopen" in text)
    ):
        return BackendUnavailableError(f"{what}: {NO_DRIVER_LIBRARY}")
    if isinstance(exc, TypeError | ValueError | OverflowError | BufferError):
        return InvalidArgumentError(f"{what}: the CUDA bindings refused an argument: {kind}: {text}")
    return DriverError(f"{what} failed in the CUDA bindings: {kind}: {text}")


def invoke(fn: Callable[..., Any], what: str, *args: object) -> Any:
    """Call a driver function; return its whole result tuple, unchecked."""
    try:
        return fn(*args)
    except Exception as exc:
        raise foreign_error(exc, what) from exc


def call(fn: Callable[..., Any], what: str, *args: object) -> None:
    """Call a driver function that returns only a ``CUresult``, and check it."""
    try:
        out = fn(*args)
    except Exception as exc:
        raise foreign_error(exc, what) from exc
    if out[0]:
        check(out[0], what)


def call_sized(fn: Callable[..., Any], name: str, nbytes: int, *args: object) -> Any:
    """Call an allocation ``fn(nbytes, *args)`` that returns ``(CUresult, value)``; check it, return the
    value. Its description (``"<name> of <nbytes> bytes"``) is formatted only for an error."""
    try:
        err, value = fn(nbytes, *args)
    except Exception as exc:
        raise foreign_error(exc, f"{name} of {nbytes} bytes") from exc
    if err:
        check(err, f"{name} of {nbytes} bytes", requested=nbytes)
    return value


def call1(fn: Callable[..., Any], what: str, *args: object, requested: int = 0) -> Any:
    """Call a driver function that returns ``(CUresult, value)``; check it, return the value."""
    try:
        err, value = fn(*args)
    except Exception as exc:
        raise foreign_error(exc, what) from exc
    check(err, what, requested=requested)
    return value


def call_teardown(fn: Callable[..., Any], what: str, *args: object) -> None:
    """Call a destroy or free; a result in `TEARDOWN_NOOPS` is not a failure."""
    try:
        out = fn(*args)
    except Exception as exc:
        raise foreign_error(exc, what) from exc
    if out[0]:
        teardown_failed(out[0], what)


def teardown_failed(err: Any, what: str) -> None:
    """A destroy or free returned ``err`` (not success): a result in `TEARDOWN_NOOPS` is logged
    and not a failure; anything else raises."""
    if int(err) in TEARDOWN_NOOPS:
        _log.debug("%s: %s at teardown, nothing left to release", what, _driver_error_name(int(err)))
        return
    check(err, what)


def call_ready(fn: Callable[..., Any], what: str, *args: object) -> bool:
    """Call a query: ``True`` on success, ``False`` on ``CUDA_ERROR_NOT_READY``, else raise."""
    try:
        (err,) = fn(*args)
    except Exception as exc:
        raise foreign_error(exc, what) from exc
    if err and int(err) == _NOT_READY:
        return False
    check(err, what)
    return True


# -- the context, made current where a call needs it ----------------------------------------------


class _ThreadState(threading.local):
    """Per thread: the context handle (as an int) the CUDA backend last made current."""

    ctx: int = 0


THREAD: Final = _ThreadState()


class Bindable(Protocol):
    """What `bound` and `bound_checked` need of a device: its context's key and the two ways to bind it."""

    _key: int

    def _bind(self) -> None: ...

    def _bind_checked(self) -> None: ...


_B = TypeVar("_B", bound=Bindable)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def bound(method: Callable[Concatenate[_B, _P], _R]) -> Callable[Concatenate[_B, _P], _R]:
    """Make the device's context current on the calling thread first, where this package did not already.

    The hot path: one comparison of the thread-local against the device's key
    (a closed device's key never matches, so it always takes the slow path,
    which raises).
    """

    @functools.wraps(method)
    def bound(self: _B, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if THREAD.ctx != self._key:
            self._bind()
        return method(self, *args, **kwargs)

    return bound


def bound_checked(method: Callable[Concatenate[_B, _P], _R]) -> Callable[Concatenate[_B, _P], _R]:
    """Make the device's context current first, asking the driver (``cuCtxGetCurrent``) what is current now.

    For the calls that create or size something in "the current context".
    """

    @functools.wraps(method)
    def bound_checked(self: _B, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self._bind_checked()
        return method(self, *args, **kwargs)

    return bound_checked


def _lookup(*names: str) -> Callable[..., Any]:
    """The first of ``names`` the bindings offer (the names differ between 12.x and 13.x)."""
    for name in names:
        fn = getattr(drv, name, None)
        if fn is not None:
            return fn  # type: ignore[no-any-return]
    raise AttributeError(f"cuda.bindings.driver has none of {', '.join(names)}")


if drv is not None:
    #: ``cuEventElapsedTime_v2`` where the bindings name it, else ``cuEventElapsedTime``.
    EVENT_ELAPSED_TIME: Callable[..., Any] = _lookup("cuEventElapsedTime_v2", "cuEventElapsedTime")
    #: ``cuGraphInstantiateWithFlags`` where offered, else ``cuGraphInstantiate(graph, flags)``.
    GRAPH_INSTANTIATE: Callable[..., Any] = _lookup("cuGraphInstantiateWithFlags", "cuGraphInstantiate")
    STREAM_NON_BLOCKING: Any = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
    EVENT_DEFAULT: Any = drv.CUevent_flags.CU_EVENT_DEFAULT
    MEM_ATTACH_GLOBAL: Any = drv.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL
    CAPTURE_MODE_GLOBAL: Any = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    #: A thread's capture modes by metrale's names (`RawDevice.exchange_capture_mode`).
    CAPTURE_MODES: Any = {
        "global": CAPTURE_MODE_GLOBAL,
        "thread_local": drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        "relaxed": drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED,
    }
    ATTRIBUTE_INTEGRATED: Any = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_INTEGRATED
    ATTRIBUTE_CC_MAJOR: Any = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    ATTRIBUTE_CC_MINOR: Any = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
    MEMHOSTALLOC_DEVICEMAP: Any = getattr(drv, "CU_MEMHOSTALLOC_DEVICEMAP", 0x02)
    POINTER_DEVICE_ORDINAL: Any = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    ATTRIBUTE_SM_COUNT: Any = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    ATTRIBUTE_SMEM_PER_SM: Any = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR


def bindings_version() -> str:
    """The installed cuda-bindings version, or ``"unknown"``."""
    try:
        from cuda import bindings

        return str(bindings.__version__)
    except Exception:
        return "unknown"


def init_driver() -> int:
    """``cuInit(0)`` and the device count; raises [`BackendUnavailableError`][metrale_core.BackendUnavailableError] with
    a reason.

    The reasons are the ones [`metrale_cuda.probe`][metrale_cuda.probe] reports, in words a
    user can act on.
    """
    if drv is None:
        raise BackendUnavailableError(
            f"cuda-bindings is not importable ({IMPORT_ERROR}): pip install 'cuda-bindings>=12.6'"
        )
    try:
        call(drv.cuInit, "cuInit", 0)
    except BackendUnavailableError:
        raise
    except MetraleError as exc:
        raise BackendUnavailableError(
            f"the NVIDIA driver did not initialize: {exc}", code=exc.code, name=exc.name
        ) from exc
    try:
        count = int(call1(drv.cuDeviceGetCount, "cuDeviceGetCount"))
    except BackendUnavailableError:
        raise
    except MetraleError as exc:
        raise BackendUnavailableError(
            f"the NVIDIA driver cannot count its devices: {exc}", code=exc.code, name=exc.name
        ) from exc
    if count <= 0:
        raise BackendUnavailableError(
            "the NVIDIA driver reports no CUDA device: check CUDA_VISIBLE_DEVICES and nvidia-smi"
        )
    return count


def warn_if_driver_older_than_bindings() -> None:
    """Log a warning when the driver's CUDA major version is older than the bindings'."""
    if drv is None:
        return
    try:
        err, version = drv.cuDriverGetVersion()
        major = int(bindings_version().split(".")[0])
    except Exception:
        return
    if not err and int(version) // 1000 < major:
        _log.warning(
            "the NVIDIA driver supports CUDA %d.%d but cuda-bindings %s expects a CUDA %d driver; "
            "some calls may fail: upgrade the driver or install cuda-bindings<%d",
            int(version) // 1000,
            int(version) % 1000 // 10,
            bindings_version(),
            major,
            major,
        )
