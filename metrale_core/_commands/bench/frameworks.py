"""The ``frameworks`` measurement: a real model's ``generate`` with every tensor from metrale, against torch's own
caching allocator, in one run.

- Each configuration is a process of its own (`generate`): torch's allocator can be changed only before torch
  first uses CUDA. The configurations take turns, round by round; each figure is the median of its rounds.
- Configurations: torch's caching allocator; metrale's pool with the ledger on every tensor; 4 KiB red zones on
  every tensor; on one tensor in 64. Then a planted one-byte overrun, reported with the tensor's site or not.
- Skipped, with the reason, off the CUDA backend or without torch and transformers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Final

from .context import Bench
from .model import Figure, Goal, Result
from .timing import compare

__all__ = ["measure_frameworks"]

_BASE: Final = "generate, torch's caching allocator"
#: label -> (mode, the METRALE_* settings of its process)
_CONFIGS: Final[dict[str, tuple[str, dict[str, str]]]] = {
    _BASE: ("torch", {}),
    "generate, metrale pool, ledger on every tensor": ("metrale", {"METRALE_REDZONE": "0"}),
    "generate, 4 KiB red zones on every tensor": ("metrale", {"METRALE_REDZONE": "4096"}),
    "generate, 4 KiB red zones on one tensor in 64": (
        "metrale", {"METRALE_REDZONE": "4096", "METRALE_REDZONE_SAMPLE": "64"}),
}
_GOALS: Final = (1.05, 1.15, 1.03)


def _why_not(b: Bench) -> str | None:
    if b.gpu.name != "cuda":
        return f"skipped: the allocator doors need the cuda backend (this run is on {b.gpu.name})"
    for package in ("torch", "transformers"):
        if importlib.util.find_spec(package) is None:
            return f"skipped: {package} is not installed"
    return None


def _child(b: Bench, mode: str, steps: int, settings: dict[str, str]) -> dict[str, Any]:
    """One configuration's process: the bench's own ``pure`` and ``site_skip`` settings, the configuration's red
    zones, the bench's device alone; its JSON line, or a ``RuntimeError`` saying why there is none."""
    ours = b.gpu.settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    env.update({"METRALE_BACKEND": "cuda", "METRALE_PURE": "1" if ours.pure else "0",
                "METRALE_SITE_SKIP": ",".join(ours.site_skip) or "none", **settings})
    ordinal = b.gpu.ordinal
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(ordinal + 1)]
    if ordinal >= len(devices):
        raise RuntimeError(f"device {ordinal} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    env["CUDA_VISIBLE_DEVICES"] = devices[ordinal]
    done = subprocess.run([sys.executable, "-m", "metrale_core._commands.bench.generate", mode, str(steps)],
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{mode} exited with status {done.returncode}: {tail}")
    try:
        result: dict[str, Any] = json.loads(lines[-1])
        result["median_s"] = float(result["median_s"])
        result["torch"] = str(result.get("torch", "?"))
    except (ValueError, KeyError, TypeError) as exc:
        raise RuntimeError(f"{mode} printed no figure ({type(exc).__name__}: {lines[-1][:80]})") from None
    return result


def measure_frameworks(b: Bench) -> Result:
    """A transformers Llama's ``generate`` under torch's allocator and under metrale's, red zones on and off."""
    title = "a real model's generate, every tensor from metrale, against torch's own allocator"
    why = _why_not(b)
    if why is not None:
        return Result("frameworks", title, why, tuple(Figure(label, "torch", "us", None, note=why)
                                                      for label in _CONFIGS))
    rounds, steps = (1, 2) if b.quick else (3, 5)
    times: dict[str, list[float]] = {label: [] for label in _CONFIGS}
    allocs: float | None = None
    version = ""
    failed: dict[str, str] = {}
    for turn in range(rounds):
        for label, (mode, settings) in _CONFIGS.items():
            if label in failed:
                continue
            b.say(f"  round {turn + 1} of {rounds}: {label}")
            try:
                got = _child(b, mode, steps, settings)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                failed[label] = f"skipped: {exc}"
                continue
            times[label].append(got["median_s"])
            version = f"torch {got['torch']}"
            if got.get("allocs_per_generate") is not None:
                allocs = got["allocs_per_generate"]
    figures: list[Figure] = []
    for label, (mode, _) in _CONFIGS.items():
        source = version if mode == "torch" else "metrale"
        if label in failed or not times[label]:
            figures.append(Figure(label, source, "us", None, note=failed.get(label, "skipped: no figure")))
            continue
        figure = Figure(label, source, "us", statistics.median(times[label]) * 1e6)
        figures.append(figure if not figures or figures[0].value is None else compare(figure, figures[0]))
    b.say("  a planted overrun")
    found: float | None  # the goal's ratio: 1 reported, 0 not, None not run
    try:
        plant = _child(b, "plant", 1, {"METRALE_REDZONE": "4096", "METRALE_REDZONE_SAMPLE": "1"})
        found = 1.0 if plant.get("found") else 0.0
        said = (f"reported at {plant.get('reported_site')}" if found
                else f"not reported; the tensor came from {plant.get('planted_site')}")
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        found, said = None, f"not run: {exc}"
    goals = b.goals(
        Goal("the ledger on every tensor costs at most 5% of a generate", figures[1].ratio, _GOALS[0], at_most=True),
        Goal("red zones on every tensor cost at most 15%", figures[2].ratio, _GOALS[1], at_most=True),
        Goal("red zones on one tensor in 64 cost at most 3%", figures[3].ratio, _GOALS[2], at_most=True),
        Goal(f"a one-byte overrun past a torch tensor, by a kernel, is reported with its site ({said})",
             found, 1.0, at_most=False),
    )
    detail = (
        f"host time per generate (LlamaForCausalLM: 8 layers, hidden 1,024, random weights, bfloat16; 4 x 32 prompt "
        f"tokens, 32 new), median of {rounds} processes per configuration in turns, each the median of {steps} "
        f"generates after a warm-up" + (f"; {allocs:,.0f} tensors per generate" if allocs else "")
    )
    return Result("frameworks", title, detail, tuple(figures), goals)
