"""metrale-core's compiled modules; pyproject.toml holds everything else (docs/building.md says why).

Two kinds, each an optional extension module cythonized when it is built (the generated C stays in the build
folder), found by their files: nothing to list.

- **One source**: a hot-path module ``X.py`` with ``_X.pxd`` beside it is compiled again as ``_X``, from the same
  file (``ledger.py`` as ``metrale_core._memory._ledger``; Cython reads ``_X.pxd`` as its declarations). The
  ``.py`` runs as Python too: the pure build, picked per backend (``_twins.pick``).
- **C ABIs**: a ``_X.pyx`` is compiled as ``_X`` (a C function another library calls, the device calls).

Where they cannot be built (no C compiler, no Python headers, no Cython), the build goes on without them and says
so in one line: the pure-Python modules run. An error Cython finds in a source fails the build. Each compiles with
`INCLUDE` on its include path: the core's C headers (``metrale/device_calls.h``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

#: binding and embedsignature give each function a signature that inspect, help() and stubtest read. Bounds and
#: negative-index checks keep Cython's defaults (on): a twin fails as its pure module does; a measured hot loop
#: may turn them off for itself (``@cython.boundscheck(False)``).
#: annotation_typing off: a one-source module's annotations are for mypy (``int`` may be any integer there); its
#: ``.pxd`` alone gives Cython its C types.
DIRECTIVES = {"language_level": 3, "binding": True, "embedsignature": True, "annotation_typing": False}
PURE = "metrale-core: {why}: built without the compiled twins; the pure-Python modules run"
#: The core's C headers, shipped in the package (``metrale_core.plugin.get_include()`` of the installed core): found
#: beside this file, since the build runs before metrale_core can be imported.
INCLUDE = Path(__file__).resolve().parent / "metrale_core" / "include"


def compiled_sources(root: Path = Path("metrale_core")) -> dict[str, Path]:
    """Each compiled module under ``root`` and its source: ``_X`` from ``X.py`` where ``_X.pxd`` is beside it and
    no ``_X.pyx`` is (one source), else from ``_X.pyx``. A ``.pxd`` with neither (``_lock.pxd``: C declarations
    only) makes no module."""
    found = {}
    for pxd in sorted(root.rglob("_*.pxd")):
        source = pxd.with_name(pxd.stem[1:] + ".py")
        if source.is_file() and not pxd.with_suffix(".pyx").exists():
            found[".".join(pxd.with_suffix("").parts)] = source
    for pyx in sorted(root.rglob("*.pyx")):
        found[".".join(pyx.with_suffix("").parts)] = pyx
    return dict(sorted(found.items()))


def twins() -> list[Extension]:
    """An optional extension for each compiled module (`compiled_sources`)."""
    found = []
    # every .pxd and header: a changed declaration rebuilds each module (setuptools compares only what is listed)
    depends = sorted(p.as_posix() for p in (*Path("metrale_core").rglob("*.pxd"), *INCLUDE.rglob("*.h")))
    for name, path in compiled_sources().items():
        ext = Extension(name, [path.as_posix()], include_dirs=[str(INCLUDE)], depends=depends, optional=True)
        ext.sources = [path.as_posix()]  # setuptools names the .c instead where Cython is missing: keep the source
        found.append(ext)
    return found


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


class BuildTwins(build_ext):
    """setuptools' build_ext (Cython's, where Cython is installed), with the twins' directives, and one line
    instead of a failure where they cannot be compiled."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.failed: list[str] = []  # the twins that did not compile, each with the compiler that failed

    def finalize_options(self) -> None:
        super().finalize_options()
        # Cython's build_ext reads these: the generated C goes to the build's temporary folder, not beside the .pyx
        self.cython_directives = {**DIRECTIVES, **(getattr(self, "cython_directives", None) or {})}
        self.cython_c_in_temp = True
        # ``from metrale.device_calls cimport ...``: Cython's view of the header, beside it
        self.cython_include_dirs = [str(INCLUDE), *(getattr(self, "cython_include_dirs", None) or [])]

    def run(self) -> None:
        why = cython_missing()
        if why:
            print(PURE.format(why=why), file=sys.stderr)
            return
        super().run()
        if self.failed:
            why = f"the C compiler failed on {len(self.failed)} twin(s) ({'; '.join(self.failed)})"
            print(PURE.format(why=why), file=sys.stderr)

    def build_extension(self, ext: Extension) -> None:
        # A module older than its source or any .pxd or header has its C made again: Cython's own check reads the
        # source's cimports only, and a one-source module's are in its .pxd (a lane kept C made against an old
        # zone table's declarations, and failed to load)
        from setuptools.modified import newer_group  # (setuptools 69; the build requires 77: a test imports this file)

        force = self.force
        self.force = force or newer_group([*ext.sources, *ext.depends], self.get_ext_fullpath(ext.name))
        try:  # each twin is tried: one that fails to compile leaves the others built
            super().build_extension(ext)
        except (CCompilerError, ExecError, PlatformError) as exc:  # not Cython's errors: a bad .pyx fails
            if not ext.optional:
                raise
            compiler = (getattr(self.compiler, "compiler_so", None) or [type(exc).__name__])[0]
            self.failed.append(f"{compiler} on {ext.name}")
        finally:
            self.force = force


if __name__ == "__main__":  # (as every build runs it: a test reads INCLUDE and twins without building)
    setup(ext_modules=twins(), cmdclass={"build_ext": BuildTwins})
