#!/usr/bin/env python3
"""Developer entry point: needs only Python 3.11+.

    python3 dev.py selftest     # create .venv if needed, install what it needs, run `metrale selftest`
    python3 dev.py test         # the whole test suite (derandomized Hypothesis profile "ci")
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
    python3 dev.py accelerate [--clean]   # optional: compile the hot-path modules with Cython (or remove them)
    python3 dev.py gpu [--only STEPS] [--quick] [--against REV] [--dry-run]
                                # on the lent GPU machine: install (no venv), selftest, conformance, the suite
                                # twice, the benchmarks; logs and summary.txt under $OUT (or gpu-logs/); see gpu()

Extra arguments after `test` go to pytest.

The core's compiled twins (``metrale_core/**/*.pyx``, docs/building.md) compile in place with the editable
install where a C compiler is, and the CUDA backend's compiled driver calls
(``backends/cuda/metrale_cuda/_cdriver.pyx``) where the CUDA toolkit's ``cuda.h`` is too; elsewhere the pure-Python
modules run, and dev.py says so once.

`torchrun` installs ``torch==2.13.0`` with pip when torch is not importable. CI's machines keep a CPU build of
it on disk, which pip takes; elsewhere pip may download a CUDA build of several GB: install a CPU build first
(``pip install torch --index-url https://download.pytorch.org/whl/cpu`` in ``.venv``) to avoid that.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import importlib.machinery
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import tomllib
import venv
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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
#: The build's files: a change reinstalls (the core's and the CUDA backend's setup.py and MANIFEST.in with their
#: pyproject.toml, the cydriver declarations the CUDA backend's build reads, and the device calls' C header, which
#: both compile against).
PROJECT_FILES = (["pyproject.toml", "setup.py", "MANIFEST.in"] + [f"{p}/pyproject.toml" for p in PACKAGES[1:]]
                 + ["backends/cuda/setup.py", "backends/cuda/MANIFEST.in",
                    "backends/cuda/pxd/cuda/bindings/cydriver.pxd", "metrale_core/include/metrale/device_calls.h"])
#: The packages with compiled twins, each by the folder that holds it: the core's twins, and the CUDA backend's
#: driver calls (``metrale_cuda/_cdriver.pyx``, built only where its setup.py finds cuda.h).
TWIN_PACKAGES = {"metrale_core": ROOT, "metrale_cuda": ROOT / "backends" / "cuda"}
#: The CUDA backend's compiled module (its setup.py builds it where it finds the CUDA toolkit's cuda.h).
CUDA_TWIN = "metrale_cuda._cdriver"
#: Where each distribution's version is written (its build backend reads it from there): an editable install's
#: metadata carries it, so a changed version reinstalls.
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
    "examples/host-app/batch_scorer.py",
]
#: What `wheels` leaves: the sdists and wheels, and the environment they were installed in.
RELEASE = VENV / "release"
VERSION_LINE = re.compile(r'^__version__ = "([^"]+)"$', re.MULTILINE)


def run(*cmd: str | Path, cwd: Path = ROOT, env: dict[str, str] | None = None) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.call([str(c) for c in cmd], cwd=cwd, env=env)


def twins() -> dict[str, Path]:
    """The compiled twins: each ``.pyx`` of `TWIN_PACKAGES` by the module its setup.py builds from it."""
    return {".".join(p.relative_to(base).with_suffix("").parts): p
            for package, base in TWIN_PACKAGES.items() for p in sorted((base / package).rglob("*.pyx"))}


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
    """The twins built in place for this Python (the editable install builds them beside their ``.pyx``)."""
    return [name for name, pyx in twins().items()
            if any(pyx.with_name(pyx.stem + s).exists() for s in importlib.machinery.EXTENSION_SUFFIXES)]


def _digest() -> str:
    digest = hashlib.sha256(sys.version.encode())
    # a changed .pyx (or .pxd, which other twins cimport) reinstalls too: the editable install compiles the twins
    for path in [ROOT / name for name in PROJECT_FILES] + list(twins().values()) + sorted(
        (ROOT / "metrale_core").rglob("*.pxd")
    ):
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
    # pip -q hides setup.py's line: say it here
    missing = sorted(set(twins()) - set(compiled_twins()))
    if missing:
        print(f"dev.py: {len(missing)} of {len(twins())} compiled twins not built ({', '.join(missing)}): no C "
              f"compiler (and for {CUDA_TWIN}, no cuda.h: set CUDA_HOME)? the pure-Python modules run", flush=True)
    stamps[full].write_text(digest)


def lint() -> int:
    """ruff, mypy --strict, and mypy's stubtest: each compiled twin against its .pyi (mypy reads the .pyi alone)."""
    ruff = run(PY, "-m", "ruff", "check", *LINTED, "tests", "examples", "conftest.py", "dev.py", "setup.py",
               "backends/fake/tests", "backends/cuda/tests", "backends/cuda/setup.py")
    if ruff or run(PY, "-m", "mypy", *LINTED):
        return 1
    compiled = compiled_twins()
    if not compiled:
        print(f"lint: no compiled twin here ({len(twins())} .pyx): stubtest skipped", flush=True)
        return 0
    allowlist = ROOT / "tools" / "stubtest-allowlist.txt"  # what Cython adds to each; not every twin has all
    # mypy finds each twin's stub by its package's folder (an editable install of setuptools' hides it behind an
    # import hook), and reads the project's settings (cuda.bindings has no stubs)
    env = {**os.environ, "MYPYPATH": os.pathsep.join(str(base) for base in TWIN_PACKAGES.values())}
    return run(PY, "-m", "mypy.stubtest", "--mypy-config-file", ROOT / "pyproject.toml", "--allowlist", allowlist,
               "--ignore-unused-allowlist", *compiled, env=env)


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


