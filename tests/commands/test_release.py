"""The release: one version source per distribution, the `metrale` meta-distribution's pins, `metrale --version`,
and the advice given where no backend is installed.

Building and installing the wheels is `python3 dev.py wheels` (CI runs it); these tests read the project files and
the installed environment.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

import metrale_core
from metrale_core import BackendNotFoundError, BackendUnavailableError, _discovery, open_backend
from metrale_core._commands import cli as _cli
from metrale_core._settings import plugins as _settings
from metrale_core.plugin import BackendRegistration
from tests._support import SETTINGS, install_distribution

ROOT = Path(__file__).resolve().parents[2]
#: Each distribution's folder and the package whose ``__version__`` is its version.
VERSIONED = {
    "metrale-core": (".", "metrale_core"),
    "metrale-fake": ("backends/fake", "metrale_fake"),
    "metrale-cuda": ("backends/cuda", "metrale_cuda"),
    "metrale-tracing": ("examples/tracing-backend", "metrale_tracing"),
    "metrale-example-pipeline": ("examples/pipeline", "metrale_pipeline"),
}
META = ROOT / "packaging" / "metrale" / "pyproject.toml"
INSTALL = 'pip install metrale (the fake backend) or pip install "metrale[cuda]" (NVIDIA GPUs)'


def _project(folder: str | Path) -> dict[str, Any]:
    with (ROOT / folder / "pyproject.toml").open("rb") as f:
        return dict(tomllib.load(f))


def _source_version(folder: str, package: str) -> str:
    text = (ROOT / folder / package / "__init__.py").read_text(encoding="utf-8")
    found = re.findall(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    assert len(found) == 1, f"{package}/__init__.py must set __version__ once"
    return str(found[0])


def _requirement_names(requirements: list[str]) -> list[str]:
    return [re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0] for r in requirements]


@pytest.mark.parametrize("dist", sorted(VERSIONED))
def test_each_distribution_reads_its_version_from_its_package(dist: str) -> None:
    folder, package = VERSIONED[dist]
    project = _project(folder)
    assert project["project"]["name"] == dist
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    if dist in ("metrale-core", "metrale-cuda"):  # setuptools (setup.py builds the compiled twins), reading the file
        assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": f"{package}.__version__"}
    else:
        assert project["tool"]["hatch"]["version"]["path"] == f"{package}/__init__.py"
    assert _source_version(folder, package) == metrale_core.__version__, "the distributions are released together"


@pytest.mark.parametrize("dist", sorted(VERSIONED))
def test_nothing_depends_on_the_meta_distribution(dist: str) -> None:
    names = _requirement_names(_project(VERSIONED[dist][0])["project"].get("dependencies", []))
    assert "metrale" not in names, "depend on metrale-core; `metrale` is what users install, and it pulls the fake"
    if dist != "metrale-core":
        assert "metrale-core" in names


def test_the_meta_distribution_pins_the_core_and_the_backends_at_its_own_version() -> None:
    with META.open("rb") as f:
        project = tomllib.load(f)["project"]
    version = project["version"]
    assert project["name"] == "metrale"
    assert version == metrale_core.__version__
    assert sorted(project["dependencies"]) == [f"metrale-core=={version}", f"metrale-fake=={version}"]
    assert project["optional-dependencies"]["cuda"] == [f"metrale-cuda=={version}"]
    # the core's extras, also under the name users install (`pip install 'metrale[report]'`, `'metrale[test]'`)
    core_extras = _project(".")["project"]["optional-dependencies"]
    for extra in ("report", "test"):
        assert extra in core_extras
        assert project["optional-dependencies"][extra] == [f"metrale-core[{extra}]=={version}"]


def test_the_installed_metadata_matches_the_source() -> None:
    for dist, (folder, package) in VERSIONED.items():
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here (an example, on a machine that installs only the core and backends)
        assert installed == _source_version(folder, package), f"{dist}: reinstall (python3 dev.py installs it)"
    assert importlib.metadata.version("metrale-core") == metrale_core.__version__


def _version(capsys: pytest.CaptureFixture[str]) -> list[str]:
    with pytest.raises(SystemExit) as exited:
        _cli.main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    return out.splitlines()


def test_version_names_the_core_and_every_backend_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _version(capsys)
    assert lines[0].startswith(f"metrale-core {metrale_core.__version__} (Python ")
    for ep in importlib.metadata.entry_points(group=metrale_core.ENTRY_POINT_GROUP):
        assert ep.dist is not None
        assert f"backend {ep.name}: {ep.dist.name} {ep.dist.version}" in lines
    assert f"backend fake: metrale-fake {importlib.metadata.version('metrale-fake')}" in lines


def test_version_gives_cuda_bindings_and_the_driver_where_the_cuda_plugin_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("metrale_cuda")
    lines = _version(capsys)
    at = lines.index(f"backend cuda: metrale-cuda {importlib.metadata.version('metrale-cuda')}")
    reported = dict(line.strip().split(": ", 1) for line in lines[at + 1 : at + 4])
    assert set(reported) == {"cuda-bindings", "driver", "driver calls"}
    try:
        bindings = importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        assert reported["cuda-bindings"].startswith("not importable")
    else:
        assert reported["cuda-bindings"] == bindings
    # without a GPU: "not found"; with one, the CUDA version the driver supports
    assert re.fullmatch(r"not found|CUDA \d+\.\d+", reported["driver"])
    # the compiled calls (cuda.bindings.cydriver) where built, unless the setting pure asks for the pure ones
    assert re.match(r"compiled: cuda\.bindings\.cydriver|pure Python: cuda\.bindings\.driver", reported["driver calls"])


def test_the_cuda_plugin_s_versions_need_no_device() -> None:
    plugin = pytest.importorskip("metrale_cuda._plugin")
    registration = plugin.metrale_backend(settings=SETTINGS)
    assert registration.versions() == plugin.versions(SETTINGS)  # (with the hook's settings: their pure)
    assert set(plugin.versions()) == {"cuda-bindings", "driver", "driver calls"}


def test_a_plugin_without_versions_reports_none() -> None:
    registration = BackendRegistration(open=lambda settings, ordinal: None)  # type: ignore[arg-type,return-value]
    assert dict(registration.versions()) == {}


def test_version_reports_a_plugin_s_versions_and_survives_one_that_raises(
    site: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    source = """
        from metrale_core.plugin import BackendRegistration, hookimpl

        def _open(settings, ordinal):
            raise RuntimeError("never opened")

        def _broken():
            raise OSError("no such library")

        @hookimpl
        def metrale_backend(settings):
            return BackendRegistration(open=_open, versions=_broken if "{kind}" == "broken" else
                                       (lambda: {{"its library": "4.5"}}))
    """
    install_distribution(site, "mtp-good", "mtp_good", source.format(kind="good"), {"good": "mtp_good"})
    install_distribution(site, "mtp-broken", "mtp_broken", source.format(kind="broken"), {"broken": "mtp_broken"})
    lines = _version(capsys)
    good = lines.index("backend good: mtp-good 1.0")
    assert lines[good + 1] == "  its library: 4.5"
    broken = lines.index("backend broken: mtp-broken 1.0")
    assert lines[broken + 1] == "  versions: its versions() raised OSError: no such library"


def test_version_prints_without_probing_a_backend(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = """
        from metrale_core.plugin import BackendRegistration, hookimpl

        PROBES = []

        @hookimpl
        def metrale_backend(settings):
            return BackendRegistration(open=None, probe=lambda settings: PROBES.append(1))
    """
    install_distribution(site, "mtp-probed", "mtp_probed", source, {"probed": "mtp_probed"})
    lines = _version(capsys)
    assert "backend probed: mtp-probed 1.0" in lines
    import mtp_probed  # type: ignore[import-not-found]

    assert mtp_probed.PROBES == [], "--version probed a backend (a probe may initialize a driver)"


@pytest.fixture
def nothing_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Discovery and --version see no plugin, as after `pip install metrale-core` alone."""
    monkeypatch.setattr(_settings, "backend_entry_points", lambda: {})
    monkeypatch.setattr(_discovery, "backend_entry_points", lambda: {})
    monkeypatch.delenv("METRALE_BACKEND", raising=False)


