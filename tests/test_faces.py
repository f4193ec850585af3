"""Faces that cannot drift: what a docstring or a page draws of the code is checked against the code.

- Each wing's ``__init__.py`` docstring names every module the layer test lists for that wing (`INSIDE`).
- The error tree drawn in ``_errors.py``'s docstring (and in ``docs/reference.md``) holds every class of
  ``_errors.__all__``, each under its real base class.
- ``docs/building.md``'s list of compiled modules is the block `twins_block` makes of ``_twins.TWINS``.

A failure says what to write, and where.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

from metrale_core import _errors
from metrale_core._twins import TWINS
from tests.test_layers import CORE, INSIDE

ROOT = CORE.parent

# -- the wings' docstrings -----------------------------------------------------------------------------------


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def _named(doc: str) -> set[str]:
    """The modules a docstring names: each word in backticks, with or without a leading dot (`ledger`,
    `.ledger`, ``ledger``)."""
    return set(re.findall(r"`+\.?([A-Za-z_]\w*)`+", doc))


def _unnamed(wing: str, modules: Iterable[str]) -> list[str]:
    """One line for each of ``modules`` (the layer test's list for ``wing``) that the wing's docstring does not
    name."""
    init = CORE / wing / "__init__.py"
    named = _named(_docstring(init))
    return [
        f"tests/test_layers.py lists {wing}.{module} (INSIDE[{wing!r}]), and the docstring of "
        f"{init.relative_to(ROOT)} does not name it: add a line `{module}`: what it holds"
        for module in modules
        if module != "__init__" and module not in named
    ]


@pytest.mark.parametrize("wing", sorted(INSIDE))
def test_each_wing_docstring_names_its_modules(wing: str) -> None:
    missing = _unnamed(wing, [module for floor in INSIDE[wing] for module in floor])
    assert not missing, "\n".join(missing)


def test_a_module_added_to_the_layer_list_is_caught() -> None:
    listed = [module for floor in INSIDE["_memory"] for module in floor]
    assert _unnamed("_memory", listed) == []
    [line] = _unnamed("_memory", [*listed, "newcomer"])
    assert "_memory.newcomer" in line and "metrale_core/_memory/__init__.py" in line


# -- the error tree ------------------------------------------------------------------------------------------

#: Where the tree is drawn: the module's docstring, and the reference page (in its ```text block).
TREES = {
    "metrale_core/_errors.py": _errors.__doc__ or "",
    "docs/reference.md": (ROOT / "docs" / "reference.md").read_text(encoding="utf-8"),
}


def _tree(text: str) -> dict[str, tuple[str | None, str]]:
    """Each class a drawing holds: its parent in the drawing (``None`` for the root) and its line.

    A drawing is the block of lines that starts with ``MetraleError`` and goes on while each line starts with
    ``├``, ``└`` or ``│`` after its indent; a class's parent is the nearest line above it whose name starts
    further left."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"\s*MetraleError\b", line)), None)
    assert start is not None, "no tree of errors drawn (a line that starts with MetraleError)"
    indent = len(lines[start]) - len(lines[start].lstrip())
    found: dict[str, tuple[str | None, str]] = {}
    above: list[tuple[int, str]] = []  # (column of the name, the name), the chain of parents
    for line in lines[start:]:
        body = line[indent:]
        match = re.match(r"([\s│├└─]*)(\w+)", body)
        if match is None or (found and not body.lstrip().startswith(("├", "└", "│"))):
            break
        column, name = len(match.group(1)), match.group(2)
        while above and above[-1][0] >= column:
            above.pop()
        found[name] = (above[-1][1] if above else None, body)
        above.append((column, name))
    return found


def _classes() -> dict[str, type]:
    return {name: value for name in _errors.__all__ if isinstance(value := getattr(_errors, name), type)}


@pytest.mark.parametrize("where", sorted(TREES))
def test_the_error_tree_holds_every_class_under_its_base(where: str) -> None:
    tree, classes = _tree(TREES[where]), _classes()
    problems = [f"{name} is drawn in {where} but is not a class of _errors.__all__" for name in tree.keys() - classes]
    for name, cls in sorted(classes.items()):
        base = next((b for b in cls.__bases__ if issubclass(b, _errors.MetraleError)), None)
        if name not in tree:
            problems.append(f"{name} (under {base and base.__name__}) is missing from the tree in {where}")
            continue
        parent, line = tree[name]
        if parent != (base.__name__ if base else None):
            problems.append(f"{name} is drawn under {parent} in {where}; its base is {base and base.__name__}")
        for other in cls.__bases__:
            if other is not base and other is not Exception and f"also a {other.__name__}" not in line:
                problems.append(f"{name} is also a {other.__name__}: its line in {where} should say so")
    assert not problems, "\n".join(problems)


def test_the_reference_page_draws_the_same_tree() -> None:
    lines = {where: [line for _, line in _tree(text).values()] for where, text in TREES.items()}
    assert lines["docs/reference.md"] == lines["metrale_core/_errors.py"], "draw the tree of _errors.py on the page"


def test_a_drawing_is_read_by_its_columns() -> None:
    drawing = "\n".join([
        "MetraleError",
        " ├── ConfigError",
        " │    └── ArenaFullError",
        " └── OutOfMemoryError",
    ])
    assert _tree(drawing) == {
        "MetraleError": (None, "MetraleError"),
        "ConfigError": ("MetraleError", " ├── ConfigError"),
        "ArenaFullError": ("ConfigError", " │    └── ArenaFullError"),
        "OutOfMemoryError": ("MetraleError", " └── OutOfMemoryError"),
    }


# -- the compiled modules on docs/building.md ----------------------------------------------------------------

BUILDING = ROOT / "docs" / "building.md"
BEGIN = "<!-- twins: the rows are made from metrale_core._twins.TWINS; tests/test_faces.py checks them -->"
END = "<!-- twins: end -->"


def twins_block() -> str:
    """The block of ``docs/building.md`` that lists the compiled modules: a row per entry of ``TWINS``, its name
    and its module (the first field of each entry)."""
    rows = [f"| `{name}` | `{entry[0]}` |" for name, entry in TWINS.items()]
    return "\n".join([BEGIN, "", "| twin | compiled module |", "| --- | --- |", *rows, "", END])


def test_building_md_lists_the_twins() -> None:
    text = BUILDING.read_text(encoding="utf-8")
    start, end = text.find(BEGIN), text.find(END)
    written = text[start : end + len(END)] if 0 <= start < end else "(no block: the marker lines are missing)"
    assert written == twins_block(), (
        f"docs/building.md's list of compiled modules is not TWINS (metrale_core/_twins.py); "
        f"write this block in its place:\n\n{twins_block()}\n"
    )
