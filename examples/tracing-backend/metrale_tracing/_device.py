"""The raw layer: every ``RawDevice`` primitive delegated to an inner device, and recorded."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any, Final

from metrale_core import GpuBackend
from metrale_core.plugin import RawDevice

__all__ = ["TracingBackend", "TracingDevice"]

#: How many calls the trace keeps by default (the oldest are dropped first); ``METRALE_TRACING_MAX_CALLS``.
TRACE_LENGTH: Final = 10_000

#: The primitives of the contract: the abstract ones and the optional kernel ones.
_PRIMITIVES: Final = sorted(
    RawDevice.__abstractmethods__
    | {"bind_to_thread", "compute_capability", "module_load", "module_unload", "module_function", "launch",
       "add_kernel_implementations", "export_memory", "import_memory", "forget_memory", "address_range",
       "order_foreign_stream", "foreign_stream", "exchange_capture_mode", "baseline", "fresh_memory_reads_zeros",
       "multiprocessors", "tensor_map_encode", "tensor_map_replace_address"}
)


class TracingDevice(RawDevice):
    """Delegates every primitive to ``inner`` and records its name, thread-safely."""

    def __init__(self, inner: RawDevice, max_calls: int = TRACE_LENGTH) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self.calls: collections.deque[str] = collections.deque(maxlen=max_calls)

    def _record(self, name: str) -> None:
        with self._lock:
            self.calls.append(name)

    def recorded(self) -> list[str]:
        """The primitives called so far, oldest first (a copy, taken under the lock)."""
        with self._lock:
            return list(self.calls)


def _delegate(name: str) -> Callable[..., Any]:
    def primitive(self: TracingDevice, *args: Any, **kwargs: Any) -> Any:
        self._record(name)
        return getattr(self.inner, name)(*args, **kwargs)

    primitive.__name__ = primitive.__qualname__ = name
    primitive.__doc__ = f"``{name}`` of the inner device, recorded."
    return primitive


for _name in _PRIMITIVES:
    setattr(TracingDevice, _name, _delegate(_name))
TracingDevice.__abstractmethods__ = frozenset()


class TracingBackend(GpuBackend):
    """The backend object ``open_backend("tracing")`` returns: a ``GpuBackend`` with the trace."""

    def raw_calls(self) -> list[str]:
        """The raw primitives called so far, oldest first."""
        raw = self.raw
        assert isinstance(raw, TracingDevice)
        return raw.recorded()
