"""The ``metrale`` command line: ``backends``, ``info``, ``stats``, ``selftest``, ``preflight``, ``conformance``,
``report``, ``bench``, ``run``, ``settings``.

- The parser and the dispatch live here; each command's body is in `commands`, imported once parsed.
- Start-up is kept short: ``--help`` imports neither pydantic nor a backend.
- A subcommand declares its own arguments only when it is parsed or its help is shown.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

TYPE_CHECKING = False  # as typing.TYPE_CHECKING is (type checkers take it as True), without importing typing

if TYPE_CHECKING:
    from typing import Any

__all__ = ["main"]


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
                        help="a file of backend.save_snapshot(path) (needed: inside the program, print "
                        "backend.memory_summary() instead)")
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
    parser.add_argument("--torch-snapshot", metavar="OUT.pickle",
                        help="write the pickle torch.cuda.memory._dump_snapshot writes, for "
                        "https://pytorch.org/memory_viz (a device per snapshot)")
    parser.add_argument("--top", type=_positive, default=8, metavar="N",
                        help="call sites shown on their own (default 8)")


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", metavar="NAMES", help="comma-separated measurements to run (see --list)")
    parser.add_argument("--json", metavar="PATH", help="also write the results, versions and device as JSON")
    parser.add_argument("--quick", action="store_true", help="a few small rounds: a smoke run, figures mean little")
    parser.add_argument("--list", action="store_true", help="list the measurements and exit")


def _size(text: str) -> int:
    import pydantic

    from .._settings.parsing import Size

    try:
        value: int = pydantic.TypeAdapter(Size).validate_python(text)
    except pydantic.ValidationError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a size in bytes (4096, 4KiB, 0x1000), not {text!r}")
    return value


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--torch", action="store_true",
                        help="allocate PyTorch's CUDA tensors from a metrale pool (metrale_core.allocators.torch)")
    parser.add_argument("--cupy", action="store_true",
                        help="allocate CuPy's arrays from a metrale pool (metrale_core.allocators.cupy)")
    parser.add_argument("--redzone", type=_size, default=None, metavar="BYTES",
                        help="red zones of this many bytes (the redzone setting; 0: off)")
    parser.add_argument("--top", type=_positive, default=10, metavar="N",
                        help="call sites listed in the report (default 10)")
    parser.add_argument("script", metavar="SCRIPT", help="the Python script, run as `python SCRIPT ARGS...` runs it")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments")


def _backend_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", metavar="NAME",
                        help="the backend to open, as `metrale backends` lists it, or auto (overrides METRALE_BACKEND)")


def _with_backend(declare: Callable[[argparse.ArgumentParser], None] | None = None,
                  ) -> Callable[[argparse.ArgumentParser], None]:
    """``declare``, then ``--backend``: for a command that opens a backend."""

    def declare_both(parser: argparse.ArgumentParser) -> None:
        if declare is not None:
            declare(parser)
        _backend_argument(parser)

    return declare_both


_BACKEND = "METRALE_BACKEND: the backend opened (a name, or auto; --backend overrides it)"
_REDZONES = ("METRALE_REDZONE (red zones of this many bytes after each allocation; 0: off), "
             "METRALE_REDZONE_ACTION (warn or raise), METRALE_REDZONE_SAMPLE, METRALE_REDZONE_LEAD")


def _epilog(*variables: str) -> str:
    """A subcommand's epilog: the ``METRALE_*`` variables that matter to it, and where every setting is listed."""
    return ("environment: " + "; ".join(variables) + ". Every setting: docs/settings.md, or `metrale settings` "
            "(its value here and where it came from).")


