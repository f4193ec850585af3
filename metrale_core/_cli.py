"""The ``metrale`` command line: ``backends``, ``info``, ``selftest``, ``preflight``, ``conformance``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from ._discovery import available_backends, open_backend
from ._errors import ConfigError, MetraleError
from ._ledger import format_bytes
from ._ptx import PtxImage, parse_ptx
from ._selftest import Check, run_selftest
from ._settings import MetraleSettings

__all__ = ["main"]


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _backends(settings: MetraleSettings) -> int:
    rows = [("name", "available", "distribution", "reason")]
    for info in available_backends(settings).values():
        rows.append((info.name, "yes" if info.available else "no", info.distribution or "?", info.reason or ""))
    print(_table(rows))
    return 0


def _info(settings: MetraleSettings) -> int:
    with open_backend(settings=settings) as gpu:
        mem = gpu.memory_info()
        print(f"backend         {gpu.name} (asked for: {settings.backend})")
        print(f"device          {gpu.device_name} (ordinal {gpu.ordinal})")
        print(f"memory free     {format_bytes(mem.free)}")
        print(f"effective free  {format_bytes(mem.effective_free)}")
        print(f"memory total    {format_bytes(mem.total)}")
        print(f"integrated      {mem.integrated}")
        print(f"scale variant   {settings.scale_variant} (target_hw={settings.target_hw!r})")
        print(f"red zones       {settings.redzone} bytes" + (" (off)" if settings.redzone == 0 else ""))
    return 0


def _selftest(settings: MetraleSettings) -> int:
    def report(check: Check) -> None:
        mark = "ok  " if check.ok else "FAIL"
        print(f"[{mark}] {check.name}: {check.detail}", flush=True)

    checks = run_selftest(settings, report)
    failed = [c for c in checks if not c.ok]
    print(f"selftest: {len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _preflight(settings: MetraleSettings, paths: Sequence[str]) -> int:
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
        ok = image.runs_on(capability)
        refused += not ok
        rows.append((name, image.target, "ok" if ok else f"REFUSED: needs {image.requirement()}"))
    print(_table(rows))
    print(f"preflight: {len(images) - refused} ok, {refused} refused")
    return 1 if refused else 0


def _conformance(settings: MetraleSettings, args: argparse.Namespace) -> int:
    from ._conformance import run_conformance

    def progress(line: str) -> None:
        print(f"  ... {line}", file=sys.stderr, flush=True)

    report = run_conformance(
        args.name, settings, examples=args.examples, steps=args.steps, seed=args.seed, progress=progress
    )
    print(report.render())
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``metrale`` console script."""
    parser = argparse.ArgumentParser(prog="metrale", description="metrale: a backend-neutral GPU runtime")
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO messages of metrale")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help="list every discovered backend and whether it can run here")
    sub.add_parser("info", help="the chosen backend, its device and memory")
    sub.add_parser("selftest", help="run a representative workload and check every step")
    pre = sub.add_parser("preflight", help="check PTX files against the device's architecture, loading nothing")
    pre.add_argument("paths", nargs="+", metavar="PATH", help="PTX files (the module name is the file's stem)")
    conf = sub.add_parser(
        "conformance", help="run the conformance state machine and the bad-input table against a backend"
    )
    conf.add_argument("name", help="the backend's name, as `metrale backends` lists it")
    conf.add_argument("--examples", type=int, default=50, help="programs the state machine runs (default 50)")
    conf.add_argument("--steps", type=int, default=30, help="steps per program (default 30)")
    conf.add_argument("--seed", type=int, default=None, help="random programs from this seed (default: derandomized)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = MetraleSettings()
    except ConfigError as exc:
        print(f"metrale: {exc}", file=sys.stderr)
        return 2
    commands = {"backends": _backends, "info": _info, "selftest": _selftest}
    try:
        if args.command == "preflight":
            return _preflight(settings, args.paths)
        if args.command == "conformance":
            return _conformance(settings, args)
        return commands[args.command](settings)
    except MetraleError as exc:
        print(f"metrale {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
