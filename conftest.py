"""Hypothesis profiles for every test tree of the repository (tests/ and examples/*/tests/), and the skip summary.

- Select a profile with ``--hypothesis-profile=NAME``; ``python3 dev.py test`` passes ``ci``, ``--fast`` ``fast``.
- Where the report characters leave skips out (``dev.py test`` passes ``-rfE``), the summary gives one line per
  skip reason with its count, instead of one line per test file and line.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings

# "ci" is derandomized so CI is stable; "thorough" (python3 dev.py test --thorough) explores more.
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
# "gpu": the "ci" examples without shrinking, so a failure on a lent GPU costs seconds, not minutes.
settings.register_profile("gpu", settings.get_profile("ci"), phases=[Phase.explicit, Phase.reuse, Phase.generate])
# "fast" (python3 dev.py test --fast): the inner loop, a few examples each, derandomized as "ci"
settings.register_profile("fast", settings.get_profile("ci"), max_examples=8, stateful_step_count=10)
settings.register_profile(
    "thorough",
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """One line per skip reason, counted, the most frequent first (where ``-r`` leaves skips out)."""
    chars = config.option.reportchars or ""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or "s" in chars or "a" in chars or "A" in chars:
        return
    counts: dict[str, int] = {}
    for report in skipped:
        longrepr = report.longrepr
        reason = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        counts[reason] = counts.get(reason, 0) + 1
    terminalreporter.section(f"{len(skipped)} skipped, for {len(counts)} reason(s)", sep="-")
    for reason, n in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        terminalreporter.line(f"{n:6d}  {reason}")
