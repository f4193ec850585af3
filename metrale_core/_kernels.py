"""Kernel modules: the registry of loaded PTX modules, kernel handles, launch arguments, run metrics."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import operator
import struct
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from ._errors import InvalidArgumentError, KernelNotFoundError, MetraleError, error_for_code
from ._ptx import Param, PtxImage
from ._types import DeviceBuffer

if TYPE_CHECKING:
    from ._backend import GpuBackend
    from ._raw import RawDevice

__all__ = [
    "Kernel",
    "KernelImplementation",
    "KernelNotFoundError",
    "KernelRegistry",
    "LaunchArg",
    "RunMetrics",
    "kernel_implementation",
]

#: CUDA's limits on a launch's shape (all current architectures).
MAX_THREADS_PER_BLOCK: Final = 1024
MAX_BLOCK: Final = (1024, 1024, 64)
MAX_GRID: Final = ((1 << 31) - 1, 65535, 65535)


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchArg:
    """One kernel argument, checked against its parameter and packed as the kernel receives it.

    ``data`` is the parameter's bytes (little-endian); ``pointer`` is the
    device address where the argument is a buffer or a raw pointer.
    """

    param: Param
    data: bytes
    pointer: int | None = None

    def describe(self) -> str:
        """The argument's value as the kernel sees it: a pointer in hex, a number, or a byte count."""
        if self.pointer is not None:
            return f"{self.pointer:#x}"
        if self.param.count > 1:
            return f"<{len(self.data)} bytes>"
        if self.param.kind == "f" and self.param.size in (4, 8):
            return repr(struct.unpack("<f" if self.param.size == 4 else "<d", self.data)[0])
        return str(int.from_bytes(self.data, "little", signed=self.param.kind == "s"))


@dataclasses.dataclass(frozen=True, slots=True)
class KernelImplementation:
    """A Python implementation of kernel ``kernel`` of module ``module``, for backends that run kernels on the CPU.

    ``function(launch, *args)`` receives a launch description (grid, block,
    shared memory) and one argument per kernel parameter: a writable
    ``numpy.uint8`` view for each pointer, from the pointed-to byte to the end
    of its allocation (red zone included, so a write one element too far lands
    in the zone as on a GPU, and one further faults), and a numpy scalar of the
    parameter's type for the others.
    """

    module: str
    kernel: str
    function: Callable[..., object]

    def __call__(self, *args: Any) -> object:
        return self.function(*args)


def kernel_implementation(module: str, kernel: str) -> Callable[[Callable[..., object]], KernelImplementation]:
    """Decorate a function as the implementation of ``(module, kernel)``.

    Register the result with ``backend.add_kernel_implementations(...)`` or
    return it from a plugin's ``metrale_kernel_implementations`` hook.
    """

    def wrap(function: Callable[..., object]) -> KernelImplementation:
        return KernelImplementation(module, kernel, function)

    return wrap


class Kernel:
    """A kernel of a loaded module; pass it to ``backend.launch``. Obtained from a :class:`KernelRegistry`."""

    __slots__ = ("_raw", "module", "name", "params", "registry")

    def __init__(self, registry: KernelRegistry, module: str, name: str, params: tuple[Param, ...], raw: object):
        self.registry = registry
        self.module = module
        self.name = name
        self.params = params
        self._raw = raw

    @property
    def signature(self) -> str:
        """The kernel's parameters as PTX declares them."""
        return f"{self.module}.{self.name}({', '.join(p.describe() for p in self.params)})"

    def __repr__(self) -> str:
        return f"<Kernel {self.signature}>"


def _unload(raw: RawDevice, modules: list[object]) -> None:
    while modules:
        module = modules.pop()
        with contextlib.suppress(MetraleError):  # the backend is gone or faulted: nothing left to unload
            raw.module_unload(module)


