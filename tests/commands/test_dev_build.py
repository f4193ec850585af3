"""The build of the compiled twins as dev.py sees it: which twins there are, and what `wheels` requires of the core's
wheel (the GPU machine's install is tools/gpu_plan.py's: tests/commands/test_dev_gpu.py).

Building them is setup.py's; `python3 dev.py wheels` (CI) builds and installs the wheels.
"""

from __future__ import annotations

import io
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

import dev

SDIST_FILES = ["metrale_core/__init__.py", "metrale_core/py.typed", "metrale_core/_memory/_t.pyx",
               "metrale_core/_memory/_t.pyi", "setup.py", "PKG-INFO"]
WHEEL = "metrale_core-1.0-cp311-cp311-linux_x86_64.whl"


def _dist(folder: Path, carried: list[str], package: str = "metrale_core", dist: str = "metrale_core") -> Path:
    """An sdist of SDIST_FILES (of ``package``) and a wheel of ``carried``, as `python -m build` leaves them; beside
    them, another distribution's, which is not looked at."""
    for name, files, wheel_files in ((dist, SDIST_FILES, carried), ("metrale_fake", ["metrale_fake/x.py"], [])):
        with tarfile.open(folder / f"{name}-1.0.tar.gz", "w:gz") as tar:
            for file in files:
                info = tarfile.TarInfo(f"{name}-1.0/{file.replace('metrale_core', package)}")
                tar.addfile(info, io.BytesIO(b""))
        with zipfile.ZipFile(folder / f"{name}-1.0-cp311-cp311-linux_x86_64.whl", "w") as zf:
            for file in wheel_files:
                zf.writestr(file, "")
    return folder


def test_the_core_wheel_carries_its_sdist_s_package_and_a_compiled_module_per_twin(tmp_path: Path) -> None:
    package = [n for n in SDIST_FILES if n.startswith("metrale_core/") and not n.endswith(".pyx")]  # (sdist only)
    so = "metrale_core/_memory/_t.cpython-311-x86_64-linux-gnu.so"
    assert dev._wheel_lacks(_dist(tmp_path, [*package, so, "metrale_core-1.0.dist-info/RECORD"]), "metrale_core") == []


def test_a_missing_file_or_compiled_twin_is_named(tmp_path: Path) -> None:
    carried = ["metrale_core/__init__.py", "metrale_core/_memory/_t.pyx", "metrale_core/_memory/_t.pyi"]
    assert dev._wheel_lacks(_dist(tmp_path, carried), "metrale_core") == [
        f"{WHEEL}: metrale_core/py.typed",
        f"{WHEEL}: metrale_core/_memory/_t.pyx's compiled module (no C compiler? the build said so)",
    ]


def test_the_cuda_wheel_needs_its_compiled_module_only_where_cuda_h_is(tmp_path: Path) -> None:
    """metrale-cuda's sdist is named with a dash or an underscore (setuptools normalizes it); its compiled driver
    calls are required where the build finds cuda.h (``compiled``), else its files only."""
    carried = ["metrale_cuda/__init__.py", "metrale_cuda/py.typed", "metrale_cuda/_memory/_t.pyi"]
    dist = _dist(tmp_path, carried, package="metrale_cuda", dist="metrale_cuda")
    assert dev._wheel_lacks(dist, "metrale_cuda", compiled=False) == []
    assert dev._wheel_lacks(dist, "metrale_cuda") == [
        "metrale_cuda-1.0-cp311-cp311-linux_x86_64.whl: metrale_cuda/_memory/_t.pyx's compiled module "
        "(no C compiler? the build said so)"
    ]


