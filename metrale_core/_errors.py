"""The error hierarchy, and CUDA's result codes mapped onto it.

    MetraleError                   .code: int | None, .name: str | None
     ├── ConfigError               a METRALE_* setting or settings keyword is invalid
     ├── SnapshotError             a memory snapshot file cannot be written or read  .path
     ├── MissingPackageError       an optional package (matplotlib, plotly, torch, CuPy) is not installed
     ├── DoorError                 an allocator door cannot be installed (torch already used CUDA)
     ├── BackendNotFoundError      no installed backend has that name
     ├── BackendUnavailableError   installed, but cannot run here
     ├── BackendClosedError        the backend (or its handle) was used after close()
     ├── InvalidArgumentError      (also a ValueError)
     │    ├── InvalidBufferError   a buffer is not live, or an operation runs past it
     │    ├── ArchitectureError    PTX for an architecture the device cannot run
     │    └── TensorMapError       a tensor map the driver would refuse  .rule
     ├── OutOfMemoryError          (also a MemoryError)  .requested
     │    └── ArenaFullError       an Arena has no room  .capacity, .used
     ├── CaptureError              a stream-capture rule was broken (CUDA 900-908)
     ├── DeviceFaultError          a sticky device fault: the backend is unusable
     ├── RedZoneError              red zones changed (redzone_action="raise")  .violations
     └── DriverError               any other driver failure
          └── KernelNotFoundError  a module or kernel the registry does not hold

Every backend speaks CUDA's vocabulary: where CUDA fails, a backend raises the
class [`error_for_code`][metrale_core.error_for_code] picks for CUDA's result code, with CUDA's ``code``
and ``name``. Errors that only metrale raises (bounds, stale handles, a closed
backend) carry ``code`` and ``name`` ``None``.
"""

from __future__ import annotations

from typing import Any, Final, final

__all__ = [
    "ArchitectureError",
    "ArenaFullError",
    "BackendClosedError",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "CaptureError",
    "ConfigError",
    "DeviceFaultError",
    "DoorError",
    "DriverError",
    "InvalidArgumentError",
    "InvalidBufferError",
    "KernelNotFoundError",
    "MetraleError",
    "MissingPackageError",
    "OutOfMemoryError",
    "RedZoneError",
    "SnapshotError",
    "TensorMapError",
    "capture_error",
    "cuda_code",
    "error_for_code",
]


