"""The host application's folder on ``sys.path``, so its tests import ``batch_scorer`` as the service does."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
