"""The wings of metrale_core and the order inside each: every import runs downward or sideways.

- `WINGS`: the wings and root modules, bottom first; a floor may import its own floor and those below.
- `INSIDE`: the same rule between the modules of one wing.
- Every import counts: type-only and function-level ones too. No import closes a circle.

docs/architecture.md draws the same wings.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "metrale_core"

#: Bottom first. A unit (a wing, or a module at the root) may import its own floor and the floors below.
WINGS: tuple[tuple[str, ...], ...] = (
    # the error tree; value types; which twins run; install hints; ``cython`` where Cython is absent
    ("_errors", "_types", "_twins", "_install", "_nocython"),
    ("_settings", "kernels", "_interop"),  # settings; what a kernel is on no backend; other libraries' protocols
    ("_device",),  # what every part of one backend shares
    ("_redzones",),  # fills, scans and verdicts
    ("_memory",),  # the ledger, arenas, holdings, the quarantine, the allocator
    ("_streams", "_reports"),  # issuing work; reports of snapshots
    ("_launch",),  # kernels, their registry and tensor maps
    ("_parts",),  # the parts of one backend, in order
    ("_backend",),  # the facade
    ("_registration", "hookspec", "_discovery", "_placement"),  # finding and opening backends
    ("__init__", "plugin"),  # the public API
    # on top: the public API, as a user's
    ("_commands", "__main__", "testing", "allocators", "pytest_plugin", "dask", "ray"),
)

#: Inside each wing, bottom first: its modules (by their name in the wing) and their floors.
INSIDE: Mapping[str, tuple[tuple[str, ...], ...]] = {
    "_settings": (("parsing", "hooks"), ("plugins",), ("model",), ("sources",)),
    "kernels": (("_ptx", "_tensormap", "_ntile"), ("__init__",), ("__main__",)),
    "_interop": (("dlpack",), ("foreign",)),
    "_device": (
        ("args", "memory_stats", "raw", "guarded", "_lock"), ("stats", "buffer"),
        ("capture_record", "capture", "handle"), ("gate",), ("context",), ("handles",),
    ),
    "_redzones": (("zone", "borrowed"), ("layout",), ("scanner",), ("ingraph", "queued", "report"), ("guard",)),
    "_memory": (
        ("meminfo", "records", "sites", "poolstats", "arena_zones"),
        ("ledger", "bump", "watch", "pool"),
        ("pressure", "arena"),
        ("snapshot", "holdings"),
        ("monitor", "exports", "quarantine"),
        ("rawmem",),
        ("pools",),
        ("lane",),
        ("allocator",),
    ),
    "_streams": (("graph_lane",), ("graphs",), ("front",), ("lane",)),
    "_reports": (("merge", "timeline"), ("summary", "torch_snapshot")),
    "_launch": (("tensormaps",), ("registry",), ("pack",), ("lane",), ("front",)),
    "_commands": (("progress", "bench"), ("conformance", "selftest", "runner"), ("commands",), ("cli",)),
    "allocators": (("door", "doorfuncs"), ("_doorfuncs",), ("__init__", "torch", "cupy")),
    "testing": (
        ("_faults",),
        ("_model", "_bad_inputs", "_capabilities", "_tensormap_rules", "_memory_rules", "_pool_rules"),
        ("_machine",),
        ("_pytest",),
        ("__init__",),
    ),
}

Graph = dict[str, set[str]]


def _modules() -> Graph:
    """Every module of metrale_core (dotted, relative to it; a package by its name) and what it imports."""
    graph: Graph = {}
    for path in sorted([*CORE.rglob("*.py"), *CORE.rglob("*.pyx")]):
        parts = list(path.relative_to(CORE).with_suffix("").parts)
        package = parts[:-1]
        name = ".".join(p for p in parts if p != "__init__") or "__init__"
        if parts[-1] == "__init__" and package:
            name = f"{name}.__init__"
        deps = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(_python_of(path), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    if node.module:
                        targets = [".".join([*base, *node.module.split(".")])]
                    else:
                        targets = [".".join([*base, a.name]) for a in node.names]
                elif node.module and node.module.split(".")[0] == "metrale_core":
                    targets = [node.module.partition(".")[2]]
            elif isinstance(node, ast.Import):
                targets = [a.name.partition(".")[2] for a in node.names if a.name.split(".")[0] == "metrale_core"]
            deps.update(t or "__init__" for t in targets)
    return graph


def _python_of(path: Path) -> str:
    """A module's source as Python: a compiled twin's (``.pyx``) Python imports, one a line, and its ``cimport`` of
    another twin as an import (its other C declarations are not Python)."""
    text = path.read_text()
    if path.suffix != ".pyx":
        return text
    lines = [re.sub(r"^(from metrale_core\.\S+) cimport ", r"\1 import ", line.strip()) for line in text.splitlines()]
    return "\n".join(line for line in lines if re.match(r"(from \S+ import [^(]+|import [\w.]+(, [\w.]+)*)$", line))


def _known(graph: Graph) -> set[str]:
    return set(graph) | {m.removesuffix(".__init__") for m in graph}


def _resolve(target: str, known: set[str]) -> str:
    """The module an import names.

    - ``from ..kernels import shipped_modules`` names ``kernels``;
    - ``from . import hookspec`` names the module ``hookspec``;
    - ``from .. import GpuBackend`` names ``__init__``.
    """
    while target not in known:
        if "." not in target:
            return "__init__"  # a name of the package's face: ``from .. import GpuBackend``
        target = target.rsplit(".", 1)[0]
    return target


def _unit(module: str) -> str:
    return module.split(".", maxsplit=1)[0]


def _inner(module: str) -> str:
    """A module's place inside its wing (``_memory.ledger`` -> ``ledger``; ``_commands.bench.run`` -> ``bench``;
    ``kernels`` -> ``__init__``)."""
    return module.partition(".")[2].split(".")[0] or "__init__"


def _floors(layers: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    return {name: i for i, floor in enumerate(layers) for name in floor}


def _upward(graph: Graph) -> list[str]:
    """Every import in ``graph`` that runs up a floor: between wings, or inside one."""
    known = _known(graph)
    wing_floor = _floors(WINGS)
    found = []
    for module, deps in sorted(graph.items()):
        unit = _unit(module)
        for dep in sorted({_resolve(d, known) for d in deps}):
            other = _unit(dep)
            if other != unit:
                if wing_floor[other] > wing_floor[unit]:
                    found.append(f"{module} (floor {wing_floor[unit]}) imports {dep} (floor {wing_floor[other]})")
                continue
            inside = _floors(INSIDE.get(unit, ()))
            a, b = _inner(module.removesuffix(".__init__")), _inner(dep)
            if a != b and a in inside and b in inside and inside[b] > inside[a]:
                found.append(f"{module} (floor {inside[a]} of {unit}) imports {dep} (floor {inside[b]})")
    return found


def test_every_module_has_a_place() -> None:
    graph = _modules()
    wing_floor = _floors(WINGS)
    missing = sorted({_unit(m) for m in graph} - set(wing_floor))
    assert not missing, f"wings or root modules with no floor in WINGS (and docs/architecture.md): {missing}"
    unplaced = [
        m for m in graph
        if "." in m and _unit(m) in INSIDE and _inner(m) not in _floors(INSIDE[_unit(m)])
        and not m.endswith(".__init__")
    ]
    assert not unplaced, f"modules with no floor in their wing's INSIDE: {sorted(unplaced)}"


def test_no_import_runs_upward() -> None:
    upward = _upward(_modules())
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


@pytest.mark.parametrize(
    ("module", "dep"),
    [("_device.context", "_memory.ledger"), ("_memory.ledger", "_memory.allocator"), ("_types", "_settings.model")],
)
def test_an_upward_import_added_is_caught(module: str, dep: str) -> None:
    graph = _modules()
    graph.setdefault(module, set()).add(dep)
    graph.setdefault(dep, set())
    assert any(line.startswith(f"{module} ") and dep in line for line in _upward(graph))


def test_no_import_closes_a_circle() -> None:
    known = _known(_modules())
    graph: Graph = {}
    for module, deps in _modules().items():
        unit = _unit(module)
        mine = graph.setdefault(unit, set())
        mine.update(_unit(_resolve(d, known)) for d in deps)
        mine.discard(unit)
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
