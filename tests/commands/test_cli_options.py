"""The command line's shared options and hints: ``--backend``, each command's ``--help``, ``metrale settings``,
the hint of a backend name that is not installed, the warning of a large red zone, ``metrale stats`` alone."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest

from metrale_core import BackendNotFoundError, BackendUnavailableError, _discovery, open_backend
from metrale_core._commands.cli import _parser, main
from metrale_core._install import install_command
from metrale_core._settings.model import MetraleSettings
from metrale_core._settings.sources import DEFAULT, ENVIRONMENT, KEYWORD, setting_sources
from tests._support import SETTINGS, metrale

#: Every subcommand, and whether it opens a backend (and so takes --backend).
COMMANDS = {
    "backends": False, "info": True, "stats": False, "selftest": True, "preflight": True, "conformance": False,
    "report": False, "bench": True, "run": True, "settings": False,
}
RED_ZONED = ("selftest", "run", "bench")


@pytest.fixture
def no_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """No METRALE_* variable, as a user's shell without any (the GPU runs of the suite set some)."""
    for name in [n for n in os.environ if n.startswith("METRALE_")]:
        monkeypatch.delenv(name)


def _help(command: str) -> str:
    sub = next(a for a in _parser()._actions if a.dest == "command")
    parser = sub.choices[command]  # type: ignore[index]
    return str(parser.format_help())


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_s_help_has_a_description_and_names_its_variables(command: str) -> None:
    text = _help(command)
    description = text.split("\n\n")[1]
    assert description.startswith(f"metrale {command}: ") and description.rstrip().endswith("."), description
    epilog = " ".join(text.split("\n\n")[-1].split())
    assert epilog.startswith("environment: ") and "METRALE_BACKEND" in epilog and "docs/settings.md" in epilog
    if command in RED_ZONED:
        assert "METRALE_REDZONE " in epilog and "METRALE_REDZONE_ACTION" in epilog
    assert ("--backend NAME" in text) == COMMANDS[command], text


def test_help_shows_the_description_and_epilog_as_a_user_runs_it() -> None:
    out = metrale("run", "--help")
    assert out.returncode == 0, out.stderr
    assert "metrale run: run a Python script under metrale" in out.stdout
    assert "METRALE_REDZONE" in out.stdout and "--backend NAME" in out.stdout


