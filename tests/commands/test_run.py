"""``metrale run``: a script run as ``python SCRIPT`` runs it, its exit status kept, a report after it.

The ``--torch`` and ``--cupy`` doors run for real on the GPU only (``tests/allocators``); here the command's own
rules, on the configured backend.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests._support import metrale


def _script(tmp_path: Path, text: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(text)
    return str(path)


def test_the_script_runs_with_its_arguments_and_its_exit_status(tmp_path: Path) -> None:
    script = _script(tmp_path, "import sys\nprint('argv', sys.argv[1:], __name__)\nsys.exit(3)\n")
    done = metrale("run", script, "a", "--b", METRALE_BACKEND="fake")
    assert done.returncode == 3, done.stderr
    assert "argv ['a', '--b'] __main__" in done.stdout
    assert f"metrale run: {script} exited with status 3" in done.stderr
    assert "red zones: 0 violation(s)" in done.stderr and "metrale memory summary" in done.stderr


@pytest.mark.parametrize(("body", "status", "said"), [
    ("raise KeyError('boom')", 1, "KeyError: 'boom'"),
    ("import sys; sys.exit('a message')", 1, "a message"),
    ("import sys; sys.exit(None)", 0, "exited with status 0"),
    ("x = 1", 0, "exited with status 0"),
])
def test_the_status_is_what_python_would_give(tmp_path: Path, body: str, status: int, said: str) -> None:
    done = metrale("run", _script(tmp_path, body + "\n"), METRALE_BACKEND="fake")
    assert done.returncode == status and said in done.stderr, done.stderr


def test_a_missing_script_is_said(tmp_path: Path) -> None:
    done = metrale("run", str(tmp_path / "nothing.py"), METRALE_BACKEND="fake")
    assert done.returncode == 2 and "no such file" in done.stderr


def test_a_bad_redzone_is_refused_by_the_parser(tmp_path: Path) -> None:
    done = metrale("run", "--redzone", "lots", _script(tmp_path, "x = 1\n"), METRALE_BACKEND="fake")
    assert done.returncode == 2 and "--redzone: must be a size in bytes" in done.stderr


def test_the_torch_door_on_the_fake_is_refused_with_the_reason(tmp_path: Path) -> None:
    done = metrale("run", "--torch", _script(tmp_path, "x = 1\n"), METRALE_BACKEND="fake")
    assert done.returncode == 1
    if importlib.util.find_spec("torch") is None:
        assert "needs PyTorch" in done.stderr and "Error:" not in done.stderr  # a package to install: said plainly
    else:
        assert "DoorError" in done.stderr and "no CUDA device" in done.stderr


@pytest.mark.parametrize("action", ["warn", "raise"])
def test_the_report_counts_every_violation_of_the_run(action: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Violations judged at a free (or a quarantine's check) during the run and at the final scan are all reported,
    once each, with their sites; ``redzone_action="raise"`` does not hide them."""
    from metrale_core import RedZoneError, RedZoneViolation, open_backend
    from metrale_core._commands.runner import report
    from tests._support import SETTINGS

    settings = SETTINGS.updated(redzone=64, redzone_quarantine_bytes=0, redzone_action=action, redzone_sample=1,
                                redzone_min_idx=0)
    with open_backend("fake", settings=settings) as gpu:
        heard: dict[tuple[int, str], RedZoneViolation] = {}
        gpu.on_redzone_violation(lambda backend, v: heard.setdefault((v.index, v.side), v))
        freed, kept = gpu.alloc(100), gpu.alloc(100)
        gpu.memset(freed.ptr + 100, 0, nbytes=1)
        gpu.memset(kept.ptr + 100, 0, nbytes=1)
        try:
            gpu.free(freed)  # judged at once: heard now
        except RedZoneError:
            assert action == "raise"
        report(gpu, [], "script.py", 0, 3, heard)
        try:
            gpu.free(kept)
        except RedZoneError:
            assert action == "raise"
    err = capsys.readouterr().err
    assert "red zones: 2 violation(s):" in err, err
    assert f"allocation #{freed.index}" in err and f"allocation #{kept.index}" in err
    assert freed.site in err and kept.site in err
