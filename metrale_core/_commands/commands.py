"""The bodies of the ``metrale`` commands: each imports what it uses when it runs.

- `table` and `print_json`: how a command prints rows and documents;
- `backends`, `info`, `stats`, `selftest`, `preflight`, `conformance`, `report`, `bench`, `settings`: one per
  command,
  each returning the exit status;
- `versions`: what ``metrale --version`` prints (no backend probed or opened).

Only `cli` imports this module, once a command is parsed: ``metrale --help`` loads none of it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

TYPE_CHECKING = False  # as typing.TYPE_CHECKING is (type checkers take it as True), without importing typing

if TYPE_CHECKING:
    from typing import Any

    from .._settings.model import MetraleSettings
    from ..kernels._ptx import PtxImage
    from .selftest import Check

__all__ = [
    "backends", "bench", "conformance", "info", "preflight", "print_json", "report", "selftest", "settings", "stats",
    "table", "versions",
]


def table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_json(doc: object) -> None:
    import json

    print(json.dumps(doc, indent=2, sort_keys=False))


def backends(settings: MetraleSettings, as_json: bool = False) -> int:
    from .._discovery import available_backends

    found = available_backends(settings).values()
    if as_json:
        print_json([{"name": i.name, "available": i.available, "distribution": i.distribution, "reason": i.reason}
                     for i in found])
        return 0
    rows = [("name", "available", "distribution", "reason")]
    for info in found:
        rows.append((info.name, "yes" if info.available else "no", info.distribution or "?", info.reason or ""))
    print(table(rows))
    return 0


def info(settings: MetraleSettings, as_json: bool = False) -> int:
    from .._discovery import open_backend
    from .._twins import describe
    from .._types import format_bytes

    with open_backend(settings=settings) as gpu:
        mem = gpu.memory_info()
        devices = _devices(gpu, settings)
        if as_json:
            print_json({
                "backend": gpu.name, "asked_for": settings.backend, "device": gpu.device_name, "ordinal": gpu.ordinal,
                "compute_capability": _capability(gpu), "memory_free": mem.free,
                "effective_free": mem.effective_free, "memory_total": mem.total, "integrated": mem.integrated,
                "scale_variant": settings.scale_variant, "target_hw": settings.target_hw,
                "redzone": settings.redzone, "graph_checks": gpu.redzone_checks if settings.redzone else None,
                "origin": gpu.origin.to_json(), "devices": devices, "code": describe(settings.pure),
            })
            return 0
        print(f"backend         {gpu.name} (asked for: {settings.backend})")
        print(f"device          {gpu.device_name} (ordinal {gpu.ordinal})")
        print(f"memory free     {format_bytes(mem.free)}")
        print(f"effective free  {format_bytes(mem.effective_free)}")
        print(f"memory total    {format_bytes(mem.total)}")
        print(f"integrated      {mem.integrated}")
        print(f"scale variant   {settings.scale_variant} (target_hw={settings.target_hw!r})")
        print(f"red zones       {settings.redzone} bytes" + (" (off)" if settings.redzone == 0 else ""))
        print(f"code            {describe(settings.pure)}")
        if settings.redzone:
            print(f"graph checks    {gpu.redzone_checks}")
        print(f"devices         {len(devices)}")
        for d in devices:
            total = format_bytes(d["memory_total"]) if d["memory_total"] is not None else "?"
            print(f"  {d['ordinal']}  {d['device']}  {total}  {d['device_uuid'] or d.get('error', '')}".rstrip())
    return 0


def _devices(gpu: Any, settings: MetraleSettings) -> list[dict[str, Any]]:
    """Every device the backend ``gpu`` is of can open here: its own, and each other ordinal opened for a
    moment (a device that fails to open is listed with why)."""
    from .._discovery import device_count, open_backend
    from .._errors import MetraleError

    listed: list[dict[str, Any]] = []
    for ordinal in range(device_count(gpu.name, settings=settings)):
        try:
            if ordinal == gpu.ordinal:
                name, total, uuid = gpu.device_name, gpu.memory_info().total, gpu.origin.device_uuid
            else:
                with open_backend(gpu.name, ordinal=ordinal, settings=settings) as other:
                    name, total, uuid = other.device_name, other.memory_info().total, other.origin.device_uuid
            listed.append({"ordinal": ordinal, "device": name, "memory_total": total, "device_uuid": uuid})
        except MetraleError as exc:
            listed.append({"ordinal": ordinal, "device": "?", "memory_total": None, "device_uuid": "",
                           "error": str(exc)})
    return listed


def _capability(gpu: Any) -> list[int] | None:
    from .._errors import MetraleError

    try:
        return list(gpu.compute_capability())
    except MetraleError:  # a backend that runs no kernels
        return None


def stats(settings: MetraleSettings, args: argparse.Namespace) -> int:
    """A saved snapshot's memory table; without one, a usage problem (exit 2): a backend opened here holds nothing."""
    import dataclasses
    from pathlib import Path

    if args.snapshot is None:  # a backend opened here would be empty: its zeros would say nothing
        print("metrale stats: needs a SNAPSHOT, a file of backend.save_snapshot(path) (METRALE_MEMORY_HISTORY keeps "
              "its history); inside the program, print(backend.memory_summary()) instead", file=sys.stderr)
        return 2
    from .._memory.pressure import memory_summary
    from .._reports.summary import snapshot_pools, snapshot_stats
    from .._reports.timeline import load_snapshot

    snapshot = load_snapshot(Path(args.snapshot))
    stats = snapshot_stats(snapshot)
    title = f"{snapshot.backend}:{snapshot.ordinal}, {snapshot.device} (snapshot {args.snapshot}, saved " \
            f"{snapshot.created})"
    live = list(snapshot.live)
    text = memory_summary(title, stats, live, None, top=args.top, pools=snapshot_pools(snapshot))
    doc: dict[str, Any] = {"snapshot": args.snapshot, "backend": snapshot.backend, "device": snapshot.device,
                           "ordinal": snapshot.ordinal}
    if args.json:
        from .._memory.records import largest_sites

        doc["stats"] = dataclasses.asdict(stats) | {"current_total_bytes": stats.current_total_bytes}
        doc["largest_live_sites"] = [{"site": site, "bytes": nbytes, "allocations": count}
                                     for site, nbytes, count in largest_sites(live, args.top)]
        print_json(doc)
    else:
        print(text)
    return 0


