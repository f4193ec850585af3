"""``metrale conformance NAME``: the conformance state machine and the bad-input table, with a verdict.

Needs Hypothesis (the ``test`` extra). The verdict names what a plugin
author needs to act: the failing rule, the shortest failing program
Hypothesis found, and the expected against the actual outcome.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

from ._discovery import available_backends, open_backend
from ._errors import BackendUnavailableError, MetraleError
from ._settings import MetraleSettings

__all__ = ["ConformanceReport", "run_conformance"]


@dataclasses.dataclass(slots=True)
class ConformanceReport:
    """What a conformance run found; ``ok`` when every part passed."""

    backend: str
    distribution: str | None
    examples: int = 0
    machine_error: str | None = None
    failing_rule: str | None = None
    program: list[str] = dataclasses.field(default_factory=list)
    bad_inputs_run: int = 0
    bad_input_failures: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.machine_error is None and not self.bad_input_failures

    def render(self) -> str:
        """The verdict, as ``metrale conformance`` prints it."""
        verdict = "PASS" if self.ok else "FAIL"
        lines = [
            f"conformance of backend {self.backend!r} ({self.distribution or 'unknown distribution'}): {verdict}",
            f"  state machine: {self.examples} program(s) run (shrinking included)"
            + (", all passed" if self.machine_error is None else ", one failed"),
        ]
        if self.machine_error is not None:
            lines.append(f"    failed in rule: {self.failing_rule or 'unknown'}")
            lines.append("    expected and actual:")
            lines += [f"      {line}" for line in self.machine_error.splitlines()]
            if self.program:
                lines.append("    shortest failing program (Hypothesis):")
                lines += [f"      {line}" for line in self.program]
        passed = self.bad_inputs_run - len(self.bad_input_failures)
        lines.append(f"  bad-input table: {passed}/{self.bad_inputs_run} refused as expected, changing nothing")
        lines += [f"    {failure}" for failure in self.bad_input_failures]
        lines.append(f"  took {self.seconds:.1f} s")
        return "\n".join(lines)


def _machine_failure(exc: BaseException, rules: set[str]) -> tuple[str, str | None, list[str]]:
    """The error text, the rule it came from, and the program Hypothesis printed in its notes."""
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    rule = None
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.name in rules:
            rule = f"{frame.name} ({frame.filename}:{frame.lineno})"
            break
    notes = [str(n) for n in getattr(exc, "__notes__", [])]
    program: list[str] = []
    for note in notes:
        program += [line for line in note.splitlines() if line.startswith(("state", "Draw "))]
    text = f"{type(exc).__name__}: {exc}"
    return text, rule, program


def run_conformance(
    name: str,
    settings: MetraleSettings,
    *,
    examples: int = 50,
    steps: int = 30,
    seed: int | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> ConformanceReport:
    """Run the conformance state machine and the bad-input table against backend ``name``."""
    try:
        import hypothesis
        from hypothesis.stateful import run_state_machine_as_test
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise BackendUnavailableError(
            f"conformance needs Hypothesis: pip install 'metrale[test]' ({exc})"
        ) from exc
    from .testing import BAD_INPUTS, backend_state_machine, bad_input_fixture, check_bad_input

    info = available_backends(settings).get(name)
    if info is None:
        open_backend(name, settings=settings)  # raises BackendNotFoundError naming the installed ones
        raise AssertionError("unreachable")  # pragma: no cover
    if not info.available:
        raise BackendUnavailableError(f"backend {name!r} is not available here: {info.reason}")
    report = ConformanceReport(name, info.distribution)
    started = time.monotonic()

    base = backend_state_machine(name, settings)

    class Counted(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            report.examples += 1
            if report.examples % 10 == 0 or report.examples == 1:
                progress(f"state machine: program {report.examples} of at most {examples}")

    Counted.__name__ = Counted.__qualname__ = base.__name__  # what Hypothesis prints as the program's first line
    rules = {n for n in dir(base) if callable(getattr(base, n, None)) and not n.startswith("_")}
    options: dict[str, Any] = {
        "max_examples": examples,
        "stateful_step_count": steps,
        "deadline": None,
        "database": None,
        "suppress_health_check": list(hypothesis.HealthCheck),
        "print_blob": False,
        "report_multiple_bugs": False,  # one verdict: the first bug, shrunk
    }
    if seed is None:
        options["derandomize"] = True
    logger = logging.getLogger("metrale")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the machine's sweeps and planted overruns log WARNINGs by design
    try:
        if seed is None:
            run_state_machine_as_test(Counted, settings=hypothesis.settings(**options))
        else:
            hypothesis.seed(seed)(lambda: run_state_machine_as_test(Counted, settings=hypothesis.settings(**options)))()
    except Exception as exc:
        report.machine_error, report.failing_rule, report.program = _machine_failure(exc, rules)
    finally:
        logger.setLevel(level)
    progress("bad-input table")
    logger.setLevel(logging.ERROR)
    try:
        with open_backend(name, settings=settings) as gpu, bad_input_fixture(gpu) as fixture:
            for case in BAD_INPUTS:
                report.bad_inputs_run += 1
                try:
                    check_bad_input(fixture, case)
                except (AssertionError, MetraleError) as exc:
                    report.bad_input_failures.append(f"{case.name}: {exc}")
    finally:
        logger.setLevel(level)
    report.seconds = time.monotonic() - started
    return report
