"""A missing optional package is named with the extra of the distribution the user installed, as a plain message."""

from __future__ import annotations

import sys
from importlib import metadata

import pytest

from metrale_core._commands.cli import main
from metrale_core._install import install_command


def test_the_command_names_metrale_where_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = metadata.distribution

    def only_metrale_missing(name: str) -> metadata.Distribution:
        if name == "metrale":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "distribution", only_metrale_missing)
    assert install_command("test") == 'pip install "metrale-core[test]"'
    assert install_command("cuda") == "pip install metrale-cuda"
    monkeypatch.setattr(metadata, "distribution", lambda name: real("metrale-core"))
    assert install_command("report") == 'pip install "metrale[report]"'
    assert install_command("cuda") == 'pip install "metrale[cuda]"'


def test_conformance_without_hypothesis_says_to_install_the_test_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [m for m in sys.modules if m == "hypothesis" or m.startswith("hypothesis.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    assert main(["conformance", "fake"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("metrale conformance: conformance needs Hypothesis, which is not installed: pip install ")
    assert "[test]" in err and "Error" not in err, err
