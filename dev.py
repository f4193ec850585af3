#!/usr/bin/env python3
"""Developer entry point: needs only Python 3.11+.

    python3 dev.py selftest     # create .venv if needed, install what it needs, run `metrale selftest`
    python3 dev.py test         # the whole suite on every core (pytest-xdist), derandomized Hypothesis profile "ci"
    python3 dev.py test --thorough   # more Hypothesis examples, random seeds
    python3 dev.py test --fast  # the inner loop: stops at the first failure, fewer examples, no docs/wheels/torchrun
    python3 dev.py lint         # ruff and mypy --strict on the packages; stubtest on the compiled twins
    python3 dev.py docs         # build the documentation site (mkdocs build --strict) into site/
    python3 dev.py docs --serve # serve it at http://127.0.0.1:8000 (mkdocs serve), rebuilt as files change
    python3 dev.py wheels       # build every distribution's sdist and wheel, install them in a fresh
                                # environment (not editable) and run metrale --version, selftest, conformance
    python3 dev.py torchrun     # install PyTorch (the CPU build where one is on disk, as on CI: see below) and run
                                # examples/distributed/ranks.py under torchrun, two ranks on the fake
    python3 dev.py engines      # install Dask and Ray (the core's extras dask and ray) and run examples/dask and
                                # examples/ray on real local clusters, two workers on two fake devices; the suite's
                                # Dask and Ray tests run where they are installed (skipped with a reason elsewhere)
    python3 dev.py metrale ...  # any metrale command in the environment
    python3 dev.py gpu ...      # on the lent GPU machine: install (no venv), selftest, conformance, the suite twice,
                                # the benchmarks, logs under $OUT: tools/gpu_plan.py does it (dev.py gpu --help)

Extra arguments after `test` go to pytest; with ``-n``, ``--pdb`` or ``-p no:xdist`` among them, pytest-xdist's
``-n auto`` is left to them.

The editable install compiles the hot path in place where a C compiler is (docs/building.md), and the CUDA backend's
driver calls where the CUDA toolkit's ``cuda.h`` is too; elsewhere the pure-Python modules run, and dev.py says so.
The first install takes minutes: a line per module compiled, pip's whole output in ``.venv/pip-install.log``.

`torchrun` installs ``torch==2.13.0`` where torch is missing (CI keeps a CPU build on disk); elsewhere pip may download
a CUDA build of several GB: first ``pip install torch --index-url https://download.pytorch.org/whl/cpu`` in .venv.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import venv
import zipfile
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
#: The build's files: a change reinstalls (each setup.py, MANIFEST.in and pyproject.toml, the cydriver declarations
#: the CUDA backend's build reads, and the device calls' C header, which both compile against).
PROJECT_FILES = (["pyproject.toml", "setup.py", "MANIFEST.in"] + [f"{p}/pyproject.toml" for p in PACKAGES[1:]]
                 + ["backends/cuda/setup.py", "backends/cuda/MANIFEST.in",
                    "backends/cuda/pxd/cuda/bindings/cydriver.pxd", "metrale_core/include/metrale/device_calls.h"])
#: The packages with compiled twins, by the folder that holds each (the CUDA backend's: its driver calls).
TWIN_PACKAGES = {"metrale_core": ROOT, "metrale_cuda": ROOT / "backends" / "cuda"}
#: The CUDA backend's compiled module (its setup.py builds it where it finds the CUDA toolkit's cuda.h).
CUDA_TWIN = "metrale_cuda._cdriver"
#: Where each distribution's version is written: an editable install's metadata carries it (a change reinstalls).
VERSION_FILES = ["metrale_core/__init__.py", "backends/fake/metrale_fake/__init__.py",
                 "backends/cuda/metrale_cuda/__init__.py", "examples/tracing-backend/metrale_tracing/__init__.py",
                 "examples/pipeline/metrale_pipeline/__init__.py"]
LINTED = ["metrale_core", "backends/fake/metrale_fake", "backends/cuda/metrale_cuda",
          "examples/tracing-backend/metrale_tracing", "examples/pipeline/metrale_pipeline",
          "examples/host-app/batch_scorer.py"]
#: What `wheels` leaves: the sdists and wheels, and the environment they were installed in.
RELEASE = VENV / "release"
VERSION_LINE = re.compile(r'^__version__ = "([^"]+)"$', re.MULTILINE)


def run(*cmd: str | Path, cwd: Path = ROOT, env: dict[str, str] | None = None) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.call([str(c) for c in cmd], cwd=cwd, env=env)


def twins() -> dict[str, Path]:
    """Every compiled module of `TWIN_PACKAGES` and its source, as each setup.py finds them (``compiled_sources``:
    ``_X`` from ``X.py`` where ``_X.pxd`` is beside it and no ``_X.pyx`` is, else from ``_X.pyx``)."""
    found = {}
    for package, base in TWIN_PACKAGES.items():
        for path in [*(base / package).rglob("_*.pxd"), *(base / package).rglob("*.pyx")]:
            source = path if path.suffix == ".pyx" else path.with_name(path.stem[1:] + ".py")
            if path.suffix == ".pyx" or (source.is_file() and not path.with_suffix(".pyx").exists()):
                found[".".join(path.relative_to(base).with_suffix("").parts)] = source
    return dict(sorted(found.items()))


def cuda_include(python: Path | str = PY) -> str | None:
    """Where the CUDA backend's build finds ``cuda.h`` (its setup.py's ``cuda_include``, run by ``python``), or
    ``None``: without it that build installs the pure driver calls, and says so."""
    code = ("import runpy, sys\n"
            "found = runpy.run_path(sys.argv[1], run_name='metrale_cuda_setup')['cuda_include']()\n"
            "print(found or '')")
    done = subprocess.run([str(python), "-c", code, str(TWIN_PACKAGES["metrale_cuda"] / "setup.py")],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or None if done.returncode == 0 else None


def compiled_twins() -> list[str]:
    """The twins built in place for this Python (the editable install builds each beside its source)."""
    return [name for name, source in twins().items() if any(
        source.with_name(name.rpartition(".")[2] + s).exists() for s in importlib.machinery.EXTENSION_SUFFIXES)]


def _digest() -> str:
    digest = hashlib.sha256(sys.version.encode())
    # a changed compiled source (.pyx, one-source .py, .pxd) reinstalls: a module older than its source runs old code
    for path in [*map(ROOT.joinpath, PROJECT_FILES), *twins().values(), *sorted(ROOT.glob("metrale_core/**/*.pxd"))]:
        digest.update(path.read_bytes() if path.exists() else b"")
    for name in VERSION_FILES:
        path = ROOT / name
        found = VERSION_LINE.search(path.read_text(encoding="utf-8")) if path.exists() else None
        digest.update(found.group(1).encode() if found else b"-")
    return digest.hexdigest()


def _forget_renamed_core() -> None:
    """A .venv made before 0.2.0 has the core installed as `metrale`, now the meta-distribution: remove it first."""
    if any(next(VENV.glob(f"{lib}/site-packages/metrale-*.dist-info"), None) for lib in ("lib/python*", "Lib")):
        run(PY, "-m", "pip", "uninstall", "-y", "-q", "metrale")


def ensure_env(full: bool = True) -> None:
    """Create .venv and install the packages (editable) when they changed: all of them with the test, lint and
    docs tools (`full`), or only what `metrale selftest` runs. A full environment serves the selftest too."""
    digest = _digest()
    stamps = {True: VENV / ".metrale-installed", False: VENV / ".metrale-selftest"}
    if any(stamps[kind].exists() and stamps[kind].read_text() == digest for kind in {True, full}):
        return
    print(f"dev.py: installing metrale into {VENV}: compiling the hot path ({len(twins())} Cython modules) takes a "
          f"few minutes; a line per module as it goes, pip's whole output in {INSTALL_LOG}", flush=True)
    if not PY.exists():
        print(f"+ creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    _forget_renamed_core()
    editable = [a for pkg in (PACKAGES if full else SELFTEST_PACKAGES) for a in ("-e", pkg)]
    if run(PY, "-m", "pip", "install", "-q", "--upgrade", "pip") or _pip_install(*editable):
        sys.exit(f"dev.py: installing the packages failed (see above; pip's whole output: {INSTALL_LOG})")
    missing = sorted(set(twins()) - set(compiled_twins()))  # pip hides setup.py's line: say it here
    if missing:
        print(f"dev.py: {len(missing)} of {len(twins())} compiled twins not built ({', '.join(missing)}): no C "
              f"compiler (and for {CUDA_TWIN}, no cuda.h: set CUDA_HOME)? the pure-Python modules run", flush=True)
    stamps[full].write_text(digest)


INSTALL_LOG = VENV / "pip-install.log"
#: The lines of ``pip install -v`` `_pip_install` shows: a folder prepared, packages installed, a build, a module.
_PROGRESS = re.compile(r"^(?:Obtaining file://(?P<preparing>\S+)|Installing collected packages: (?P<installing>.*)"
                       r"|\s*Building editable for (?P<building>\S+) \(pyproject\.toml\): started"
                       r"|\s*building '(?P<compiling>[\w.]+)' extension)\s*$")


def _pip_install(*args: str) -> int:
    """``pip install -v ARGS``, its output into `INSTALL_LOG`, a line shown per `_PROGRESS` line (and the log's end
    where pip fails): progress, not minutes of silence."""
    start, compiled, total = time.monotonic(), 0, len(twins())
    print("+ pip install", *args, flush=True)
    with INSTALL_LOG.open("w") as log, subprocess.Popen([PY, "-m", "pip", "install", "-v", *args], cwd=ROOT,
                                                        text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                        errors="replace") as pip:
        for line in pip.stdout or ():
            log.write(line)
            if found := _PROGRESS.match(line):
                what = str(found.lastgroup)  # the alternative that matched
                compiled += what == "compiling"
                shown = {"installing": f"{found[what].count(',') + 1} packages",
                         "compiling": f"{found[what]} ({compiled} of {total})"}
                print(f"  {time.monotonic() - start:4.0f} s  {what} {shown.get(what, found[what])}", flush=True)
    if pip.returncode:
        print("".join(INSTALL_LOG.read_text(errors="replace").splitlines(keepends=True)[-40:]), end="", flush=True)
    return pip.returncode


def lint() -> int:
    """ruff, mypy --strict, and mypy's stubtest: each compiled twin against its .pyi (mypy reads the .pyi alone)."""
    ruff = run(PY, "-m", "ruff", "check", *LINTED, "tests", "examples", "conftest.py", "dev.py", "setup.py",
               "backends/fake/tests", "backends/cuda/tests", "backends/cuda/setup.py", "tools/gpu_plan.py")
    if ruff or run(PY, "-m", "mypy", *LINTED):
        return 1
    # stubtest for the hand-written .pyx (C ABIs) against their .pyi; a one-source module is its own stub
    compiled = [name for name in compiled_twins() if twins()[name].suffix == ".pyx"]
    if not compiled:
        print("lint: no compiled .pyx here: stubtest skipped", flush=True)
        return 0
    allowlist = ROOT / "tools" / "stubtest-allowlist.txt"  # what Cython adds to each; not every twin has all
    # mypy finds each twin's stub by its package's folder (an editable install of setuptools' hides it behind an
    # import hook), and reads the project's settings (cuda.bindings has no stubs)
    env = {**os.environ, "MYPYPATH": os.pathsep.join(str(base) for base in TWIN_PACKAGES.values())}
    return run(PY, "-m", "mypy.stubtest", "--mypy-config-file", ROOT / "pyproject.toml", "--allowlist", allowlist,
               "--ignore-unused-allowlist", *compiled, env=env)


