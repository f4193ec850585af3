"""The ``metrale`` command line: ``backends``, ``info``, ``stats``, ``selftest``, ``preflight``, ``conformance``,
``report``, ``bench``.

Start-up is kept short: a command imports what it uses when it runs (``--help`` imports neither pydantic
nor a backend), and a subcommand's own arguments are declared only when that subcommand is parsed or its
help is shown.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

TYPE_CHECKING = False  # as typing.TYPE_CHECKING is (type checkers take it as True), without importing typing

if TYPE_CHECKING:
    from typing import Any

    from .._reports.timeline import MemorySnapshot
    from .._settings.model import MetraleSettings
    from ..kernels._ptx import PtxImage
    from .selftest import Check

__all__ = ["main"]


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _print_json(doc: object) -> None:
    import json

    print(json.dumps(doc, indent=2, sort_keys=False))


def _backends(settings: MetraleSettings, as_json: bool = False) -> int:
    from .._discovery import available_backends

    found = available_backends(settings).values()
    if as_json:
        _print_json([{"name": i.name, "available": i.available, "distribution": i.distribution, "reason": i.reason}
                     for i in found])
        return 0
    rows = [("name", "available", "distribution", "reason")]
    for info in found:
        rows.append((info.name, "yes" if info.available else "no", info.distribution or "?", info.reason or ""))
    print(_table(rows))
    return 0


def _info(settings: MetraleSettings, as_json: bool = False) -> int:
    from .._discovery import open_backend
    from .._types import format_bytes

    with open_backend(settings=settings) as gpu:
        mem = gpu.memory_info()
        devices = _devices(gpu, settings)
        if as_json:
            _print_json({
                "backend": gpu.name, "asked_for": settings.backend, "device": gpu.device_name, "ordinal": gpu.ordinal,
                "compute_capability": _capability(gpu), "memory_free": mem.free,
                "effective_free": mem.effective_free, "memory_total": mem.total, "integrated": mem.integrated,
                "scale_variant": settings.scale_variant, "target_hw": settings.target_hw,
                "redzone": settings.redzone, "graph_checks": gpu.redzone_checks if settings.redzone else None,
                "origin": gpu.origin.to_json(), "devices": devices,
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


def _snapshot_stats(snapshot: MemorySnapshot, model: Any) -> Any:
    """The `MemoryStats` a snapshot's free-form ``stats`` hold: a counter it does not give is 0 (a map,
    empty), as a snapshot of an older version has fewer; a counter of the wrong type is a ``SnapshotError``."""
    import dataclasses
    import json

    from .._errors import SnapshotError

    values: dict[str, Any] = {}
    for field in dataclasses.fields(model):
        value = snapshot.stats.get(field.name)
        mapping = field.type in ("dict[str, int]", dict[str, int])
        if value is None:
            values[field.name] = {} if mapping else 0
            continue
        good = (
            isinstance(value, dict) and all(isinstance(k, str) and type(v) is int for k, v in value.items())
            if mapping else type(value) is int
        )
        if not good:
            need = "a map of kinds to byte counts" if mapping else "an integer"
            raise SnapshotError(
                f"{snapshot.name}: stats field {field.name!r} must be {need}, not {json.dumps(value)[:60]}; the "
                f"file is damaged or was not written by metrale",
                path=snapshot.source,
            )
        values[field.name] = dict(value) if mapping else value
    return model(**values)


def _stats(settings: MetraleSettings, args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    if args.snapshot is not None:
        from .._device.stats import MemoryStats
        from .._memory.pressure import memory_summary
        from .._reports.timeline import load_snapshot

        snapshot = load_snapshot(Path(args.snapshot))
        stats = _snapshot_stats(snapshot, MemoryStats)
        title = f"{snapshot.backend}:{snapshot.ordinal}, {snapshot.device} (snapshot {args.snapshot}, saved " \
                f"{snapshot.created})"
        live = list(snapshot.live)
        text = memory_summary(title, stats, live, None, top=args.top)
        doc: dict[str, Any] = {"snapshot": args.snapshot, "backend": snapshot.backend, "device": snapshot.device,
                               "ordinal": snapshot.ordinal}
    else:
        from .._discovery import open_backend

        with open_backend(settings=settings) as gpu:
            stats = gpu.stats()
            text = gpu.memory_summary(args.top)
            live = gpu.ledger_probe().records()
            doc = {"backend": gpu.name, "device": gpu.device_name, "ordinal": gpu.ordinal}
    if args.json:
        from .._memory.ledger import largest_sites

        doc["stats"] = dataclasses.asdict(stats) | {"current_total_bytes": stats.current_total_bytes}
        doc["largest_live_sites"] = [{"site": site, "bytes": nbytes, "allocations": count}
                                     for site, nbytes, count in largest_sites(live, args.top)]
        _print_json(doc)
    else:
        print(text)
    return 0


def _selftest(settings: MetraleSettings, snapshot: str | None = None) -> int:
    from pathlib import Path

    from .selftest import run_selftest

    def report(check: Check) -> None:
        mark = "ok  " if check.ok else "FAIL"
        print(f"[{mark}] {check.name}: {check.detail}", flush=True)

    checks = run_selftest(settings, report, Path(snapshot) if snapshot else None)
    failed = [c for c in checks if not c.ok]
    print(f"selftest: {len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _preflight(settings: MetraleSettings, paths: Sequence[str]) -> int:
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
    print(_table(rows))
    print(f"preflight: {len(images) - refused} ok, {refused} refused")
    return 1 if refused else 0


def _conformance(settings: MetraleSettings, args: argparse.Namespace) -> int:
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
        _print_json(report.to_json())
    else:
        print(report.render())
    return 0 if report.ok else 1


def _report_summary(snapshot: MemorySnapshot, top: int) -> None:
    from .._reports.timeline import format_time, live_by_site
    from .._types import format_bytes

    timeline = live_by_site(snapshot, top)
    print(f"snapshot   {snapshot.source or 'several, merged'} (saved {snapshot.created})")
    print(f"device     {snapshot.backend} on {snapshot.device} (ordinal {snapshot.ordinal})")
    rows: list[tuple[str, ...]]
    live = f"{format_bytes(sum(a.nbytes for a in snapshot.live))} in {len(snapshot.live)} allocation(s)"
    if not snapshot.events:
        why = "history recording was off: set METRALE_MEMORY_HISTORY" if snapshot.history_limit == 0 else "none kept"
        print(f"events     0 ({why})")
        print(f"live       {live} when saved")
        rows = [("call site", "live when saved")]
        for label, values in zip(timeline.labels, timeline.series, strict=True):
            rows.append((label, format_bytes(values[0])))
    else:
        dropped = f", {snapshot.dropped} older dropped" if snapshot.dropped else ""
        print(f"events     {len(snapshot.events)} (history limit {snapshot.history_limit}{dropped})")
        step, end = timeline.peak_step, timeline.times[-1]
        peak = f"peak live  {format_bytes(timeline.totals[step])}"
        if step == 0:
            print(f"{peak} before the first event")
        else:
            event = snapshot.events[step - 1]
            what = f"{'an' if event.op == 'alloc' else 'a'} {event.op} of {format_bytes(event.allocation.nbytes)}"
            print(f"{peak} at {format_time(timeline.times[step], end)} (after events[{step - 1}], {what} at "
                  f"{event.allocation.site})")
        print(f"live       {live} when saved")
        rows = [("call site", "peak", "at", "live when saved")]
        for label, values in zip(timeline.labels, timeline.series, strict=True):
            high = max(range(len(values)), key=lambda i: (values[i], -i))
            rows.append((label, format_bytes(values[high]), format_time(timeline.times[high], end),
                         format_bytes(values[-1])))
    if timeline.labels:
        print()
        print(_table(rows))


def _report(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .._reports.timeline import chrome_trace, load_snapshot, plot_html, plot_png

    snapshots = [load_snapshot(Path(path)) for path in args.snapshot]
    if len(snapshots) == 1:
        snapshot = snapshots[0]
    else:
        from .._reports.merge import merge_reports, merge_snapshots

        snapshot = merge_snapshots(snapshots)
    if args.trace is None and args.png is None and args.html is None:
        if len(snapshots) > 1:
            print(merge_reports(snapshots, top=args.top).render())
            print()
        _report_summary(snapshot, args.top)
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
    except OSError as exc:
        print(f"metrale report: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


def _bench(settings: MetraleSettings, args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .bench import MEASUREMENTS, pick, run_bench

    if args.list:
        print(_table([("measurement", "what it times")] + [(m.name, m.title) for m in MEASUREMENTS]))
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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds, 0 or more, not {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number, at least 1, not {text!r}")
    return value


class _Command(argparse.ArgumentParser):
    """A subcommand's parser: ``declare`` adds its arguments the first time it parses or shows its help,
    so ``metrale --help`` and every other command skip the imports that its defaults need."""

    def __init__(self, *args: Any, declare: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._declare = declare

    def _declared(self) -> None:
        declare, self._declare = self._declare, None
        if declare is not None:
            declare(self)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        self._declared()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._declared()
        return super().format_usage()

    def format_help(self) -> str:
        self._declared()
        return super().format_help()


def _selftest_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--snapshot", metavar="PATH", help="keep the ledger's history and save a memory snapshot here (metrale report)"
    )


def _preflight_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH", help="PTX files (the module name is the file's stem)")


def _conformance_arguments(parser: argparse.ArgumentParser) -> None:
    from .conformance import DEFAULT_BUDGET_S, DEFAULT_EXAMPLES, DEFAULT_STEPS

    parser.add_argument("name", help="the backend's name, as `metrale backends` lists it")
    parser.add_argument(
        "--examples", type=_positive, default=DEFAULT_EXAMPLES, metavar="N",
        help=f"programs the state machine runs before it shrinks a failure (default {DEFAULT_EXAMPLES})",
    )
    parser.add_argument("--steps", type=_positive, default=DEFAULT_STEPS, metavar="N",
                        help=f"steps per program (default {DEFAULT_STEPS})")
    parser.add_argument("--seed", type=int, default=None, help="random programs from this seed (default: derandomized)")
    parser.add_argument(
        "--budget", type=_seconds, default=DEFAULT_BUDGET_S, metavar="SECONDS",
        help=f"time the state machine may take, shrinking included; no program starts after it "
        f"(default {DEFAULT_BUDGET_S:g}; 0: no limit)",
    )
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")


def _json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print it as JSON, for scripts")


def _stats_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("snapshot", nargs="?", metavar="SNAPSHOT",
                        help="a file of backend.save_snapshot(path); without it, the configured backend as it opens")
    parser.add_argument("--top", type=_positive, default=5, metavar="N", help="live call sites listed (default 5)")
    _json_argument(parser)


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("snapshot", metavar="SNAPSHOT", nargs="+",
                        help="a file written by backend.save_snapshot(path); several (one per rank) merge into one "
                        "report, each call site named by its rank")
    parser.add_argument("--trace", metavar="OUT.json",
                        help="write a Chrome trace-event timeline (Perfetto, chrome://tracing)")
    parser.add_argument("--png", metavar="OUT.png", help="write a stacked plot of live memory (needs matplotlib)")
    parser.add_argument("--html", metavar="OUT.html",
                        help="write an interactive timeline, for a browser with no network (needs plotly)")
    parser.add_argument("--top", type=_positive, default=8, metavar="N",
                        help="call sites shown on their own (default 8)")


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", metavar="NAMES", help="comma-separated measurements to run (see --list)")
    parser.add_argument("--json", metavar="PATH", help="also write the results, versions and device as JSON")
    parser.add_argument("--quick", action="store_true", help="a few small rounds: a smoke run, figures mean little")
    parser.add_argument("--list", action="store_true", help="list the measurements and exit")


def _versions() -> str:
    """What ``metrale --version`` prints: metrale-core's version, each backend plugin's distribution and version
    (the entry points of ``metrale.backends``), and what each plugin's ``versions()`` reports of what it runs on
    (cuda-bindings and the CUDA driver, for the CUDA backend). No backend is probed or opened."""
    import platform

    from .. import __version__
    from .._discovery import INSTALL_ADVICE, _discover_with_plugins
    from .._settings.model import MetraleSettings
    from .._settings.plugins import backend_entry_points

    lines = [f"metrale-core {__version__} (Python {platform.python_version()})"]
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


class _Version(argparse.Action):
    """``--version``: print ``_versions()`` and exit (before a command is asked for; nothing imported early)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(_versions(), flush=True)
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metrale", description="metrale: a backend-neutral GPU runtime")
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO messages of metrale")
    parser.add_argument("--version", action=_Version,
                        help="print the versions of metrale-core, each backend plugin, cuda-bindings and the driver")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Command)
    sub.add_parser("backends", help="list every discovered backend and whether it can run here",
                   declare=_json_argument)
    sub.add_parser("info", help="the chosen backend, its device and memory", declare=_json_argument)
    sub.add_parser("stats", help="a table of memory: current, peak and allocated by kind, counts, the largest live "
                   "call sites (of a saved snapshot, or of the configured backend)", declare=_stats_arguments)
    sub.add_parser("selftest", help="run a representative workload and check every step", declare=_selftest_arguments)
    sub.add_parser("preflight", help="check PTX files against the device's architecture, loading nothing",
                   declare=_preflight_arguments)
    sub.add_parser("conformance", help="run the conformance state machine and the bad-input table against a backend",
                   declare=_conformance_arguments)
    sub.add_parser("report", help="a saved memory snapshot as a Perfetto timeline, a plot or an interactive HTML "
                   "timeline of live memory by call site", declare=_report_arguments)
    sub.add_parser("bench", help="time metrale's operations next to the raw driver, CuPy and PyTorch; print medians "
                   "and ratios", declare=_bench_arguments)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``metrale`` console script."""
    args = _parser().parse_args(argv)
    import logging

    from .._errors import ConfigError, MetraleError
    from .._settings.model import MetraleSettings

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = MetraleSettings()
    except ConfigError as exc:
        print(f"metrale: {exc}", file=sys.stderr)
        return 2
    commands = {"backends": _backends, "info": _info}
    try:
        if args.command == "stats":
            return _stats(settings, args)
        if args.command == "preflight":
            return _preflight(settings, args.paths)
        if args.command == "conformance":
            return _conformance(settings, args)
        if args.command == "report":
            return _report(args)
        if args.command == "bench":
            return _bench(settings, args)
        if args.command == "selftest":
            return _selftest(settings, args.snapshot)
        return commands[args.command](settings, args.json)
    except MetraleError as exc:
        print(f"metrale {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