#: ``dev.py test --fast``: the inner loop. Stops at the first failure, a few Hypothesis examples each, and leaves out
#: what builds wheels, runs subprocess after subprocess (the docs' examples, torchrun, the pytest plugin's own
#: sessions) or exists for CI; the whole suite still runs before a commit lands.
FAST_SELECTION: tuple[str, ...] = (
    "-x", "-p", "no:cacheprovider",
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


def engines() -> int:
    """Install Dask's distributed and Ray (the core's extras) and run the two examples on local clusters of two
    workers, each on a fake device of its own, checking each merged report names both workers."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    # the extras' requirements alone: reinstalling the core (and recompiling its twins) would add nothing
    if run(PY, "-m", "pip", "install", "-q", *extras["dask"], *extras["ray"]):
        sys.exit("dev.py engines: installing the extras dask and ray failed (see above)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    env["RAY_AUTH_MODE"] = "disabled"
    failed = 0
    for example, expected in (("dask", "merged ledger report: 2 process(es)"),
                              ("ray", "merged ledger report: 2 process(es)")):
        command = [str(PY), str(ROOT / "examples" / example / "report.py")]
        print("+ " + " ".join(command), flush=True)
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=600)
        print(done.stdout, end="")
        if done.returncode or expected not in done.stdout:
            print(done.stderr[-4000:], file=sys.stderr)
            print(f"dev.py engines: the {example} example failed, or its report does not name both workers",
                  file=sys.stderr)
            failed = done.returncode or 1
    return failed


# -- dev.py gpu: one command for the lent GPU machine ------------------------------------------------------------
#
# - the plan: `GpuStep`s of `GpuCommand`s, built by `gpu_plan` from the options (`--dry-run` prints it);
# - the run: `run_gpu_step` runs a step's commands under its time limit, its output in logs/STEP.txt;
# - the summary: `pytest_final_line`, `skip_reasons`, `bench_table` read the logs into summary.txt.

#: Where the wheels of .whl/ go on the GPU machine (it has no network and no pydantic): a --target dir on
#: PYTHONPATH, as ../shared/gpu/README.md says; never a venv.
GPU_SITE = Path("/tmp/site")
#: Where `--against REV` puts the old revision: its source (src/), its packages (site/) and an empty working
#: folder (run/), so `python -m metrale_core` imports neither checkout by accident.
AGAINST_ROOT = Path("/tmp/metrale-against")
SUITE_PATHS = ("tests", "backends/fake/tests", "backends/cuda/tests", "examples/tracing-backend/tests",
               "examples/pipeline/tests")
#: The pure-Python modules, whatever was compiled (`MetraleSettings.pure`).
PURE_ENV: Mapping[str, str] = {"METRALE_PURE": "1"}
#: The scale variant with red zones, as the CUDA backend must pass it (any `strix*` target selects the variant).
STRIX_ENV: Mapping[str, str] = {"METRALE_TARGET_HW": "strix-h200", "METRALE_REDZONE": "256"}
#: With --quick, the strix run covers the files that read the scale variant (capture state, red zones).
STRIX_QUICK = ("tests/streams/test_capture.py", "tests/plugins/test_state_machine.py",
               "tests/reports/test_distributed.py", "tests/launch/test_tensor_maps.py")
#: The whole run's default time: the device tool allows 600 s a command, install and transfers included.
GPU_BUDGET_S = 540
#: A step is not started with less time left than this.
GPU_MIN_STEP_S = 10
# Measured: on an H200, selftest 2 s, conformance 14 s, bench_redzones 4 s, probes 10 s, metrale bench 16 s.
GPU_STEPS: Mapping[str, tuple[str, int]] = {
    "info": ("the GPU, the versions, the backends, the shipped PTX's preflight", 60),
    "selftest": ("metrale selftest", 90),
    "conformance": ("metrale conformance on the GPU's backend", 120),
    "suite": ("the whole suite, default settings", 420),
    "strix": ("the whole suite, METRALE_TARGET_HW=strix-h200 METRALE_REDZONE=256", 420),
    "pure": ("the whole suite on the pure-Python modules, METRALE_PURE=1", 420),
    "strix-pure": ("the strix suite on the pure-Python modules, METRALE_PURE=1", 420),
    "redzones": ("tools/bench_redzones.py: the scan against per-zone reads, a zoned alloc/free", 90),
    "probes": ("backends/cuda/tools: the driver calls red zones use, DLPack export costs", 90),
    "bench": ("metrale bench --json", 180),
}


@dataclasses.dataclass(frozen=True)
class GpuCommand:
    """One command of a step: its arguments, extra environment, folder, and a folder put first on PYTHONPATH."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cwd: Path = ROOT
    path_first: Path | None = None

    def text(self) -> str:
        """The command as a shell would take it (``python3`` for this Python, a script as ``'<N lines>'``)."""
        argv = ["python3" if a == sys.executable else f"<{a.count(chr(10))} lines>" if "\n" in a else a
                for a in self.argv]
        env = [f"{k}={v}" for k, v in self.env.items()]
        path = [f"PYTHONPATH={self.path_first}:$PYTHONPATH"] if self.path_first else []
        where = f"(in {self.cwd}) " if self.cwd != ROOT else ""
        return where + " ".join([*path, *env, shlex.join(argv)])


@dataclasses.dataclass(frozen=True)
class GpuStep:
    """A step: a name for --only and the summary, its commands, its time limit, and how its log is read."""

    name: str
    title: str
    limit_s: int
    commands: tuple[GpuCommand, ...]
    kind: str = "plain"  # "pytest", "bench", "against-bench", "info" (its rc not counted), "plain"
    counted: bool = True
    folders: tuple[Path, ...] = ()
    needs: str | None = None  # a step that must have passed first, else this one is not run


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    out: Path
    steps: tuple[GpuStep, ...]
    install: bool
    budget_s: int
    against: str | None
    rounds: int


@dataclasses.dataclass
class GpuResult:
    step: GpuStep
    rc: int | None  # None: not run (`lines` says why)
    seconds: float
    limit_s: float
    lines: list[str]


def _python(*args: str) -> tuple[str, ...]:
    return (sys.executable, *args)


def _metrale(*args: str) -> tuple[str, ...]:
    return _python("-m", "metrale_core", *args)


_VERSIONS = (
    "import importlib, platform\n"
    "found = ['python ' + platform.python_version()]\n"
    "for name, module in [('cuda-bindings', 'cuda.bindings'), ('numpy', 'numpy'), ('cupy', 'cupy'),\n"
    "                     ('torch', 'torch'), ('pydantic', 'pydantic'), ('pluggy', 'pluggy'),\n"
    "                     ('hypothesis', 'hypothesis'), ('pytest', 'pytest')]:\n"
    "    try:\n"
    "        found.append(name + ' ' + str(importlib.import_module(module).__version__))\n"
    "    except Exception as exc:\n"
    "        found.append(name + ' missing (' + type(exc).__name__ + ')')\n"
    "print(', '.join(found))\n"
)
#: ``python -c _IMPORTS_FROM WHO FOLDER``: fails unless every metrale package comes from FOLDER.
_IMPORTS_FROM = (
    "import sys, metrale_core, metrale_fake, metrale_cuda\n"
    "where = [m.__file__ or '' for m in (metrale_core, metrale_fake, metrale_cuda)]\n"
    "print(sys.argv[1], 'imports from', ', '.join(where))\n"
    "sys.exit(0 if all(w.startswith(sys.argv[2]) for w in where) else 'not all from ' + sys.argv[2])\n"
)


#: ``python -c _TWINS_BUILT HINT NAME...``: fails unless each compiled twin NAME imports (only a compiled one can; the
#: CUDA backend's also checks its cydriver functions' signatures against the installed cuda-bindings' as it loads),
#: naming what a build needs (setuptools, Cython, a C compiler, Python's headers, cuda.h) and HINT. pip -q hides
#: setup.py's own line.
_TWINS_BUILT = (
    "import importlib, importlib.metadata as md, os, runpy, shutil, sys, sysconfig\n"
    "hint, names = sys.argv[1], sys.argv[2:]\n"
    "missing = []\n"
    "for n in names:\n"
    "    try:\n"
    "        importlib.import_module(n)\n"
    "    except Exception as exc:\n"
    "        missing.append(f'{n} ({type(exc).__name__}: {exc})')\n"
    "print(f'compiled twins: {len(names) - len(missing)} of {len(names)} built', *missing)\n"
    "def version(name):\n"
    "    try:\n"
    "        return name + ' ' + md.version(name)\n"
    "    except md.PackageNotFoundError:\n"
    "        return 'no ' + name\n"
    "def cuda_h():\n"
    "    try:\n"
    "        found = runpy.run_path('backends/cuda/setup.py', run_name='metrale_cuda_setup')['cuda_include']()\n"
    "    except Exception as exc:\n"
    "        return f'cuda.h not looked for ({type(exc).__name__})'\n"
    "    return f'cuda.h in {found}' if found else 'cuda.h missing (set CUDA_HOME)'\n"
    "cc = (sysconfig.get_config_var('CC') or 'cc').split()[0]\n"
    "header = os.path.join(sysconfig.get_paths()['include'], 'Python.h')\n"
    "found = [version('setuptools'), version('Cython'), version('cuda-bindings'),\n"
    "         cc + (' found' if shutil.which(cc) else ' missing'),\n"
    "         'Python.h ' + ('found' if os.path.exists(header) else 'missing'), cuda_h()]\n"
    "if missing:\n"
    "    sys.exit('not compiled; here: ' + ', '.join(found) + '; ' + hint)\n"
)
#: What building the core needs on the GPU machine, carried as wheels: ``../shared/gpu/fetch-wheels.sh`` these.
GPU_BUILD_WHEELS = ("cython==3.3.1", "setuptools==84.2.1")


def _install_commands(wheels: bool) -> tuple[GpuCommand, ...]:
    """The wheels of .whl/ into /tmp/site (with setuptools and Cython, which build the core's twins and the CUDA
    backend's driver calls: no build isolation, no network), the packages editable (the twins compiled in place),
    then a check that they were."""
    pip = _python("-m", "pip", "install", "-q", "--no-index", "--no-deps")
    commands = []
    if wheels:
        commands.append(GpuCommand((*pip, "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(GPU_SITE),
                                    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / ".whl").glob("*.whl")))))
    editable = [a for folder in PACKAGES for a in ("-e", folder.removesuffix("[test,lint,docs]"))]
    commands.append(GpuCommand((*pip, "--no-build-isolation", *editable)))
    hint = f"carry setuptools and Cython: ../shared/gpu/fetch-wheels.sh {' '.join(GPU_BUILD_WHEELS)}"
    commands.append(GpuCommand(_python("-c", _TWINS_BUILT, hint, *twins())))
    return tuple(commands)