@pytest.mark.usefixtures("no_variables")
def test_backend_option_overrides_the_variable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                               ) -> None:
    monkeypatch.setenv("METRALE_BACKEND", "nonexistent")
    assert main(["info", "--json", "--backend", "fake"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["backend"] == "fake" and doc["asked_for"] == "fake"


@pytest.mark.usefixtures("no_variables")
def test_a_bad_backend_option_is_refused_as_a_bad_variable(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--backend", "fakee"]) == 1
    by_option = capsys.readouterr().err
    monkeypatch.setenv("METRALE_BACKEND", "fakee")
    assert main(["info"]) == 1
    by_variable = capsys.readouterr().err
    assert by_option == by_variable
    assert by_option.startswith("metrale info: BackendUnavailableError: the configured backend 'fakee' ")
    assert by_option.endswith("; did you mean 'fake'?\n") and by_option.count("\n") == 1


@pytest.mark.usefixtures("no_variables")
@pytest.mark.parametrize(("command", "status"), [("selftest", 0), ("bench --list", 0), ("preflight missing.ptx", 2)])
def test_every_backend_command_takes_the_option(command: str, status: int, capsys: pytest.CaptureFixture[str]
                                                ) -> None:
    """Parsed and applied (bench --list and a missing PTX file open no backend)."""
    assert main([*command.split(), "--backend", "fake"]) == status, capsys.readouterr()
    if command == "selftest":
        assert "sweep on fake:0" in capsys.readouterr().out
        assert main(["selftest", "--backend", "fakee"]) == 1
        said = capsys.readouterr()
        assert "did you mean 'fake'?" in said.out + said.err  # the selftest's first check says why it failed


def test_a_name_one_typo_away_is_suggested() -> None:
    with pytest.raises(BackendNotFoundError, match=r"; did you mean 'fake'\?$"):
        open_backend("fak", settings=SETTINGS)
    with pytest.raises(BackendNotFoundError, match=r"; did you mean 'auto'\?$"):
        open_backend("autp", settings=SETTINGS)
    with pytest.raises(BackendNotFoundError) as far:
        open_backend("nonexistent", settings=SETTINGS)
    assert "did you mean" not in str(far.value)


def test_cuda_where_it_is_not_installed_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _discovery.backend_entry_points
    monkeypatch.setattr(_discovery, "backend_entry_points", lambda: {k: v for k, v in real().items() if k != "cuda"})
    hint = f"; the cuda backend is not installed: {install_command('cuda')}"
    with pytest.raises(BackendUnavailableError) as configured:
        open_backend(settings=SETTINGS.updated(backend="cuda"))
    assert str(configured.value).endswith(hint), configured.value
    with pytest.raises(BackendNotFoundError) as named:
        open_backend("cuda", settings=SETTINGS)
    assert str(named.value).endswith(hint)


@pytest.mark.parametrize(("redzone", "warned"), [(1 << 20, False), ((1 << 20) + 1, True), (4096, False)])
def test_a_red_zone_over_a_mebibyte_is_warned_of_once_per_open(caplog: pytest.LogCaptureFixture, redzone: int,
                                                                warned: bool) -> None:
    with caplog.at_level(logging.WARNING, logger="metrale"), \
            open_backend("fake", settings=SETTINGS.updated(redzone=redzone)) as gpu:
        gpu.free(gpu.alloc(64))
        gpu.free(gpu.alloc(64))
    found = [r for r in caplog.records if "64 to 4096 bytes" in r.getMessage()]
    assert len(found) == (1 if warned else 0), caplog.text
    if warned:
        assert found[0].name == "metrale" and found[0].levelno == logging.WARNING
        assert "fake:0" in found[0].getMessage() and f"METRALE_REDZONE={redzone}" in found[0].getMessage()


def test_stats_without_a_snapshot_says_what_it_needs() -> None:
    out = metrale("stats", METRALE_BACKEND="fake")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "save_snapshot" in out.stderr and "memory_summary()" in out.stderr


@pytest.mark.usefixtures("no_variables")
def test_setting_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_REDZONE", "4KiB")
    monkeypatch.setenv("METRALE_FAKE_MEMORY_BYTES", "2GiB")
    monkeypatch.setenv("METRALE_PURE", "")  # empty: unset
    settings = MetraleSettings(oom_retries=5)
    by_variable = {s.variable: s for s in setting_sources(settings)}
    assert set(MetraleSettings.model_fields) <= {s.keyword for s in by_variable.values()}
    assert by_variable["METRALE_REDZONE"].value == 4096 and by_variable["METRALE_REDZONE"].source == ENVIRONMENT
    fake = by_variable["METRALE_FAKE_MEMORY_BYTES"]
    assert (fake.value, fake.source, fake.plugin, fake.keyword) == (2 << 30, ENVIRONMENT, "fake", "fake_memory_bytes")
    assert by_variable["METRALE_PURE"].source == DEFAULT
    assert by_variable["METRALE_BACKEND"].source == DEFAULT
    assert by_variable["METRALE_OOM_RETRIES"].source == KEYWORD
    # updated() passes every field as a keyword: those at their default still read as the default
    again = {s.variable: s.source for s in setting_sources(settings.updated(backend="fake"))}
    assert again["METRALE_BACKEND"] == KEYWORD and again["METRALE_TARGET_HW"] == DEFAULT
    assert again["METRALE_REDZONE"] == ENVIRONMENT


def test_settings_command_lists_every_setting_its_value_and_source() -> None:
    out = metrale("settings", METRALE_REDZONE="4KiB", METRALE_SITE_SKIP="torch,myapp")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in out.stdout.splitlines()[2:]}
    assert rows["METRALE_REDZONE"] == ["4096", "environment (METRALE_REDZONE)"]
    assert rows["METRALE_SITE_SKIP"] == ["torch,myapp", "environment (METRALE_SITE_SKIP)"]
    assert rows["METRALE_BACKEND"] == ["auto", "default"]
    assert rows["METRALE_REDZONE_TRACE_IDX"] == ["unset", "default"]
    assert "METRALE_FAKE_MEMORY_BYTES" in rows
    assert len(rows) == len(MetraleSettings.model_fields) + sum(
        1 for s in setting_sources(SETTINGS) if s.plugin is not None)
    doc = json.loads(metrale("settings", "--json", METRALE_REDZONE="4KiB").stdout)
    entry = next(d for d in doc if d["variable"] == "METRALE_REDZONE")
    assert entry == {"keyword": "redzone", "variable": "METRALE_REDZONE", "value": 4096, "source": ENVIRONMENT,
                     "plugin": None}
    assert re.fullmatch(r"[a-z_]+", entry["keyword"])


def test_settings_command_refuses_a_bad_variable_in_one_line() -> None:
    out = metrale("settings", METRALE_REDZONE="plenty")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "METRALE_REDZONE" in out.stderr
