"""``metrale selftest``: a representative workload, checked step by step."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from .._backend import GpuBackend
from .._discovery import open_backend
from .._errors import CaptureError, MetraleError, OutOfMemoryError
from .._settings.model import MetraleSettings
from .._types import format_bytes

__all__ = ["Check", "run_selftest"]

MIB = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Check:
    """One step of the self-test and what it found."""

    name: str
    ok: bool
    detail: str


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _Heard(logging.Handler):
    """The ``metrale`` logger's WARNING (and worse) records of one check, kept to be printed under its line;
    records below WARNING go on to the parent logger's handlers, as they would have."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logging.NOTSET)
        self.parent = logger.parent
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.lines.append(f"{record.levelname} {record.name}: {_short_sites(record.getMessage())}")
        elif self.parent is not None:
            self.parent.handle(record)


@contextlib.contextmanager
def _heard() -> Iterator[list[str]]:
    """Within: the ``metrale`` logger's warnings are kept in the list yielded instead of reaching the handlers
    above it (the console's), so the check that caused them can show them under its own line."""
    logger = logging.getLogger("metrale")
    handler = _Heard(logger)
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield handler.lines
    finally:
        logger.propagate = propagate
        logger.removeHandler(handler)


#: This module's paths as call sites name them (its source file), written ``selftest.py`` in what it prints.
_OWN_PATHS = tuple(sorted({_Capture.emit.__code__.co_filename, str(Path(__file__))}, key=len, reverse=True))


def _short_sites(text: str) -> str:
    """``text`` with the call sites of this module shortened to ``selftest.py:LINE``: they are the planted
    faults' lines, and their full path (the installed package's) says nothing more."""
    for path in _OWN_PATHS:
        text = text.replace(f"{path}:", "selftest.py:")
    return text


