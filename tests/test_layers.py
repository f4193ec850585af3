"""The layers of metrale_core: every import (type-only and function-level ones too) runs downward or
sideways within a layer, and no import closes a circle. docs/architecture.md draws the same layers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "metrale_core"

#: Bottom first. A module may import modules of its own layer or of the layers below.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_errors",),
    ("_settings", "_meminfo", "_dlpack", "_ptx", "kernels"),  # foundations
    ("_types", "_tensormap", "_ntile"),  # records, and pure functions of them (tensor-map rules, the N tile)
    ("_buffer", "_raw", "_interop"),  # handles to memory, the raw contract, foreign memory
    ("_capture", "_ledger", "_redzone", "_arena", "_pressure", "_snapshot", "_merge"),  # rules and bookkeeping
    ("_context",),  # what the parts of one backend share
    ("_handles", "_registry", "_holdings", "_graphcheck", "_tensormaps"),  # handles and liveness, in-graph checks
    ("_zoneguard", "_monitor"),  # collaborators...
    ("_streams", "_allocator"),
    ("_exports", "_kernels"),
    ("_backend",),  # the facade
    ("_registration", "hookspec", "_discovery", "_ranks"),  # finding and opening backends, a rank's device
    ("__init__", "plugin"),  # the public API
    ("_cli", "__main__", "_bench", "_report", "_selftest", "_conformance", "_progress", "testing"),  # on top
)


def _unit(module: str) -> str:
    """The layer unit of a dotted module name inside metrale_core (``_bench._timing`` -> ``_bench``)."""
    return module.split(".", maxsplit=1)[0] if module else "__init__"


def _units() -> dict[str, set[str]]:
    """Each unit's imports of other metrale_core units."""
    graph: dict[str, set[str]] = {}
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(CORE).with_suffix("")
        parts = list(rel.parts)
        package = parts[:-1]
        unit = _unit(".".join(p for p in parts if p != "__init__")) if parts != ["__init__"] else "__init__"
        deps = graph.setdefault(unit, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                    mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
                    names = [] if node.module else [a.name for a in node.names]
                    targets = [mod] if node.module else [".".join([*base, n]) for n in names]
                elif node.module and node.module.split(".")[0] == "metrale_core":
                    targets = [node.module.partition(".")[2]]
            elif isinstance(node, ast.Import):
                targets = [a.name.partition(".")[2] for a in node.names if a.name.split(".")[0] == "metrale_core"]
            for target in targets:
                dep = _unit(target)
                if dep != unit:
                    deps.add(dep)
    return graph


def _layer_of() -> dict[str, int]:
    return {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def test_every_module_has_a_layer() -> None:
    missing = sorted(set(_units()) - set(_layer_of()))
    assert not missing, f"modules of metrale_core with no layer in LAYERS (and docs/architecture.md): {missing}"


def test_no_import_runs_upward() -> None:
    layer = _layer_of()
    upward = [
        f"{unit} (layer {layer[unit]}) imports {dep} (layer {layer[dep]})"
        for unit, deps in _units().items()
        for dep in sorted(deps)
        if dep in layer and unit in layer and layer[dep] > layer[unit]
    ]
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_no_import_closes_a_circle() -> None:
    graph = _units()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(unit: str) -> None:
        state[unit] = 1
        path.append(unit)
        for dep in sorted(graph.get(unit, ())):
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep) :], dep]
                pytest.fail("an import circle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[unit] = 2

    for unit in sorted(graph):
        if unit not in state:
            visit(unit)
