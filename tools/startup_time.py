"""Start-up time of metrale: each case in fresh subprocesses, the median wall time of N runs.

    .venv/bin/python tools/startup_time.py            # median of 10
    .venv/bin/python tools/startup_time.py -n 20 --json out.json

Cases: ``import metrale_core``; ``import metrale_core`` and ``open_backend('fake')`` (closed again);
``metrale --help``; ``metrale backends``; and a bare ``python -c pass`` as the floor every case pays.
The console script is run as the installed ``metrale`` next to the interpreter where there is one, else as
``python -m metrale_core``. The environment is the caller's (``METRALE_*`` included).

``--bytecode`` lets the children cache their bytecode (in a folder of their own under the temporary
directory, through ``PYTHONPYCACHEPREFIX``, so the working tree gets no ``__pycache__``), as an installed
package has it: where ``PYTHONDONTWRITEBYTECODE`` is set, every module of an editable install (metrale's
own, the bundled backends) is compiled from source in every process, which is a large part of its start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _metrale() -> list[str]:
    script = Path(sys.executable).with_name("metrale")
    if script.exists():
        return [str(script)]
    found = shutil.which("metrale")
    return [found] if found else [sys.executable, "-m", "metrale_core"]


def _cases() -> dict[str, list[str]]:
    py = sys.executable
    return {
        "python -c pass": [py, "-c", "pass"],
        "import metrale_core": [py, "-c", "import metrale_core"],
        "import + open_backend('fake')": [
            py, "-c", "import metrale_core; from metrale_core import open_backend; open_backend('fake').close()",
        ],
        "metrale --help": [*_metrale(), "--help"],
        "metrale backends": [*_metrale(), "backends"],
    }


def _time(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=10, help="runs per case (default 10)")
    parser.add_argument("--json", metavar="PATH", help="also write the medians (ms) as JSON")
    parser.add_argument("--bytecode", action="store_true",
                        help="let the children cache bytecode (PYTHONPYCACHEPREFIX), as installed packages have it")
    args = parser.parse_args(argv)
    env = os.environ.copy()
    if args.bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(Path(tempfile.gettempdir()) / "metrale-startup-pycache")
    cases = _cases()
    for command in cases.values():  # warm the file cache (and the bytecode cache) once; not counted
        _time(command, env)
    results: dict[str, dict[str, float]] = {}
    width = max(len(name) for name in cases)
    bytecode = "cached" if args.bytecode else "as the environment says"
    print(f"{'case':<{width}}  median ms    min ms    max ms  (n={args.n}; bytecode {bytecode})")
    for name, command in cases.items():
        times = [_time(command, env) * 1000 for _ in range(args.n)]
        results[name] = {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}
        print(f"{name:<{width}}  {statistics.median(times):9.1f} {min(times):9.1f} {max(times):9.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
