"""The ``frameworks`` measurement: a real model's ``generate`` with every tensor from metrale, against torch's own
caching allocator, in one run.

- Each configuration is a process of its own (`generate`): torch's allocator can be changed only before torch
  first uses CUDA. The configurations take turns, round by round; each figure is the median of its rounds.
- Configurations: torch's caching allocator; metrale's pool with the ledger on every tensor; 4 KiB red zones on
  every tensor; on one tensor in 64. Then a planted one-byte overrun, reported with the tensor's site or not.
- Graphs: the model's forward captured with ``torch.cuda.graph`` and replayed, under torch's allocator and under
  metrale's door with 4 KiB zones on every tensor, in turns; an overrun planted inside the captured graph (a memset
  node), reported with the tensor's site or not; an out-of-memory under the door, raised as torch's error and
  followed by an allocation that is served.
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
_REPLAY: Final = "forward replayed from a torch.cuda.graph, torch's caching allocator"
#: label -> (mode, settings): a captured forward's replay, torch's allocator against the zoned door
_GRAPHS: Final[dict[str, tuple[str, dict[str, str]]]] = {
    _REPLAY: ("graph-torch", {}),
    "forward replayed from a torch.cuda.graph, 4 KiB red zones on every tensor": (
        "graph-metrale", {"METRALE_REDZONE": "4096", "METRALE_REDZONE_SAMPLE": "1"}),
}
_ZONED: Final = {"METRALE_REDZONE": "4096", "METRALE_REDZONE_SAMPLE": "1"}


def _why_not(b: Bench) -> str | None:
    if b.gpu.name != "cuda":
        return f"skipped: the allocator doors need the cuda backend (this run is on {b.gpu.name})"
    for package in ("torch", "transformers"):
        if importlib.util.find_spec(package) is None:
            return f"skipped: {package} is not installed"
    return None


def _planted(b: Bench, mode: str) -> tuple[float | None, str]:
    """A planted overrun's process (``plant``, ``graph-plant``): 1.0 where it was reported with the tensor's site, 0.0
    where not, ``None`` where it did not run; and what to say."""
    try:
        plant = _child(b, mode, 1, _ZONED)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return None, f"not run: {exc}"
    if plant.get("found"):
        return 1.0, f"reported at {plant.get('reported_site')}"
    return 0.0, f"not reported; the tensor came from {plant.get('planted_site')}"


def _replays(b: Bench, rounds: int, steps: int) -> list[Figure]:
    """The captured forward's replay under torch's allocator and the zoned door, in turns: two figures."""
    times: dict[str, list[float]] = {label: [] for label in _GRAPHS}
    failed: dict[str, str] = {}
    for turn in range(rounds):
        for label, (mode, settings) in _GRAPHS.items():
            if label not in failed:
                b.say(f"  round {turn + 1} of {rounds}: {label}")
                try:
                    times[label].append(_child(b, mode, steps, settings)["median_s"])
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    failed[label] = f"skipped: {exc}"
    figures: list[Figure] = []
    for label, (mode, _) in _GRAPHS.items():
        source = "torch" if mode == "graph-torch" else "metrale"
        if not times[label]:
            figures.append(Figure(label, source, "us", None, note=failed.get(label, "skipped: no figure")))
            continue
        figure = Figure(label, source, "us", statistics.median(times[label]) * 1e6)
        figures.append(figure if not figures or figures[0].value is None else compare(figure, figures[0]))
    return figures


def _child(b: Bench, mode: str, steps: int, settings: dict[str, str], *, figure: bool = True) -> dict[str, Any]:
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
        if figure:
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
                                                      for label in (*_CONFIGS, *_GRAPHS)))
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
    found, said = _planted(b, "plant")
    graphs = _replays(b, rounds, steps)
    figures += graphs
    b.say("  an overrun planted inside a captured graph")
    found_in_graph, said_in_graph = _planted(b, "graph-plant")
    b.say("  an out-of-memory under the door")
    try:
        oom = _child(b, "oom", 1, {}, figure=False)
        raised = 1.0 if oom.get("raised") and oom.get("next_served") else 0.0
        said_oom = f"{oom.get('raised')}; the next allocation served: {oom.get('next_served')}"
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        raised, said_oom = None, f"not run: {exc}"
    goals = b.goals(
        Goal("the ledger on every tensor costs at most 5% of a generate", figures[1].ratio, _GOALS[0], at_most=True),
        Goal("red zones on every tensor cost at most 15%", figures[2].ratio, _GOALS[1], at_most=True),
        Goal("red zones on one tensor in 64 cost at most 3%", figures[3].ratio, _GOALS[2], at_most=True),
        Goal(f"a one-byte overrun past a torch tensor, by a kernel, is reported with its site ({said})",
             found, 1.0, at_most=False),
        Goal("a captured forward's replay with red zones on every tensor costs at most 5%", graphs[1].ratio, 1.05,
             at_most=True),
        Goal(f"an overrun inside a captured graph is reported with the tensor's site ({said_in_graph})",
             found_in_graph, 1.0, at_most=False),
        Goal(f"an out-of-memory under the door is torch's error, and the next allocation is served ({said_oom})",
             raised, 1.0, at_most=False),
    )
    detail = (
        f"host time per generate (LlamaForCausalLM: 8 layers, hidden 1,024, random weights, bfloat16; 4 x 32 prompt "
        f"tokens, 32 new), median of {rounds} processes per configuration in turns, each the median of {steps} "
        f"generates after a warm-up" + (f"; {allocs:,.0f} tensors per generate" if allocs else "")
    )
    return Result("frameworks", title, detail, tuple(figures), goals)
