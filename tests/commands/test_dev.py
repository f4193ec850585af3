"""`python3 dev.py`'s own loop: what the first install shows while it compiles, and how `test` runs pytest.

- The install: a line per folder pip prepares, package it builds and module it compiles, pip's whole output in a
  log, the log's end where pip fails.
- `test`: on every core (pytest-xdist, ``--dist loadgroup``) unless the arguments choose, bytecode cached.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dev

#: What ``pip install -v`` prints, cut down: the lines dev.py shows and some it does not.
PIP_OUTPUT = """\
Obtaining file:///src/metrale
  Installing build dependencies: started
  Collecting Cython>=3.1
  Building editable for metrale-core (pyproject.toml): started
  Running command Building editable for metrale-core (pyproject.toml)
  Compiling metrale_core/_memory/_ledger.pyx because it changed.
  [1/1] Cythonizing metrale_core/_memory/_ledger.pyx
  building 'metrale_core._memory._ledger' extension
  gcc -pthread -fPIC -c /tmp/build/metrale_core/_memory/_ledger.c
  building 'metrale_core._device._stats' extension
  Building editable for metrale-core (pyproject.toml): finished with status 'done'
Installing collected packages: execnet, pytest-xdist, metrale-core
Successfully installed execnet-2.1.2 metrale-core-0.2.0 pytest-xdist-3.8.0
"""


class _Pip:
    """Stands in for the ``pip install -v`` process: prints `PIP_OUTPUT`, exits with ``returncode``."""

    returncode = 0

    def __init__(self, command: list[Any], **_: Any) -> None:
        self.command = command
        self.stdout: Iterator[str] = iter(PIP_OUTPUT.splitlines(keepends=True))

    def __enter__(self) -> _Pip:
        return self

    def __exit__(self, *_: object) -> None:
        return None


@pytest.fixture
def pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> type[_Pip]:
    monkeypatch.setattr(dev, "INSTALL_LOG", tmp_path / "pip-install.log")
    monkeypatch.setattr(subprocess, "Popen", _Pip)
    twins = {"metrale_core._memory._ledger": Path("_ledger.pyx"), "metrale_core._device._stats": Path("_stats.pyx")}
    monkeypatch.setattr(dev, "twins", lambda: twins)
    return _Pip


def test_the_install_shows_each_folder_build_and_compiled_module(pip: type[_Pip],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert dev._pip_install("-e", ".") == 0
    shown = [line.split(" s  ", 1)[1] for line in capsys.readouterr().out.splitlines()[1:]]
    assert shown == [
        "preparing /src/metrale",
        "building metrale-core",
        "compiling metrale_core._memory._ledger (1 of 2)",
        "compiling metrale_core._device._stats (2 of 2)",
        "installing 3 packages",
    ]
    assert dev.INSTALL_LOG.read_text() == PIP_OUTPUT  # the whole output kept


def test_a_failed_install_prints_the_log_s_end(pip: type[_Pip], capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pip, "returncode", 1)
    assert dev._pip_install("-e", ".") == 1
    assert capsys.readouterr().out.endswith("Successfully installed execnet-2.1.2 metrale-core-0.2.0 "
                                            "pytest-xdist-3.8.0\n")


def _pytest_calls(monkeypatch: pytest.MonkeyPatch, *runs: list[str]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def run(*cmd: Any, **kw: Any) -> int:
        calls.append((cmd, kw))
        return 0

    monkeypatch.setattr(dev, "ensure_env", lambda full=True: None)
    monkeypatch.setattr(dev, "run", run)
    for argv in runs:
        assert dev.main(argv) == 0
    return calls


def test_the_suite_runs_on_every_core_with_its_bytecode_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    (whole, kw), (fast, _) = _pytest_calls(monkeypatch, ["test"], ["test", "--fast", "-k", "capture"])
    assert whole[1:3] == ("-m", "pytest") and "--hypothesis-profile=ci" in whole
    assert whole[-4:] == dev.PARALLEL == ("-n", "auto", "--dist", "loadgroup")
    assert "PYTHONDONTWRITEBYTECODE" not in kw["env"] and kw["env"]["PATH"] == os.environ["PATH"]
    assert "--hypothesis-profile=fast" in fast and "-x" in fast and fast[-2:] == ("-k", "capture")
    assert all(a in fast for a in dev.PARALLEL) and "--fast" not in fast


@pytest.mark.parametrize("given", [["-n", "0"], ["-n4"], ["--numprocesses=3"], ["-p", "no:xdist"], ["--pdb"],
                                   ["--trace"], ["--dist", "worksteal", "-n", "2"]])
def test_arguments_that_choose_the_processes_are_left_to_choose(monkeypatch: pytest.MonkeyPatch,
                                                               given: list[str]) -> None:
    ((command, _),) = _pytest_calls(monkeypatch, ["test", *given])
    assert list(command[-len(given):]) == given and command.count("-n") == given.count("-n")
    assert "auto" not in command and "loadgroup" not in command