class KernelRegistry:
    """The modules of one ``load_modules`` call, and a cache of their kernel handles.

    The modules unload at :meth:`close` (or leaving a ``with`` block), when
    the registry and every kernel handle from it are garbage, or when the
    backend closes, whichever comes first.
    """

    __slots__ = ("__weakref__", "_backend", "_closed", "_finalizer", "_images", "_kernels", "_lock", "_modules")

    def __init__(self, backend: GpuBackend, images: Mapping[str, PtxImage], modules: Mapping[str, object]):
        self._backend = backend
        self._images = dict(images)
        self._modules = dict(modules)
        self._kernels: dict[tuple[str, str], Kernel] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _unload, backend._raw, list(modules.values()))

    @property
    def modules(self) -> dict[str, tuple[str, ...]]:
        """Each loaded module's kernels."""
        return {name: tuple(img.entries) for name, img in self._images.items()}

    @property
    def closed(self) -> bool:
        return self._closed or self._backend.closed

    def kernel(self, module: str, name: str) -> Kernel:
        """The kernel ``name`` of ``module``, looked up once and cached."""
        self._backend._check_open()
        if self._closed:
            raise MetraleError("this kernel registry was closed; load the modules again")
        key = (module, name)
        with self._lock:
            cached = self._kernels.get(key)
        if cached is not None:
            return cached
        image = self._images.get(module)
        if image is None or name not in image.entries:
            held = "; ".join(f"{m}: {', '.join(img.entries) or 'no kernels'}" for m, img in self._images.items())
            err = error_for_code("CUDA_ERROR_NOT_FOUND", "kernel lookup")
            missing = f"module {module!r}" if image is None else f"kernel {name!r} in module {module!r}"
            raise KernelNotFoundError(
                f"no {missing}; this registry holds {held}", code=err.code, name=err.name
            )
        raw = self._backend._raw.module_function(self._modules[module], name)
        kernel = Kernel(self, module, name, image.entries[name], raw)
        with self._lock:
            kernel = self._kernels.setdefault(key, kernel)
        self._backend._metrics.looked_up(module, name)
        return kernel

    def close(self) -> None:
        """Unload the modules; kernels from this registry can no longer launch."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> KernelRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<KernelRegistry {sorted(self._images)} ({state})>"


def pack_args(kernel: Kernel, args: object, what: str, live: Callable[[DeviceBuffer], None]) -> list[LaunchArg]:
    """Check ``args`` against the kernel's parameters and pack them; nothing reaches a driver otherwise."""
    if type(args) is not tuple and type(args) is not list:
        if isinstance(args, str | bytes) or not hasattr(args, "__len__") or not hasattr(args, "__iter__"):
            raise InvalidArgumentError(f"{what}: args must be a list or tuple, got {args!r}")
        args = list(args)  # type: ignore[call-overload, unused-ignore]
    values: Sequence[object] = args  # type: ignore[assignment, unused-ignore]
    params = kernel.params
    if len(values) != len(params):
        raise InvalidArgumentError(
            f"{what}: {kernel.signature} takes {len(params)} argument(s), got {len(values)}"
        )
    packed = []
    for param, value in zip(params, values, strict=True):
        if type(value) is DeviceBuffer and param.pointer_sized:  # the hot path: a buffer for a pointer
            live(value)
            packed.append(LaunchArg(param, value.ptr.to_bytes(8, "little"), value.ptr))
        else:
            packed.append(_pack(kernel, param, value, what, live))
    return packed


