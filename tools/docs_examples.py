"""Run every Python example of the docs and compare what it prints with the docs.

Each ```` ```python ```` block of ``docs/*.md`` and ``README.md`` runs as its own
program, ``app.py`` in a scratch folder, with ``METRALE_BACKEND=fake`` and no
other ``METRALE_*`` variable set, and
standard error merged into standard output in the order written. When a
```` ```text ```` block follows it, the output must equal it, with the scratch
folder written as ``/tmp/app``. A comment on the line before a block changes
that:

- ``<!-- docs-test: skip -->``: not run (a file of a package, not a program);
- ``<!-- docs-test: varies -->``: run, but its output (timings, the host's
  memory) is not compared.

A reason may follow the word: ``<!-- docs-test: skip (needs a GPU) -->``.

Console blocks (a fenced block with no language, or ``console``, whose first
line starts with ``$ ``) run too: each ``$ `` line (with its ``\\``
continuation lines) is a command for ``bash -c``, run in turn in one scratch
folder that mirrors the repository root (its files linked, ``docs/`` copied),
with no ``METRALE_*`` variable set (as ``docs/cli.md`` says its outputs were
made: ``auto`` picks the fake where no GPU answers, and only there do the
tests run; ``METRALE_BACKEND=fake`` would show in ``metrale info`` and in the
conformance verdict), and the environment's ``bin`` folder first on ``PATH``.
``/tmp/`` in a command is a folder of the scratch one, written back as
``/tmp/`` in the output, and the scratch folder and the repository are both
written ``/work/main``, where the docs' outputs were made. The lines after a command,
up to the next ``$ ``, are what it must print (standard error merged, as a
terminal shows it); ``$ echo $?`` after a command prints its exit status, as
in a shell. The same two comments apply to a console block: ``skip`` for
commands that need a GPU, the network or another checkout (mark them so),
``varies`` for outputs that differ run to run or machine to machine (timings,
versions, the host's memory, the plugins installed); in a ``varies`` block a
command that fails must be followed by ``$ echo $?``, so a failure is written
down rather than unseen.

    python tools/docs_examples.py            # check, print the differences
    python tools/docs_examples.py --update   # rewrite the text blocks and console outputs with what runs print
    python tools/docs_examples.py docs/cli.md   # only the examples of these pages

``tests/commands/test_docs.py`` runs the check in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ROOT / "tools" / "docs_files"
_BLOCK = re.compile(
    r"(?P<directive><!-- docs-test: (?P<mode>skip|varies)(?: [^>]*)? -->\n)?"
    r"```python\n(?P<code>.*?)```\n"
    r"(?P<gap>\s*\n)?(?:```text\n(?P<want>.*?)```)?",
    re.S,
)
_FENCE = re.compile(r"(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)\n?")
_DIRECTIVE = re.compile(r"\s*<!-- docs-test: (?P<mode>skip|varies)(?: [^>]*)? -->\s*")
#: What a console block's scratch folder does not mirror from the repository root.
_NOT_MIRRORED = {".git", ".venv", "site", "docs", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis"}
COMMAND_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Command:
    """One ``$ `` command of a console block, and the output lines after it."""

    text: str  # without the "$ ", continuation lines included
    line: int
    want: str
    want_span: tuple[int, int]  # where its output lines lie in the page


@dataclasses.dataclass(frozen=True)
class Example:
    """One Python block of a page and the output block after it (if any), or one console block."""

    path: Path
    line: int
    code: str
    mode: str | None  # "skip", "varies" or None
    want: str | None
    want_span: tuple[int, int] | None  # where the text block's body lies in the page
    commands: tuple[Command, ...] = ()  # a console block's commands; none for a Python block
    indent: str = ""  # a console block's indentation in the page (inside a list item)

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def console(self) -> bool:
        return bool(self.commands)


def _console_blocks(path: Path, text: str) -> list[Example]:
    """The console blocks of a page: fenced, no language (or ``console``), the first line a ``$ `` command."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    found = []
    i = 0
    while i < len(lines):
        m = _FENCE.fullmatch(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), m.group("indent")
        close = re.compile(rf"[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*\n?")
        j = i + 1
        while j < len(lines) and not close.fullmatch(lines[j]):
            j += 1
        body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : j]]
        if m.group("info").strip() in {"", "console"} and body and body[0].startswith("$ "):
            directive = _DIRECTIVE.fullmatch(lines[i - 1]) if i else None
            commands = []
            k = 0
            while k < len(body):
                first = k
                command = body[k][2:]
                while command.rstrip("\n").endswith("\\") and k + 1 < len(body):
                    k += 1
                    command += body[k]
                k += 1
                out = k
                while k < len(body) and not body[k].startswith("$ "):
                    k += 1
                span = (starts[i + 1 + out], starts[i + 1 + k])
                commands.append(Command(command.rstrip("\n"), i + 2 + first, "".join(body[out:k]), span))
            found.append(
                Example(
                    path, i + 1, "".join(body), directive.group("mode") if directive else None,
                    None, None, tuple(commands), indent,
                )
            )
        i = j + 1
    return found


