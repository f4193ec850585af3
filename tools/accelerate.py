#!/usr/bin/env python3
"""The optional compiled path: Cython compiles metrale's hot-path modules in place, unchanged.

    python3 dev.py accelerate            # installs Cython into .venv, compiles, prints what it built
    python3 dev.py accelerate --clean    # removes the compiled modules: pure Python again
    python3 tools/accelerate.py [--clean]   # the same with the running Python (needs Cython and a C compiler)

Each module listed in :data:`MODULES` is compiled from its own ``.py`` (Cython's pure-Python mode,
annotations not taken as C types, so every check of the Python source behaves as written) into an
extension module beside it. Python's import system prefers the extension over the ``.py`` of the
same name, so nothing else changes: the pure-Python modules stay the source, the fallback and
CI's default; the compiled ones are a build product, ignored by git. ``metrale bench`` prints
which modules ran compiled. Rebuild after editing a listed module (a stale extension shadows the
edited source; the bench's line says so).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The modules of the ledgered alloc/free, memset, launch and graph-launch paths, by the folder
#: their package lives in.
MODULES: dict[str, tuple[str, ...]] = {
    ".": (
        "metrale_core/_memory/allocator.py",
        "metrale_core/_memory/arena.py",
        "metrale_core/_backend.py",
        "metrale_core/_device/buffer.py",
        "metrale_core/_device/capture.py",
        "metrale_core/_device/context.py",
        "metrale_core/_device/handles.py",
        "metrale_core/_memory/holdings.py",
        "metrale_core/_launch/front.py",
        "metrale_core/_memory/ledger.py",
        "metrale_core/_memory/pressure.py",
        "metrale_core/_streams/front.py",
        "metrale_core/_streams/graphs.py",
        "metrale_core/_redzones/guard.py",
    ),
    "backends/cuda": ("metrale_cuda/_device.py", "metrale_cuda/_driver.py", "metrale_cuda/_launch.py"),
    "backends/fake": ("metrale_fake/_device.py", "metrale_fake/_memory.py"),
}

#: Builds each package's extensions into the folder it lives in (run in a scratch folder, where no
#: pyproject.toml is read).
_SETUP = """
import os, sys
from Cython.Build import cythonize
from setuptools import Extension, setup
folder, build, *names = sys.argv[1:]
extensions = [Extension(name[:-3].replace("/", "."), [os.path.join(folder, name)]) for name in names]
directives = {"annotation_typing": False, "binding": True, "embedsignature": True, "language_level": 3}
setup(
    name="metrale-accelerate",
    script_args=["build_ext", "-j", str(os.cpu_count() or 1), "--build-lib", folder, "--build-temp", build],
    ext_modules=cythonize(extensions, build_dir=build, quiet=True, nthreads=4, compiler_directives=directives),
)
"""


def _sources() -> list[Path]:
    return [ROOT / folder / name for folder, names in MODULES.items() for name in names]


def _built(source: Path) -> list[Path]:
    return [p for p in source.parent.glob(f"{source.stem}.*") if p.suffix in (".so", ".pyd")]


def clean() -> int:
    removed = 0
    for source in _sources():
        for path in _built(source):
            path.unlink()
            removed += 1
    print(f"accelerate: removed {removed} compiled module(s); metrale runs as pure Python")
    return 0


def build() -> int:
    try:
        import Cython.Build  # noqa: F401
        import setuptools  # noqa: F401
    except ImportError:
        print("accelerate: needs Cython and setuptools here (python3 -m pip install cython setuptools)",
              file=sys.stderr)
        return 1
    for folder, names in MODULES.items():
        with tempfile.TemporaryDirectory(prefix="metrale-accelerate-") as tmp:  # the generated C, not kept
            code = subprocess.call([sys.executable, "-c", _SETUP, str(ROOT / folder), tmp, *names], cwd=tmp)
        if code:
            print(f"accelerate: building {folder} failed (see above); what did not build runs as pure Python",
                  file=sys.stderr)
            return code
    built = [path for source in _sources() for path in _built(source)]
    print(f"accelerate: {len(built)} of {len(_sources())} modules compiled in place (Cython):")
    for path in built:
        print(f"  {path.relative_to(ROOT)}")
    return 0 if len(built) == len(_sources()) else 1


def main(argv: list[str]) -> int:
    if argv not in ([], ["--clean"]):
        print(__doc__)
        return 2
    return clean() if argv else build()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