def _not_local(report: Path, dist: Path) -> list[str]:
    """The metrale distributions pip's install report shows as coming from somewhere other than ``dist``."""
    wrong = []
    for item in json.loads(report.read_text())["install"]:
        name = item["metadata"]["name"]
        url = item.get("download_info", {}).get("url", "")
        if name.startswith("metrale") and not url.startswith(dist.as_uri()):
            wrong.append(f"{name} {item['metadata']['version']} from {url or '?'}")
    return wrong


def _build_requirements() -> list[str]:
    """What building the distributions needs (each [build-system] requires): `wheels` builds without isolation."""
    found: list[str] = []
    for folder in DISTRIBUTIONS:
        with (ROOT / folder / "pyproject.toml").open("rb") as f:
            found += [r for r in tomllib.load(f)["build-system"]["requires"] if r not in found]
    return found


def _wheel_lacks(dist: Path, package: str, compiled: bool = True) -> list[str]:
    """What the wheel of the distribution of ``package`` lacks: a file of ``package`` in its sdist (not the build's
    by-products, nor a twin's .pyx), or a compiled module for each twin (.pyx) where ``compiled``."""
    stem = package.replace("_", "[-_]")
    sdist = next(p for p in dist.glob("*.tar.gz") if re.match(f"{stem}-[0-9]", p.name))
    wheel = next(p for p in dist.glob("*.whl") if re.match(f"{stem}-[0-9]", p.name))
    with tarfile.open(sdist) as tar:
        sources = [m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()]
    with zipfile.ZipFile(wheel) as zf:
        carried = set(zf.namelist())
    # (a twin's .pyx stays in the sdist: the wheel carries what it compiled to, and its stub)
    lacks = [f"{wheel.name}: {name}" for name in sources
             if name.startswith(f"{package}/") and not name.endswith(".pyx") and name not in carried]
    for pyx in (name for name in sources if name.startswith(f"{package}/") and name.endswith(".pyx")):
        stem = pyx.removesuffix(".pyx") + "."
        if compiled and not any(n.startswith(stem) and n.endswith((".so", ".pyd")) for n in carried):
            lacks.append(f"{wheel.name}: {pyx}'s compiled module (no C compiler? the build said so)")
    return lacks


