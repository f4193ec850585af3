"""``python -m metrale_core``: the ``metrale`` command line."""

import sys

from ._commands.cli import main

sys.exit(main())
