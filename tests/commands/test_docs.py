"""Every Python example and console example (``$ metrale ...``) of the docs runs, and prints what the docs say.

The outputs in the docs were made on a machine without a GPU, the Python
examples' with ``METRALE_BACKEND=fake``, the console examples' with no
``METRALE_*`` variable (the docs say so); ``tools/docs_examples.py --update``
rewrites them. On a machine where a GPU answers, the examples that print what
the machine has would differ, so this runs only where none does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from metrale_core import available_backends
from tests._support import SETTINGS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import docs_examples

EXAMPLES = [e for e in docs_examples.examples() if e.mode != "skip"]


def test_the_docs_have_examples() -> None:
    assert len(EXAMPLES) >= 30, [e.name for e in EXAMPLES]
    consoles = [e for e in EXAMPLES if e.console]
    assert len(consoles) >= 10, [e.name for e in consoles]
    assert any(c.text.startswith("metrale preflight") for e in consoles for c in e.commands)


@pytest.mark.skipif(
    available_backends(SETTINGS).get("cuda") is not None and available_backends(SETTINGS)["cuda"].available,
    reason="the docs' outputs were made without a GPU; here one answers",
)
@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_example_prints_what_the_docs_say(example: docs_examples.Example, tmp_path: Path) -> None:
    problem = docs_examples.check(example, tmp_path)
    assert problem is None, f"{problem}\n(if the new output is right: python3 tools/docs_examples.py --update)"