@pytest.mark.usefixtures("nothing_installed")
def test_with_no_backend_installed_every_open_names_the_install_command() -> None:
    with pytest.raises(BackendUnavailableError) as auto:
        open_backend(settings=SETTINGS.updated(backend="auto"))
    assert str(auto.value) == f"no backend is installed (asked for 'auto'); install one: {INSTALL}"
    with pytest.raises(BackendUnavailableError) as configured:
        open_backend(settings=SETTINGS.updated(backend="fake"))
    assert str(configured.value) == f"no backend is installed (asked for 'fake'); install one: {INSTALL}"
    with pytest.raises(BackendNotFoundError) as named:
        open_backend("cuda", settings=SETTINGS)
    assert str(named.value) == f"no backend is installed (asked for 'cuda'); install one: {INSTALL}"


@pytest.mark.usefixtures("nothing_installed")
def test_with_no_backend_installed_info_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli.main(["info"]) == 1
    err = capsys.readouterr().err
    assert err == f"metrale info: BackendUnavailableError: no backend is installed (asked for 'auto'); install one: " \
                  f"{INSTALL}\n"


@pytest.mark.usefixtures("nothing_installed")
def test_with_no_backend_installed_version_says_how_to_install_one(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _version(capsys)
    assert lines[1].startswith("  code: ")  # which code runs (the compiled twins, or the pure modules)
    assert lines[2:] == [f"backends: none installed; install one: {INSTALL}"]


def test_auto_with_no_available_backend_and_no_fake_points_to_the_fake(site: Path) -> None:
    source = """
        from metrale_core.plugin import BackendRegistration, hookimpl

        @hookimpl
        def metrale_backend(settings):
            return BackendRegistration(open=None, probe=lambda settings: "no such device here")
    """
    install_distribution(site, "mtp-absent", "mtp_absent", source, {"absent": "mtp_absent"})
    only = {k: v for k, v in _settings.backend_entry_points().items() if k == "absent"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_discovery, "backend_entry_points", lambda: only)
        with pytest.raises(BackendUnavailableError, match=r"\(absent: no such device here\); pip install metrale "
                           r"adds the fake backend, which runs anywhere; see `metrale backends`"):
            open_backend(settings=SETTINGS.updated(backend="auto"))
