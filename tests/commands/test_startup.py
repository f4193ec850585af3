"""Start-up: what importing metrale and running the command line load, and what discovery repeats.

No test here times anything: each checks what is imported, probed or scanned, in a fresh process where
the question is what a process loads.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import metrale_core
from metrale_core import MetraleSettings, available_backends, open_backend
from tests._support import SETTINGS, install_distribution

#: Modules a bare ``import metrale_core`` or ``metrale --help`` must not load.
HEAVY = ("pydantic", "pydantic_settings", "pluggy", "numpy", "importlib.metadata", "hypothesis",
         "metrale_core._settings", "metrale_core._backend", "metrale_core._discovery", "metrale_fake")


def _loaded_after(code: str, *, besides: str = "") -> list[str]:
    """The modules of :data:`HEAVY` (and their submodules) a fresh interpreter holds after ``code``; with
    ``besides``, code run first, only those ``code`` loaded (``besides="import pytest"``: pytest loads pluggy)."""
    probe = textwrap.dedent(besides) + "\nimport sys as _sys\n_before = set(_sys.modules) if " + repr(
        bool(besides)) + " else set()\n" + textwrap.dedent(code) + textwrap.dedent(f"""
        import json, sys
        heavy = {HEAVY!r}
        print(json.dumps(sorted(m for m in sys.modules if m not in _before
                                and (m in heavy or m.startswith(tuple(h + "." for h in heavy))))),
              file=sys.stderr)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stderr.strip().splitlines()[-1]))


def test_importing_the_package_loads_none_of_its_dependencies() -> None:
    assert _loaded_after("import metrale_core") == []


def test_a_public_name_loads_what_it_needs_on_first_use() -> None:
    loaded = _loaded_after("from metrale_core import InvalidArgumentError, parse_ptx")
    assert loaded == [], "errors and PTX parsing need neither pydantic nor the backend"
    loaded = _loaded_after("from metrale_core import open_backend; open_backend('fake').close()")
    assert "pydantic_settings" in loaded and "metrale_core._backend" in loaded


def test_the_ledger_and_report_names_load_neither_settings_nor_a_backend() -> None:
    loaded = _loaded_after("from metrale_core import Arena, LedgerEvent, LedgerProbe, OomWatchdog, merge_reports")
    assert loaded == [], "the ledger, arenas, the watchdog and merged reports need neither pydantic nor pluggy"


def test_the_pytest_plugin_loads_nothing_but_pytest() -> None:
    """Every pytest session where metrale is installed imports the plugin: it adds none of metrale's dependencies."""
    assert _loaded_after("import metrale_core.pytest_plugin", besides="import pytest") == []


PLAIN_SESSION = """
    import sys

    def pytest_sessionfinish(session):
        heavy = ("pydantic", "pydantic_settings", "metrale_core._settings", "metrale_core._backend", "metrale_fake")
        loaded = sorted(m for m in sys.modules if m in heavy or m.startswith(tuple(h + "." for h in heavy)))
        print("\\nplugin:", "metrale_core.pytest_plugin" in sys.modules, "loaded:", loaded)
"""


def test_a_pytest_session_without_the_fixture_loads_neither_settings_nor_a_backend(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(textwrap.dedent(PLAIN_SESSION))
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    assert True\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("METRALE_", "PYTEST_"))}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "plugin: True loaded: []" in out.stdout, out.stdout


def test_every_public_name_is_there_and_is_its_module_s() -> None:
    for name in metrale_core.__all__:
        value = getattr(metrale_core, name)
        if name != "__version__":
            module = importlib.import_module(f"metrale_core.{metrale_core._WHERE[name]}")
            assert value is getattr(module, name), name
    assert set(metrale_core.__all__) <= set(dir(metrale_core))
    star: dict[str, object] = {}
    exec("from metrale_core import *", star)
    assert set(metrale_core.__all__) <= set(star)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        _ = metrale_core.no_such_name  # type: ignore[attr-defined]
    with pytest.raises(ImportError):
        exec("from metrale_core import no_such_name", {})