def _against_commands(rev: str, base: Path) -> tuple[GpuCommand, ...]:
    src, site, tar = base / "src", base / "site", base / "src.tar"
    pip = _python("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation", "--no-compile",
                  "--upgrade", "--target", str(site))
    return (
        GpuCommand(("git", "archive", "--format=tar", f"--output={tar}", rev)),
        GpuCommand(("tar", "-xf", str(tar), "-C", str(src))),
        GpuCommand((*pip, str(src), str(src / "backends" / "fake"), str(src / "backends" / "cuda"))),
        GpuCommand(_python("-c", _IMPORTS_FROM, "the old code", str(site)), cwd=base / "run", path_first=site),
        GpuCommand(_python("-c", _IMPORTS_FROM, "the new code", str(ROOT)), cwd=base / "run"),
    )


def gpu_plan(options: argparse.Namespace) -> GpuPlan:
    """The steps ``options`` ask for, in order; refuses unknown step names and an --against without the bench."""
    chosen = list(GPU_STEPS) if options.only is None else [n.strip() for n in options.only.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in GPU_STEPS]
    if unknown or not chosen:
        raise SystemExit(f"dev.py gpu --only: no step named {', '.join(unknown) or 'at all'}; "
                         f"choose from {', '.join(GPU_STEPS)}")
    chosen = [name for name in GPU_STEPS if name in chosen]  # in the plan's order
    if (options.against or options.pure_turns) and "bench" not in chosen:
        raise SystemExit("dev.py gpu --against and --pure-turns compare metrale bench: add bench to --only")
    if options.against and options.pure_turns:
        raise SystemExit("dev.py gpu: --against or --pure-turns, not both")
    if options.rounds < 2:
        raise SystemExit("dev.py gpu --rounds: at least 2 (the old and the new code take turns)")
    out = Path(options.out or os.environ.get("OUT") or ROOT / "gpu-logs").resolve()
    logs, quick = out / "logs", options.quick
    backend = os.environ.get("METRALE_BACKEND", "auto")
    pytest_args = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "--hypothesis-profile=gpu", "-rfEs")
    bench_args = ("bench", *(("--quick",) if quick else ()), *(("--only", options.bench) if options.bench else ()))
    commands: dict[str, tuple[GpuCommand, ...]] = {
        "info": (
            GpuCommand(("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")),
            GpuCommand(_python("-c", _VERSIONS)),
            GpuCommand(("git", "describe", "--always", "--dirty")),  # -dirty: the tree is not HEAD's
            GpuCommand(_metrale("--version")),
            GpuCommand(_metrale("backends")),
            GpuCommand(_metrale("preflight", *sorted(str(p.relative_to(ROOT))
                                                     for p in (ROOT / "metrale_core" / "kernels").glob("*.ptx")))),
        ),
        "selftest": (GpuCommand(_metrale("selftest")),),
        "conformance": (GpuCommand(_metrale("conformance", "cuda" if backend == "auto" else backend,
                                            *(("--budget", "10") if quick else ()))),),
        "suite": (GpuCommand(_python(*pytest_args, *SUITE_PATHS, *options.pytest_args)),),
        "strix": (GpuCommand(_python(*pytest_args, *(STRIX_QUICK if quick else SUITE_PATHS), *options.pytest_args),
                             env=STRIX_ENV),),
        "pure": (GpuCommand(_python(*pytest_args, *SUITE_PATHS, *options.pytest_args), env=PURE_ENV),),
        "strix-pure": (GpuCommand(_python(*pytest_args, *(STRIX_QUICK if quick else SUITE_PATHS),
                                          *options.pytest_args), env={**STRIX_ENV, **PURE_ENV}),),
        "redzones": (GpuCommand(_python("tools/bench_redzones.py", "--zones", "1000" if quick else "10000",
                                        *(("--repeat", "3") if quick else ()))),),
        "probes": (GpuCommand(_python("backends/cuda/tools/probe_costs.py")),
                   GpuCommand(_python("backends/cuda/tools/dlpack_cost.py"))),
        "bench": (GpuCommand(_metrale(*bench_args, "--json", str(out / "bench.json"))),),
    }
    steps = []
    for name in chosen:
        title, limit = GPU_STEPS[name]
        kind = {"info": "info", "suite": "pytest", "strix": "pytest", "pure": "pytest", "strix-pure": "pytest",
                "bench": "bench"}.get(name, "plain")
        step = GpuStep(name, title, limit, commands[name], kind, counted=name != "info")
        if name == "bench" and options.pure_turns:
            turns = tuple(
                GpuCommand(_metrale(*bench_args, "--json", str(logs / f"bench-{who}-{i}.json")), env=env)
                for i in range(1, options.rounds + 1)
                for who, env in (("old", PURE_ENV), ("new", {"METRALE_PURE": "0"}))
            )
            title = f"metrale bench pure (old) and compiled (new), in turns, {options.rounds} each"
            step = GpuStep("bench", title, limit * 2 * options.rounds, turns, "against-bench")
        elif name == "bench" and options.against:
            base = AGAINST_ROOT / re.sub(r"[^A-Za-z0-9._-]", "_", options.against)
            steps.append(GpuStep("against", f"install the core and backends of {options.against} into {base}/site",
                                 120, _against_commands(options.against, base), folders=(base / "src", base / "run")))
            turns = []
            for i in range(1, options.rounds + 1):
                for who, first in (("old", base / "site"), ("new", None)):
                    json_path = logs / f"bench-{who}-{i}.json"
                    turns.append(GpuCommand(_metrale(*bench_args, "--json", str(json_path)), cwd=base / "run",
                                            path_first=first))
            title = f"metrale bench of {options.against} (old) and this checkout (new), in turns, {options.rounds} each"
            # without the old code installed, the "old" runs would time the new code
            step = GpuStep("bench", title, limit * 2 * options.rounds, tuple(turns), "against-bench", needs="against")
        steps.append(step)
    return GpuPlan(out, tuple(steps), not options.no_install, options.budget, options.against, options.rounds)