def wheels() -> int:
    """Build every distribution's sdist, and its wheel from that sdist; install the wheels into a fresh
    environment (not editable), `metrale[cuda]` resolved through --find-links; run the release checks there."""
    start = time.monotonic()
    ensure_env(full=False)
    if run(PY, "-m", "pip", "install", "-q", "build", *_build_requirements()):
        sys.exit("dev.py: installing build and the build backends failed (see above)")
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
    # the CUDA backend's driver calls compile where its build finds cuda.h: required there, else the pure calls
    include = cuda_include()
    if include is None:
        print("dev.py wheels: no cuda.h here (set CUDA_HOME): metrale-cuda's wheel has the pure driver calls only",
              flush=True)
    lacks = _wheel_lacks(dist, "metrale_core") + _wheel_lacks(dist, "metrale_cuda", compiled=include is not None)
    if lacks:
        sys.exit(f"dev.py wheels: a wheel lacks {'; '.join(lacks)}")
    print(f"+ creating {env_dir}", flush=True)
    venv.create(env_dir, with_pip=True)
    env_py = env_dir / BIN.name / "python"
    report = RELEASE / "install-report.json"
    version = tomllib.loads((ROOT / DISTRIBUTIONS[-1] / "pyproject.toml").read_text())["project"]["version"]
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
    # and the compiled twins (named after the command), which import only where they were compiled
    where = ("import importlib, sys, metrale_core, metrale_fake, metrale_cuda\n"
             "modules = [metrale_core, metrale_fake, metrale_cuda, *map(importlib.import_module, sys.argv[1:])]\n"
             "outside = [m.__file__ for m in modules if not (m.__file__ or '').startswith(sys.prefix)]\n"
             "sys.exit(f'not from the wheels: {outside}' if outside else 0)")
    expected = [name for name in twins() if include is not None or name != CUDA_TWIN]
    for cmd in ([env_py, "-c", where, *expected], [metrale, "--version"], [metrale, "selftest"],
                [metrale, "conformance", "fake"]):
        if run(*cmd, cwd=env_dir, env=child_env):
            sys.exit(f"dev.py wheels: {' '.join(str(c) for c in cmd[1:]) or cmd[0]} failed in {env_dir}")
    print(f"wheels: {len(sdists)} sdists and {len(wheel_files)} wheels in {dist}, installed in {env_dir}; "
          f"--version, selftest and conformance fake passed ({time.monotonic() - start:.0f} s)")
    print(INSTALL_ROUTE.format(dist=dist))
    return 0


