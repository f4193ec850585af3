"""Kernel modules as the user holds them: the registry of loaded PTX modules, kernel handles and the run metrics.

A [`KernelRegistry`][metrale_core.KernelRegistry] owns its modules (they unload at its ``close()``, when it and its
kernels are garbage, or when the backend closes). Launching is the kernel front's and its lane's (``front.py``,
``lane.py``); checking and packing a launch's arguments is ``pack.py``'s.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from .._device.buffer import DeviceBuffer
from .._device.context import DeviceContext, gated
from .._errors import BackendClosedError, KernelNotFoundError, MetraleError, error_for_code
from .._types import LaunchArg
from ..kernels._ptx import Param, PtxImage

if TYPE_CHECKING:
    from .._device.raw import RawDevice

__all__ = ["MAX_BLOCK", "MAX_GRID", "MAX_THREADS_PER_BLOCK", "Kernel", "KernelRegistry", "RunMetrics"]

#: CUDA's limits on a launch's shape (all current architectures).
MAX_THREADS_PER_BLOCK: Final = 1024
MAX_BLOCK: Final = (1024, 1024, 64)
MAX_GRID: Final = ((1 << 31) - 1, 65535, 65535)


class Kernel:
    """A kernel of a loaded module; pass it to ``backend.launch``. Obtained from a
    [`KernelRegistry`][metrale_core.KernelRegistry]."""

    __slots__ = ("_packs", "_plan", "key", "module", "name", "params", "raw", "registry")

    def __init__(self, registry: KernelRegistry, module: str, name: str, params: tuple[Param, ...], raw: object):
        self.registry = registry
        self.module = module
        self.name = name
        self.params = params
        #: The backend's raw handle of the kernel (what ``RawDevice.launch`` receives; a plain attribute).
        self.raw = raw
        #: ``(module, name)``, as run metrics count it.
        self.key = (module, name)
        # For pack_args (pack.py): each parameter with what its checks read (properties, read once here), and per
        # parameter the packed arguments of the buffers passed there lately (a buffer is immutable: its
        # packed pointer never changes; the buffer is held, so its id stays its own while kept).
        self._plan = tuple(
            (p, p.pointer_sized, p.count == 1, p.size, p.kind == "b", p.kind == "f") for p in params
        )
        self._packs: tuple[dict[int, tuple[DeviceBuffer, LaunchArg]], ...] = tuple({} for _ in params)

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

    The modules unload at [`close`][metrale_core.KernelRegistry.close] (or leaving a ``with`` block), when
    the registry and every kernel handle from it are garbage, or when the
    backend closes, whichever comes first.
    """

    __slots__ = (
        "__weakref__", "_ctx", "_finalizer", "_images", "_kernels", "_lock", "_metrics", "_modules", "unloaded",
    )

    def __init__(
        self, ctx: DeviceContext, metrics: RunMetrics, images: Mapping[str, PtxImage], modules: Mapping[str, object]
    ) -> None:
        self._ctx = ctx
        self._metrics = metrics
        self._images = dict(images)
        self._modules = dict(modules)
        self._kernels: dict[tuple[str, str], Kernel] = {}
        self._lock = threading.Lock()
        #: Whether its modules were unloaded (by its ``close()``); a plain flag, for the launches' hot paths
        #: ([`closed`][metrale_core.KernelRegistry.closed] also says whether the backend closed).
        self.unloaded = False
        self._finalizer = weakref.finalize(self, _unload, ctx.raw, list(modules.values()))

    @property
    def modules(self) -> dict[str, tuple[str, ...]]:
        """Each loaded module's kernels."""
        return {name: tuple(img.entries) for name, img in self._images.items()}

    @property
    def closed(self) -> bool:
        return self.unloaded or self._ctx.closed

    def _owned_by(self, ctx: DeviceContext) -> bool:
        """Whether this registry belongs to the backend of ``ctx``."""
        return self._ctx is ctx

    @gated
    def kernel(self, module: str, name: str) -> Kernel:
        """The kernel ``name`` of ``module``, looked up once and cached."""
        self._ctx.check_open()
        if self.unloaded:
            raise BackendClosedError("this kernel registry was closed; load the modules again")
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
        raw = self._ctx.raw.module_function(self._modules[module], name)
        kernel = Kernel(self, module, name, image.entries[name], raw)
        with self._lock:
            kernel = self._kernels.setdefault(key, kernel)
        self._metrics.looked_up(module, name)
        return kernel

    def close(self) -> None:
        """Unload the modules; kernels from this registry can no longer launch."""
        if self.unloaded:
            return
        self.unloaded = True
        self._finalizer()
        with self._lock:
            self._kernels.clear()  # each held this registry: a cycle

    def __enter__(self) -> KernelRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<KernelRegistry {sorted(self._images)} ({state})>"


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
