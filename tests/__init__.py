"""metrale's test suite: a package, a folder per wing of ``metrale_core`` (``tests/_support.py``: shared)."""
