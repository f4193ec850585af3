"""Injected driver failures, for backends that offer them: the `FaultInjecting` protocol.

- `FaultInjecting`: a backend object with ``inject_fault``, such as the fake's
  ``FakeBackend``. It is runtime-checkable: ``isinstance(gpu, FaultInjecting)``
  says whether a backend can inject, and narrows its type for the call.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["FaultInjecting"]


@runtime_checkable
class FaultInjecting(Protocol):
    """A backend that can make its next raw calls fail, as a driver would."""

    def inject_fault(self, op: str, *, nth: int = 1, code: str = "CUDA_ERROR_UNKNOWN") -> None:
        """Make the ``nth`` next raw call of ``op`` fail once with CUDA result ``code``."""