def examples(pages: list[Path] | None = None) -> list[Example]:
    """Every Python block and console block of the docs, in page order."""
    found = []
    for path in pages or [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        text = path.read_text(encoding="utf-8")
        page = []
        for m in _BLOCK.finditer(text):
            line = text[: m.start("code")].count("\n")
            span = (m.start("want"), m.end("want")) if m.group("want") is not None else None
            page.append(Example(path, line, m.group("code"), m.group("mode"), m.group("want"), span))
        page += _console_blocks(path, text)
        found += sorted(page, key=lambda e: e.line)
    return found


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    env["METRALE_BACKEND"] = "fake"  # as the docs say their outputs were made
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(example: Example, folder: Path) -> tuple[int, str]:
    """Run ``example`` as ``folder/app.py``, next to the files of ``tools/docs_files`` (the PTX an example
    loads); its exit status and its output, the folder written ``/tmp/app``."""
    for extra in FILES.iterdir():
        shutil.copy(extra, folder / extra.name)
    (folder / "app.py").write_text(example.code, encoding="utf-8")
    out = subprocess.run(
        [sys.executable, "app.py"], cwd=folder, env=_environment(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=120, check=False,
    )
    return out.returncode, out.stdout.replace(str(folder), "/tmp/app")


def run_console(example: Example, folder: Path) -> list[tuple[int, str]]:
    """Run the commands of a console block in turn in ``folder``, made a mirror of the repository root;
    each one's exit status and output."""
    for entry in ROOT.iterdir():
        if entry.name not in _NOT_MIRRORED:
            (folder / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    shutil.copytree(ROOT / "docs", folder / "docs")  # a command may write there (a plot)
    (folder / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # metrale, python
    results = []
    status = 0
    for command in example.commands:
        text = command.text.replace("/tmp/", f"{folder}/tmp/")
        out = subprocess.run(
            ["bash", "-c", f"(exit {status}); {text}"], cwd=folder, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, timeout=COMMAND_TIMEOUT_S, check=False,
        )
        status = out.returncode
        got = out.stdout.replace(f"{folder}/tmp/", "/tmp/").replace(f"{folder}/", "/work/main/")
        results.append((status, got.replace(f"{ROOT}/", "/work/main/")))
    return results


def _lines(text: str) -> list[str]:
    """The lines of an output, without trailing spaces and without blank lines around them."""
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n").splitlines()


def _check_console(example: Example, folder: Path) -> str | None:
    problems = []
    results = run_console(example, folder)
    for n, (command, (status, got)) in enumerate(zip(example.commands, results, strict=True)):
        following = example.commands[n + 1].text.strip() if n + 1 < len(example.commands) else ""
        if example.mode == "varies" and status != 0 and following != "echo $?":
            problems.append(f"line {command.line}: `{command.text}` exited {status} (follow it with `$ echo $?`):"
                            f"\n{got}")
        elif example.mode != "varies" and _lines(got) != _lines(command.want):
            diff = difflib.unified_diff(
                [f"{x}\n" for x in _lines(command.want)], [f"{x}\n" for x in _lines(got)],
                "the docs", "the command printed",
            )
            problems.append(f"line {command.line}: `{command.text}` prints something else than the docs say:\n"
                            + "".join(diff))
    return f"{example.name}: " + "\n".join(problems) if problems else None


def check(example: Example, folder: Path) -> str | None:
    """``None`` if the example runs (and prints what the docs say); else what went wrong."""
    if example.console:
        return _check_console(example, folder)
    rc, got = run(example, folder)
    if rc != 0:
        return f"{example.name}: exited {rc}:\n{got}"
    if example.mode == "varies" or example.want is None or got.strip() == example.want.strip():
        return None
    diff = difflib.unified_diff(
        example.want.strip().splitlines(True), got.strip().splitlines(True), "the docs", "the example printed"
    )
    return f"{example.name}: prints something else than the docs say:\n{''.join(diff)}"


def _edits(example: Example) -> list[tuple[int, int, str]]:
    """What to write over the page's output blocks of ``example``: (start, end, text) each."""
    with tempfile.TemporaryDirectory() as tmp:
        if example.console:
            edits = []
            for command, (_, got) in zip(example.commands, run_console(example, Path(tmp)), strict=True):
                lines = _lines(got)
                edits.append((*command.want_span, "".join(f"{example.indent}{x}\n" for x in lines)))
            return edits
        rc, got = run(example, Path(tmp))
    if rc != 0:
        print(f"{example.name}: exited {rc}, left as it is", file=sys.stderr)
        return []
    return [(*example.want_span, got.strip() + "\n")]  # type: ignore[list-item]


def _updatable(example: Example) -> bool:
    return example.mode is None and (example.want_span is not None or example.console)


def update(found: list[Example]) -> int:
    """Rewrite each compared output with what its example prints now; returns how many changed."""
    changed = 0
    by_page: dict[Path, list[Example]] = {}
    for example in filter(_updatable, found):
        by_page.setdefault(example.path, []).append(example)
    for path, page in by_page.items():
        edits = [edit for example in page for edit in _edits(example)]
        text = old = path.read_text(encoding="utf-8")  # read after the runs: as fresh as it can be
        if [e for e in examples([path]) if _updatable(e)] != page:
            print(f"{path.relative_to(ROOT)} changed while its examples ran; left as it is", file=sys.stderr)
            continue
        for start, end, new in sorted(edits, reverse=True):
            if text[start:end] != new:
                text = text[:start] + new + text[end:]
                changed += 1
                print(f"updated {path.relative_to(ROOT)}:{text[:start].count(chr(10)) + 1}")
        if text != old:
            path.write_text(text, encoding="utf-8")
    return changed


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the outputs with what the examples print")
    parser.add_argument("pages", nargs="*", type=Path, help="only these pages (default: docs/*.md, README.md)")
    args = parser.parse_args()
    found = examples([p.resolve() for p in args.pages] or None)
    if args.update:
        print(f"{update(found)} output(s) rewritten")
        return 0
    failures = []
    for example in found:
        if example.mode == "skip":
            continue
        with tempfile.TemporaryDirectory() as tmp:
            problem = check(example, Path(tmp))
        if problem:
            failures.append(problem)
            print(problem)
    print(f"{len(found)} example(s), {len(failures)} failing")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
