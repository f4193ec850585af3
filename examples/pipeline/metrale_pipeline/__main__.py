"""``python -m metrale_pipeline``: the same as the ``metrale-pipeline`` command."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
