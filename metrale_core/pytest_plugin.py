"""metrale's pytest plugin: the ``metrale_backend`` fixture, a backend per test, checked and closed at teardown.

- Loaded in every pytest session where metrale-core is installed (entry point ``pytest11``, name ``metrale``;
  ``-p no:metrale`` turns it off). Importing it costs nothing past pytest: no backend opens, and pydantic and the
  backends load only when a test asks for the fixture.
- Settings come from ``METRALE_*`` through [`MetraleSettings`][metrale_core.MetraleSettings]; then the ini option
  ``metrale_backend``, the options ``--metrale-backend NAME`` and ``--metrale-redzone N``, and last the test's
  marker ``metrale_settings(**changes)``, each over the one before.
- Teardown, in order: ``synchronize()`` (the verdicts queued behind graph launches are judged),
  ``scan_redzones()`` (every zone, live and quarantined), the ledger read, then ``close()``, always.
- A leak (an allocation still on the ledger, or one a sweep took), a red-zone violation found at any check of the
  test, or a check that could not be judged fails the test at its teardown, naming each site.
  ``metrale_allow_leaks(reason)`` lets leaks pass; violations still fail. ``metrale_allow_violations(reason)``
  lets violations pass (a test that plants an overrun to see it caught); leaks still fail.
- Leaks are what the ledger holds (``alloc``, ``alloc_managed``, pool pieces, with their sites) and the arena memory
  still held (``alloc_arena`` blocks, arenas not closed: counted, as they are not on the ledger).
- A test whose body raised is not failed twice: what its teardown found is logged on ``metrale`` instead.
- After a device fault nothing can be freed or read back: the fixture logs that it checked nothing, and closes.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Final

import pytest

if TYPE_CHECKING:
    from metrale_core import AllocRecord, GpuBackend, MetraleSettings, RedZoneViolation

__all__ = ["ALLOW_LEAKS", "ALLOW_VIOLATIONS", "SETTINGS_MARKER", "metrale_backend"]

_log = logging.getLogger("metrale")

#: The marker that lets a test leave allocations behind: ``@pytest.mark.metrale_allow_leaks(reason="...")``.
ALLOW_LEAKS: Final = "metrale_allow_leaks"
#: The marker that lets a test's red zones be overrun (it plants one to see it caught):
#: ``@pytest.mark.metrale_allow_violations(reason="...")``.
ALLOW_VIOLATIONS: Final = "metrale_allow_violations"
#: The marker that changes the test's settings: ``@pytest.mark.metrale_settings(fake_defer=True)``.
SETTINGS_MARKER: Final = "metrale_settings"

#: The most call sites a failure lists; the rest are counted.
_MAX_SITES: Final = 20
#: The tests whose body raised (noted as its call is reported, read by the fixture's teardown). Not a
#: ``pytest.StashKey``: the plugin loads in every session where metrale is installed, older pytests too.
_BODY_RAISED: Final[weakref.WeakKeyDictionary[pytest.Item, bool]] = weakref.WeakKeyDictionary()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--metrale-backend``, ``--metrale-redzone`` and the ini option ``metrale_backend``."""
    group = parser.getgroup("metrale", "metrale (the metrale_backend fixture)")
    group.addoption(
        "--metrale-backend", metavar="NAME", default=None,
        help="the backend metrale_backend opens: fake, cuda, auto or a plugin's name "
        "(default: the ini option metrale_backend, else METRALE_BACKEND, else auto)",
    )
    group.addoption(
        "--metrale-redzone", metavar="N", default=None,
        help="red-zone bytes of metrale_backend's allocations, as METRALE_REDZONE (64, 1KiB; 0 turns them off)",
    )
    parser.addini("metrale_backend", "the backend metrale_backend opens (--metrale-backend overrides it)", default="")


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers; refuse a bad ``--metrale-redzone`` once, before any test runs."""
    config.addinivalue_line(
        "markers",
        f"{ALLOW_LEAKS}(reason=None): metrale_backend does not fail this test for allocations it leaves on the "
        "ledger (red-zone violations and unjudged checks still fail it)",
    )
    config.addinivalue_line(
        "markers",
        f"{ALLOW_VIOLATIONS}(reason=None): metrale_backend does not fail this test for red-zone violations (a "
        "test that plants an overrun to see it caught; leaks still fail it)",
    )
    config.addinivalue_line(
        "markers",
        f"{SETTINGS_MARKER}(**changes): metrale_backend opens with these settings changed "
        "(MetraleSettings keywords: fake_defer=True, redzone=64, backend='fake')",
    )
    redzone = config.getoption("metrale_redzone", None)
    if redzone is not None:
        from metrale_core import ConfigError, MetraleSettings

        try:
            settings = MetraleSettings()
        except ConfigError as exc:
            raise pytest.UsageError(f"metrale's settings (METRALE_*): {exc}") from None
        try:
            settings.updated(redzone=redzone)
        except ConfigError as exc:
            raise pytest.UsageError(f"--metrale-redzone: {exc}") from None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    """Note whether the test's body raised (a failure, a skip, an expected failure), for the fixture's teardown."""
    if call.when == "call":
        _BODY_RAISED[item] = call.excinfo is not None


@pytest.fixture
def metrale_backend(request: pytest.FixtureRequest) -> Iterator[GpuBackend]:
    """A [`GpuBackend`][metrale_core.GpuBackend] opened for one test; checked, then closed, at its teardown.

    - Opened with the settings of ``METRALE_*``, the plugin's options and the test's ``metrale_settings`` marker.
    - Teardown fails the test (an error at teardown) when an allocation of the test is still on the ledger or was
      swept, when a red zone was overrun, or when a check could not be judged; the message names each site.
    - ``close()`` runs whatever happens, a failed test's backend too.
    """
    from metrale_core import open_backend

    node = request.node
    allowed = _allowed(node, ALLOW_LEAKS)
    allowed_violations = _allowed(node, ALLOW_VIOLATIONS)
    settings = _settings(request.config, node)
    gpu = open_backend(settings=settings)
    found: list[RedZoneViolation] = []
    try:
        gpu.on_redzone_violation(lambda _name, violation: found.append(violation))
    except BaseException:
        gpu.close()
        raise
    yield gpu
    try:
        findings = _inspect(gpu, found)
    finally:
        gpu.close()
    if allowed is not None and findings.leaks:
        _log.info("%s: %d allocation(s) left, allowed by %s(%s)", node.nodeid, len(findings.leaks), ALLOW_LEAKS,
                  allowed or "no reason given")
        findings = dataclasses.replace(findings, leaks=(), arena_bytes=0)
    if allowed_violations is not None and findings.violations:
        _log.info("%s: %d red-zone violation(s), allowed by %s(%s)", node.nodeid, len(findings.violations),
                  ALLOW_VIOLATIONS, allowed_violations or "no reason given")
        findings = dataclasses.replace(findings, violations=())
    for note in findings.notes:
        _log.warning("%s: %s", node.nodeid, note)
    if not findings.failed:
        return
    message = findings.message(node.nodeid)
    if _BODY_RAISED.get(node, False):  # the test failed already: say what teardown found, once
        _log.warning("%s", message)
        return
    pytest.fail(message, pytrace=False)


@dataclasses.dataclass(frozen=True, slots=True)
class _Findings:
    """What one test's teardown found on its backend."""

    backend: str
    leaks: tuple[AllocRecord, ...] = ()
    swept: int = 0  # of the leaks, those a sweep took (the first ones)
    arena_bytes: int = 0  # arena memory still held: alloc_arena blocks, arenas not closed (not on the ledger)
    violations: tuple[RedZoneViolation, ...] = ()
    unjudged: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # logged, never failed

    @property
    def failed(self) -> bool:
        return bool(self.leaks or self.arena_bytes or self.violations or self.unjudged)

    def message(self, nodeid: str) -> str:
        """The failure: the leaks grouped by site, the violations, the checks not judged; then what to do."""
        from metrale_core._types import format_bytes

        lines = [f"metrale_backend ({self.backend}) at the teardown of {nodeid}:"]
        if self.leaks:
            total = sum(r.nbytes for r in self.leaks)
            live = len(self.leaks) - self.swept
            where = f"{live} allocation(s) still on the ledger" + (
                f" and {self.swept} swept by sweep_unreleased()" if self.swept else "")
            lines.append(f"  leaked: {where}, {total} bytes ({format_bytes(total)}), by call site:")
            lines += [f"    {line}" for line in _by_site(self.leaks)]
        if self.arena_bytes:
            lines.append(f"  leaked: {self.arena_bytes} bytes ({format_bytes(self.arena_bytes)}) of arena memory still "
                         f"held: alloc_arena blocks not released with free_arena(), or arenas not closed")
        if self.violations:
            lines.append(f"  {len(self.violations)} red-zone violation(s):")
            lines += [f"    {v.describe()}" for v in self.violations]
        if self.unjudged:
            lines.append("  checks not judged:")
            lines += [f"    {why}" for why in self.unjudged]
        advice = []
        if self.leaks or self.arena_bytes:
            advice.append(f"free what the test allocates (or mark it @pytest.mark.{ALLOW_LEAKS}(reason=...))")
        if self.violations:
            advice.append("fix the write past the buffer's bounds (allocated at the site named), or mark a test "
                          f"that overruns on purpose @pytest.mark.{ALLOW_VIOLATIONS}(reason=...)")
        if self.unjudged:
            advice.append("end every capture the test begins")
        lines.append("  " + "; ".join(advice))
        return "\n".join(lines)


