"""Finding backends through the entry-point group ``metrale.backends``, and opening one.

Each entry point is loaded on its own and registered with one pluggy
``PluginManager("metrale")``, which validates its hooks against the spec.
Every hook is called one way: through pluggy, one plugin at a time
(`alone`, `each`). So an implementation may take fewer arguments than
its spec, and a plugin that fails to import, raises, or returns nonsense
is listed as unavailable with a reason naming its distribution; the
others stand.

The entry points are scanned once per state of ``sys.path`` (shared with the
settings, which find the plugins' settings models through the same group).
``open_backend(name)`` probes only the backend it opens; ``auto`` and
``available_backends()`` probe every one.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from collections.abc import Callable
from typing import final

import pluggy

from . import hookspec
from ._backend import GpuBackend
from ._device.raw import RawDevice
from ._errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    InvalidArgumentError,
    MetraleError,
)
from ._registration import BackendRegistration
from ._settings.hooks import alone, each
from ._settings.model import MetraleSettings
from ._settings.plugins import ENTRY_POINT_GROUP, backend_entry_points
from ._types import BackendInfo, KernelImplementation, RedZoneViolation, as_index, format_bytes

__all__ = ["ENTRY_POINT_GROUP", "available_backends", "device_count", "open_backend"]

_log = logging.getLogger("metrale.discovery")

#: The command that installs a backend, named where none is installed (the core alone has none).
INSTALL_ADVICE = 'pip install metrale (the fake backend) or pip install "metrale[cuda]" (NVIDIA GPUs)'
#: Red zones larger than this (``METRALE_REDZONE``, bytes) are warned of when a backend opens.
LARGE_REDZONE = 1 << 20


@final
@dataclasses.dataclass(frozen=True, slots=True)
class _Found:
    info: BackendInfo
    registration: BackendRegistration | None
    package: str


def _distribution(ep: importlib.metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return None if dist is None else str(dist.name)


def _discover(settings: MetraleSettings) -> dict[str, _Found]:
    return _discover_with_plugins(settings)[0]


def _discover_with_plugins(
    settings: MetraleSettings, only_probe: str | None = None,
) -> tuple[dict[str, _Found], pluggy.PluginManager]:
    """Every backend, loaded and registered; ``only_probe`` names the one backend whose availability probe
    runs (the one a named open opens), the others are listed as not probed. ``None`` probes every one."""
    by_name = backend_entry_points()

    pm = pluggy.PluginManager(hookspec.PROJECT_NAME)
    pm.add_hookspecs(hookspec)
    found: dict[str, _Found] = {}
    loaded: dict[str, object] = {}

    def unavailable(name: str, dist: str | None, reason: str, package: str = "") -> None:
        found[name] = _Found(BackendInfo(name, False, _one_line(reason), dist), None, package)

    for name, eps in sorted(by_name.items()):
        dists = sorted({_distribution(ep) or "?" for ep in eps})
        ep = eps[0]
        dist = _distribution(ep)
        if len(eps) > 1:
            unavailable(
                name,
                ", ".join(dists),
                f"the name {name!r} is claimed by {len(eps)} entry points, from "
                f"distributions {' and '.join(dists)}; uninstall all but one",
            )
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=name)
        except Exception as exc:  # a plugin's import may fail in any way
            unavailable(
                name, dist,
                f"plugin {ep.value!r} of distribution {dist} failed to load: "
                f"{type(exc).__name__}: {exc}; reinstall or fix that distribution",
            )
            continue
        loaded[name] = plugin

    for name, plugin in loaded.items():
        ep = by_name[name][0]
        dist = _distribution(ep)
        package = ep.module.partition(".")[0]
        try:
            results = alone(pm, "metrale_backend", plugin)(settings=settings)
        except Exception as exc:
            unavailable(name, dist, f"the metrale_backend hook of {dist} raised {type(exc).__name__}: {exc}")
            continue
        registrations = [r for r in results if r is not None]
        if len(registrations) != 1 or not isinstance(registrations[0], BackendRegistration):
            unavailable(
                name, dist,
                f"the metrale_backend hook of {dist} returned {results!r}; it must return "
                f"exactly one BackendRegistration",
            )
            continue
        registration = registrations[0]
        problem = _malformed(registration)
        if problem is not None:
            unavailable(name, dist, f"the BackendRegistration of {dist} {problem}")
            continue
        if only_probe is not None and name != only_probe:
            reason: str | None = "not probed: another backend was asked for"
        else:
            try:
                reason = registration.probe(settings)
            except Exception as exc:
                reason = f"its availability probe raised {type(exc).__name__}: {exc}"
        info = BackendInfo(name, reason is None, None if reason is None else _one_line(reason), dist,
                           registration.description)
        found[name] = _Found(info, registration, package)
    return dict(sorted(found.items())), pm


def _malformed(registration: BackendRegistration) -> str | None:
    """What is wrong with a registration's fields, or ``None``."""
    preference = registration.preference
    if isinstance(preference, bool) or not isinstance(preference, int):
        return f"has preference={preference!r}; it must be an integer"
    cls = registration.backend_class
    if cls is not None and not (isinstance(cls, type) and issubclass(cls, GpuBackend)):
        return f"has backend_class={cls!r}; it must be GpuBackend or a subclass of it"
    if not callable(registration.device_count):
        return f"has device_count={registration.device_count!r}; it must be a function of the settings"
    return None


