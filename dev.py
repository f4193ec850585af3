#!/usr/bin/env python3
"""Developer entry point: needs only Python 3.11+.

    python3 dev.py selftest     # create .venv if needed, install, run `metrale selftest`
    python3 dev.py test         # the whole test suite (derandomized Hypothesis profile "ci")
    python3 dev.py test --thorough   # more Hypothesis examples, random seeds
    python3 dev.py lint         # ruff and mypy --strict on the packages
    python3 dev.py docs         # build the documentation site (mkdocs build --strict) into site/
    python3 dev.py metrale ...  # any metrale command in the environment
    python3 dev.py accelerate [--clean]   # optional: compile the hot-path modules with Cython (or remove them)

Extra arguments after `test` go to pytest.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"
PACKAGES = [".[test,lint,docs]", "backends/fake", "backends/cuda", "examples/tracing-backend", "examples/pipeline"]
PROJECT_FILES = ["pyproject.toml"] + [f"{p}/pyproject.toml" for p in PACKAGES[1:]]
LINTED = [
    "metrale_core",
    "backends/fake/metrale_fake",
    "backends/cuda/metrale_cuda",
    "examples/tracing-backend/metrale_tracing",
    "examples/pipeline/metrale_pipeline",
]


def run(*cmd: str | Path) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.call([str(c) for c in cmd], cwd=ROOT)


def ensure_env() -> None:
    """Create .venv and install the three distributions (editable) when they changed."""
    digest = hashlib.sha256(sys.version.encode())
    for name in PROJECT_FILES:
        path = ROOT / name
        digest.update(path.read_bytes() if path.exists() else b"")
    stamp = VENV / ".metrale-installed"
    if stamp.exists() and stamp.read_text() == digest.hexdigest():
        return
    if not PY.exists():
        print(f"+ creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    editable: list[str] = []
    for pkg in PACKAGES:
        editable += ["-e", pkg]
    if run(PY, "-m", "pip", "install", "-q", "--upgrade", "pip") or run(PY, "-m", "pip", "install", "-q", *editable):
        sys.exit("dev.py: installing the packages failed (see above)")
    stamp.write_text(digest.hexdigest())


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"selftest", "test", "lint", "docs", "metrale", "accelerate"}:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    ensure_env()
    if command == "selftest":
        return run(BIN / "metrale", "selftest", *rest)
    if command == "metrale":
        return run(BIN / "metrale", *rest)
    if command == "accelerate":
        if "--clean" not in rest and run(PY, "-m", "pip", "install", "-q", "cython", "setuptools"):
            sys.exit("dev.py: installing Cython failed (see above); metrale stays pure Python")
        return run(PY, ROOT / "tools" / "accelerate.py", *rest)
    if command == "docs":
        return run(BIN / "mkdocs", "build", "--strict", *rest)
    if command == "lint":
        ruff = run(PY, "-m", "ruff", "check", *LINTED, "tests", "examples", "conftest.py", "dev.py")
        return ruff or run(PY, "-m", "mypy", *LINTED)
    profile = "thorough" if "--thorough" in rest else "ci"
    rest = [a for a in rest if a != "--thorough"]
    # pytest exits 5 when it collected no test: that is a failure here too.
    return run(PY, "-m", "pytest", f"--hypothesis-profile={profile}", *rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