def _inspect(gpu: GpuBackend, found: list[RedZoneViolation]) -> _Findings:
    """Judge what is pending, scan every zone and read the ledger; the backend stays open (the caller closes it)."""
    from metrale_core import CaptureError, MetraleError, RedZoneError

    backend = f"{gpu.name}:{gpu.ordinal}"
    if gpu.closed:  # the test closed it: its close() checked the zones (the observer heard them) and swept the leaks
        _log.info("metrale_backend (%s) was closed by the test: its close() swept and logged what leaked; the "
                  "fixture checks only the red zones", backend)
        return _Findings(backend, violations=_distinct(found))
    unjudged: list[str] = []
    notes: list[str] = []
    # synchronize: the verdicts queued behind graph launches are judged; then every zone, live and quarantined
    for what, step in (("synchronize()", gpu.synchronize), ("scan_redzones()", gpu.scan_redzones)):
        if gpu.faulted is not None:
            break
        try:
            step()
        except RedZoneError:
            continue  # redzone_action="raise": the observer has what it found
        except CaptureError as exc:
            unjudged.append(f"a stream capture still runs, so no check may wait for the device: the red zones of "
                            f"the test were not judged ({what}: {exc.name})")
            break
        except MetraleError as exc:
            if gpu.faulted is None:
                unjudged.append(f"{what} failed, so the red zones of the test were not judged: {exc}")
            break
    if gpu.faulted is not None:  # every call but close() is refused: nothing could have been freed since
        first = gpu.faulted.splitlines()[0]
        notes.append(f"the device faulted ({first}): metrale_backend judged no red zone and checked no leak")
        return _Findings(backend, violations=_distinct(found), unjudged=tuple(unjudged), notes=tuple(notes))
    try:
        report = gpu.ledger_report()
        arena_bytes = gpu.stats().current_bytes.get("arena", 0)
    except MetraleError as exc:
        unjudged.append(f"the ledger could not be read: {exc}")
        return _Findings(backend, violations=_distinct(found), unjudged=tuple(unjudged), notes=tuple(notes))
    return _Findings(backend, leaks=report.swept + report.live, swept=len(report.swept), arena_bytes=arena_bytes,
                     violations=_distinct(found), unjudged=tuple(unjudged), notes=tuple(notes))


