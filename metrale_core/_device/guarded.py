"""The guarded raw layer: one rule for what a raw call's exception becomes.

- `raise_raw`: the rule. A device fault latches the context's fault; a
  ``MetraleError`` goes on; a foreign exception (a plugin's bug) becomes a
  ``DriverError`` naming the call.
- `GuardedRaw`: the raw layer as the core calls it, every call under `raise_raw`.
  The hot paths call the plugin itself and apply `raise_raw` in their ``except``.
- `Detached`: a closed backend's raw layer; every primitive raises ``BackendClosedError``.

It sits below the context: it reaches it through a callable that returns it (a
weak reference), typed by the one method it needs (`Faulting`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, Protocol, final

from .._errors import BackendClosedError, DeviceFaultError, DriverError, MetraleError

__all__ = ["Detached", "Faulting", "GuardedRaw", "raise_raw"]


class Faulting(Protocol):
    """What the guarded layer asks of its context: to latch a device fault and describe it."""

    def faulted_by(self, exc: DeviceFaultError) -> DeviceFaultError: ...


def raise_raw(context: Faulting | None, who: str, name: str, exc: Exception) -> NoReturn:
    """Raise what the exception ``exc`` of raw call ``name`` becomes (call it in the ``except`` block).

    - ``DeviceFaultError``: latched by ``context``, so every later call reports the first fault.
    - Any other ``MetraleError``: raised as it is, its cause kept.
    - A foreign exception: a ``DriverError`` naming backend ``who`` and the call, caused by it.
    """
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


@final
class GuardedRaw:
    """The raw layer as the core calls it: one place that watches every raw call.

    - Each method is looked up once and wrapped: its exceptions go through `raise_raw`.
    - ``context`` returns the context, or ``None`` once it is gone (a weak reference:
      the context holds this layer, so neither keeps the other alive).
    - `detach` (at ``close()``) lets go of the raw device: every later call raises
      [`BackendClosedError`][metrale_core.BackendClosedError].
    """

    def __init__(self, target: object, context: Callable[[], Faulting | None], name: str) -> None:
        self._target: object = target
        self._context = context
        self._name = name

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
        """Let go of the raw device and of every method looked up so far (at ``close()``).

        Later calls raise ``BackendClosedError(closed)``.
        """
        name = self._name
        self.__dict__.clear()
        self._target = Detached(closed)
        self._context = _dead_ref
        self._name = name


@final
class Detached:
    """A closed backend's raw layer: every primitive raises ``BackendClosedError``."""

    __slots__ = ("_closed",)

    def __init__(self, closed: str) -> None:
        self._closed = closed

    def __getattr__(self, name: str) -> Callable[..., NoReturn]:
        closed = self._closed

        def refuse(*args: object, **kwargs: object) -> NoReturn:
            raise BackendClosedError(f"raw {name}(): {closed}")

        return refuse