#: What `dev.py wheels` prints last: the README's route from a clone, without dev.py (nothing is on the index yet).
INSTALL_ROUTE = (
    "To install these wheels into an environment of your own (metrale is not on the package index yet):\n"
    '    pip install --find-links {dist} "metrale[report]"     # or "metrale[cuda]", "metrale[test]"\n'
    "or, without dev.py, from the clone's root:\n"
    "    pip wheel --no-deps -w wheels . backends/fake backends/cuda packaging/metrale\n"
    '    pip install --find-links wheels "metrale[report]"'
)


#: ``dev.py test`` on every core (pytest-xdist); an ``xdist_group``'s tests (conftest.py) run on one worker, in turn.
PARALLEL = ("-n", "auto", "--dist", "loadgroup")
#: ``dev.py test --fast``: the inner loop. Stops at the first failure, a few Hypothesis examples each; leaves out the
#: slow tests and what builds wheels, runs subprocess after subprocess (the docs' examples, torchrun) or is for CI.
FAST_SELECTION: tuple[str, ...] = (
    "-x", "-p", "no:cacheprovider", "-m", "not slow",
    "--ignore=tests/commands/test_docs.py", "--ignore=tests/commands/test_release.py",
    "--ignore=tests/commands/test_dev_build.py", "--ignore=tests/commands/test_dev_gpu.py",
    "--ignore=tests/reports/test_distributed.py", "--ignore=tests/plugins/test_plugin_page.py",
)