def _distinct(found: Sequence[RedZoneViolation]) -> tuple[RedZoneViolation, ...]:
    """Each zone once (every check reports a changed zone again while its buffer lives), the latest report kept,
    in the order first found."""
    latest: dict[tuple[int, int, str], RedZoneViolation] = {}
    for violation in found:
        latest[(violation.index, violation.ptr, violation.side)] = violation
    return tuple(latest.values())


def _by_site(records: Sequence[AllocRecord]) -> list[str]:
    """One line per call site, the most bytes first: ``file:line``, the count, the sizes and their total."""
    from metrale_core._types import format_bytes

    sites: dict[str, list[int]] = {}
    for record in records:
        sites.setdefault(record.site, []).append(record.nbytes)
    ordered = sorted(sites.items(), key=lambda item: (-sum(item[1]), item[0]))
    lines = []
    for site, sizes in ordered[:_MAX_SITES]:
        total = f"{sum(sizes)} bytes ({format_bytes(sum(sizes))})"
        if len(sizes) == 1:
            lines.append(f"{site}: 1 allocation of {total}")
        elif len(set(sizes)) == 1:
            lines.append(f"{site}: {len(sizes)} allocations of {sizes[0]} bytes, {total} in all")
        else:
            shown = ", ".join(str(n) for n in sizes[:5]) + (", ..." if len(sizes) > 5 else "")
            lines.append(f"{site}: {len(sizes)} allocations ({shown} bytes), {total} in all")
    if len(ordered) > _MAX_SITES:
        rest = ordered[_MAX_SITES:]
        lines.append(f"... and {len(rest)} more site(s), {sum(len(s) for _, s in rest)} allocation(s)")
    return lines


def _allowed(node: pytest.Item, name: str) -> str | None:
    """The reason of the test's marker ``name`` (``""`` without one); ``None``: not marked."""
    marker = node.get_closest_marker(name)
    if marker is None:
        return None
    args, kwargs = marker.args, dict(marker.kwargs)
    reason = kwargs.pop("reason", args[0] if len(args) == 1 else "")
    if len(args) > 1 or (args and "reason" in marker.kwargs) or kwargs or not isinstance(reason, str):
        pytest.fail(f"{node.nodeid}: {name} takes one argument, a reason (a str): "
                    f"@pytest.mark.{name}(reason='...'), got {marker.args!r} {marker.kwargs!r}", pytrace=False)
    return reason


def _settings(config: pytest.Config, node: pytest.Item) -> MetraleSettings:
    """``METRALE_*``, then the ini option, the command line's options, and the test's markers, farthest first."""
    from metrale_core import MetraleSettings

    settings = MetraleSettings()
    backend = config.getoption("metrale_backend", None) or str(config.getini("metrale_backend") or "")
    if backend:
        settings = settings.updated(backend=backend)
    redzone = config.getoption("metrale_redzone", None)
    if redzone is not None:
        settings = settings.updated(redzone=redzone)
    for marker in reversed(list(node.iter_markers(SETTINGS_MARKER))):
        if marker.args:
            pytest.fail(f"{node.nodeid}: {SETTINGS_MARKER} takes settings as keywords "
                        f"(@pytest.mark.{SETTINGS_MARKER}(redzone=64)), got {marker.args!r}", pytrace=False)
        settings = settings.updated(**marker.kwargs)
    return settings
