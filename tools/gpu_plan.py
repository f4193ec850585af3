#!/usr/bin/env python3
"""``python3 dev.py gpu``: one command for the lent GPU machine (``dev.py gpu`` hands its arguments on to `gpu`).

    python3 dev.py gpu [--only STEPS] [--quick] [--against REV] [--pure-turns] [--dry-run] [-- PYTEST_ARGS]

It installs the checkout into that machine's Python (no venv), then runs each step under its own time limit, never
stopping at a failure; logs/STEP.txt and summary.txt go under $OUT (or gpu-logs/). README.md says what it runs.

- the plan: `GpuStep`s of `GpuCommand`s, built by `gpu_plan` from the options (``--dry-run`` prints it);
- the run: `run_gpu_step` runs a step's commands under its time limit, its output in logs/STEP.txt;
- the summary: `pytest_final_line`, `skip_reasons`, `bench_table` read the logs into summary.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: dev.py (the packages, the twins) is in the folder above
    sys.path.insert(0, str(ROOT))

from dev import PACKAGES, twins  # noqa: E402

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
    "probes": ("backends/cuda/tools: the driver calls red zones use, DLPack export costs, the door's pair zoned", 150),
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
                   GpuCommand(_python("backends/cuda/tools/dlpack_cost.py")),
                   GpuCommand(_python("backends/cuda/tools/probe_door.py"))),
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


if __name__ == "__main__":
    sys.exit(gpu(sys.argv[1:]))
