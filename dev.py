#!/usr/bin/env python3
"""Developer entry point: needs only Python 3.11+.

    python3 dev.py selftest     # create .venv if needed, install what it needs, run `metrale selftest`
    python3 dev.py test         # the whole test suite (derandomized Hypothesis profile "ci")
    python3 dev.py test --thorough   # more Hypothesis examples, random seeds
    python3 dev.py lint         # ruff and mypy --strict on the packages
    python3 dev.py docs         # build the documentation site (mkdocs build --strict) into site/
    python3 dev.py docs --serve # serve it at http://127.0.0.1:8000 (mkdocs serve), rebuilt as files change
    python3 dev.py wheels       # build every distribution's sdist and wheel, install them in a fresh
                                # environment (not editable) and run metrale --version, selftest, conformance
    python3 dev.py torchrun     # install PyTorch (the CPU build where one is on disk, as on CI: see below) and run
                                # examples/distributed/ranks.py under torchrun, two ranks on the fake
    python3 dev.py metrale ...  # any metrale command in the environment
    python3 dev.py accelerate [--clean]   # optional: compile the hot-path modules with Cython (or remove them)

Extra arguments after `test` go to pytest.

`torchrun` installs ``torch==2.13.0`` with pip when torch is not importable. CI's machines keep a CPU build of
it on disk, which pip takes; elsewhere pip may download a CUDA build of several GB: install a CPU build first
(``pip install torch --index-url https://download.pytorch.org/whl/cpu`` in ``.venv``) to avoid that.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"
PACKAGES = [".[test,lint,docs]", "backends/fake", "backends/cuda", "examples/tracing-backend", "examples/pipeline"]
#: What `selftest` needs: the core and the backends, without the test, lint and docs tools.
SELFTEST_PACKAGES = [".", "backends/fake", "backends/cuda"]
#: Every distribution `wheels` builds, by folder; the last is `metrale`, the meta-distribution users install.
DISTRIBUTIONS = [".", "backends/fake", "backends/cuda", "examples/tracing-backend", "examples/pipeline",
                 "packaging/metrale"]
PROJECT_FILES = ["pyproject.toml"] + [f"{p}/pyproject.toml" for p in PACKAGES[1:]]
#: Where each distribution's version is written (hatch reads it from there): an editable install's metadata
#: carries it, so a changed version reinstalls.
VERSION_FILES = [
    "metrale_core/__init__.py",
    "backends/fake/metrale_fake/__init__.py",
    "backends/cuda/metrale_cuda/__init__.py",
    "examples/tracing-backend/metrale_tracing/__init__.py",
    "examples/pipeline/metrale_pipeline/__init__.py",
]
LINTED = [
    "metrale_core",
    "backends/fake/metrale_fake",
    "backends/cuda/metrale_cuda",
    "examples/tracing-backend/metrale_tracing",
    "examples/pipeline/metrale_pipeline",
]
#: What `wheels` leaves: the sdists and wheels, and the environment they were installed in.
RELEASE = VENV / "release"
VERSION_LINE = re.compile(r'^__version__ = "([^"]+)"$', re.MULTILINE)


def run(*cmd: str | Path, cwd: Path = ROOT, env: dict[str, str] | None = None) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.call([str(c) for c in cmd], cwd=cwd, env=env)


def _digest() -> str:
    digest = hashlib.sha256(sys.version.encode())
    for name in PROJECT_FILES:
        path = ROOT / name
        digest.update(path.read_bytes() if path.exists() else b"")
    for name in VERSION_FILES:
        path = ROOT / name
        found = VERSION_LINE.search(path.read_text(encoding="utf-8")) if path.exists() else None
        digest.update(found.group(1).encode() if found else b"-")
    return digest.hexdigest()


def _forget_renamed_core() -> None:
    """A .venv made before 0.2.0 has the core installed under the name `metrale`, which is now the
    meta-distribution (never installed here): remove it first, or two distributions claim the core's files."""
    if any(VENV.glob("lib/python*/site-packages/metrale-*.dist-info")) or any(
        VENV.glob("Lib/site-packages/metrale-*.dist-info")
    ):
        run(PY, "-m", "pip", "uninstall", "-y", "-q", "metrale")