def _shown(value: object) -> str:
    """A setting's value (as ``model_dump(mode="json")`` writes it) as its variable would be written."""
    if value is None:
        return "unset"
    if value == "":
        return '""'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or "none"
    return str(value)


def settings(current: MetraleSettings, as_json: bool = False) -> int:
    """Every setting, the core's then each installed plugin's: its variable, its value, where it came from."""
    from .._settings.sources import ENVIRONMENT, setting_sources

    listed = setting_sources(current)
    if as_json:
        print_json([s.to_json() for s in listed])
        return 0
    rows = [("variable", "value", "from")]
    for s in listed:
        source = f"{s.source} ({s.variable})" if s.source == ENVIRONMENT else s.source
        rows.append((s.variable, _shown(s.value), source))
    print(table(rows))
    return 0


def selftest(settings: MetraleSettings, snapshot: str | None = None) -> int:
    from pathlib import Path

    from .selftest import run_selftest

    def report(check: Check) -> None:
        mark = "ok  " if check.ok else "FAIL"
        print(f"[{mark}] {check.name}: {check.detail}", flush=True)

    checks = run_selftest(settings, report, Path(snapshot) if snapshot else None)
    failed = [c for c in checks if not c.ok]
    print(f"selftest: {len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def preflight(settings: MetraleSettings, paths: Sequence[str]) -> int:
    from pathlib import Path

    from .._discovery import open_backend
    from ..kernels._ptx import parse_ptx

    images: dict[str, PtxImage] = {}
    stems = [Path(p).stem for p in paths]
    for path in paths:
        # the module is named by its file's stem, or by its path where two files share a stem
        name = Path(path).stem if stems.count(Path(path).stem) == 1 else path
        try:
            images[name] = parse_ptx(name, Path(path).read_bytes())
        except OSError as exc:
            print(f"metrale preflight: cannot read {path}: {exc.strerror}", file=sys.stderr)
            return 2
    with open_backend(settings=settings) as gpu:
        capability = gpu.compute_capability()
        device = gpu.device_name
    rows = [("module", "target", f"on {device} (sm_{capability[0]}{capability[1]})")]
    refused = 0
    for name, image in images.items():
        problems = image.feature_problems()
        ok = image.runs_on(capability) and not problems
        refused += not ok
        why = f"REFUSED: {problems[0]}" if problems else f"REFUSED: needs {image.requirement()}"
        rows.append((name, image.target, "ok" if ok else why))
    print(table(rows))
    print(f"preflight: {len(images) - refused} ok, {refused} refused")
    return 1 if refused else 0


def conformance(settings: MetraleSettings, args: argparse.Namespace) -> int:
    from .conformance import run_conformance
    from .progress import Progress

    with Progress("programs") as bar:
        def progress(line: str) -> None:
            if bar.plain:
                bar.note(f"  ... {line}")

        report = run_conformance(
            args.name, settings, examples=args.examples, steps=args.steps, seed=args.seed,
            budget_s=args.budget or None, progress=progress, step=None if bar.plain else bar.step,
        )
    if args.json:
        print_json(report.to_json())
    else:
        print(report.render())
    return 0 if report.ok else 1


def report(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .._errors import MissingPackageError
    from .._reports.summary import snapshot_summary
    from .._reports.timeline import chrome_trace, load_snapshot, plot_html, plot_png

    snapshots = [load_snapshot(Path(path)) for path in args.snapshot]
    if len(snapshots) == 1:
        snapshot = snapshots[0]
    else:
        from .._reports.merge import merge_reports, merge_snapshots

        snapshot = merge_snapshots(snapshots)
    if args.trace is None and args.png is None and args.html is None and args.torch_snapshot is None:
        if len(snapshots) > 1:
            print(merge_reports(snapshots, top=args.top).render())
            print()
        print(snapshot_summary(snapshot, args.top, table))
        return 0
    out = args.trace
    try:
        if args.trace is not None:
            Path(args.trace).write_text(json.dumps(chrome_trace(snapshot, args.top)) + "\n", encoding="utf-8")
            print(f"wrote timeline: {args.trace} (open it in https://ui.perfetto.dev)")
        out = args.png
        if args.png is not None:
            plot_png(snapshot, Path(args.png), args.top)
            print(f"wrote plot: {args.png}")
        out = args.html
        if args.html is not None:
            plot_html(snapshot, Path(args.html), args.top)
            print(f"wrote interactive timeline: {args.html} (open it in a browser; it needs no network)")
        out = args.torch_snapshot
        if args.torch_snapshot is not None:
            from .._reports.torch_snapshot import device_notes, write_torch_snapshot

            written = write_torch_snapshot(snapshots, Path(args.torch_snapshot))
            print(f"wrote PyTorch memory snapshot: {args.torch_snapshot} (open it in https://pytorch.org/memory_viz)")
            for line in device_notes(written):
                print(f"  {line}")
    except OSError as exc:
        print(f"metrale report: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except MissingPackageError as exc:  # its own message: a package to install, not a bad setting
        print(f"metrale report: {exc}", file=sys.stderr)
        return 1
    return 0


def bench(settings: MetraleSettings, args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .bench import MEASUREMENTS, pick, run_bench

    if args.list:
        print(table([("measurement", "what it times")] + [(m.name, m.title) for m in MEASUREMENTS]))
        return 0
    pick(args.only)  # an unknown name is refused before a backend opens

    from .progress import Progress

    with Progress("measurements") as bar:
        def progress(line: str) -> None:
            if bar.plain:
                bar.note(line)

        report = run_bench(settings, only=args.only, quick=args.quick, progress=progress,
                           step=None if bar.plain else bar.step)
    print(report.text())
    if args.json:
        path = Path(args.json)
        path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        print(f"\nwrote {path}")
    return 0


def versions() -> str:
    """What ``metrale --version`` prints: metrale-core's version, each backend plugin's distribution and version
    (the entry points of ``metrale.backends``), and what each plugin's ``versions()`` reports of what it runs on
    (cuda-bindings and the CUDA driver, for the CUDA backend). No backend is probed or opened."""
    import platform

    from .. import __version__
    from .._discovery import INSTALL_ADVICE, _discover_with_plugins
    from .._settings.model import MetraleSettings
    from .._settings.plugins import backend_entry_points
    from .._twins import describe

    try:
        pure = MetraleSettings().pure
    except Exception:  # a bad setting: said below, where the plugins are loaded
        pure = False
    lines = [f"metrale-core {__version__} (Python {platform.python_version()})", f"  code: {describe(pure)}"]
    by_name = backend_entry_points()
    if not by_name:
        lines.append(f"backends: none installed; install one: {INSTALL_ADVICE}")
        return "\n".join(lines)
    try:  # "" names no backend: every plugin is loaded and registered, none is probed (a probe may load a driver)
        found = _discover_with_plugins(MetraleSettings(), only_probe="")[0]
    except Exception as exc:  # a bad setting: the distributions are still listed
        found = {}
        lines.append(f"backends: plugins not loaded: {type(exc).__name__}: {' '.join(str(exc).split())}")
    for name, eps in sorted(by_name.items()):
        dists = sorted({f"{ep.dist.name} {ep.dist.version}" if ep.dist else "?" for ep in eps})
        lines.append(f"backend {name}: {', '.join(dists)}")
        entry = found.get(name)
        if entry is None:
            continue
        if entry.registration is None:
            lines.append(f"  not loaded: {entry.info.reason}")
            continue
        try:
            reported = dict(entry.registration.versions())
        except Exception as exc:
            lines.append(f"  versions: its versions() raised {type(exc).__name__}: {exc}")
            continue
        lines.extend(f"  {key}: {value}" for key, value in reported.items())
    return "\n".join(lines)