def test_help_loads_neither_settings_nor_a_backend() -> None:
    code = """
        import contextlib, io
        from metrale_core._commands.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main(["--help"])
    """
    assert _loaded_after(code) == []


def test_a_subcommand_s_help_still_shows_its_arguments_and_defaults() -> None:
    from metrale_core._commands.conformance import DEFAULT_BUDGET_S, DEFAULT_EXAMPLES, DEFAULT_STEPS

    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    out = subprocess.run([sys.executable, "-m", "metrale_core", "conformance", "--help"], capture_output=True,
                         text=True, env=env, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for expected in ("--examples N", f"(default {DEFAULT_EXAMPLES})", f"(default {DEFAULT_STEPS})",
                     f"(default {DEFAULT_BUDGET_S:g}; 0: no limit)", "--seed SEED", "name"):
        assert expected in text, expected
    out = subprocess.run([sys.executable, "-m", "metrale_core", "report"], capture_output=True, text=True, env=env,
                         timeout=120, check=False)
    assert out.returncode == 2 and "the following arguments are required: SNAPSHOT" in out.stderr


COUNTED = """
    from metrale_core import BackendRegistration, hookimpl
    from metrale_fake import FakeDevice

    PROBES = []

    def probe(settings):
        PROBES.append(settings)
        return None

    @hookimpl
    def metrale_backend(settings):
        return BackendRegistration(open=FakeDevice, probe=probe, description="counts its probes")
"""


def test_an_open_by_name_probes_only_the_backend_it_opens(site: Path) -> None:
    install_distribution(site, "mtp-counted", "mtp_counted", COUNTED, {"counted": "mtp_counted"})
    with open_backend("fake", settings=SETTINGS):
        pass
    import mtp_counted  # type: ignore[import-not-found]

    assert mtp_counted.PROBES == [], "opening the fake probed another backend"
    assert available_backends(SETTINGS)["counted"].available
    assert len(mtp_counted.PROBES) == 1
    with open_backend("counted", settings=SETTINGS) as gpu:
        assert gpu.name == "counted"
    assert len(mtp_counted.PROBES) == 2


def test_an_open_by_name_of_an_unknown_backend_lists_every_installed_one(site: Path) -> None:
    install_distribution(site, "mtp-counted", "mtp_counted", COUNTED, {"counted": "mtp_counted"})
    with pytest.raises(metrale_core.BackendNotFoundError, match=r"installed: counted, .*fake"):
        open_backend("nonexistent", settings=SETTINGS)


def test_entry_points_are_scanned_once_per_state_of_the_path(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scans: list[object] = []
    real = importlib.metadata.entry_points

    def counting(**params: str) -> importlib.metadata.EntryPoints:
        scans.append(params)
        return real(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", counting)
    available_backends(MetraleSettings())
    first = len(scans)
    assert first <= 1
    available_backends(MetraleSettings())
    with open_backend("fake", settings=MetraleSettings()):
        pass
    assert len(scans) == first, "the same path was scanned again"

    # a distribution installed into a folder already on the path: the folder's time changes, it is seen
    late = COUNTED.replace("counts its probes", "late")
    install_distribution(site, "mtp-late", "mtp_late", late, {"late": "mtp_late"})
    later = os.stat(site).st_mtime_ns + 1_000_000_000
    os.utime(site, ns=(later, later))
    assert available_backends(SETTINGS)["late"].description == "late"
    assert len(scans) == first + 1

    # a folder put on the path is seen
    other = site / "more"
    other.mkdir()
    more = COUNTED.replace("counts its probes", "more")
    install_distribution(other, "mtp-more", "mtp_more", more, {"more": "mtp_more"})
    monkeypatch.syspath_prepend(str(other))
    assert available_backends(SETTINGS)["more"].description == "more"
    assert len(scans) == first + 2