def test_the_twins_are_what_each_setup_py_compiles_by_module(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("setuptools", reason="setup.py imports setuptools, not installed here")
    import runpy

    found = dev.twins()
    monkeypatch.chdir(dev.ROOT)  # (setup.py runs in its folder)
    core = runpy.run_path(str(dev.ROOT / "setup.py"), run_name="metrale_core_setup")["compiled_sources"]()
    assert {n: p for n, p in found.items() if n.startswith("metrale_core.")} == {
        name: (dev.ROOT / path) for name, path in core.items()
    }
    cuda = sorted((dev.ROOT / "backends" / "cuda" / "metrale_cuda").rglob("*.pyx"))
    assert sorted(p for n, p in found.items() if n.startswith("metrale_cuda.")) == cuda
    assert dev.CUDA_TWIN in found and found[dev.CUDA_TWIN].name == "_cdriver.pyx"
    assert set(dev.compiled_twins()) <= set(found)


def test_dev_py_finds_cuda_h_as_the_cuda_backend_s_build_does() -> None:
    import runpy

    setup = runpy.run_path(str(dev.ROOT / "backends" / "cuda" / "setup.py"), run_name="metrale_cuda_setup")
    found = setup["cuda_include"]()
    assert dev.cuda_include(dev.sys.executable) == (str(found) if found else None)


def _cuda_setup() -> dict[str, object]:
    import runpy

    pytest.importorskip("setuptools", reason="the CUDA backend's setup.py imports setuptools, not installed here")
    return runpy.run_path(str(dev.ROOT / "backends" / "cuda" / "setup.py"), run_name="metrale_cuda_setup")


def _header(folder: Path, *, pxd: bool = True) -> Path:
    (folder / "metrale").mkdir(parents=True, exist_ok=True)
    (folder / "metrale" / "device_calls.h").write_text("/* the device calls */\n")
    if pxd:
        (folder / "metrale" / "device_calls.pxd").write_text("# Cython's view\n")
    return folder


def test_the_cuda_build_finds_the_device_calls_header_in_the_clone_first() -> None:
    """From a clone, the core beside it (an isolated editable install, as dev.py's); from the sdist, the copy the sdist
    carries; else the installed core's (a build without isolation): ``metrale_core.plugin.get_include()``."""
    from metrale_core.plugin import get_include

    setup = _cuda_setup()
    find, roots = setup["metrale_include"], setup["metrale_roots"]
    assert callable(find) and callable(roots)
    clone = dev.ROOT / "metrale_core" / "include"
    assert find() == clone and roots()[:2] == [clone, dev.ROOT / "backends" / "cuda" / "include"]
    assert Path(get_include()) in roots()  # (the installed core: this tree's, editable)


def test_an_unpacked_sdist_finds_its_copy_first_and_else_the_installed_core(tmp_path: Path) -> None:
    from metrale_core.plugin import get_include

    find = _cuda_setup()["metrale_include"]
    assert callable(find)
    unpacked = tmp_path / "metrale_cuda-1.0"
    unpacked.mkdir()
    assert find(unpacked) == Path(get_include())  # no clone around it, no copy: the installed core's
    _header(unpacked / "include", pxd=False)  # an older core's copy, without Cython's view: not taken
    assert find(unpacked) == Path(get_include())
    copy = _header(unpacked / "include")
    assert find(unpacked) == copy


def test_the_cuda_sdist_carries_a_copy_of_the_core_s_header_and_its_declarations(tmp_path: Path) -> None:
    from setuptools import Distribution

    sdist = _cuda_setup()["SdistWithHeader"]
    assert isinstance(sdist, type)
    command = sdist(Distribution({"name": "metrale-cuda", "version": "1.0"}))
    command.make_release_tree(str(tmp_path / "tree"), [])
    for name in ("device_calls.h", "device_calls.pxd"):  # the header, and Cython's view of it (_cdriver cimports it)
        copied = tmp_path / "tree" / "include" / "metrale" / name
        assert copied.read_bytes() == (dev.ROOT / "metrale_core" / "include" / "metrale" / name).read_bytes()


def test_wheels_installs_what_every_distribution_builds_with() -> None:
    with (dev.ROOT / "pyproject.toml").open("rb") as f:
        core = tomllib.load(f)["build-system"]["requires"]
    needed = dev._build_requirements()
    assert set(core) <= set(needed) and any(r.startswith("hatchling") for r in needed)
    assert any(r.startswith("Cython") for r in core) and any(r.startswith("setuptools") for r in core)
