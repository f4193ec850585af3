"""What a one-source module reads as ``cython`` where Cython is not installed: it runs as Python.

- A hot-path module is written once, as Python that Cython compiles well (``ledger.py``, compiled as ``_ledger``
  with ``_ledger.pxd`` beside it: docs/building.md). It reads ``cython.compiled`` to pick a C-only spot::

      try:
          import cython
      except ImportError:  # (no Cython here: the module runs as Python)
          from .. import _nocython as cython

- Compiled, ``cython.compiled`` is ``True`` and Cython drops the other branch; as Python (with Cython installed or
  not) it is ``False``.
"""

from __future__ import annotations

from typing import Final

__all__ = ["compiled"]

compiled: Final = False
