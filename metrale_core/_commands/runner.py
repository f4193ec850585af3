"""``metrale run``: an unmodified Python script under metrale, its frameworks' tensors on the ledger.

- Opens the configured backend (``--redzone N`` overrides the ``redzone`` setting), installs the allocator doors
  asked for (``--torch``, ``--cupy``) before the script imports anything, and runs the script as ``python SCRIPT``
  would (`runpy`, as ``__main__``, with its own ``sys.argv``).
- Then: the script's globals are dropped and collected (its tensors go back), the device waits, the red zones are
  judged, and the report goes to stderr: violations with their sites, and what is still held with its sites (a
  leak, or memory a framework keeps for the process: cuBLAS's workspace), the peak.
- Its exit status is the script's: ``sys.exit(n)``'s, 1 for an uncaught exception (its traceback printed), 0 else.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._errors import MetraleError, RedZoneError
from .._types import RedZoneViolation

if TYPE_CHECKING:
    from .. import GpuBackend
    from .._settings.model import MetraleSettings
    from ..allocators import Door

__all__ = ["run_script"]


def _exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # as Python does: the message, status 1
    return 1


def _run(script: str, argv: Sequence[str]) -> int:
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *argv]
    if sys.path:
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as ``python SCRIPT`` sets it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        return _exit_status(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130  # as Python's own exit on an uncaught Ctrl-C (128 + SIGINT)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    return 0


def _install(gpu: GpuBackend, torch: bool, cupy: bool) -> list[Door]:
    doors: list[Door] = []
    if torch:
        from ..allocators import torch as torch_door

        doors.append(torch_door.install(gpu))
        torch_door.graph_trees_off()  # (torch.compile's "reduce-overhead" then captures what the door serves)
    if cupy:
        from ..allocators import cupy as cupy_door

        doors.append(cupy_door.install(gpu))
    return doors


def _settle(doors: list[Door]) -> None:
    """The script's objects are gone: collect them, so the frameworks free their tensors, and let the device
    finish the work that used them."""
    gc.collect()
    for door in doors:
        if door.framework == "torch":
            import torch  # type: ignore[import-not-found, import-untyped, unused-ignore]

            torch.cuda.synchronize()


def run_script(
    settings: MetraleSettings, script: str, argv: Sequence[str], *, torch: bool, cupy: bool, redzone: int | None,
    top: int = 10,
) -> int:
    """Run ``script`` under metrale; the script's exit status."""
    from .._discovery import open_backend

    if not os.path.isfile(script):
        print(f"metrale run: {script}: no such file", file=sys.stderr)
        return 2
    if redzone is not None:
        settings = settings.updated(redzone=redzone)
    gpu = open_backend(settings=settings)
    heard: dict[tuple[int, str], RedZoneViolation] = {}  # every zone found changed in the run, once
    gpu.on_redzone_violation(lambda backend, v: heard.setdefault((v.index, v.side), v))
    try:
        doors = _install(gpu, torch, cupy)
        status = _run(script, argv)
        _settle(doors)
        report(gpu, doors, script, status, top, heard)
    finally:
        gpu.close()
    return status


def report(
    gpu: GpuBackend, doors: list[Door], script: str, status: int, top: int,
    heard: dict[tuple[int, str], RedZoneViolation],
) -> None:
    """What ``metrale run`` prints after the script: violations, what is still held, the peak (to stderr)."""
    out = sys.stderr
    try:
        gpu.scan_redzones()  # the last check: what it finds is heard too
    except RedZoneError:
        pass  # (redzone_action="raise": the observers heard it first)
    except MetraleError as exc:  # a fault the script left behind: say it, print the rest
        print(f"metrale run: the red zones could not be judged: {type(exc).__name__}: {exc}", file=out)
    violations = list(heard.values())
    print(f"\nmetrale run: {script} exited with status {status}", file=out)
    for door in doors:
        failures = f", {door.failures} refused (the last: {door.last_error})" if door.failures else ""
        print(f"  {door.framework}: {door.out()} tensor(s) still held{failures}", file=out)
    print(f"  red zones: {len(violations)} violation(s)" + (":" if violations else ""), file=out)
    for v in violations:
        print(f"    {v.describe()}", file=out)
    print(gpu.memory_summary(top=top), file=out)
