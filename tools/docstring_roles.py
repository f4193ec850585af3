"""Rewrite the Sphinx cross-reference roles of docstrings and comments as mkdocstrings cross-references.

The API reference (``docs/reference.md``) is rendered by mkdocstrings, which
reads the ``:param x:``, ``:returns:`` and ``:raises X:`` fields of the Sphinx
docstring style but shows the roles of the prose (``:class:`~pkg.X```) raw.
This turns each role into a Markdown cross-reference to the object's public
path, which mkdocs-autorefs links and ``mkdocs build --strict`` checks::

    :class:`~metrale_core.GpuBackend`      ->  [`GpuBackend`][metrale_core.GpuBackend]
    :meth:`close` (in GpuBackend)          ->  [`close`][metrale_core.GpuBackend.close]
    :meth:`Title <metrale_core.X.y>`       ->  [`Title`][metrale_core.X.y]
    :func:`_bound` (no public path)        ->  `_bound`

A name is resolved as Python would from the docstring's (or comment's) scope,
with griffe's static analysis of the packages: the class, the module, its
imports, then an absolute path. The link names the object at its public path
(``metrale_core.DeviceBuffer``, not ``metrale_core._device.buffer.DeviceBuffer``);
a name with no public path (a private helper) or that does not resolve
becomes plain code, since the reference cannot show it. Only docstrings (bare
string statements) and comments change, never code; a line the rewrite makes
longer than 120 characters is broken at a space outside links and code.
Running it again changes nothing.

It also turns reStructuredText's ``text::`` before an indented block into
``text:`` (Markdown shows the block as code without it).

    python tools/docstring_roles.py FILE.py ...           # rewrite in place
    python tools/docstring_roles.py --check FILE.py ...   # list the roles left; exit 1 if any
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parents[1]
LINE_LENGTH = 120
ROLE = re.compile(
    r":(?:py:)?(?P<role>class|func|meth|attr|data|mod|exc|obj|const):`(?P<body>[^`]+)`"
)
#: Where the packages live: the repository root, and each distribution of backends/ and examples/.
SEARCH_PATHS = [ROOT, *sorted(p for d in ("backends", "examples") for p in (ROOT / d).iterdir() if p.is_dir())]


@dataclass
class Resolver:
    """Resolves names with griffe and maps each object to its public path."""

    loader: griffe.GriffeLoader
    public: dict[str, str]  # canonical path -> shortest public path

    @classmethod
    def load(cls) -> Resolver:
        loader = griffe.GriffeLoader(search_paths=[str(p) for p in SEARCH_PATHS], allow_inspection=False)
        for path in SEARCH_PATHS:
            for package in sorted(path.glob("metrale_*/__init__.py")):
                loader.load(package.parent.name)
        loader.resolve_aliases(implicit=True, external=False)
        public: dict[str, str] = {}
        for name, module in loader.modules_collection.members.items():
            _walk_public(module, name, public, set())
        return cls(loader, public)

    def scope(self, module: str, qualname: list[str]) -> griffe.Object | None:
        try:
            obj = self.loader.modules_collection[module]
        except KeyError:
            return None
        for part in qualname:
            member = obj.members.get(part)
            if member is None or member.is_alias:
                break
            obj = member
        return obj

    def target(self, name: str, scope: griffe.Object | None, role: str = "obj") -> str | None:
        """The public path of ``name`` as seen from ``scope``; ``None`` if it has none.

        As in Sphinx, ``meth``, ``attr`` and ``obj`` look in the enclosing class first, the other roles in
        the module first (``:func:`n_tile``` in a class with a field ``n_tile`` is the module's function).
        """
        name = re.sub(r"\s+", "", name)
        if name.startswith(".") and scope is not None:  # a module relative to the current package
            package = scope.module if scope.module.is_package else scope.module.parent
            level = len(name) - len(name.lstrip("."))
            for _ in range(level - 1):
                package = package.parent if package is not None and package.parent is not None else package
            name = f"{package.path}.{name.lstrip('.')}" if package is not None else name.lstrip(".")
        head, _, rest = name.partition(".")
        candidates = []
        if scope is not None:
            scopes = [scope, scope.module] if role in {"meth", "attr", "obj"} else [scope.module, scope]
            for where in scopes:
                with contextlib.suppress(griffe.NameResolutionError, griffe.AliasResolutionError, ValueError):
                    candidates.append(where.resolve(head) + (f".{rest}" if rest else ""))
        candidates.append(name)
        for path in candidates:
            found = self._object(path)
            if found is not None:
                return self.public.get(found.path)
        return None

    def _object(self, path: str) -> griffe.Object | None:
        try:
            obj = self.loader.modules_collection[path]
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
        try:
            return obj.final_target if obj.is_alias else obj
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None


def _walk_public(obj: griffe.Object, public_path: str, public: dict[str, str], seen: set[str]) -> None:
    """Record the public path of ``obj`` and of its public members, recursively."""
    known = public.get(obj.path)
    if known is None or len(public_path) < len(known):
        public[obj.path] = public_path
    if obj.path in seen:
        return
    seen.add(obj.path)
    exports = set(obj.exports) if obj.is_module and obj.exports is not None else None
    for name, member in list(obj.members.items()):
        submodule = not member.is_alias and member.is_module  # public whatever ``__all__`` says
        if name.startswith("_") or (exports is not None and name not in exports and not submodule):
            continue
        try:
            target = member.final_target if member.is_alias else member
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
        if target.is_module and member.is_alias:
            continue  # a module imported into another: its own walk covers it
        _walk_public(target, f"{public_path}.{name}", public, seen)


def module_name(path: Path) -> str:
    """``metrale_core/_commands/bench/run.py`` -> ``metrale_core._commands.bench.run``."""
    path = path.resolve()
    parts = [] if path.name == "__init__.py" else [path.stem]
    folder = path.parent
    while (folder / "__init__.py").exists():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts)


@dataclass
class Piece:
    """A docstring or comment token: where it lies and the scope its names resolve in."""

    start: tuple[int, int]
    end: tuple[int, int]
    scope: list[str]
    comment: bool


def _scopes(tree: ast.Module) -> tuple[list[tuple[int, int, list[str]]], list[tuple[int, int, list[str]]]]:
    """The bare string statements (line span, scope) and the defs and classes (line span, qualname).

    A string's scope is the innermost def or class around it: the first string of a body documents that
    def or class, a later one of a class body one of its attributes; names resolve there either way.
    """
    strings: list[tuple[int, int, list[str]]] = []
    blocks: list[tuple[int, int, list[str]]] = []

    def visit(node: ast.AST, qualname: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant):
                if isinstance(child.value.value, str):
                    strings.append((child.lineno, child.end_lineno or child.lineno, qualname))
            elif isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                inner = [*qualname, child.name]
                blocks.append((child.lineno, child.end_lineno or child.lineno, inner))
                visit(child, inner)
            else:
                visit(child, qualname)

    visit(tree, [])
    return strings, blocks


def pieces(source: str) -> Iterator[Piece]:
    """Every docstring-like string token and every comment of ``source``."""
    strings, blocks = _scopes(ast.parse(source))
    by_line = {start: (end, scope) for start, end, scope in strings}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        row = token.start[0]
        if token.type == tokenize.COMMENT:
            inside = [q for s, e, q in blocks if s <= row <= e]
            yield Piece(token.start, token.end, max(inside, key=len) if inside else [], True)
        elif token.type == tokenize.STRING and row in by_line and token.end[0] <= by_line[row][0]:
            yield Piece(token.start, token.end, by_line[row][1], False)


def convert(text: str, resolve: Resolver, module: str, scope: list[str], notes: list[str], where: str) -> str:
    """``text`` with its roles rewritten."""
    owner = resolve.scope(module, scope)

    def one(m: re.Match[str]) -> str:
        body = m.group("body")
        explicit = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^<>]+)>", body, re.S)
        if explicit:
            title, name = explicit.group("title"), explicit.group("target")
        else:
            name = body
            title = body.lstrip("~").split(".")[-1] if body.startswith("~") else body
        title = re.sub(r"\s+", " ", title).strip()
        target = resolve.target(name.lstrip("~"), owner, m.group("role"))
        if target is None:
            notes.append(f"{where}: {m.group(0)!r} has no public path; written as code")
            return f"`{title}`"
        return f"[`{title}`][{target}]"

    return ROLE.sub(one, text)


def literal_blocks(text: str, column: int) -> str:
    """reStructuredText's ``paragraph::`` before an indented block as Markdown's ``paragraph:``.

    The indented block stays: Markdown shows it as code too. A ``::`` alone on its line goes.
    """
    lines = text.split("\n")
    out: list[str] = []
    for number, line in enumerate(lines):
        if number and not line.strip() and lines[number - 1].strip() == "::" and out and not out[-1].strip():
            continue  # the blank line after a dropped ``::``, which had one before it
        indent = column if number == 0 else len(line) - len(line.lstrip())
        block = next((x for x in lines[number + 2 :] if x.strip()), None)
        opens = (
            line.rstrip().endswith("::")
            and number + 1 < len(lines)
            and not lines[number + 1].strip()
            and block is not None
            and len(block) - len(block.lstrip()) > indent
        )
        if not opens:
            out.append(line)
        elif line.strip() == "::":
            continue
        else:
            out.append(re.sub(r"\s*::\s*$", "", line) if line.rstrip().endswith(" ::") else line.rstrip()[:-1])
    return "\n".join(out)


def _break_at(line: str, limit: int) -> int | None:
    """The index of the last space before ``limit`` outside code spans and links, after the text starts."""
    code = False
    depth = 0
    best = None
    start = len(line) - len(line.lstrip())
    for i, char in enumerate(line):
        if i > limit:
            break
        if char == "`":
            code = not code
        elif not code and char == "[":
            depth += 1
        elif not code and char == "]":
            depth = max(depth - 1, 0)
        elif char == " " and not code and depth == 0 and i > start + 3:
            best = i
    return best


#: A line that does not continue the paragraph above it: blank, a field, a list item, the string's end.
_NOT_PROSE = re.compile(r"\s*(?:$|:|[-*+] |\d+\. |>>>|\.\. |\"\"\"|'''|\"$)")


def wrap(old: str, new: str, comment: bool, column: int) -> str:
    """Break the lines of ``new`` the rewrite pushed past the line length (``column``: where the token starts).

    The words past the limit move to the start of the next line when it continues the same paragraph
    (as indented, not a field, list item or the string's end), else onto a line of their own.
    """
    if old == new:
        return new
    lines = new.split("\n")
    number = 0
    while number < len(lines):
        line = lines[number]
        offset = column if number == 0 else 0
        at = _break_at(line, LINE_LENGTH - offset) if offset + len(line) > LINE_LENGTH else None
        if at is None:
            number += 1
            continue
        head, tail = line[:at].rstrip(), line[at + 1 :].lstrip()
        if comment:
            marker = re.match(r"#:? ?", line)
            prefix = " " * column + (marker.group(0) if marker else "# ")
        else:
            prefix = " " * (column if offset else len(line) - len(line.lstrip()))
            if line.lstrip().startswith(":"):
                prefix += "    "  # the continuation of a field (:param x: ...)
        lines[number] = head
        after = lines[number + 1] if number + 1 < len(lines) else None
        if not comment and after is not None and len(after) - len(after.lstrip()) == len(prefix) \
                and not _NOT_PROSE.match(after):
            lines[number + 1] = f"{prefix}{tail} {after.lstrip()}"
        else:
            lines.insert(number + 1, prefix + tail)
        number += 1
    return "\n".join(lines)


def rewrite(path: Path, resolve: Resolver, notes: list[str]) -> bool:
    """Rewrite the roles of one file; whether it changed."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    module = module_name(path)
    edits = []
    for piece in pieces(source):
        a = starts[piece.start[0] - 1] + piece.start[1]
        b = starts[piece.end[0] - 1] + piece.end[1]
        old = source[a:b]
        if not ROLE.search(old) and (piece.comment or literal_blocks(old, piece.start[1]) == old):
            continue
        new = convert(old, resolve, module, piece.scope, notes, f"{path}:{piece.start[0]}")
        if not piece.comment:
            new = literal_blocks(new, piece.start[1])
        edits.append((a, b, wrap(old, new, piece.comment, piece.start[1])))
    for a, b, new in sorted(edits, reverse=True):
        source = source[:a] + new + source[b:]
    if edits:
        path.write_text(source, encoding="utf-8")
    return bool(edits)


def left(path: Path) -> list[str]:
    """The roles left in the docstrings and comments of one file."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    found = []
    for piece in pieces(source):
        for row in range(piece.start[0], piece.end[0] + 1):
            found += [f"{path}:{row}: {m.group(0)}" for m in ROLE.finditer(lines[row - 1])]
        if not piece.comment:
            text = "\n".join(lines[piece.start[0] - 1 : piece.end[0]])[piece.start[1] :]
            if literal_blocks(text, piece.start[1]) != text:
                found.append(f"{path}:{piece.start[0]}: a reStructuredText ``::`` literal block")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="only list the roles left; exit 1 if any")
    args = parser.parse_args()
    if args.check:
        found = [line for path in args.files for line in left(path)]
        print("\n".join(found) or "no roles left")
        return 1 if found else 0
    resolve = Resolver.load()
    notes: list[str] = []
    changed = [path for path in args.files if rewrite(path, resolve, notes)]
    for note in notes:
        print(note, file=sys.stderr)
    print(f"{len(changed)} of {len(args.files)} file(s) rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
