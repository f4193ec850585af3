"""The hook specification: the whole contract between metrale and a backend plugin.

A backend plugin is a module (or object) with functions marked by
[`hookimpl`][metrale_core.hookimpl], registered in the entry-point group ``metrale.backends``;
the entry point's name is the backend's name:

    # pyproject.toml of the plugin's distribution
    [project.entry-points."metrale.backends"]
    mybackend = "my_package._plugin"

    # my_package/_plugin.py
    from metrale_core.plugin import BackendRegistration, hookimpl

    @hookimpl
    def metrale_backend(settings):
        return BackendRegistration(open=MyRawDevice.open, probe=MyRawDevice.probe)

What a backend needs is importable from [`metrale_core.plugin`][metrale_core.plugin].

Every hook is documented with the same template: what it is for, how the
results of several plugins combine, its parameters, and what it returns.

metrale calls every hook through pluggy, one plugin at a time: an
implementation may take fewer arguments than its spec offers, and one
that takes an argument the spec lacks is refused when the plugin loads.
The spec of ``metrale_settings`` is written beside the settings (the
settings scan validates against it) and listed here with the others.
A spec's body is its docstring, as in pytest's ``hookspec.py``: pluggy
reads its signature and never calls it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._settings.hooks import PROJECT_NAME, hookimpl, hookspec
from ._settings.plugins import metrale_settings

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ._registration import BackendRegistration
    from ._settings.model import MetraleSettings
    from ._types import KernelImplementation, RedZoneViolation

__all__ = [
    "PROJECT_NAME",
    "hookimpl",
    "hookspec",
    "metrale_backend",
    "metrale_kernel_implementations",
    "metrale_redzone_violation",
    "metrale_settings",
]


@hookspec
def metrale_backend(settings: MetraleSettings) -> BackendRegistration | None:
    """Describe the backend this plugin provides.

    Called once for each plugin, on its own (never as one call over all
    plugins), whenever backends are discovered, so that a plugin that fails
    cannot hide the others. The result is validated at the boundary: anything
    but a [`BackendRegistration`][metrale_core.BackendRegistration] makes the backend
    unavailable, with a reason naming the plugin's distribution.

    **Results:** one per plugin; not combined.

    :param settings: the settings discovery runs with. Read them, never the
        environment.
    :returns: a [`BackendRegistration`][metrale_core.BackendRegistration], or ``None`` when
        the plugin provides no backend (it is then listed as unavailable).
    """


@hookspec
def metrale_kernel_implementations(settings: MetraleSettings) -> Iterable[KernelImplementation]:  # type: ignore[empty-body]
    """Provide Python implementations of kernels, for backends that run kernels on the CPU.

    Called for each plugin on its own when a backend opens; the fake backend
    runs a launch of ``(module, kernel)`` through the implementation
    registered for it. A plugin that raises, or returns something other than
    [`KernelImplementation`][metrale_core.KernelImplementation] records, is skipped with a
    WARNING naming it.

    **Results:** the records of every plugin are concatenated; where two
    plugins implement one kernel, the one registered last wins.

    :param settings: the settings the backend opens with.
    :returns: an iterable of [`KernelImplementation`][metrale_core.KernelImplementation]
        (made with [`kernel_implementation`][metrale_core.kernel_implementation]).
    """


@hookspec
def metrale_redzone_violation(backend: str, violation: RedZoneViolation) -> None:
    """Observe a red-zone violation, wherever a backend finds one.

    Called for each violation, on every plugin that implements it, before the
    violation is logged or raised (``redzone_action``), whether a scan, a
    ``free`` or a graph launch found it. An observer that raises is logged
    and skipped; it cannot stop the others or the report.

    **Results:** ignored.

    :param backend: the name of the backend that found it.
    :param violation: the [`RedZoneViolation`][metrale_core.RedZoneViolation].
    """