#: The torch dev.py torchrun installs where none is: the release CI's machines keep a CPU build of on disk.
TORCH = "torch==2.13.0"


def torchrun() -> int:
    """Run the torchrun example with two ranks on the fake (two fake devices) and check the merged report."""
    missing = subprocess.run([PY, "-c", "import torch.distributed"], capture_output=True, check=False).returncode
    if missing and run(PY, "-m", "pip", "install", "-q", TORCH):
        sys.exit(f"dev.py torchrun: installing {TORCH} failed (see above)")
    return _example("torchrun", ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 str(ROOT / "examples" / "distributed" / "ranks.py")],
                    METRALE_BACKEND="fake", METRALE_FAKE_DEVICE_COUNT="2")


def engines() -> int:
    """Install Dask's distributed and Ray (the core's extras) and run the two examples on local clusters of two
    workers, each on a fake device of its own, checking each merged report names both workers."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    # the extras' requirements alone: reinstalling the core (and recompiling its twins) would add nothing
    if run(PY, "-m", "pip", "install", "-q", *extras["dask"], *extras["ray"]):
        sys.exit("dev.py engines: installing the extras dask and ray failed (see above)")
    failed = [_example(name, [str(ROOT / "examples" / name / "report.py")], RAY_AUTH_MODE="disabled")
              for name in ("dask", "ray")]
    return next((rc for rc in failed if rc), 0)


def _example(name: str, args: list[str], **env: str) -> int:
    """Run an example of two processes with ``env`` and no other ``METRALE_*``: its merged report must name both."""
    command = [str(PY), *args]
    print("+ " + " ".join(command), flush=True)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}, **env}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=600)
    print(done.stdout, end="")
    if done.returncode == 0 and "merged ledger report: 2 process(es)" in done.stdout:
        return 0
    print(done.stderr[-4000:], file=sys.stderr)
    print(f"dev.py: the {name} example failed, or its merged report does not name both processes", file=sys.stderr)
    return done.returncode or 1


def main(argv: list[str]) -> int:
    commands = {"selftest", "test", "lint", "docs", "metrale", "wheels", "torchrun", "engines", "gpu"}
    if not argv or argv[0] not in commands:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "wheels":
        return wheels()
    if command == "gpu":  # the lent GPU machine: installs into its Python, makes no .venv
        sys.path.insert(0, str(ROOT / "tools"))
        return importlib.import_module("gpu_plan").gpu(rest)
    ensure_env(full=command != "selftest")
    if command in ("selftest", "metrale"):
        return run(BIN / "metrale", *(["selftest"] if command == "selftest" else []), *rest)
    if command in ("torchrun", "engines", "lint"):
        return {"torchrun": torchrun, "engines": engines, "lint": lint}[command]()
    if command == "docs":
        if "--serve" in rest:  # open http://127.0.0.1:8000: search and links need a server, not a file
            return run(BIN / "mkdocs", "serve", *[a for a in rest if a != "--serve"])
        return run(BIN / "mkdocs", "build", "--strict", *rest)
    profile = "thorough" if "--thorough" in rest else "fast" if "--fast" in rest else "ci"
    fast = FAST_SELECTION if "--fast" in rest else ()
    rest = [a for a in rest if a not in ("--thorough", "--fast")]
    # every core, unless the arguments choose (-n 0, -p no:xdist) or need one process (--pdb, --trace)
    own = any(a.startswith(("-n", "--numprocesses", "--dist", "--pdb", "--trace")) or a == "no:xdist" for a in rest)
    # pytest exits 5 when it collected no test: that is a failure here too. -rfE: failures and errors listed, the
    # skips summed up per reason (conftest.py). Bytecode cached, whatever PYTHONDONTWRITEBYTECODE says: each worker
    # and each of the suite's hundreds of subprocesses would compile metrale (and pytest rewrite the tests) anew
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return run(PY, "-m", "pytest", f"--hypothesis-profile={profile}", "-rfE", *(() if own else PARALLEL), *fast,
               *rest, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
