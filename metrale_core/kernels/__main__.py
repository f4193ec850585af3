"""Regenerate the shipped PTX from the CUDA C sources (needs nvcc)."""

import subprocess
import sys
from pathlib import Path

from . import ARCHES, MODULES

here = Path(__file__).resolve().parent
for name in MODULES:
    command = ["nvcc", "-ptx", f"-arch={ARCHES[name]}", "-o", str(here / f"{name}.ptx"), str(here / f"{name}.cu")]
    print("+", " ".join(command))
    if subprocess.call(command):
        sys.exit(f"nvcc failed for {name}")