def _steps(gpu: GpuBackend, before_sweep: Callable[[], None] = lambda: None) -> Iterator[tuple[str, Callable[[], str]]]:
    payload = os.urandom(MIB)

    def round_trip() -> str:
        buf = gpu.alloc(MIB)
        gpu.copy_to_device(buf, payload)
        out = bytearray(MIB)
        gpu.copy_to_host(out, buf)
        gpu.free(buf)
        assert bytes(out) == payload, "the bytes read back differ from the bytes written"
        return f"{format_bytes(MIB)} host -> device -> host, bytes identical"

    def memset_and_d2d() -> str:
        a, b = gpu.alloc(MIB), gpu.alloc(MIB)
        gpu.memset(a, 0x5A)
        gpu.memset(a, 0x00, offset=MIB // 2)
        gpu.copy_device(b, a)
        out = bytearray(MIB)
        gpu.copy_to_host(out, b)
        gpu.free(a)
        gpu.free(b)
        assert out[: MIB // 2] == b"\x5a" * (MIB // 2) and out[MIB // 2 :] == bytes(MIB // 2)
        return "memset of both halves, device -> device copy, read back"

    def graph() -> str:
        src, dst = gpu.alloc(4096), gpu.alloc(4096)
        gpu.memset(src, 7)
        gpu.memset(dst, 0)
        stream = gpu.create_stream()
        gpu.begin_capture(stream)
        gpu.memset(src, 9, nbytes=16, stream=stream)
        gpu.copy_device(dst, src, stream=stream)
        graph = gpu.end_capture(stream)
        before = bytearray(4096)
        gpu.copy_to_host(before, dst)
        assert before == bytes(4096), "captured work ran before the graph was launched"
        exe = graph.instantiate()
        exe.launch(stream)
        exe.launch(stream)
        stream.synchronize()
        after = bytearray(4096)
        gpu.copy_to_host(after, dst)
        assert after == b"\x09" * 16 + b"\x07" * 4080, "the graph's replay wrote the wrong bytes"
        exe.close()
        graph.close()
        gpu.free(src)
        gpu.free(dst)
        stream.close()
        return "captured a memset and a copy, nothing ran until launch, replayed twice"

    def capture_rules() -> str:
        stream = gpu.create_stream()
        live = gpu.live_alloc_len()
        gpu.begin_capture(stream)
        try:
            gpu.alloc(256)
        except CaptureError as exc:
            refused = exc.name
        else:
            raise AssertionError("alloc during a capture was not refused")
        try:
            gpu.end_capture(stream)
        except CaptureError as exc:
            ended = exc.name
        else:
            raise AssertionError("end_capture of an invalidated capture did not fail")
        assert gpu.live_alloc_len() == live, "the refused alloc changed the ledger"
        stream.close()
        return f"alloc during capture -> {refused}; end_capture -> {ended}; ledger unchanged"

    def redzone() -> str:
        buf = gpu.alloc(1000)
        gpu.memset(buf.ptr + buf.nbytes + 3, 0xFF, nbytes=1)  # a planted one-byte overrun
        found = gpu.scan_redzones()
        gpu.free(buf)
        # the freed buffer waits in the quarantine, its zones still watched: checked (and reported again) here,
        # by the sweep that releases the quarantine, rather than by whichever later check drains it
        gpu.sweep_unreleased()
        mine = [v for v in found if v.index == buf.index]
        assert len(mine) == 1 and mine[0].side == "trail" and mine[0].offset == 3, f"scan found {found}"
        return (f"planted a write 3 bytes past a 1000-byte buffer; scan reported {mine[0].side} offset 3, the "
                "freed buffer's check reported it again")

    def pinned() -> str:
        host = gpu.alloc_host(64 * 1024)
        host.view()[:] = b"\x11" * (64 * 1024)
        buf = gpu.alloc(64 * 1024)
        gpu.copy_to_device(buf, host)
        back = gpu.alloc_host(64 * 1024)
        gpu.copy_to_host(back, buf)
        gpu.default_stream.synchronize()
        assert back.view().tobytes() == b"\x11" * (64 * 1024)
        gpu.free(buf)
        gpu.free(host)
        gpu.free(back)
        return "pinned host -> device -> pinned host, asynchronous, synchronized"

    def memory() -> str:
        info = gpu.memory_info()
        assert 0 <= info.effective_free <= info.total
        return (
            f"{format_bytes(info.free)} free, {format_bytes(info.effective_free)} effective, "
            f"{format_bytes(info.total)} total, integrated={info.integrated}"
        )

    def arena_and_stats() -> str:
        before = gpu.stats()
        weights = gpu.alloc(4 * MIB)
        with gpu.create_arena(8 * MIB) as arena:
            for step in range(4):  # per-step scratch: pieces, then one reset
                pieces = [arena.alloc(MIB) for _ in range(step + 2)]
                for piece in pieces:
                    gpu.memset(piece, step)
                arena.reset()
            used = gpu.stats()
        gpu.free(weights)
        after = gpu.stats()
        assert used.arena_allocs - before.arena_allocs == 2 + 3 + 4 + 5, used
        assert used.current_bytes["device"] - before.current_bytes["device"] == 4 * MIB
        assert after.current_total_bytes == before.current_total_bytes, (before, after)
        return (
            f"14 arena pieces over 4 resets, none on the ledger; stats: {after.alloc_count} allocations, "
            f"peak {format_bytes(after.peak_total_bytes)}"
        )

    def out_of_memory() -> str:
        held = gpu.alloc(2 * MIB)
        total = gpu.memory_info().total
        records = gpu.ledger_probe().records()
        try:
            gpu.alloc(total + (1 << 30))
        except OutOfMemoryError as exc:
            message = str(exc)
        else:
            raise AssertionError("an allocation larger than the device succeeded")
        assert gpu.ledger_probe().records() == records, "the failed allocation changed the ledger"
        assert held.site in message, f"the error does not name the call site holding memory: {message}"
        gpu.free(held)
        return f"asked for more than the device has; the error names who holds memory:\n      {_short_sites(message)}"

    def leak_and_sweep() -> str:
        handler = _Capture()
        logger = logging.getLogger("metrale")
        logger.addHandler(handler)
        try:
            for _ in range(3):
                gpu.alloc(2 * MIB)  # left on purpose: the sweep must find them
            gpu.alloc_managed(MIB)
            before_sweep()  # the memory snapshot, where one is asked for: the planted leak shows as live
            swept = gpu.sweep_unreleased()
        finally:
            logger.removeHandler(handler)
        assert swept == 4, f"sweep found {swept} allocations, expected 4"
        assert gpu.live_alloc_len() == 0
        assert any(m.startswith("sweep") for m in handler.messages), "the sweep logged no report"
        return "left 4 allocations on purpose; the sweep freed them and logged its report"

    yield "copy round trip", round_trip
    yield "memset and device copy", memset_and_d2d
    yield "graph capture and replay", graph
    yield "capture rules", capture_rules
    yield "red-zone overrun caught", redzone
    yield "pinned host buffers", pinned
    yield "memory info", memory
    yield "arena and stats", arena_and_stats
    yield "out of memory explained", out_of_memory
    yield "leak swept and reported", leak_and_sweep


def run_selftest(
    settings: MetraleSettings, report: Callable[[Check], None], snapshot: Path | None = None
) -> list[Check]:
    """Open the configured backend and run every check; red zones are turned on if off.

    With ``snapshot``, the ledger's history is kept and saved there just before the last check's
    sweep, so the leak it plants shows as live (for ``metrale report``).
    """
    if settings.redzone == 0:
        settings = settings.updated(redzone=256)
    if snapshot is not None and settings.memory_history == 0:
        settings = settings.updated(memory_history=100_000)
    checks: list[Check] = []

    def record(check: Check) -> None:
        checks.append(check)
        report(check)

    try:
        gpu = open_backend(settings=settings)
    except MetraleError as exc:
        record(Check("open backend", False, str(exc)))
        return checks
    with gpu:
        record(Check("open backend", True, f"{gpu.name} on {gpu.device_name}"))
        probe = gpu.ledger_probe()
        def save() -> None:
            if snapshot is None:
                return
            try:
                gpu.save_snapshot(snapshot)
            except (OSError, MetraleError) as exc:
                record(Check("memory snapshot", False, f"{type(exc).__name__}: {exc}"))
            else:
                record(Check("memory snapshot", True, f"saved to {snapshot}, before the sweep: its leak is live there"))

        for name, step in _steps(gpu, save):
            with _heard() as warnings:  # the check's own warnings (its planted faults'), printed under its line
                try:
                    ok, detail = True, step()
                except (AssertionError, MetraleError) as exc:
                    ok, detail = False, f"{type(exc).__name__}: {exc}"
            record(Check(name, ok, "\n".join([detail, *(f"      {line}" for line in warnings)])))
    record(Check("close", probe.live_count() == 0, f"backend closed; the ledger probe reads {probe.live_count()}"))
    return checks
