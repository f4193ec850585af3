"""`metrale conformance`: a verdict a plugin author can act on, in bounded time and memory."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from metrale_core._commands.conformance import DEFAULT_BUDGET_S, changed_settings, run_conformance
from tests._support import SETTINGS, install_distribution

# A backend whose raw memset stops one byte short: the kind of bug the state machine exists to find.
SHORT_MEMSET = """
    from metrale_core import BackendRegistration, hookimpl
    from metrale_fake import FakeDevice

    class ShortMemset(FakeDevice):
        def memset(self, ptr, value, nbytes, stream):
            super().memset(ptr, value, max(1, nbytes - 1), stream)

    @hookimpl
    def metrale_backend(settings):
        return BackendRegistration(open=ShortMemset)
"""

# A backend whose arena allocations fail: every program's setup (it creates an arena) fails. Each raw
# device it opens says whether it was closed.
NO_ARENA = """
    from metrale_core import BackendRegistration, error_for_code, hookimpl
    from metrale_fake import FakeDevice

    OPENED = []

    class NoArena(FakeDevice):
        def __init__(self, settings, ordinal):
            super().__init__(settings, ordinal)
            self.closed = False
            OPENED.append(self)

        def alloc(self, nbytes, kind):
            if kind == "arena":
                raise error_for_code("CUDA_ERROR_UNKNOWN", "no arenas here")
            return super().alloc(nbytes, kind)

        def close(self):
            self.closed = True
            super().close()

    @hookimpl
    def metrale_backend(settings):
        return BackendRegistration(open=NoArena)
"""

WARN = SETTINGS.updated(redzone_action="warn")


@pytest.fixture
def short(site: Path) -> Iterator[str]:
    install_distribution(site, "mtp-short", "mtp_short", SHORT_MEMSET, {"short": "mtp_short"})
    yield "short"


class _Clock:
    """A clock the test moves: ``run_conformance`` measures its budget with it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_fake_conforms() -> None:
    report = run_conformance("fake", WARN, examples=20, steps=20)
    assert report.ok, report.render()
    assert report.examples >= 20 and report.bad_inputs_run >= 20
    assert "PASS" in report.render()


def _caught_short_memset(error: str | None) -> bool:
    """The machine's error for the one-byte-short memset: a value the model did not expect, or, with red zones
    on, the zone byte the short fill left unfilled, reported by the sweep that judges it."""
    return error is not None and ("the model expects" in error or ("the sweep reported [RedZoneViolation(" in error
                                                                      and "expected {}" in error))


@pytest.mark.slow
def test_broken_backend_gets_an_actionable_verdict(short: str) -> None:
    report = run_conformance(short, WARN, examples=100, steps=20)
    text = report.render()
    assert not report.ok and "FAIL" in text and "mtp-short" in text
    assert report.failing_rule is not None and os.path.join("metrale_core", "testing", "") in report.failing_rule, text
    assert _caught_short_memset(report.machine_error), text
    assert any(line.startswith("state.") for line in report.program), text


@pytest.mark.slow
def test_a_one_byte_short_memset_fails_with_a_verdict_naming_its_budget(short: str) -> None:
    """The defaults: the failure, shrunk within the default budget (the run prints its verdict; how long it
    took is measured outside the tests: see docs/plugin-authors.md)."""
    report = run_conformance(short, WARN)
    text = report.render()
    assert report.verdict == "FAIL" and not report.ok, text
    assert _caught_short_memset(report.machine_error), text
    assert f"a time budget of {DEFAULT_BUDGET_S:g} s" in text and "up to 50 program(s) of 30 steps" in text, text
    assert text.splitlines()[1].startswith("  settings: "), text
    if report.shrunk:
        assert "shortest failing program (Hypothesis):" in text and report.stopped is None, text
    else:  # a slow machine: the budget ran out while shrinking, and the verdict says so
        assert report.stopped is not None and "while shrinking" in report.stopped, text


def test_the_budget_stops_shrinking_and_the_verdict_shows_the_failure_as_found(short: str) -> None:
    clock = _Clock()

    def progress(line: str) -> None:
        if "shrinking" in line:
            clock.now = 1000.0  # the search found the failure; the budget is spent before shrinking begins

    report = run_conformance(short, WARN, budget_s=10, progress=progress, clock=clock)
    text = report.render()
    assert report.verdict == "FAIL" and not report.shrunk, text
    assert report.stopped is not None and "the time budget of 10 s ran out while shrinking" in report.stopped, text
    assert "failing program, not shrunk (Hypothesis):" in text and "raise it with --budget" in text, text
    assert _caught_short_memset(report.machine_error), text
    assert any(line.startswith("state.") for line in report.program), text


def test_a_run_the_budget_cut_short_is_incomplete_not_a_pass() -> None:
    clock = _Clock()

    def progress(line: str) -> None:
        if line.startswith("state machine: program 10"):
            clock.now = 1000.0

    report = run_conformance("fake", WARN, examples=40, steps=5, budget_s=5, progress=progress, clock=clock)
    text = report.render()
    assert report.verdict == "INCOMPLETE" and not report.ok and report.machine_error is None, text
    assert report.examples == 10, text
    assert report.stopped is not None and "before 40 programs were run" in report.stopped, text


def test_the_verdict_names_the_settings_it_ran_under() -> None:
    settings = SETTINGS.updated(redzone=64, redzone_lead=True, fake_defer=True)
    report = run_conformance("fake", settings, examples=2, steps=5)
    line = report.render().splitlines()[1]
    assert line.startswith("  settings: ") and "redzone=64" in line and "redzone_lead=True" in line, line
    assert "fake_defer=True" in line, line
    assert changed_settings(settings) == report.settings


def test_a_program_whose_setup_fails_leaves_no_backend_open(site: Path) -> None:
    install_distribution(site, "mtp-noarena", "mtp_noarena", NO_ARENA, {"noarena": "mtp_noarena"})
    import mtp_noarena  # type: ignore[import-not-found]

    report = run_conformance("noarena", WARN, examples=3, steps=5, budget_s=20)
    assert report.verdict == "FAIL" and report.machine_error is not None and "no arenas here" in report.machine_error
    assert any("no arenas here" in failure for failure in report.bad_input_failures), report.render()
    assert report.failing_rule is not None and report.failing_rule.startswith("_setup, not a rule"), report.render()
    assert mtp_noarena.OPENED and all(device.closed for device in mtp_noarena.OPENED), report.render()


def test_cli_unknown_backend() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    out = subprocess.run(
        [sys.executable, "-m", "metrale_core", "conformance", "no-such-backend"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert out.returncode == 1 and "BackendNotFoundError" in out.stderr


@pytest.mark.slow
def test_cli_takes_a_budget_and_shows_it() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    args = [sys.executable, "-m", "metrale_core", "conformance", "fake", "--examples", "3", "--steps", "5"]
    out = subprocess.run([*args, "--budget", "30"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout and "a time budget of 30 s" in out.stdout, out.stdout
    assert "settings: all at their defaults" in out.stdout, out.stdout
    unlimited = subprocess.run([*args, "--budget", "0"], capture_output=True, text=True, env=env, timeout=120,
                               check=False)
    assert unlimited.returncode == 0 and "no time budget" in unlimited.stdout, unlimited.stdout + unlimited.stderr
    bad = subprocess.run([*args, "--budget", "soon"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert bad.returncode == 2 and "must be a number of seconds" in bad.stderr
