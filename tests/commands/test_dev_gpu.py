"""`python3 dev.py gpu`'s pure parts (tools/gpu_plan.py): the plan, and reading pytest's and the bench's output into
the summary.

- The plan: the steps in order, `--only`, `--quick`, `--against` (the old and the new bench in turns); the install
  (setuptools and Cython from .whl/, no build isolation, a check of the twins); `dev.py gpu` hands on its arguments.
- The readers: pytest's final line, the skip reasons counted, the old/new bench table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import gpu_plan


def _options(**given: Any) -> argparse.Namespace:
    options: dict[str, Any] = {"only": None, "quick": False, "against": None, "pure_turns": False, "rounds": 2,
                               "bench": None, "budget": 540, "out": "/tmp/gpu-logs-test", "no_install": False,
                               "dry_run": True, "pytest_args": []}
    return argparse.Namespace(**{**options, **given})


def test_the_default_plan_runs_every_step_in_order() -> None:
    plan = gpu_plan.gpu_plan(_options())
    assert [s.name for s in plan.steps] == list(gpu_plan.GPU_STEPS)
    strix = next(s for s in plan.steps if s.name == "strix")
    assert dict(strix.commands[0].env) == {"METRALE_TARGET_HW": "strix-h200", "METRALE_REDZONE": "256"}
    assert all(p in strix.commands[0].argv for p in gpu_plan.SUITE_PATHS)
    assert plan.install


def test_only_and_quick_choose_the_steps_and_their_size() -> None:
    plan = gpu_plan.gpu_plan(_options(only="bench, strix", quick=True, no_install=True))
    assert [s.name for s in plan.steps] == ["strix", "bench"]  # the plan's order, not the option's
    strix, bench = plan.steps
    assert "tests/streams/test_capture.py" in strix.commands[0].argv and "tests" not in strix.commands[0].argv
    assert "--quick" in bench.commands[0].argv
    assert not plan.install


@pytest.mark.parametrize(("given", "said"), [
    ({"only": "suite,nope"}, "no step named nope"),
    ({"only": ","}, "no step named at all"),
    ({"only": "suite", "against": "1932081"}, "add bench to --only"),
    ({"against": "1932081", "rounds": 1}, "at least 2"),
])
def test_a_bad_option_is_refused(given: dict[str, Any], said: str) -> None:
    with pytest.raises(SystemExit, match=said):
        gpu_plan.gpu_plan(_options(**given))


def test_against_installs_the_old_revision_and_takes_turns() -> None:
    plan = gpu_plan.gpu_plan(_options(only="bench", against="1932081", rounds=3, bench="alloc"))
    against, bench = plan.steps
    assert against.name == "against" and "1932081" in against.commands[0].argv
    assert bench.kind == "against-bench" and bench.needs == "against"  # never the new code timed as the old
    turns = [(c.path_first is not None, c.argv[-1].rsplit("/", 1)[-1]) for c in bench.commands]
    assert turns == [(True, "bench-old-1.json"), (False, "bench-new-1.json"), (True, "bench-old-2.json"),
                     (False, "bench-new-2.json"), (True, "bench-old-3.json"), (False, "bench-new-3.json")]
    assert all(c.cwd == bench.commands[0].cwd != gpu_plan.ROOT for c in bench.commands)  # neither checkout on sys.path
    assert all(c.argv[c.argv.index("--only") + 1] == "alloc" for c in bench.commands)


PYTEST_LOG = """\
.....s..F
=================================== short test summary info ===================================
SKIPPED [11] tests/test_capture.py: backend cuda unavailable: no driver
SKIPPED [2] tests/test_capture.py:71: backend cuda unavailable: no driver
SKIPPED [3] tests/test_docs.py:40: a GPU answers here
FAILED tests/test_x.py::test_y - AssertionError: no
1 failed, 1359 passed, 16 skipped, 2 warnings in 98.71s (0:01:38)
"""


def test_the_pytest_log_is_read() -> None:
    assert gpu_plan.pytest_final_line(PYTEST_LOG) == "1 failed, 1359 passed, 16 skipped, 2 warnings in 98.71s (0:01:38)"
    assert gpu_plan.pytest_final_line("====== 3 passed in 0.12s ======\n") == "3 passed in 0.12s"
    assert gpu_plan.pytest_final_line("no tests ran in 0.01s\n") == "no tests ran in 0.01s"
    assert gpu_plan.pytest_final_line("....\n(stopped: out of time after 20 s)\n") is None
    assert gpu_plan.skip_reasons(PYTEST_LOG) == [(13, "backend cuda unavailable: no driver"), (3, "a GPU answers here")]
    step = gpu_plan.GpuStep("suite", "the suite", 300, (), "pytest")
    lines = gpu_plan.step_lines(step, PYTEST_LOG, gpu_plan.ROOT)
    assert lines[0].startswith("1 failed") and lines[-1].startswith("FAILED tests/test_x.py::test_y")


def _report(alloc: float, copy: float | None) -> dict[str, Any]:
    figure = {"source": "metrale", "unit": "us", "vs": None, "ratio": None, "note": ""}
    return {"device": "NVIDIA H100", "results": [
        {"name": "alloc", "figures": [{**figure, "label": "metrale 1 MiB", "value": alloc, "ratio": alloc / 3.0},
                                      {**figure, "source": "cuda.bindings 13.3.1", "label": "raw", "value": 3.0}]},
        {"name": "copy", "figures": [{**figure, "label": "metrale D2D", "unit": "GB/s", "value": copy}]},
    ]}


def test_the_bench_table_puts_medians_side_by_side() -> None:
    table = gpu_plan.bench_table([_report(20.0, 4000.0), _report(24.0, 4100.0)],
                                 [_report(10.0, None), _report(12.0, None)])
    assert [line.split() for line in table] == [
        ["figure", "unit", "old", "(2)", "new", "(2)", "new/old", "old", "x", "base", "new", "x", "base"],
        ["alloc:", "metrale", "1", "MiB", "us", "22.00", "11.00", "0.500", "7.33", "3.67"],  # the raw is not metrale's
        ["copy:", "metrale", "D2D", "GB/s", "4050.00", "-", "-", "-", "-"],  # skipped in the new runs
    ]


def test_pure_turns_run_the_bench_pure_and_compiled_in_turns() -> None:
    plan = gpu_plan.gpu_plan(_options(only="bench", pure_turns=True, rounds=2, bench="alloc"))
    (bench,) = plan.steps
    assert bench.kind == "against-bench"
    assert [(c.env.get("METRALE_PURE"), Path(c.argv[-1]).name) for c in bench.commands] == [
        ("1", "bench-old-1.json"), ("0", "bench-new-1.json"), ("1", "bench-old-2.json"), ("0", "bench-new-2.json"),
    ]


def test_pure_turns_need_the_bench_and_not_against() -> None:
    with pytest.raises(SystemExit, match="add bench"):
        gpu_plan.gpu_plan(_options(only="suite", pure_turns=True))
    with pytest.raises(SystemExit, match="not both"):
        gpu_plan.gpu_plan(_options(only="bench", pure_turns=True, against="HEAD"))


def test_the_pure_suites_set_metrale_pure() -> None:
    plan = gpu_plan.gpu_plan(_options(only="pure,strix-pure"))
    assert [(s.name, s.kind, s.commands[0].env.get("METRALE_PURE")) for s in plan.steps] == [
        ("pure", "pytest", "1"), ("strix-pure", "pytest", "1"),
    ]
    assert plan.steps[1].commands[0].env["METRALE_TARGET_HW"] == "strix-h200"


@pytest.mark.parametrize("wheels", [True, False])
def test_the_gpu_install_builds_without_isolation_and_checks_the_twins(wheels: bool) -> None:
    commands = gpu_plan._install_commands(wheels)
    if wheels:  # setuptools and Cython among them: on the path before the build
        assert "--target" in commands[0].argv and str(gpu_plan.GPU_SITE) in commands[0].argv
    editable, check = commands[-2:]
    assert "--no-build-isolation" in editable.argv and "--no-index" in editable.argv
    assert check.argv[:2] == (sys.executable, "-c") and list(check.argv[4:]) == list(gpu_plan.twins())
    assert all(w in check.argv[3] for w in gpu_plan.GPU_BUILD_WHEELS)


def test_dev_py_gpu_hands_its_arguments_on() -> None:
    """``python3 dev.py gpu ARGS`` is tools/gpu_plan.py's: here its plan, printed, with no install and no venv."""
    out = subprocess.run([sys.executable, "dev.py", "gpu", "--dry-run", "--no-install", "--only", "selftest,bench",
                          "--quick"], cwd=gpu_plan.ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    steps = [line.split(" (")[0] for line in out.stdout.splitlines() if not line.startswith((" ", "dev.py gpu:"))]
    assert steps == ["selftest", "bench"] and "--quick" in out.stdout
