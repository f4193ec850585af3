"""The command line, run as a user runs it: a subprocess with its own environment."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def metrale(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "metrale_core", *args],
        capture_output=True, text=True, env=environ, timeout=300, check=False,
    )


def test_backends_table() -> None:
    out = metrale("backends")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["name", "available", "distribution", "reason"]
    fake = next(line for line in lines if line.startswith("fake "))
    assert "yes" in fake and "metrale-fake" in fake
    assert any(line.startswith("cuda ") and "metrale-cuda" in line for line in lines)


def test_selftest_on_fake_passes() -> None:
    out = metrale("selftest", METRALE_BACKEND="fake")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "selftest: 12 passed, 0 failed" in out.stdout
    assert "sweep on fake:0: 4 allocation(s)" in out.stdout


def test_info_on_fake() -> None:
    out = metrale("info", METRALE_BACKEND="fake", METRALE_FAKE_MEMORY_BYTES="2GiB")
    assert out.returncode == 0, out.stderr
    assert "memory total    2.0 GiB" in out.stdout


@pytest.mark.parametrize("command", ["backends", "info", "selftest"])
def test_bad_settings_exit_nonzero_with_one_line(command: str) -> None:
    out = metrale(command, METRALE_REDZONE="plenty")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "METRALE_REDZONE" in out.stderr


def test_unavailable_backend_is_one_line_error() -> None:
    out = metrale("info", METRALE_BACKEND="nonexistent")
    assert out.returncode == 1 and "BackendUnavailableError" in out.stderr and out.stderr.count("\n") == 1
