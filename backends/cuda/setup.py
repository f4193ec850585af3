"""metrale-cuda's compiled driver calls; pyproject.toml holds everything else (docs/building.md says why).

``metrale_cuda/_cdriver.pyx`` (the hot path's driver calls through ``cuda.bindings.cydriver``) becomes an optional
extension module, compiled as C++ (``cydriver`` declarations need ``<type_traits>``) against the CUDA toolkit's
``cuda.h``, found by `cuda_include`, and metrale-core's ``metrale/device_calls.h`` (the device calls' struct), found
by `metrale_include`. Cython reads the ``cydriver`` functions it calls from ``pxd/`` (their declarations as
cuda-bindings declares them), not from an installed cuda-bindings, whose own ``cydriver.pxd`` needs a ``cuda.h`` of its
own version: the build needs no cuda-bindings. Where the module cannot be built (no Cython, no ``cuda.h``, no
``metrale/device_calls.h``, no C++ compiler), the build goes on without it and says so in one line: the pure calls
(``cuda.bindings.driver``) run. An error in the ``.pyx`` fails the build.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.sdist import sdist
from setuptools.errors import CCompilerError, ExecError, PlatformError

#: As the core's twins (its setup.py says why): signatures that inspect, help() and stubtest read; bounds checks on.
DIRECTIVES = {"language_level": 3, "binding": True, "embedsignature": True}
PURE = "metrale-cuda: {why}: built without the compiled driver calls; the pure calls (cuda.bindings.driver) run"
#: The declarations of the cydriver functions the module calls (``pxd/cuda/bindings/cydriver.pxd``).
DECLARATIONS = "pxd"


def cuda_roots() -> list[Path]:
    """Where a CUDA toolkit may be, in the order looked: ``CUDA_HOME``, ``CUDA_PATH``, the toolkit of the ``nvcc`` on
    ``PATH`` (``bin/nvcc``'s folder's parent, links followed), ``/usr/local/cuda``."""
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", "")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    roots.append("/usr/local/cuda")
    return [Path(root) for root in dict.fromkeys(roots) if root]


def cuda_include() -> Path | None:
    """The first folder holding ``cuda.h``: each root's ``include/``, or its ``targets/<arch>-linux/include/``."""
    for root in cuda_roots():
        for include in (root / "include", root / "targets" / f"{platform.machine()}-linux" / "include"):
            if (include / "cuda.h").is_file():
                return include
    return None


#: The header ``_cdriver.pyx`` includes, under an include folder: the device calls' struct, defined once in
#: metrale-core.
HEADER = Path("metrale", "device_calls.h")
#: Cython's view of it, beside it (``from metrale.device_calls cimport ...``): carried and looked for with it.
DECLARATIONS_PXD = Path("metrale", "device_calls.pxd")
HERE = Path(__file__).resolve().parent


def metrale_roots(here: Path = HERE) -> list[Path]:
    """Where metrale-core's C headers may be (``metrale_core.plugin.get_include()``), in the order looked: the core
    of the clone this backend is in (``../../metrale_core/include``: ``dev.py``'s editable installs, isolated or not),
    the copy this backend's sdist carries (``include/``, made by `SdistWithHeader` from the first found), the
    installed core's ``include/`` (found without importing it: a build without isolation where metrale-core is
    installed)."""
    roots = [here.parent.parent / "metrale_core" / "include", here / "include"]
    try:
        spec = importlib.util.find_spec("metrale_core")
    except (ImportError, ValueError):  # (a broken installation: as if none)
        spec = None
    if spec is not None:
        roots += [Path(folder) / "include" for folder in spec.submodule_search_locations or []]
    return list(dict.fromkeys(roots))


def metrale_include(here: Path = HERE) -> Path | None:
    """The first of `metrale_roots` that holds `HEADER` and `DECLARATIONS_PXD` (an older core's, without the second,
    would fail Cython's cimport: the pure driver calls then), or ``None``."""
    return next((root for root in metrale_roots(here)
                 if (root / HEADER).is_file() and (root / DECLARATIONS_PXD).is_file()), None)