class MetraleError(Exception):
    """The base of every error metrale raises.

    ``code`` and ``name`` are CUDA's result code and its name where a CUDA
    status applies (the fake backend uses the same ones), else ``None``.
    """

    code: int | None
    name: str | None

    def __init__(self, message: str, *, code: int | None = None, name: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.name = name

    @property
    def message(self) -> str:
        """The message without the ``[NAME (code)]`` suffix ``str()`` adds, for wrapping in another message."""
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        text = super().__str__()
        if self.name is not None:
            return f"{text} [{self.name} ({self.code})]"
        return text


@final
class ConfigError(MetraleError):
    """A ``METRALE_*`` setting (or a keyword to ``MetraleSettings``) is invalid."""


@final
class MissingPackageError(MetraleError):
    """An optional package is not installed (matplotlib or plotly, for ``metrale report``'s plots); the
    message names the extra of the ``metrale`` distribution that brings it. Not a setting: no ``ConfigError``."""


@final
class DoorError(MetraleError):
    """A framework's allocator door (``metrale_core.allocators``) cannot be installed: the framework already
    allocated device memory its own way, or the backend's memory is not the framework's device memory."""


@final
class SnapshotError(MetraleError):
    """A memory snapshot file cannot be written (``save_snapshot``: the path is a folder, its
    folder is missing or not writable) or read (``metrale report``: missing, not JSON, not a
    metrale snapshot, of a newer version, or inconsistent). ``path`` names it."""

    path: str | None

    def __init__(self, message: str, *, path: object = None) -> None:
        super().__init__(message)
        self.path = None if path is None else str(path)


@final
class BackendNotFoundError(MetraleError):
    """No installed backend has the name that was asked for."""


@final
class BackendUnavailableError(MetraleError):
    """The backend is installed but cannot run here; the message says why."""


@final
class BackendClosedError(MetraleError):
    """A backend, or a handle of one, was used after ``close()``; open a new backend."""


class InvalidArgumentError(MetraleError, ValueError):
    """An argument is out of range or of the wrong kind; nothing was changed."""


@final
class InvalidBufferError(InvalidArgumentError):
    """A buffer is unknown, no longer live, or an operation would run past it."""


@final
class ArchitectureError(InvalidArgumentError):
    """PTX images target an architecture the device cannot run (``CUDA_ERROR_NO_BINARY_FOR_GPU``)."""


@final
class TensorMapError(InvalidArgumentError):
    """A tensor map breaks a rule ``cuTensorMapEncodeTiled`` enforces (``CUDA_ERROR_INVALID_VALUE``); ``rule``
    names it (``"box_dim"``, ``"global_stride"``...: ``metrale_core.TENSOR_MAP_RULES`` lists them all)."""

    rule: str

    def __init__(self, message: str, *, rule: str) -> None:
        super().__init__(message, code=1, name="CUDA_ERROR_INVALID_VALUE")
        self.rule = rule


class OutOfMemoryError(MetraleError, MemoryError):
    """An allocation failed for lack of memory. ``requested`` is the bytes asked for."""

    requested: int

    def __init__(
        self,
        message: str,
        *,
        requested: int = 0,
        code: int | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(message, code=code, name=name)
        self.requested = requested


@final
class ArenaFullError(OutOfMemoryError):
    """An [`Arena`][metrale_core.Arena] has no room left for an allocation: ``requested``
    bytes were asked for, ``used`` of its ``capacity`` are handed out. The device may
    have memory to spare; ``reset()`` the arena or create a larger one."""

    capacity: int
    used: int

    def __init__(self, message: str, *, requested: int, capacity: int, used: int) -> None:
        super().__init__(message, requested=requested)
        self.capacity = capacity
        self.used = used


@final
class CaptureError(MetraleError):
    """A stream-capture rule was broken (CUDA's codes 900-908)."""


@final
class DeviceFaultError(MetraleError):
    """The device faulted (a sticky error): the context is unusable."""


class DriverError(MetraleError):
    """Any other failure the driver (or the fake, speaking for it) reported."""


@final
class KernelNotFoundError(DriverError):
    """A module or kernel the registry does not hold (``CUDA_ERROR_NOT_FOUND``); the message lists what it does."""


@final
class RedZoneError(MetraleError):
    """Red zones changed and ``redzone_action`` is ``"raise"``; ``violations`` lists them."""

    violations: list[Any]

    def __init__(self, message: str, violations: list[Any]) -> None:
        super().__init__(message)
        self.violations = violations


#: CUDA's result codes that metrale names, from ``cuda.h`` (the same numbers in
#: CUDA 12 and 13). The fake backend raises these names; the CUDA backend's
#: checker looks names up here and falls back to the driver's own name.
_CODES: Final[dict[str, int]] = {
    "CUDA_SUCCESS": 0,
    "CUDA_ERROR_INVALID_VALUE": 1,
    "CUDA_ERROR_OUT_OF_MEMORY": 2,
    "CUDA_ERROR_NOT_INITIALIZED": 3,
    "CUDA_ERROR_DEINITIALIZED": 4,
    "CUDA_ERROR_NO_DEVICE": 100,
    "CUDA_ERROR_INVALID_DEVICE": 101,
    "CUDA_ERROR_INVALID_IMAGE": 200,
    "CUDA_ERROR_INVALID_CONTEXT": 201,
    "CUDA_ERROR_CONTEXT_ALREADY_CURRENT": 202,
    "CUDA_ERROR_MAP_FAILED": 205,
    "CUDA_ERROR_NO_BINARY_FOR_GPU": 209,
    "CUDA_ERROR_ECC_UNCORRECTABLE": 214,
    "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED": 217,
    "CUDA_ERROR_INVALID_PTX": 218,
    "CUDA_ERROR_INVALID_HANDLE": 400,
    "CUDA_ERROR_ILLEGAL_STATE": 401,
    "CUDA_ERROR_NOT_FOUND": 500,
    "CUDA_ERROR_NOT_READY": 600,
    "CUDA_ERROR_ILLEGAL_ADDRESS": 700,
    "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES": 701,
    "CUDA_ERROR_LAUNCH_TIMEOUT": 702,
    "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED": 704,
    "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED": 705,
    "CUDA_ERROR_CONTEXT_IS_DESTROYED": 709,
    "CUDA_ERROR_ASSERT": 710,
    "CUDA_ERROR_HARDWARE_STACK_ERROR": 714,
    "CUDA_ERROR_ILLEGAL_INSTRUCTION": 715,
    "CUDA_ERROR_MISALIGNED_ADDRESS": 716,
    "CUDA_ERROR_INVALID_ADDRESS_SPACE": 717,
    "CUDA_ERROR_INVALID_PC": 718,
    "CUDA_ERROR_LAUNCH_FAILED": 719,
    "CUDA_ERROR_NOT_PERMITTED": 800,
    "CUDA_ERROR_NOT_SUPPORTED": 801,
    "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED": 900,
    "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED": 901,
    "CUDA_ERROR_STREAM_CAPTURE_MERGE": 902,
    "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED": 903,
    "CUDA_ERROR_STREAM_CAPTURE_UNJOINED": 904,
    "CUDA_ERROR_STREAM_CAPTURE_ISOLATION": 905,
    "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT": 906,
    "CUDA_ERROR_CAPTURED_EVENT": 907,
    "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD": 908,
    "CUDA_ERROR_UNKNOWN": 999,
}
_NAMES: Final[dict[int, str]] = {v: k for k, v in _CODES.items()}

#: Sticky errors: after one of these the context is unusable (CUDA's docs:
#: "the process must be terminated and relaunched").
_STICKY: Final[frozenset[str]] = frozenset(
    {
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "CUDA_ERROR_LAUNCH_FAILED",
        "CUDA_ERROR_ASSERT",
        "CUDA_ERROR_HARDWARE_STACK_ERROR",
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        "CUDA_ERROR_MISALIGNED_ADDRESS",
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        "CUDA_ERROR_INVALID_PC",
        "CUDA_ERROR_ECC_UNCORRECTABLE",
        "CUDA_ERROR_LAUNCH_TIMEOUT",
    }
)

#: What to do about a code, appended to the message where one applies.
_ADVICE: Final[dict[str, str]] = {
    "CUDA_ERROR_INVALID_VALUE": "check that the pointer and size lie inside one live allocation",
    "CUDA_ERROR_OUT_OF_MEMORY": "free buffers you no longer need, or ask for less",
    "CUDA_ERROR_NO_DEVICE": "no CUDA device is visible: check CUDA_VISIBLE_DEVICES and nvidia-smi",
    "CUDA_ERROR_INVALID_DEVICE": "the ordinal is past the last device: see nvidia-smi",
    "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED": "these two devices cannot reach each other directly (nvidia-smi topo "
    "-m shows the links); copy_peer still copies between them, through the host",
    "CUDA_ERROR_NOT_READY": "the work has not finished yet; this is not a failure",
    "CUDA_ERROR_INVALID_HANDLE": "the handle was destroyed or belongs to another context",
    "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED": "this call is not allowed while a stream is "
    "capturing; do it before begin_capture or after end_capture",
    "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED": "the capture was invalidated by a forbidden call (where metrale "
    "refused none, one made outside metrale: in global mode any thread's allocation, free or synchronize bars "
    "it, such as another library's free run by the garbage collector); call end_capture to discard it, then "
    "capture again",
    "CUDA_ERROR_STREAM_CAPTURE_ISOLATION": "a capturing stream may only wait on events recorded "
    "in the same capture",
    "CUDA_ERROR_ILLEGAL_STATE": "the stream is in the wrong capture state for this call: begin_capture "
    "needs a stream that is not capturing, end_capture the stream that began the capture",
}


def cuda_code(name: str) -> int | None:
    """CUDA's numeric code for a result name such as ``"CUDA_ERROR_OUT_OF_MEMORY"``."""
    return _CODES.get(name)


def error_for_code(
    code_or_name: int | str,
    what: str,
    *,
    requested: int = 0,
    driver_name: str | None = None,
) -> MetraleError:
    """The metrale error for a CUDA result, with ``what`` (the call that failed).

    The one table from CUDA's codes to metrale's classes: every backend raises
    driver failures through it, so the same failure is the same class with
    the same ``code`` and ``name`` everywhere.

    :param code_or_name: CUDA's result, as its number or its name (``"CUDA_ERROR_OUT_OF_MEMORY"``).
    :param what: the call that failed, which the message begins with.
    :param requested: for an out-of-memory result, the bytes asked for (the error's ``requested``).
    :param driver_name: the driver's own name for a code metrale's table does not know.
    :returns: an [`OutOfMemoryError`][metrale_core.OutOfMemoryError],
        [`InvalidArgumentError`][metrale_core.InvalidArgumentError],
        [`CaptureError`][metrale_core.CaptureError] (900-908),
        [`DeviceFaultError`][metrale_core.DeviceFaultError] (a sticky fault) or
        [`DriverError`][metrale_core.DriverError], to be raised by the caller.
    """
    if isinstance(code_or_name, str):
        name = code_or_name
        code = _CODES.get(name)
    else:
        code = int(code_or_name)
        name = _NAMES.get(code) or driver_name or f"CUresult {code}"
    advice = _ADVICE.get(name)
    message = f"{what} failed" + (f": {advice}" if advice else "")
    if name == "CUDA_ERROR_OUT_OF_MEMORY":
        return OutOfMemoryError(message, requested=requested, code=code, name=name)
    if name == "CUDA_ERROR_INVALID_VALUE":
        return InvalidArgumentError(message, code=code, name=name)
    if code is not None and 900 <= code <= 908:
        return CaptureError(message, code=code, name=name)
    if name in _STICKY:
        return DeviceFaultError(message, code=code, name=name)
    return DriverError(message, code=code, name=name)


def capture_error(name: str, message: str) -> CaptureError:
    """The [`CaptureError`][metrale_core.CaptureError] for CUDA result ``name`` (one of 900-908, or
    ``CUDA_ERROR_ILLEGAL_STATE``) with metrale's ``message``: the one place capture errors are built."""
    return CaptureError(message, code=_CODES.get(name), name=name)


def is_sticky(name: str | None) -> bool:
    """Whether a CUDA result name is a sticky device fault."""
    return name in _STICKY