def _none_installed(requested: str) -> str:
    return f"no backend is installed (asked for {requested!r}); install one: {INSTALL_ADVICE}"


def _choose_auto(found: dict[str, _Found]) -> str:
    """The available backend with the highest preference; of equals, the name first in alphabetical order."""
    ranked = sorted(
        (-f.registration.preference, name)
        for name, f in found.items()
        if f.registration is not None and f.info.available
    )
    if not ranked:
        if not found:
            raise BackendUnavailableError(_none_installed("auto"))
        reasons = "; ".join(f"{name}: {f.info.reason}" for name, f in found.items())
        fake = "" if "fake" in found else "; pip install metrale adds the fake backend, which runs anywhere"
        raise BackendUnavailableError(
            f"backend auto: no installed backend is available here ({reasons}){fake}; see `metrale backends`"
        )
    _log.info("backend auto: chose %s (preference %d, of %s)", ranked[0][1], -ranked[0][0],
              ", ".join(name for _, name in ranked))
    return ranked[0][1]


def _close_quietly(raw: object) -> None:
    """Close what a failed open left, if it can be closed; a failure to close is logged, not raised."""
    close = getattr(raw, "close", None)
    if not callable(close):
        return
    try:
        close()
    except Exception:
        _log.warning("closing the raw device of a backend that failed to open raised", exc_info=True)


def _kernel_implementations(pm: pluggy.PluginManager, settings: MetraleSettings) -> list[KernelImplementation]:
    """Every plugin's ``metrale_kernel_implementations``, each called on its own."""
    collected: list[KernelImplementation] = []
    for name, hook in each(pm, "metrale_kernel_implementations"):
        try:
            records = [r for result in hook(settings=settings) for r in result or ()]
        except Exception as exc:
            _log.warning("plugin %s: metrale_kernel_implementations raised %s: %s", name, type(exc).__name__, exc)
            continue
        bad = [r for r in records if not isinstance(r, KernelImplementation)]
        if bad:
            _log.warning("plugin %s: metrale_kernel_implementations returned %r, not KernelImplementation "
                         "records; skipped", name, bad[:3])
            continue
        collected.extend(records)
    return collected


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def available_backends(settings: MetraleSettings | None = None) -> dict[str, BackendInfo]:
    """Every discovered backend, whether or not it can run here (each one's availability probe runs)."""
    return {name: f.info for name, f in _discover(settings or MetraleSettings()).items()}


