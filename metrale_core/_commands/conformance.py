"""``metrale conformance NAME``: the conformance state machine and the bad-input table, with a verdict.

Needs Hypothesis (the ``test`` extra). The verdict names what a plugin
author needs to act: the failing rule, the shortest failing program
Hypothesis found, the expected against the actual outcome, and the settings
and budgets the run had.

A run is bounded: the state machine first runs its programs without
shrinking (at most ``examples`` of them); on a failure it runs again, this time
shrinking, until the time budget is spent. A failure the budget did not leave
time to shrink is reported as it was first found, and the verdict says so.
Memory stays bounded too: a closed backend holds no memory, and the machine
collects every `COLLECT_EVERY` programs.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
import traceback
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Final

from .._discovery import available_backends, open_backend
from .._errors import BackendUnavailableError, InvalidArgumentError, MetraleError, MissingPackageError
from .._settings.model import MetraleSettings, installed_plugin_settings

__all__ = ["DEFAULT_BUDGET_S", "DEFAULT_EXAMPLES", "DEFAULT_STEPS", "ConformanceReport", "run_conformance"]

#: Programs the state machine runs (before any shrinking), steps per program.
DEFAULT_EXAMPLES: Final = 50
DEFAULT_STEPS: Final = 30
#: Seconds the state machine may take, shrinking included; the bad-input table runs after it.
DEFAULT_BUDGET_S: Final = 40.0


#: Where the state machine's rules are written (``metrale_core/testing``).
_MACHINE_DIR: Final = Path(__file__).resolve().parent.parent / "testing"


class _OutOfBudget(KeyboardInterrupt):  # not an error: the one exception Hypothesis lets through
    """Raised where the next program would start after the budget ran out; it ends the run.

    Hypothesis ends a run at once, with no bookkeeping of the program it was in, only for a
    ``KeyboardInterrupt``; ``run_conformance`` catches it before it goes any further.
    """


@dataclasses.dataclass(slots=True)
class ConformanceReport:
    """What a conformance run found; ``ok`` when every part passed."""

    backend: str
    distribution: str | None
    #: Programs the state machine ran, shrinking included.
    examples: int = 0
    #: The settings of the run that differ from their defaults, as ``name=value``.
    settings: list[str] = dataclasses.field(default_factory=list)
    max_examples: int = DEFAULT_EXAMPLES
    steps: int = DEFAULT_STEPS
    seed: int | None = None
    budget_s: float | None = DEFAULT_BUDGET_S
    #: Why the state machine stopped before it was done (the budget ran out), if it did.
    stopped: str | None = None
    #: Whether the budget ran out before the state machine had run its programs (with none failing).
    incomplete: bool = False
    machine_error: str | None = None
    failing_rule: str | None = None
    program: list[str] = dataclasses.field(default_factory=list)
    #: Whether ``program`` is the shortest Hypothesis found (shrinking finished) or the first failing one.
    shrunk: bool = False
    bad_inputs_run: int = 0
    bad_input_failures: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.machine_error is None and not self.incomplete and not self.bad_input_failures

    @property
    def verdict(self) -> str:
        """``PASS``, ``FAIL``, or ``INCOMPLETE`` (nothing failed, but the budget ran out before the programs ran)."""
        if self.machine_error is not None or self.bad_input_failures:
            return "FAIL"
        return "INCOMPLETE" if self.incomplete else "PASS"

    def to_json(self) -> dict[str, object]:
        """The report as JSON-ready data: every field, with ``verdict`` and ``ok``."""
        return {"verdict": self.verdict, "ok": self.ok, **dataclasses.asdict(self)}

    def _run_line(self) -> str:
        order = "derandomized" if self.seed is None else f"seed {self.seed}"
        budget = "no time budget" if self.budget_s is None else f"a time budget of {self.budget_s:g} s"
        return f"up to {self.max_examples} program(s) of {self.steps} steps, {order}, {budget}"

    def render(self) -> str:
        """The verdict, as ``metrale conformance`` prints it."""
        verdict = self.verdict
        settings = ", ".join(self.settings) if self.settings else "all at their defaults"
        lines = [
            f"conformance of backend {self.backend!r} ({self.distribution or 'unknown distribution'}): {verdict}",
            f"  settings: {settings}",
            f"  state machine: {self.examples} program(s) run (shrinking included), "
            + ("all passed" if self.machine_error is None else "one failed"),
            f"    ran {self._run_line()}",
        ]
        if self.stopped is not None:
            lines.append(f"    {self.stopped}")
        if self.machine_error is not None:
            lines.append(f"    failed in rule: {self.failing_rule or 'unknown'}")
            lines.append("    expected and actual:")
            lines += [f"      {line}" for line in self.machine_error.splitlines()]
            if self.program:
                kind = "shortest failing program" if self.shrunk else "failing program, not shrunk"
                lines.append(f"    {kind} (Hypothesis):")
                lines += [f"      {line}" for line in self.program]
        passed = self.bad_inputs_run - len(self.bad_input_failures)
        lines.append(f"  bad-input table: {passed}/{self.bad_inputs_run} refused as expected, changing nothing")
        lines += [f"    {failure}" for failure in self.bad_input_failures]
        lines.append(f"  took {self.seconds:.1f} s")
        return "\n".join(lines)


def changed_settings(settings: MetraleSettings) -> list[str]:
    """The settings that differ from their defaults (the plugins' too), as ``name=value``."""
    fields = MetraleSettings.model_fields
    defaults = {name: field.get_default(call_default_factory=True) for name, field in fields.items()}
    for plugin in installed_plugin_settings():
        for name, field in plugin.model.model_fields.items():
            defaults[plugin.keyword(name)] = field.get_default(call_default_factory=True)
    dumped = settings.model_dump()
    return [f"{name}={value!r}" for name, value in dumped.items() if name in defaults and defaults[name] != value]


def _machine_failure(
    exc: BaseException, rules: Collection[str], invariants: Collection[str] = (),
) -> tuple[str, str | None, list[str]]:
    """The error text, the rule it came from, and the program Hypothesis printed in its notes (without the
    ``invariants`` it printed after every step, unless one of them failed)."""
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    rule = None
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if Path(frame.filename).resolve().parent != _MACHINE_DIR:  # the backend's own frames may bear a rule's name
            continue
        if frame.name in rules:
            rule = f"{frame.name} ({frame.filename}:{frame.lineno})"
            break
        if frame.name in {"_setup", "teardown"}:
            rule = f"{frame.name}, not a rule: the program's {frame.name.strip('_')} ({frame.filename}:{frame.lineno})"
            break
    notes = [str(n) for n in getattr(exc, "__notes__", [])]
    program: list[str] = []
    checks = {f"state.{name}()" for name in invariants if name != (rule or "").partition(" ")[0]}
    for note in notes:
        program += [line for line in note.splitlines() if line.startswith(("state", "Draw ")) and line not in checks]
    text = f"{type(exc).__name__}: {exc}"
    return text, rule, program


def run_conformance(
    name: str,
    settings: MetraleSettings,
    *,
    examples: int = DEFAULT_EXAMPLES,
    steps: int = DEFAULT_STEPS,
    seed: int | None = None,
    budget_s: float | None = DEFAULT_BUDGET_S,
    progress: Callable[[str], None] = lambda line: None,
    clock: Callable[[], float] = time.monotonic,
    step: Callable[[int, int, str], None] | None = None,
) -> ConformanceReport:
    """Run the conformance state machine and the bad-input table against backend ``name``.

    The state machine runs at most ``examples`` programs of ``steps`` steps (derandomized, or from
    ``seed``); a failure is then shrunk while ``budget_s`` seconds last (``None``: no limit). No new
    program starts after the budget ran out: the verdict says so, and shows the failure as found.
    ``clock`` reads the time the budget is measured in (seconds). ``progress`` receives a line now and then;
    ``step``, where given, ``(programs run, programs at most, what runs)`` at every program and the table.
    """
    for what, value in (("examples", examples), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"run_conformance: {what} must be a whole number, at least 1, not {value!r}")
    if budget_s is not None and not budget_s > 0:
        raise InvalidArgumentError(f"run_conformance: budget_s must be a positive number of seconds or None, "
                                   f"not {budget_s!r}")
    try:
        import hypothesis
        from hypothesis.stateful import get_state_machine_test
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from .._install import install_command

        raise MissingPackageError(
            f"conformance needs Hypothesis, which is not installed: {install_command('test')}"
        ) from exc
    from ..testing import BAD_INPUTS, backend_state_machine, bad_input_fixture, check_bad_input

    info = available_backends(settings).get(name)
    if info is None:
        open_backend(name, settings=settings)  # raises BackendNotFoundError naming the installed ones
        raise AssertionError("unreachable")  # pragma: no cover
    if not info.available:
        raise BackendUnavailableError(f"backend {name!r} is not available here: {info.reason}")
    report = ConformanceReport(
        name, info.distribution, settings=changed_settings(settings), max_examples=examples, steps=steps,
        seed=seed, budget_s=budget_s,
    )
    started = clock()
    deadline = None if budget_s is None else started + budget_s

    base = backend_state_machine(name, settings)

    class Counted(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            if deadline is not None and clock() > deadline:
                raise _OutOfBudget
            report.examples += 1
            super().__init__()
            n = report.examples
            if step is not None:
                step(min(n, examples), examples, "conformance: state machine" if n <= examples else "shrinking")
            if n == 1 or n % (10 if n <= examples else 100) == 0:
                progress(f"state machine: program {n}")

    Counted.__name__ = Counted.__qualname__ = base.__name__  # what Hypothesis prints as the program's first line
    rules = {n for n in dir(base) if callable(getattr(base, n, None)) and not n.startswith("_")}
    # the invariants Hypothesis prints after every step (its marker attribute; without it, they stay in)
    invariants = {n for n in rules if getattr(getattr(base, n), "hypothesis_stateful_invariant", None) is not None}
    options: dict[str, Any] = {
        "max_examples": examples,
        "stateful_step_count": steps,
        "deadline": None,
        "database": None,
        "suppress_health_check": list(hypothesis.HealthCheck),
        "print_blob": False,
        "report_multiple_bugs": False,  # one verdict: the first bug, shrunk
        "derandomize": seed is None,
    }
    # Hypothesis's explain phase is left out: once a program failed, it runs every later program (all of
    # the shrinking) under a line tracer, which costs more time and memory than the search itself (a
    # planted one-byte bug: 1122 programs, 51 s, 480 MB with it; 421 programs, 5 s, 79 MB without). The
    # verdict names the rule instead.
    search = [hypothesis.Phase.explicit, hypothesis.Phase.reuse, hypothesis.Phase.generate]

    def run(phases: list[hypothesis.Phase]) -> None:
        test = get_state_machine_test(Counted, settings=hypothesis.settings(**options, phases=phases))
        (test if seed is None else hypothesis.seed(seed)(test))()

    def out_of_budget(doing: str, so: str) -> str:
        return (f"stopped: the time budget of {budget_s:g} s ran out {doing}, after {report.examples} program(s): "
                f"{so}; raise it with --budget")

    logger = logging.getLogger("metrale")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the machine's sweeps and planted overruns log WARNINGs by design
    try:
        # 1. search, without shrinking: the first failure, as found
        try:
            run(search)
        except _OutOfBudget:
            report.stopped = out_of_budget(f"before {examples} programs were run", "none of them failed")
            report.incomplete = True
        except Exception as exc:
            report.machine_error, report.failing_rule, report.program = _machine_failure(exc, rules, invariants)
        # 2. on a failure, the same search again (derandomized or seeded: the same programs), shrinking
        if report.machine_error is not None:
            progress("state machine: a program failed; shrinking it")
            try:
                run([*search, hypothesis.Phase.shrink])
            except _OutOfBudget:
                report.stopped = out_of_budget("while shrinking", "the program below is the failing one as found")
            except Exception as exc:
                report.machine_error, report.failing_rule, report.program = _machine_failure(exc, rules, invariants)
                report.shrunk = True
            else:
                report.stopped = "shrinking found no failure again: the backend does not fail the same way twice"
    finally:
        logger.setLevel(level)
        gc.collect()  # what the programs left, before the table
    progress("bad-input table")
    if step is not None:
        step(examples, examples, "conformance: bad-input table")
    logger.setLevel(logging.ERROR)
    try:
        with open_backend(name, settings=settings) as gpu, bad_input_fixture(gpu) as fixture:
            for case in BAD_INPUTS:
                report.bad_inputs_run += 1
                try:
                    check_bad_input(fixture, case)
                except (AssertionError, MetraleError) as exc:
                    report.bad_input_failures.append(f"{case.name}: {exc}")
    except MetraleError as exc:  # the handles the cases use could not be made (or released)
        report.bad_input_failures.append(f"the table's own handles failed: {type(exc).__name__}: {exc}")
    finally:
        logger.setLevel(level)
    report.seconds = clock() - started
    return report
