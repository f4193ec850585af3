"""How metrale calls a plugin's hook: through pluggy, one plugin at a time.

- `PROJECT_NAME`, `hookspec`, `hookimpl`: pluggy's project and its two markers.
- `alone`: the one way to call a hook. It is pluggy's caller for one plugin, so
  argument selection and the spec apply, and a failure stays that plugin's own.
- `each`: `alone` for every plugin that implements a hook.

The settings hook's spec lives in `plugins`, beside `PluginSettings` (it names it); the
others in `metrale_core.hookspec`. Only pluggy is imported here.
"""

from __future__ import annotations

from typing import Final

import pluggy

__all__ = ["PROJECT_NAME", "alone", "each", "hookimpl", "hookspec"]

#: The pluggy project name of metrale's hooks.
PROJECT_NAME: Final = "metrale"

hookspec: Final = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl: Final = pluggy.HookimplMarker(PROJECT_NAME)


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