def _unknown_hint(requested: str, found: dict[str, _Found]) -> str:
    """What ends the message of a name no installed backend has: the command that installs it (``cuda``, metrale's
    own extra; the fake comes with metrale), or the installed name (or ``auto``) one typo away."""
    if requested == "cuda":
        from ._install import install_command

        return f"; the cuda backend is not installed: {install_command('cuda')}"
    import difflib

    close = difflib.get_close_matches(requested, [*found, "auto"], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _available(name: str | None, settings: MetraleSettings) -> tuple[str, _Found, pluggy.PluginManager]:
    """The backend ``name`` (``None``: ``settings.backend``; ``"auto"``: chosen) found available here, with the
    plugin manager; else ``BackendNotFoundError`` or ``BackendUnavailableError`` saying why."""
    requested = settings.backend if name is None else name
    # a named open probes only that backend (a probe may load a driver); auto compares them all
    found, plugins = _discover_with_plugins(settings, None if requested == "auto" else requested)
    if requested == "auto":
        requested = _choose_auto(found)
    entry = found.get(requested)
    installed = ", ".join(found) or "none"
    if entry is None:
        if not found:
            error = BackendUnavailableError if name is None else BackendNotFoundError
            raise error(_none_installed(requested))
        if name is None:
            raise BackendUnavailableError(
                f"the configured backend {requested!r} (settings.backend, from METRALE_BACKEND or a "
                f"keyword) names no installed backend (installed: {installed}); set it to one of those "
                f"or to auto{_unknown_hint(requested, found)}"
            )
        raise BackendNotFoundError(
            f"no backend named {requested!r} is installed (installed: {installed}); "
            f"see `metrale backends`{_unknown_hint(requested, found)}"
        )
    if entry.registration is None or not entry.info.available:
        raise BackendUnavailableError(f"backend {requested!r} is not available here: {entry.info.reason}")
    return requested, entry, plugins


def device_count(name: str | None = None, *, settings: MetraleSettings | None = None) -> int:
    """How many devices backend ``name`` can open here (ordinals ``0 .. count - 1``), as its registration's
    ``device_count`` says: the CUDA driver's count (after ``CUDA_VISIBLE_DEVICES``), the fake's
    ``device_count`` setting. ``name=None`` takes ``settings.backend``; ``"auto"`` the backend it would open.

    :raises BackendNotFoundError: no backend of that name is installed.
    :raises BackendUnavailableError: it cannot run here, or it cannot count its devices.
    """
    settings = settings or MetraleSettings()
    requested, entry, _ = _available(name, settings)
    assert entry.registration is not None
    try:
        count = entry.registration.device_count(settings)
    except MetraleError as exc:
        raise BackendUnavailableError(f"backend {requested!r} cannot count its devices: {exc}") from exc
    except Exception as exc:
        raise BackendUnavailableError(
            f"backend {requested!r} ({entry.info.distribution}) failed to count its devices: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if type(count) is not int or count < 0:
        raise BackendUnavailableError(
            f"backend {requested!r} ({entry.info.distribution}) counted {count!r} devices; its registration's "
            f"device_count must return an int >= 0"
        )
    return count


def open_backend(
    name: str | None = None,
    *,
    ordinal: int = 0,
    settings: MetraleSettings | None = None,
) -> GpuBackend:
    """Open backend ``name`` on device ``ordinal``.

    ``name=None`` takes ``settings.backend``; ``"auto"`` picks, of the
    backends available here, the one whose registration declares the highest
    ``preference`` (of equals, the name first in alphabetical order).

    A backend asked for by name is the only one whose availability probe
    runs (another backend's probe may load its driver: ``open_backend("fake")``
    never imports ``cuda.bindings``); ``"auto"`` probes every one. Every
    installed plugin is still loaded, and its kernel implementations and
    red-zone hooks apply, whichever backend is opened.
    """
    settings = settings or MetraleSettings()
    index = as_index(ordinal)
    if index is None or index < 0:
        raise InvalidArgumentError(f"open_backend: ordinal must be a non-negative integer, got {ordinal!r}")
    requested, entry, plugins = _available(name, settings)
    assert entry.registration is not None
    registration = entry.registration
    try:
        raw = registration.open(settings, index)
    except MetraleError:
        raise
    except Exception as exc:
        raise BackendUnavailableError(
            f"backend {requested!r} ({entry.info.distribution}) failed to open device {ordinal}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(raw, RawDevice):
        _close_quietly(raw)
        raise BackendUnavailableError(
            f"backend {requested!r} ({entry.info.distribution}) failed to open device {ordinal}: its open() "
            f"returned {type(raw).__qualname__}, not a RawDevice; fix or uninstall that distribution"
        )
    cls = registration.backend_class or GpuBackend
    try:
        backend = cls(requested, index, settings, raw, internal_packages={entry.package})
    except MetraleError:
        _close_quietly(raw)
        raise
    except Exception as exc:
        _close_quietly(raw)
        raise BackendUnavailableError(
            f"backend {requested!r} ({entry.info.distribution}) failed to start on device {ordinal}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    except BaseException:
        _close_quietly(raw)
        raise
    try:
        implementations = _kernel_implementations(plugins, settings)
        if implementations:
            backend.add_kernel_implementations(*implementations)
        for _, hook in each(plugins, "metrale_redzone_violation"):
            backend.on_redzone_violation(_observer(hook))
    except BaseException:
        backend.close()
        raise
    if settings.redzone > LARGE_REDZONE:
        _warn_large_redzone(settings.redzone, f"{backend.name}:{backend.ordinal}")
    return backend


def _warn_large_redzone(redzone: int, where: str) -> None:
    """The WARNING a backend that opens with red zones over `LARGE_REDZONE` logs, once per open."""
    logging.getLogger("metrale").warning(
        "red zones of %s (METRALE_REDZONE=%d) on %s: each zoned allocation costs that much more device memory, "
        "and the time to fill and check it; 64 to 4096 bytes catch most overruns",
        format_bytes(redzone), redzone, where,
    )


def _observer(hook: pluggy.HookCaller) -> Callable[[str, RedZoneViolation], object]:
    """One plugin's ``metrale_redzone_violation`` as a backend observer."""

    def observe(backend: str, violation: RedZoneViolation) -> object:
        return hook(backend=backend, violation=violation)

    return observe