class _Version(argparse.Action):
    """``--version``: print ``commands.versions()`` and exit (before a command is asked for; nothing imported early)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        from .commands import versions

        print(versions(), flush=True)
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metrale", description="metrale: a backend-neutral GPU runtime")
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO messages of metrale")
    parser.add_argument("--version", action=_Version,
                        help="print the versions of metrale-core, each backend plugin, cuda-bindings and the driver")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Command)
    commands: list[tuple[str, str, Callable[[argparse.ArgumentParser], None] | None, tuple[str, ...]]] = [
        ("backends", "list every discovered backend and whether it can run here", _json_argument,
         ("METRALE_BACKEND: not read (every backend is listed)",
          "each plugin's own METRALE_<NAME>_* (METRALE_FAKE_MEMORY_BYTES)")),
        ("info", "the chosen backend, its device and memory", _with_backend(_json_argument),
         (_BACKEND, "METRALE_REDZONE (shown)", "METRALE_TARGET_HW", "METRALE_PURE")),
        ("stats", "a table of memory: current, peak and allocated by kind, counts, the largest live call sites, of a "
         "saved snapshot", _stats_arguments,
         ("METRALE_BACKEND: not read (the snapshot names its backend)",
          "METRALE_MEMORY_HISTORY, of the program that saves the snapshot")),
        ("selftest", "run a representative workload and check every step", _with_backend(_selftest_arguments),
         (_BACKEND, _REDZONES + " (red zones of 256 bytes where METRALE_REDZONE is 0)", "METRALE_MEMORY_HISTORY")),
        ("preflight", "check PTX files against the device's architecture, loading nothing",
         _with_backend(_preflight_arguments), (_BACKEND, "METRALE_TARGET_HW")),
        ("conformance", "run the conformance state machine and the bad-input table against a backend",
         _conformance_arguments,
         ("METRALE_BACKEND: not read (the NAME argument picks the backend)", "each plugin's METRALE_<NAME>_*")),
        ("report", "a saved memory snapshot as a Perfetto timeline, a plot, an interactive HTML timeline of live "
         "memory by call site, or PyTorch's memory snapshot", _report_arguments,
         ("METRALE_BACKEND: not read (the snapshot names its backend)",
          "METRALE_MEMORY_HISTORY and METRALE_MEMORY_HISTORY_FRAMES, of the program that saves the snapshot")),
        ("bench", "time metrale's operations next to the raw driver, CuPy and PyTorch; print medians and ratios",
         _with_backend(_bench_arguments),
         (_BACKEND, _REDZONES + " (red zones slow every allocation)", "METRALE_KERNEL_TIMING", "METRALE_PURE")),
        ("run", "run a Python script under metrale (its torch and CuPy tensors on the ledger with --torch, --cupy), "
         "then report leaks, red-zone violations and the peak; exits with the script's status",
         _with_backend(_run_arguments),
         (_BACKEND, _REDZONES + " (--redzone overrides METRALE_REDZONE)", "METRALE_MEMORY_HISTORY",
          "METRALE_SITE_SKIP")),
        ("settings", "list every setting, the core's and each installed plugin's: its variable, its value here and "
         "where it came from", _json_argument,
         ("every METRALE_* variable, METRALE_BACKEND among them", "an empty variable counts as unset")),
    ]
    for name, summary, declare, variables in commands:
        sub.add_parser(name, help=summary, description=f"metrale {name}: {summary}.", epilog=_epilog(*variables),
                       declare=declare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``metrale`` console script."""
    args = _parser().parse_args(argv)
    import logging

    from .._errors import ConfigError, MetraleError, MissingPackageError
    from .._settings.model import MetraleSettings

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = MetraleSettings()
        if getattr(args, "backend", None) is not None:  # --backend: as METRALE_BACKEND would set it
            settings = settings.updated(backend=args.backend)
    except ConfigError as exc:
        print(f"metrale: {exc}", file=sys.stderr)
        return 2
    from . import commands

    try:
        if args.command == "stats":
            return commands.stats(settings, args)
        if args.command == "preflight":
            return commands.preflight(settings, args.paths)
        if args.command == "conformance":
            return commands.conformance(settings, args)
        if args.command == "report":
            return commands.report(args)
        if args.command == "bench":
            return commands.bench(settings, args)
        if args.command == "run":
            from .runner import run_script

            return run_script(settings, args.script, args.args, torch=args.torch, cupy=args.cupy,
                              redzone=args.redzone, top=args.top)
        if args.command == "selftest":
            return commands.selftest(settings, args.snapshot)
        return {"backends": commands.backends, "info": commands.info, "settings": commands.settings}[args.command](
            settings, args.json)
    except MissingPackageError as exc:  # a package to install: its message alone
        print(f"metrale {args.command}: {exc}", file=sys.stderr)
        return 1
    except MetraleError as exc:
        print(f"metrale {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
