"""The public names are one table: ``__all__``, the type-checking imports and the lazy loader agree.

- `_PUBLIC` (module -> names) is the table; the lazy loader reads `_WHERE`, made from it;
- ``__all__`` holds the same names (and ``__version__``), for ``import *`` and static tools;
- the ``if TYPE_CHECKING:`` imports name each from the same module, for mypy.
"""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import metrale_core

INIT = Path(metrale_core.__file__)


def _type_checking_imports() -> dict[str, str]:
    """Each name the ``if TYPE_CHECKING:`` block of ``metrale_core/__init__.py`` imports, with its module."""
    found: dict[str, str] = {}
    for node in ast.parse(INIT.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.level == 1 and stmt.module, ast.dump(stmt)
                for alias in stmt.names:
                    assert alias.asname is None, alias.name
                    assert alias.name not in found, f"{alias.name} is imported twice"
                    found[alias.name] = stmt.module
    return found


def test_all_is_the_table() -> None:
    assert len(metrale_core.__all__) == len(set(metrale_core.__all__))
    assert set(metrale_core.__all__) == {*metrale_core._WHERE, "__version__"}


def test_the_type_checking_imports_are_the_table() -> None:
    assert _type_checking_imports() == metrale_core._WHERE


def test_the_table_names_each_name_once() -> None:
    names = [name for names in metrale_core._PUBLIC.values() for name in names]
    assert len(names) == len(set(names)) == len(metrale_core._WHERE)


def test_each_name_is_defined_where_the_table_says() -> None:
    for name, module in metrale_core._WHERE.items():
        value = getattr(importlib.import_module(f"metrale_core.{module}"), name)
        assert getattr(metrale_core, name) is value, name
        home = getattr(value, "__module__", None)
        if isinstance(value, type | types.FunctionType):  # (an alias, a constant: no module of its own)
            assert home == f"metrale_core.{module}", f"{name} is defined in {home}, the table says {module}"