# -- reading the logs

_PYTEST_FINAL = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+ in \d[\d.]*s\b.*?|no tests ran in \d[\d.]*s\b.*?)\s*=*$")
_SKIPPED = re.compile(r"^SKIPPED \[(\d+)\] \S+?: (.*)$")  # the file, with :line or without


def pytest_final_line(text: str) -> str | None:
    """pytest's closing line (``1359 passed, 85 skipped in 98.71s (0:01:38)``), ``None`` if it never got there."""
    found = None
    for line in text.splitlines():
        match = _PYTEST_FINAL.match(line.strip())
        if match:
            found = match.group(1)
    return found


def skip_reasons(text: str) -> list[tuple[int, str]]:
    """The reasons of ``-rs``'s ``SKIPPED [N] file:line: reason`` lines, counted, the most frequent first."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        match = _SKIPPED.match(line.strip())
        if match:
            counts[match.group(2)] = counts.get(match.group(2), 0) + int(match.group(1))
    return sorted(((n, reason) for reason, n in counts.items()), key=lambda item: (-item[0], item[1]))


def bench_figures(report: Mapping[str, Any]) -> dict[tuple[str, str], tuple[str, float, float | None]]:
    """metrale's own figures of one ``metrale bench --json`` report: (measurement, label) -> (unit, value, the
    ratio to its baseline in the same run, or ``None`` where it has none)."""
    figures = {}
    for result in report.get("results", ()):
        for figure in result.get("figures", ()):
            if figure.get("source") == "metrale" and figure.get("value") is not None:
                ratio = figure.get("ratio")
                figures[(result["name"], figure["label"])] = (
                    figure["unit"], float(figure["value"]), None if ratio is None else float(ratio)
                )
    return figures


def bench_table(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each metrale figure side by side: the median over the old runs, over the new, and new / old; then the
    median of each run's ratio to its baseline (the raw driver or a peer, timed in the same run), old and new.

    The ratios cancel what drifts between runs (the driver's own times move by a fifth on a lent GPU)."""
    runs = {"old": [bench_figures(r) for r in old], "new": [bench_figures(r) for r in new]}
    keys: list[tuple[str, str]] = []
    units: dict[tuple[str, str], str] = {}
    for figures in runs["new"] + runs["old"]:
        for key, (unit, _, _) in figures.items():
            if key not in units:
                keys.append(key)
                units[key] = unit
    rows = [("figure", "unit", f"old ({len(old)})", f"new ({len(new)})", "new/old", "old x base", "new x base")]
    for key in keys:
        medians: dict[str, float | None] = {}
        for who, reports in runs.items():
            for i, what in ((1, who), (2, f"{who} ratio")):
                values = [float(v) for figures in reports if key in figures and (v := figures[key][i]) is not None]
                medians[what] = statistics.median(values) if values else None
        old_v, new_v = medians["old"], medians["new"]
        ratio = f"{new_v / old_v:.3f}" if old_v and new_v is not None else "-"
        rows.append((f"{key[0]}: {key[1]}", units[key], _figure(old_v), _figure(new_v), ratio,
                     _figure(medians["old ratio"]), _figure(medians["new ratio"])))
    widths = [max(len(row[i]) for row in rows) for i in range(7)]
    return ["  ".join([f"{r[0]:<{widths[0]}}", f"{r[1]:<{widths[1]}}",
                       *(f"{c:>{w}}" for c, w in zip(r[2:], widths[2:], strict=True))]).rstrip() for r in rows]


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def step_lines(step: GpuStep, text: str, logs: Path) -> list[str]:
    """What the summary says of a step, from its log."""
    tail = [line for line in text.splitlines() if line.strip() and not line.startswith("+ ")]
    if step.kind == "info":
        return tail[:40]
    if step.kind == "pytest":
        lines = [pytest_final_line(text) or "(no final line: " + (tail[-1] if tail else "no output") + ")"]
        lines += [f"skipped {n}: {reason}" for n, reason in skip_reasons(text)]
        failed = [line[:300] for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
        return lines + failed[:20] + ([f"... and {len(failed) - 20} more"] if len(failed) > 20 else [])
    if step.kind == "bench":
        return [line for line in tail if line.lstrip().startswith("goal:")] + tail[-1:]
    if step.kind == "against-bench":
        reports = {who: [r for r in (_read_json(p) for p in sorted(logs.glob(f"bench-{who}-*.json"))) if r]
                   for who in ("old", "new")}
        if not reports["old"] or not reports["new"]:
            return [f"no table: {len(reports['old'])} old and {len(reports['new'])} new runs finished", *tail[-3:]]
        device = reports["new"][0].get("device", "?")
        return [f"on {device}; medians of the rounds; us: lower is better, GB/s: higher is better",
                *bench_table(reports["old"], reports["new"])]
    return tail[-5:]


# -- running

def _kill(process: subprocess.Popen[bytes]) -> None:
    """End the command and what it started (its own process group, made for it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_gpu_step(step: GpuStep, log: Path, limit_s: float) -> int:
    """Run ``step``'s commands in order, their output in ``log``, all within ``limit_s``; 124 when out of time.
    A failed command does not stop the step: the rc is the first failure's."""
    for folder in step.folders:
        folder.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + limit_s
    rc = 0
    log.write_text("")
    with log.open("a") as out:  # O_APPEND: the commands write to the same file
        for command in step.commands:
            out.write(f"+ {command.text()}\n")
            out.flush()
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **command.env}
            if command.path_first:
                env["PYTHONPATH"] = os.pathsep.join(p for p in (str(command.path_first), env.get("PYTHONPATH")) if p)
            left = deadline - time.monotonic()
            if left <= 0:
                out.write(f"\n(not run: the step's {step.limit_s} s are spent)\n")
                return rc or 124
            try:
                process = subprocess.Popen(command.argv, cwd=command.cwd, env=env, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as exc:
                out.write(f"\n(could not start: {exc})\n")
                rc = rc or 127
                continue
            try:
                code = process.wait(timeout=left)
            except subprocess.TimeoutExpired:
                _kill(process)
                out.write(f"\n(stopped: out of time after {limit_s:.0f} s)\n")
                return 124
            if code:
                out.write(f"\n(exit status {code})\n")
                rc = rc or code
    return rc


def _summary(plan: GpuPlan, results: Sequence[GpuResult], started: str, commit: str) -> str:
    lines = [f"dev.py gpu at {commit}, started {started}; budget {plan.budget_s} s; logs in {plan.out}",
             f"{'step':<12} {'rc':>4} {'time':>7} {'limit':>7}  what"]
    for r in results:
        rc = "-" if r.rc is None else str(r.rc)
        lines.append(f"{r.step.name:<12} {rc:>4} {r.seconds:>6.0f}s {r.limit_s:>6.0f}s  {r.step.title}")
    for r in results:
        head = "not run" if r.rc is None else f"rc {r.rc}, {r.seconds:.0f} s"
        lines += ["", f"== {r.step.name} ({head})", *(f"  {line}" for line in r.lines)]
    return "\n".join(lines) + "\n"


def _pack(out: Path) -> None:
    """logs/ into logs.tgz; under $OUT (the lent machine returns at most 8 files) logs/ itself goes."""
    logs = out / "logs"
    with tarfile.open(out / "logs.tgz", "w:gz") as tar:
        tar.add(logs, arcname="logs")
    if os.environ.get("OUT"):
        shutil.rmtree(logs)


def _commit() -> str:
    # "-dirty" where the working tree differs from HEAD (the GPU machine's copy may carry an older .git)
    done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() or "an unknown commit"


def gpu(argv: Sequence[str]) -> int:
    """On the lent GPU machine, one command: install the checkout (no venv: the wheels of .whl/ into /tmp/site,
    setuptools and Cython among them, the packages editable into this Python, the twins compiled), then each step
    under its own time limit, never stopping at a failure; logs/STEP.txt and summary.txt under $OUT (or gpu-logs/).
    Exits 1 if a step failed or did not run."""
    parser = argparse.ArgumentParser(prog="dev.py gpu", description=gpu.__doc__)
    parser.add_argument("--only", metavar="STEPS", help=f"comma-separated steps: {', '.join(GPU_STEPS)}")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: bench --quick, fewer zones, a 10 s conformance, strix over fewer files")
    parser.add_argument("--against", metavar="REV",
                        help="also install the core and backends of git revision REV and run its metrale bench and "
                             "this checkout's in turns; summary.txt gets a table of metrale's figures, old and new")
    parser.add_argument("--pure-turns", action="store_true",
                        help="run metrale bench on the pure-Python modules (METRALE_PURE=1, old) and the compiled "
                             "twins (new) in turns; summary.txt gets the table of both")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of each bench with --against or --pure-turns (default 2)")
    parser.add_argument("--bench", metavar="NAMES", help="metrale bench --only NAMES (default: every measurement)")
    parser.add_argument("--budget", type=int, default=GPU_BUDGET_S, metavar="SECONDS",
                        help=f"the whole run's time; a step gets what is left, at most its own limit "
                             f"(default {GPU_BUDGET_S})")
    parser.add_argument("--out", metavar="DIR", help="where logs go (default: $OUT, else gpu-logs/)")
    parser.add_argument("--no-install", action="store_true",
                        help="use the packages this Python already has (a machine set up before, or .venv here)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS", help="passed to both suite runs")
    options = parser.parse_args(argv)
    plan = gpu_plan(options)
    install = GpuStep("install", "the wheels of .whl/ into /tmp/site, the packages editable, the twins", 180,
                      _install_commands((ROOT / ".whl").is_dir()))
    steps = ((install,) if plan.install else ()) + plan.steps
    if options.dry_run:
        print(f"dev.py gpu: python3 is {sys.executable}; logs in {plan.out}; budget {plan.budget_s} s"
              + (f"; PYTHONPATH starts with {GPU_SITE}" if plan.install else ""))
        for step in steps:
            print(f"{step.name} (at most {step.limit_s} s): {step.title}")
            for command in step.commands:
                print(f"    {command.text()}")
        return 0
    start, started = time.monotonic(), datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    logs = plan.out / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    if plan.install:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(GPU_SITE), os.environ.get("PYTHONPATH")) if p)
    commit, results = _commit(), []
    for step in steps:
        left = plan.budget_s - (time.monotonic() - start)
        limit = min(step.limit_s, left)
        failed = [r.step.name for r in results if r.step.name == step.needs and r.rc != 0]
        if failed:
            results.append(GpuResult(step, None, 0.0, 0.0, [f"not run: {failed[0]} failed"]))
        elif limit < GPU_MIN_STEP_S:
            results.append(GpuResult(step, None, 0.0, 0.0, [f"not run: the budget of {plan.budget_s} s was spent"]))
        else:
            print(f"== {step.name}: {step.title} (at most {limit:.0f} s)", flush=True)
            log = logs / f"{step.name}.txt"
            began = time.monotonic()
            rc = run_gpu_step(step, log, limit)
            results.append(GpuResult(step, rc, time.monotonic() - began, limit,
                                     step_lines(step, log.read_text(errors="replace"), logs)))
            print(f"   {step.name}: rc {rc} in {time.monotonic() - began:.0f} s", flush=True)
        (plan.out / "summary.txt").write_text(_summary(plan, results, started, commit))
    _pack(plan.out)
    print((plan.out / "summary.txt").read_text(), end="")
    return int(any(r.step.counted and r.rc != 0 for r in results))


