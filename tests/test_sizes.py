"""What keeps the core small enough to read: no module of ``metrale_core`` over `MODULE_LINES` lines, no class over
`CLASS_LINES`, and the facade, `GpuBackend`, at most `FACADE_LINES` (it delegates each call in a line; the parts
own the work: ``_parts.py``). A failure names the module or class and its size: split it along a seam (a part
that owns its state), never by moving lines into a helper only it calls."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_layers import CORE

MODULE_LINES = 500
CLASS_LINES = 500
FACADE_LINES = 450

MODULES = sorted(CORE.rglob("*.py"))


def _classes(tree: ast.Module) -> dict[str, int]:
    """Each class of ``tree`` (nested ones too) by name, with its lines, decorators included."""
    return {node.name: node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.end_lineno is not None}


@pytest.mark.parametrize("path", MODULES, ids=[p.relative_to(CORE).as_posix() for p in MODULES])
def test_no_module_or_class_is_too_long(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    lines = text.count("\n") + (not text.endswith("\n") and bool(text))
    assert lines <= MODULE_LINES, f"{path.relative_to(CORE.parent)} has {lines} lines (at most {MODULE_LINES})"
    long = {name: n for name, n in _classes(ast.parse(text)).items() if n > CLASS_LINES}
    assert not long, f"{path.relative_to(CORE.parent)}: classes over {CLASS_LINES} lines: {long}"


def test_the_facade_stays_thin() -> None:
    lines = _classes(ast.parse((CORE / "_backend.py").read_text(encoding="utf-8")))["GpuBackend"]
    assert lines <= FACADE_LINES, f"GpuBackend has {lines} lines (at most {FACADE_LINES}): delegate to a part"
