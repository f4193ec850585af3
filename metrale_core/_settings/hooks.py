"""How metrale calls a plugin's hook: through pluggy, one plugin at a time.

- `PROJECT_NAME`, `hookspec`, `hookimpl`: pluggy's project and its two markers.
- `metrale_settings`: the settings hook's spec. It is written here, below the settings
  model, so the settings scan validates against it; `metrale_core.hookspec` lists it
  with the other hooks.
- `alone`: the one way to call a hook. It is pluggy's caller for one plugin, so
  argument selection and the spec apply, and a failure stays that plugin's own.
- `each`: `alone` for every plugin that implements a hook.
- `settings_hook`: one plugin's ``metrale_settings``, validated against its spec.

Only pluggy is imported at run time; the settings model imports this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, final

import pluggy

if TYPE_CHECKING:
    from .model import PluginSettings

__all__ = ["PROJECT_NAME", "alone", "each", "hookimpl", "hookspec", "metrale_settings", "settings_hook"]

#: The pluggy project name of metrale's hooks.
PROJECT_NAME: Final = "metrale"

hookspec: Final = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl: Final = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def metrale_settings() -> type[PluginSettings] | None:
    """Declare the plugin's own settings: a [`PluginSettings`][metrale_core.plugin.PluginSettings] subclass.

    Called for each plugin on its own, once per process (again only when
    ``sys.path`` changes), when the first [`MetraleSettings`][metrale_core.MetraleSettings]
    is built; it takes no settings, since it says what they are. The model's
    ``env_prefix`` must be ``METRALE_`` and the entry point's name in capitals
    (``METRALE_FAKE_`` for ``fake``). Each field ``memory_bytes`` of it is then
    the variable ``METRALE_FAKE_MEMORY_BYTES`` and the keyword and attribute
    ``fake_memory_bytes`` of ``MetraleSettings``, validated with the core's
    settings, listed in the settings table and known to the unknown-variable
    warning; the plugin reads its values with ``settings.plugin(FakeSettings)``.
    A hook that raises, returns anything but one such class, or whose model
    names a setting the core or another plugin already has, is skipped with a
    WARNING naming the plugin, and the others stand.

    **Results:** one per plugin; not combined.

    :returns: the plugin's [`PluginSettings`][metrale_core.plugin.PluginSettings]
        subclass, or ``None`` when it has no settings of its own.
    """
    raise RuntimeError("hook specification: never called directly")  # pragma: no cover


@final
class _SettingsSpec:
    """The spec the settings scan registers a plugin against (the other hooks are discovery's)."""

    metrale_settings = staticmethod(metrale_settings)


def alone(pm: pluggy.PluginManager, hook: str, plugin: object) -> pluggy.HookCaller:
    """Hook ``hook`` of ``plugin`` alone, as pluggy calls it (``pm.subset_hook_caller``).

    - Argument selection: an implementation may take fewer arguments than the spec offers.
    - The spec: a call that leaves out one of the spec's arguments warns.
    - Confinement: the other plugins are left out, so a failure is this plugin's alone.
    """
    others = [p for p in pm.get_plugins() if p is not plugin]
    return pm.subset_hook_caller(hook, remove_plugins=others)


def each(pm: pluggy.PluginManager, hook: str) -> list[tuple[str, pluggy.HookCaller]]:
    """`alone` for each plugin that implements ``hook``, with the plugin's name, in registration order."""
    caller: pluggy.HookCaller | None = getattr(pm.hook, hook, None)
    plugins: dict[str, object] = {}
    for impl in () if caller is None else caller.get_hookimpls():
        plugins.setdefault(impl.plugin_name, impl.plugin)
    return [(name, alone(pm, hook, plugin)) for name, plugin in plugins.items()]


def settings_hook(plugin: object, name: str) -> list[object]:
    """The results of ``plugin``'s ``metrale_settings`` (registered as ``name``), through `alone`.

    :raises pluggy.PluginValidationError: its implementation does not fit the spec.
    :raises Exception: whatever the hook raised.
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(_SettingsSpec)
    pm.register(plugin, name=name)
    return list(alone(pm, "metrale_settings", plugin)())