def _pack(kernel: Kernel, param: Param, value: object, what: str, live: Callable[[DeviceBuffer], None]) -> LaunchArg:
    def where() -> str:  # built only for an error: launches are a hot path
        return f"{what}: argument {param.name} ({param.describe()}) of {kernel.module}.{kernel.name}"

    if param.count > 1:
        if isinstance(value, bytes | bytearray | memoryview) and len(memoryview(value).cast("B")) == param.nbytes:
            return LaunchArg(param, bytes(value))
        raise InvalidArgumentError(f"{where()} takes {param.nbytes} raw bytes, got {value!r}")
    if isinstance(value, DeviceBuffer) or (isinstance(value, int) and not isinstance(value, bool)):
        if not param.pointer_sized:
            raise InvalidArgumentError(
                f"{where()} is not a pointer: pass an explicitly typed scalar (numpy.uint32(7), ctypes.c_float(1.0))"
            )
        if isinstance(value, DeviceBuffer):
            live(value)
            pointer = value.ptr
        else:
            pointer = operator.index(value)
            if not 0 <= pointer < 1 << 64:
                raise InvalidArgumentError(f"{where()}: {pointer} is not a 64-bit device address")
        return LaunchArg(param, pointer.to_bytes(8, "little"), pointer)
    kind, size, data = _scalar(value)
    if kind is None:
        raise InvalidArgumentError(
            f"{where()}: expected a DeviceBuffer, an int pointer or an explicitly typed scalar "
            f"(a numpy scalar or a ctypes value), got {value!r}"
        )
    compatible = param.kind == "b" or (param.kind == "f") == (kind == "f")
    if size != param.size or not compatible:
        raise InvalidArgumentError(f"{where()} does not take {value!r} ({kind}{size * 8}); pass a matching type")
    return LaunchArg(param, data)


_CTYPES_KINDS: dict[type, str | None] = {}


def _scalar(value: object) -> tuple[str | None, int, bytes]:
    """``(kind, size, bytes)`` of a numpy scalar or ctypes value, kind ``f`` for floats, ``i`` for integers."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None and hasattr(value, "tobytes") and getattr(value, "shape", None) == ():
        kind = "f" if dtype.kind == "f" else "i" if dtype.kind in "iub" else None
        little = value.astype(dtype.newbyteorder("<")) if dtype.byteorder == ">" else value  # type: ignore[attr-defined]
        return kind, int(dtype.itemsize), bytes(little.tobytes())
    if isinstance(value, ctypes._SimpleCData):
        cls = type(value)
        if cls in _CTYPES_KINDS:
            kind = _CTYPES_KINDS[cls]
        else:
            kind = "f" if isinstance(value, ctypes.c_float | ctypes.c_double) else "i"
            if isinstance(value, ctypes.c_char_p | ctypes.c_wchar_p | ctypes.c_void_p | ctypes.c_bool):
                kind = "i" if isinstance(value, ctypes.c_void_p) else None
            _CTYPES_KINDS[cls] = kind
        return kind, ctypes.sizeof(value), bytes(value)
    return None, 0, b""


class RunMetrics:
    """Per backend, from its opening: the kernels looked up, launches per kernel, GPU time per kernel."""

    __slots__ = ("_lock", "_lookups", "gpu_ms", "launches", "pending")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lookups: dict[tuple[str, str], None] = {}
        self.launches: Counter[tuple[str, str]] = Counter()
        self.gpu_ms: dict[tuple[str, str], float] = {}
        self.pending: list[tuple[tuple[str, str], object, object]] = []

    def looked_up(self, module: str, kernel: str) -> None:
        with self._lock:
            self._lookups[(module, kernel)] = None

    def launched(self, key: tuple[str, str]) -> None:
        with self._lock:
            self.launches[key] += 1

    @property
    def lookups(self) -> list[tuple[str, str]]:
        """The kernels looked up, in order, once each: an audit of what this backend used."""
        return list(self._lookups)

    def table(self) -> str:
        """A table of every kernel looked up: launches and, where timed, GPU milliseconds."""
        rows = [("kernel", "launches", "gpu ms", "mean us")]
        for key in self._lookups:
            count = self.launches.get(key, 0)
            ms = self.gpu_ms.get(key)
            mean = "" if ms is None or not count else f"{ms * 1000 / count:.1f}"
            rows.append((f"{key[0]}.{key[1]}", str(count), "" if ms is None else f"{ms:.3f}", mean))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
