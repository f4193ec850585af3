"""mkdocs hooks: pages generated from the code, so they cannot drift from it.

``<!-- metrale:settings-table -->`` in a page becomes the table of every
``MetraleSettings`` field (its variable, type, default and description),
followed by one table per installed plugin that declares settings of its own
(the ``metrale_settings`` hook), the bundled fake's among them.
"""

from __future__ import annotations

from typing import Any

from pydantic.fields import FieldInfo

from metrale_core import MetraleSettings
from metrale_core._settings.model import installed_plugin_settings
from metrale_core._settings.parsing import is_size
from metrale_core._settings.plugins import ENV_PREFIX

PLACEHOLDER = "<!-- metrale:settings-table -->"


def _default(name: str, field: FieldInfo) -> str:
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{value}`"
    if isinstance(value, int) and is_size(field) and value >= 1 << 30:
        return f"`{value >> 30} GiB`"
    if name == "redzone_fill":
        return f"`{value:#04x}`"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None").replace(" | ", " or ")


def _table(prefix: str, fields: dict[str, FieldInfo]) -> list[str]:
    rows = ["| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in fields.items():
        kind = _type(field.annotation) + (" (size)" if is_size(field) else "")
        rows.append(f"| `{prefix}{name.upper()}` | {kind} | {_default(name, field)} | {field.description or ''} |")
    return rows


def settings_table() -> str:
    """The Markdown tables of every setting, from ``MetraleSettings`` and the installed plugins' models."""
    lines = _table(ENV_PREFIX, MetraleSettings.model_fields)
    for plugin in installed_plugin_settings():
        lines += [
            "",
            f"Settings of the `{plugin.name}` backend (distribution `{plugin.distribution}`, "
            f"`{plugin.model.__module__}.{plugin.model.__qualname__}`), read by that backend only; "
            f"each is also the keyword and attribute `{plugin.name}_<field>` of `MetraleSettings`:",
            "",
            *_table(plugin.env_prefix, plugin.model.model_fields),
        ]
    return "\n".join(lines)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Fill the placeholders of a page."""
    return markdown.replace(PLACEHOLDER, settings_table()) if PLACEHOLDER in markdown else markdown
