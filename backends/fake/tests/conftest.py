"""The fake backend's own tests: the ``fake`` fixture of ``tests/_support.py``."""

from __future__ import annotations

from tests._support import fake

__all__ = ["fake"]  # a fixture: offered to every test here