def ensure_env(full: bool = True) -> None:
    """Create .venv and install the packages (editable) when they changed: all of them with the test, lint and
    docs tools (`full`), or only what `metrale selftest` runs. A full environment serves the selftest too."""
    digest = _digest()
    stamps = {True: VENV / ".metrale-installed", False: VENV / ".metrale-selftest"}
    for kind in (True, False) if not full else (True,):
        if stamps[kind].exists() and stamps[kind].read_text() == digest:
            return
    if not PY.exists():
        print(f"+ creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    _forget_renamed_core()
    editable: list[str] = []
    for pkg in PACKAGES if full else SELFTEST_PACKAGES:
        editable += ["-e", pkg]
    if run(PY, "-m", "pip", "install", "-q", "--upgrade", "pip") or run(PY, "-m", "pip", "install", "-q", *editable):
        sys.exit("dev.py: installing the packages failed (see above)")
    stamps[full].write_text(digest)


def _meta_version() -> str:
    with (ROOT / DISTRIBUTIONS[-1] / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def _not_local(report: Path, dist: Path) -> list[str]:
    """The metrale distributions pip's install report shows as coming from somewhere other than ``dist``."""
    wrong = []
    for item in json.loads(report.read_text())["install"]:
        name = item["metadata"]["name"]
        url = item.get("download_info", {}).get("url", "")
        if name.startswith("metrale") and not url.startswith(dist.as_uri()):
            wrong.append(f"{name} {item['metadata']['version']} from {url or '?'}")
    return wrong


def wheels() -> int:
    """Build every distribution's sdist, and its wheel from that sdist; install the wheels into a fresh
    environment (not editable), `metrale[cuda]` resolved through --find-links; run the release checks there."""
    start = time.monotonic()
    ensure_env(full=False)
    if run(PY, "-m", "pip", "install", "-q", "build", "hatchling>=1.18"):
        sys.exit("dev.py: installing build and hatchling failed (see above)")
    dist, env_dir = RELEASE / "dist", RELEASE / "env"
    shutil.rmtree(RELEASE, ignore_errors=True)
    for folder in DISTRIBUTIONS:
        # the wheel is built from the sdist: a file the sdist leaves out breaks the build here
        if run(PY, "-m", "build", "-q", "--no-isolation", "--outdir", dist, ROOT / folder):
            sys.exit(f"dev.py wheels: building {folder} failed (see above)")
    built = sorted(p.name for p in dist.iterdir())
    sdists, wheel_files = [n for n in built if n.endswith(".tar.gz")], [n for n in built if n.endswith(".whl")]
    if len(sdists) != len(DISTRIBUTIONS) or len(wheel_files) != len(DISTRIBUTIONS):
        sys.exit(f"dev.py wheels: expected {len(DISTRIBUTIONS)} sdists and wheels in {dist}, found {built}")
    print(f"+ creating {env_dir}", flush=True)
    venv.create(env_dir, with_pip=True)
    env_py = env_dir / BIN.name / "python"
    report = RELEASE / "install-report.json"
    version = _meta_version()
    # `pip install metrale` as a user types it, resolved to the wheels just built, and Hypothesis, which the
    # conformance suite runs on (not the whole `test` extra: plotting libraries cost CI time); the examples too,
    # so their metadata is checked
    wanted = [f"metrale[cuda]=={version}", "hypothesis>=6.100", f"metrale-tracing=={version}",
              f"metrale-example-pipeline=={version}"]
    if run(env_py, "-m", "pip", "install", "-q", "--find-links", dist, "--report", report, *wanted, cwd=env_dir):
        sys.exit("dev.py wheels: installing the built wheels failed (see above)")
    wrong = _not_local(report, dist)
    if wrong:
        sys.exit(f"dev.py wheels: pip took {'; '.join(wrong)}, not the wheels built in {dist}")
    # run outside the working tree, with nothing of it on the path: the installed wheels are what runs
    child_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    metrale = env_dir / BIN.name / "metrale"
    where = ("import sys, metrale_core, metrale_fake, metrale_cuda\n"
             "outside = [m.__file__ for m in (metrale_core, metrale_fake, metrale_cuda)\n"
             "           if not (m.__file__ or '').startswith(sys.prefix)]\n"
             "sys.exit(f'not from the wheels: {outside}' if outside else 0)")
    for cmd in ([env_py, "-c", where], [metrale, "--version"], [metrale, "selftest"],
                [metrale, "conformance", "fake"]):
        if run(*cmd, cwd=env_dir, env=child_env):
            sys.exit(f"dev.py wheels: {' '.join(str(c) for c in cmd[1:]) or cmd[0]} failed in {env_dir}")
    print(f"wheels: {len(sdists)} sdists and {len(wheel_files)} wheels in {dist}, installed in {env_dir}; "
          f"--version, selftest and conformance fake passed ({time.monotonic() - start:.0f} s)")
    return 0


#: The torch dev.py torchrun installs where none is: the release CI's machines keep a CPU build of on disk.
TORCH = "torch==2.13.0"


def torchrun() -> int:
    """Run the torchrun example with two ranks on the fake (two fake devices) and check the merged report."""
    missing = subprocess.run([PY, "-c", "import torch.distributed"], capture_output=True, check=False).returncode
    if missing and run(PY, "-m", "pip", "install", "-q", TORCH):
        sys.exit(f"dev.py torchrun: installing {TORCH} failed (see above)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    env.update(METRALE_BACKEND="fake", METRALE_FAKE_DEVICE_COUNT="2")
    command = [str(PY), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(ROOT / "examples" / "distributed" / "ranks.py")]
    print("+ " + " ".join(command), flush=True)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=600)
    print(done.stdout, end="")
    if done.returncode or "merged ledger report: 2 process(es)" not in done.stdout:
        print(done.stderr[-4000:], file=sys.stderr)
        print("dev.py torchrun: the example failed, or its merged report does not name both ranks", file=sys.stderr)
        return done.returncode or 1
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"selftest", "test", "lint", "docs", "metrale", "accelerate", "wheels", "torchrun"}:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "wheels":
        return wheels()
    ensure_env(full=command != "selftest")
    if command == "selftest":
        return run(BIN / "metrale", "selftest", *rest)
    if command == "metrale":
        return run(BIN / "metrale", *rest)
    if command == "torchrun":
        return torchrun()
    if command == "accelerate":
        if "--clean" not in rest and run(PY, "-m", "pip", "install", "-q", "cython", "setuptools"):
            sys.exit("dev.py: installing Cython failed (see above); metrale stays pure Python")
        return run(PY, ROOT / "tools" / "accelerate.py", *rest)
    if command == "docs":
        if "--serve" in rest:  # open http://127.0.0.1:8000: search and links need a server, not a file
            return run(BIN / "mkdocs", "serve", *[a for a in rest if a != "--serve"])
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
