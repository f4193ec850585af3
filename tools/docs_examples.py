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

    python tools/docs_examples.py            # check, print the differences
    python tools/docs_examples.py --update   # rewrite the text blocks with what the examples print

``tests/test_docs.py`` runs the check in CI.
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
    r"(?P<directive><!-- docs-test: (?P<mode>skip|varies) -->\n)?"
    r"```python\n(?P<code>.*?)```\n"
    r"(?P<gap>\s*\n)?(?:```text\n(?P<want>.*?)```)?",
    re.S,
)


@dataclasses.dataclass(frozen=True)
class Example:
    """One Python block of a page, and the output block after it (if any)."""

    path: Path
    line: int
    code: str
    mode: str | None  # "skip", "varies" or None
    want: str | None
    want_span: tuple[int, int] | None  # where the text block's body lies in the page

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def examples() -> list[Example]:
    """Every Python block of the docs, in page order."""
    found = []
    for path in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        text = path.read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            line = text[: m.start("code")].count("\n")
            span = (m.start("want"), m.end("want")) if m.group("want") is not None else None
            found.append(Example(path, line, m.group("code"), m.group("mode"), m.group("want"), span))
    return found


def run(example: Example, folder: Path) -> tuple[int, str]:
    """Run ``example`` as ``folder/app.py``, next to the files of ``tools/docs_files`` (the PTX an example
    loads); its exit status and its output, the folder written ``/tmp/app``."""
    for extra in FILES.iterdir():
        shutil.copy(extra, folder / extra.name)
    (folder / "app.py").write_text(example.code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    env["METRALE_BACKEND"] = "fake"  # as the docs say their outputs were made
    env["PYTHONUNBUFFERED"] = "1"
    out = subprocess.run(
        [sys.executable, "app.py"], cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=120, check=False,
    )
    return out.returncode, out.stdout.replace(str(folder), "/tmp/app")


def check(example: Example, folder: Path) -> str | None:
    """``None`` if the example runs (and prints what the docs say); else what went wrong."""
    rc, got = run(example, folder)
    if rc != 0:
        return f"{example.name}: exited {rc}:\n{got}"
    if example.mode == "varies" or example.want is None or got.strip() == example.want.strip():
        return None
    diff = difflib.unified_diff(
        example.want.strip().splitlines(True), got.strip().splitlines(True), "the docs", "the example printed"
    )
    return f"{example.name}: prints something else than the docs say:\n{''.join(diff)}"


def update(found: list[Example]) -> int:
    """Rewrite each compared text block with what its example prints now; returns how many changed."""
    changed = 0
    by_page: dict[Path, list[Example]] = {}
    for example in found:
        if example.mode is None and example.want_span is not None:
            by_page.setdefault(example.path, []).append(example)
    for path, page in by_page.items():
        text = path.read_text(encoding="utf-8")
        for example in sorted(page, key=lambda e: -e.want_span[0]):  # type: ignore[index]
            with tempfile.TemporaryDirectory() as tmp:
                rc, got = run(example, Path(tmp))
            if rc != 0:
                print(f"{example.name}: exited {rc}, left as it is", file=sys.stderr)
                continue
            start, end = example.want_span  # type: ignore[misc]
            new = got.strip() + "\n"
            if text[start:end] != new:
                text = text[:start] + new + text[end:]
                changed += 1
                print(f"updated {example.name}")
        path.write_text(text, encoding="utf-8")
    return changed


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the text blocks with the examples' output")
    args = parser.parse_args()
    found = examples()
    if args.update:
        print(f"{update(found)} text block(s) rewritten")
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
