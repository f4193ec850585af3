"""Pytest helpers: a fixture's params over every discovered backend, and the state machine bound to one."""

from __future__ import annotations

from typing import Any

from .. import MetraleSettings, available_backends
from ._capabilities import backend_capabilities
from ._machine import BackendMachine

__all__ = ["backend_params", "backend_state_machine"]


def backend_params(
    settings: MetraleSettings | None = None, *, expected: tuple[str, ...] = (), needs: tuple[str, ...] = ()
) -> list[Any]:
    """``pytest.param``s of every discovered backend, for ``@pytest.fixture(params=...)``.

    An unavailable backend, or one of ``expected`` that is not even
    installed, is a param skipped with the reason, so a test report says
    why it did not run there (with ``expected=("cuda",)``, a machine
    without the CUDA backend installed still shows ``cuda``, skipped).
    With ``needs`` (names of [`CAPABILITIES`][metrale_core.testing.CAPABILITIES]), an
    available backend that lacks one of them is skipped too, with the reason
    (each such backend is opened once, here, to probe it).
    """
    import pytest

    settings = settings or MetraleSettings()
    infos = available_backends(settings)
    params = []
    for name, info in infos.items():
        reason = None if info.available else f"backend {name} unavailable: {info.reason}"
        if reason is None and needs:
            capabilities = backend_capabilities(name, settings)
            reason = next((why for why in map(capabilities.why_not, needs) if why is not None), None)
        marks = [] if reason is None else [pytest.mark.skip(reason=reason)]
        params.append(pytest.param(name, marks=marks, id=name))
    for name in expected:
        if name not in infos:
            skip = pytest.mark.skip(reason=f"backend {name} is not installed")
            params.append(pytest.param(name, marks=[skip], id=name))
    return params


def backend_state_machine(
    name: str, settings: MetraleSettings | None = None
) -> type[BackendMachine]:
    """A [`BackendMachine`][metrale_core.testing.BackendMachine] subclass bound to backend ``name`` and ``settings``.

    ``backend_state_machine("mybackend").TestCase`` is a ``unittest.TestCase``
    that pytest collects.
    """
    return type(
        f"BackendMachine_{name}",
        (BackendMachine,),
        {"backend_name": name, "settings": settings},
    )