def main(argv: list[str]) -> int:
    commands = {"selftest", "test", "lint", "docs", "metrale", "accelerate", "wheels", "torchrun", "engines", "gpu"}
    if not argv or argv[0] not in commands:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "wheels":
        return wheels()
    if command == "gpu":  # the lent GPU machine: installs into its Python, makes no .venv
        return gpu(rest)
    ensure_env(full=command != "selftest")
    if command == "selftest":
        return run(BIN / "metrale", "selftest", *rest)
    if command == "metrale":
        return run(BIN / "metrale", *rest)
    if command == "torchrun":
        return torchrun()
    if command == "engines":
        return engines()
    if command == "accelerate":
        if "--clean" not in rest and run(PY, "-m", "pip", "install", "-q", "cython", "setuptools"):
            sys.exit("dev.py: installing Cython failed (see above); metrale stays pure Python")
        return run(PY, ROOT / "tools" / "accelerate.py", *rest)
    if command == "docs":
        if "--serve" in rest:  # open http://127.0.0.1:8000: search and links need a server, not a file
            return run(BIN / "mkdocs", "serve", *[a for a in rest if a != "--serve"])
        return run(BIN / "mkdocs", "build", "--strict", *rest)
    if command == "lint":
        return lint()
    profile = "thorough" if "--thorough" in rest else "fast" if "--fast" in rest else "ci"
    fast = FAST_SELECTION if "--fast" in rest else ()
    rest = [a for a in rest if a not in ("--thorough", "--fast")]
    # pytest exits 5 when it collected no test: that is a failure here too. -rfE: failures and errors listed, the
    # skips summed up per reason (conftest.py)
    return run(PY, "-m", "pytest", f"--hypothesis-profile={profile}", "-rfE", *fast, *rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
