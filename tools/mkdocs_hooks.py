"""mkdocs hooks: pages generated from the code, so they cannot drift from it.

``<!-- metrale:settings-table -->`` in a page becomes the table of every
``MetraleSettings`` field: its variable, type, default and description.
"""

from __future__ import annotations

from typing import Any

from metrale_core import MetraleSettings
from metrale_core._settings import ENV_PREFIX

PLACEHOLDER = "<!-- metrale:settings-table -->"
_SIZES = {"redzone", "fake_memory_bytes"}


def _default(name: str, value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{value}`"
    if isinstance(value, int) and name in _SIZES and value >= 1 << 30:
        return f"`{value >> 30} GiB`"
    if name == "redzone_fill":
        return f"`{value:#04x}`"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _type(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None").replace(" | ", " or ")


def settings_table() -> str:
    """The Markdown table of every setting, from ``MetraleSettings`` itself."""
    rows = ["| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in MetraleSettings.model_fields.items():
        kind = _type(field.annotation) + (" (size)" if name in _SIZES else "")
        rows.append(
            f"| `{ENV_PREFIX}{name.upper()}` | {kind} | {_default(name, field.default)} "
            f"| {field.description or ''} |"
        )
    return "\n".join(rows)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Fill the placeholders of a page."""
    return markdown.replace(PLACEHOLDER, settings_table()) if PLACEHOLDER in markdown else markdown
