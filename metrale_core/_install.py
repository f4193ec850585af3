"""The ``pip install`` that adds an optional part, named for the distribution the user installed.

- `install_command`: ``pip install "metrale[report]"`` where the ``metrale`` distribution is installed (what the
  README installs), else ``pip install "metrale-core[report]"`` (a checkout's editable core, or a backend author's
  environment, which has the core alone).
"""

from __future__ import annotations

from importlib import metadata
from typing import Literal

__all__ = ["install_command"]


def install_command(extra: Literal["report", "test", "cuda"]) -> str:
    """The command that adds ``extra`` to this environment's metrale (``cuda``: only ``metrale`` has it)."""
    try:
        metadata.distribution("metrale")
    except metadata.PackageNotFoundError:
        if extra == "cuda":
            return "pip install metrale-cuda"
        return f'pip install "metrale-core[{extra}]"'
    return f'pip install "metrale[{extra}]"'
