"""docs/plugin-authors.md tells the truth: the toy backend built from the page's own code, installed (its
package and entry point on the path, as pip lays them out), passes ``metrale conformance`` and the page's own
test files, and its example prints what the page shows.

(That the toy passes metrale's own suite, ``-k toy``, with the skips the page lists, is checked by hand: it
takes the whole suite's collection; the page says how.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "plugin-authors.md"

#: "File `path`:" (its words may run on over a few lines), then the file's block.
_FILE = re.compile(
    r"^File `(?P<path>[^`]+)`(?:[^\n]|\n(?!\n))*?:\n\n(?:<!-- docs-test: skip -->\n)?```[a-z]*\n(?P<body>.*?)^```$",
    re.S | re.M,
)


def _tree(text: str, root: str) -> tuple[int, set[str]]:
    """Where the page draws the layout of distribution ``root``, and the files it draws."""
    start = text.index(f"```\n{root}/\n")
    block = text[start + 4 : text.index("```", start + 4)].splitlines()[1:]
    files: set[str] = set()
    parents: list[str] = []
    for line in block:
        depth = (len(line) - len(line.lstrip(" "))) // 2 - 1
        name = line.split()[0]
        del parents[depth:]
        if name.endswith("/"):
            parents.append(name.rstrip("/"))
        else:
            files.add("/".join([*parents, name]))
    return start, files


def page_distribution(root: str = "metrale-toy") -> dict[str, str]:
    """The files of the page's toy distribution, as the page gives them."""
    text = PAGE.read_text(encoding="utf-8")
    start, wanted = _tree(text, root)
    files: dict[str, str] = {}
    for m in _FILE.finditer(text, start):
        if m["path"] in wanted:
            files.setdefault(m["path"], m["body"])
    assert set(files) == wanted, f"the page draws {sorted(wanted)} but gives {sorted(files)}"
    return files


def _install(files: dict[str, str], where: Path) -> tuple[Path, Path]:
    """Lay the distribution out in ``where``: its source, and a site folder where it is installed (the
    wheel's packages and a dist-info with the entry points of its pyproject.toml)."""
    source, site = where / "metrale-toy", where / "site"
    for path, body in files.items():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text(body, encoding="utf-8")
    project = tomllib.loads(files["pyproject.toml"])
    meta, wheel = project["project"], project["tool"]["hatch"]["build"]["targets"]["wheel"]
    for package in wheel["packages"]:
        for path in (source / package).rglob("*.py"):
            (site / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            (site / path.relative_to(source)).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    groups = meta["entry-points"]
    (info / "entry_points.txt").write_text(
        "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for group, eps in groups.items())
    )
    return source, site


@pytest.fixture
def installed(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The page's toy distribution, installed in a folder of its own; the environment that sees it."""
    source, site = _install(page_distribution(), tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}  # as the page runs it
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return source, env


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd, timeout=300, check=False)


def test_the_page_s_backend_passes_metrale_conformance(installed: tuple[Path, dict[str, str]]) -> None:
    source, env = installed
    out = _run([sys.executable, "-m", "metrale_core", "conformance", "toy"], env, source)
    assert out.returncode == 0, out.stdout + out.stderr
    verdict = out.stdout.splitlines()
    assert verdict[0] == "conformance of backend 'toy' (metrale-toy): PASS", out.stdout
    assert verdict[1] == "  settings: all at their defaults", out.stdout


def test_the_page_s_own_tests_pass_as_it_shows(installed: tuple[Path, dict[str, str]]) -> None:
    source, env = installed
    out = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], env, source)
    assert out.returncode == 0, out.stdout + out.stderr
    shown = re.search(r"^\$ python -m pytest -q tests\n.*?^(\d+) passed", PAGE.read_text(encoding="utf-8"), re.S | re.M)
    assert shown is not None, "the page shows no run of its tests"
    ran = re.search(r"^(\d+) passed", out.stdout, re.M)
    assert ran is not None and ran[1] == shown[1], f"the page shows {shown[1]} passed; the run: {out.stdout[-300:]}"


def test_the_page_s_example_prints_what_it_shows(installed: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    _, env = installed
    text = PAGE.read_text(encoding="utf-8")
    start = text.index("Then it opens like any other backend")
    example = re.compile(r"```python\n(?P<code>.*?)```\n\n```text\n(?P<want>.*?)```", re.S).search(text, start)
    assert example is not None
    app = tmp_path / "app"
    app.mkdir()
    (app / "app.py").write_text(example["code"], encoding="utf-8")
    out = subprocess.run([sys.executable, "app.py"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**env, "PYTHONUNBUFFERED": "1"}, cwd=app, timeout=120, check=False)
    assert out.returncode == 0, out.stdout
    assert out.stdout.replace(str(app), "/tmp/app") == example["want"]