class SdistWithHeader(sdist):
    """setuptools' sdist, with a copy of metrale-core's `HEADER` and `DECLARATIONS_PXD` under ``include/``: a wheel
    built from the sdist in isolation (where metrale-core is neither beside it nor installed) still compiles the
    driver calls. The copies are the core's files as found, never edited here."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        include = metrale_include()
        if include is None:
            looked = ", ".join(str(root) for root in metrale_roots())
            raise SystemExit(f"metrale-cuda's sdist: no {HEADER.as_posix()} to carry (looked in {looked})")
        for carried in (HEADER, DECLARATIONS_PXD):
            target = Path(base_dir, "include", carried)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(include / carried, target)


#: The oldest Cython that compiles the twins (``cython.pymutex``, ``cython.critical_section``).
CYTHON_MIN = (3, 1)


def cython_missing() -> str:
    """Why Cython cannot build the twins here (not installed, or older than `CYTHON_MIN`), or ``""``."""
    if importlib.util.find_spec("Cython") is None:
        return "Cython is not installed"
    import Cython

    found = tuple(int(part) for part in Cython.__version__.split(".")[:2] if part.isdigit())
    if found < CYTHON_MIN:
        return f"Cython {Cython.__version__} is older than {'.'.join(map(str, CYTHON_MIN))}"
    return ""


class BuildDriverCalls(build_ext):
    """setuptools' build_ext (Cython's, where Cython is installed) with the module's directives, ``cuda.h`` and
    declarations, and one line instead of a failure where it cannot be compiled."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.failed: list[str] = []  # the modules that did not compile, each with the compiler that failed

    def finalize_options(self) -> None:
        super().finalize_options()
        # Cython's build_ext reads these: the generated C++ goes to the build's temporary folder, not beside the .pyx
        self.cython_directives = {**DIRECTIVES, **(getattr(self, "cython_directives", None) or {})}
        self.cython_c_in_temp = True
        self.cython_include_dirs = [DECLARATIONS, *(getattr(self, "cython_include_dirs", None) or [])]

    def run(self) -> None:
        why = cython_missing()
        if why:
            print(PURE.format(why=why), file=sys.stderr)
            return
        include = cuda_include()
        if include is None:
            looked = ", ".join(str(root) for root in cuda_roots())
            why = f"no cuda.h (looked in {looked}: set CUDA_HOME to a CUDA toolkit)"
            print(PURE.format(why=why), file=sys.stderr)
            return
        header = metrale_include()
        if header is None:
            looked = ", ".join(str(root) for root in metrale_roots())
            why = (f"no {HEADER.as_posix()} (looked in {looked}: install metrale-core and build without isolation, or "
                   "build from a clone)")
            print(PURE.format(why=why), file=sys.stderr)
            return
        for ext in self.extensions:
            ext.include_dirs += [str(include), str(header)]
        self.cython_include_dirs = [*self.cython_include_dirs, str(header)]  # metrale/device_calls.pxd, beside the .h
        super().run()
        if self.failed:
            why = f"the C++ compiler failed ({'; '.join(self.failed)}) against {include}/cuda.h"
            print(PURE.format(why=why), file=sys.stderr)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except (CCompilerError, ExecError, PlatformError) as exc:  # not Cython's errors: a bad .pyx fails
            if not ext.optional:
                raise
            compiler = (getattr(self.compiler, "compiler_so_cxx", None) or getattr(self.compiler, "compiler_cxx", None)
                        or [type(exc).__name__])[0]
            self.failed.append(f"{compiler} on {ext.name}")


def driver_calls() -> list[Extension]:
    """The optional extension of each ``metrale_cuda/*.pyx`` (one: ``_cdriver``), as C++."""
    found = []
    for path in sorted(Path("metrale_cuda").glob("*.pyx")):
        ext = Extension(".".join(path.with_suffix("").parts), [path.as_posix()], language="c++", optional=True)
        ext.sources = [path.as_posix()]  # setuptools names the .cpp instead where Cython is missing: keep the .pyx
        found.append(ext)
    return found


if __name__ == "__main__":  # (as every build runs it: dev.py reads cuda_include without building)
    setup(ext_modules=driver_calls(), cmdclass={"build_ext": BuildDriverCalls, "sdist": SdistWithHeader})
