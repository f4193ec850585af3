"""`metrale conformance`: a verdict a plugin author can act on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import SETTINGS, install_distribution
from metrale_core._conformance import run_conformance

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


def test_fake_conforms() -> None:
    report = run_conformance("fake", SETTINGS.updated(redzone_action="warn"), examples=20, steps=20)
    assert report.ok, report.render()
    assert report.examples >= 20 and report.bad_inputs_run >= 20
    assert "PASS" in report.render()


def test_broken_backend_gets_an_actionable_verdict(site: Path) -> None:
    install_distribution(site, "mtp-short", "mtp_short", SHORT_MEMSET, {"short": "mtp_short"})
    report = run_conformance("short", SETTINGS.updated(redzone_action="warn"), examples=100, steps=20)
    text = report.render()
    assert not report.ok and "FAIL" in text and "mtp-short" in text
    assert report.failing_rule is not None and os.path.join("metrale_core", "testing", "") in report.failing_rule, text
    assert report.machine_error is not None and "the model expects" in report.machine_error, text
    assert any(line.startswith("state.") for line in report.program), text


def test_cli_unknown_backend() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    out = subprocess.run(
        [sys.executable, "-m", "metrale_core", "conformance", "no-such-backend"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert out.returncode == 1 and "BackendNotFoundError" in out.stderr
