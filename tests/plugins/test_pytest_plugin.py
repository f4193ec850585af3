"""The pytest plugin (``metrale_core.pytest_plugin``): the ``metrale_backend`` fixture run by pytest's own ``pytester``.

- Each test writes a test file and runs pytest on it in this process; the plugin comes in through its entry point,
  as in a user's session. The inner sessions use the fake backend (``METRALE_BACKEND=fake``): no GPU needed.
- A leak, an overrun, a verdict judged only at teardown and a capture left running each fail the inner test at its
  teardown, naming the site; a clean test passes; the markers and options do what they say; a failing test's
  backend is closed all the same.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

#: The inner sessions' arguments: no cache folder, the plugin's failures in full.
ARGS = ("-p", "no:cacheprovider", "-q", "--strict-markers")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fake_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``METRALE_*`` variable of the outer session reaches the inner one but ``METRALE_PURE`` (which code runs,
    not what it does); the inner one opens the fake backend, and loads the plugins installed, as a user's does."""
    for name in [n for n in os.environ if n.startswith("METRALE_") and n != "METRALE_PURE"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("METRALE_BACKEND", "fake")
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)


def _site(pytester: pytest.Pytester, name: str, line: int) -> str:
    return f"{pytester.path / name}:{line}"


def test_the_entry_point_names_the_plugin() -> None:
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="pytest11")}
    assert found.get("metrale") == "metrale_core.pytest_plugin"


def test_a_clean_test_passes_and_gets_the_configured_backend(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_clean="""
        def test_clean(metrale_backend):
            gpu = metrale_backend
            assert gpu.name == "fake" and gpu.settings.redzone == 64
            buf = gpu.alloc(100)
            gpu.memset(buf, 1)                       # inside the buffer
            gpu.free(buf)
    """)
    monkeypatch.setenv("METRALE_REDZONE", "64")
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(passed=1)


def test_a_leak_fails_the_test_naming_each_site_and_size(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_leak="""
        def test_leaks(metrale_backend):
            gpu = metrale_backend
            kept = [gpu.alloc(1024) for _ in range(2)] + [gpu.alloc(512)]
            gpu.alloc_managed(4096)
            gone = gpu.alloc(64)
            gpu.free(gone)
            assert gpu.live_alloc_len() == 4
    """)
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(passed=1, errors=1)
    out = result.stdout.str()
    assert "ERROR at teardown of test_leaks" in out
    assert "leaked: 4 allocation(s) still on the ledger, 6656 bytes (6.5 KiB), by call site:" in out
    assert f"{_site(pytester, 'test_leak.py', 4)}: 1 allocation of 4096 bytes (4.0 KiB)" in out
    assert f"{_site(pytester, 'test_leak.py', 3)}: 3 allocations (1024, 1024, 512 bytes), 2560 bytes (2.5 KiB) in all" \
        in out
    assert out.index("test_leak.py:4:") < out.index("test_leak.py:3:"), "the most bytes first"
    assert "test_leak.py:5" not in out, "a freed buffer is no leak"
    assert "metrale_allow_leaks(reason=...)" in out


def test_a_buffer_taken_by_a_sweep_is_a_leak_too(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_swept="""
        def test_swept(metrale_backend):
            metrale_backend.alloc(512)
            assert metrale_backend.sweep_unreleased() == 1
    """)
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*leaked: 0 allocation(s) still on the ledger and 1 swept by sweep_unreleased(), 512 bytes (512 B), by call "
        "site:",
        f"*{_site(pytester, 'test_swept.py', 2)}: 1 allocation of 512 bytes (512 B)",
    ])


OVERRUN = """
    def test_overrun(metrale_backend):
        gpu = metrale_backend
        buf = gpu.alloc(100)
        gpu.memset(buf.ptr + buf.nbytes, 0, nbytes=1)    # one byte past the end: into the red zone
        gpu.free(buf)
"""


@pytest.mark.parametrize(
    ("env", "args"),
    [
        ({"METRALE_REDZONE": "64"}, ()),  # found by the teardown's scan (the freed buffer waits in quarantine)
        ({"METRALE_REDZONE": "64", "METRALE_REDZONE_QUARANTINE_BYTES": "0"}, ()),  # found (and logged) by free
        ({"METRALE_REDZONE": "64", "METRALE_REDZONE_ACTION": "raise"}, ()),  # the teardown scan raises: caught
        ({}, ("--metrale-redzone", "64")),  # red zones from the option
    ],
    ids=["scan", "free", "raise", "option"],
)
def test_an_overrun_fails_the_test_naming_the_site_side_and_offset(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], args: tuple[str, ...]
) -> None:
    pytester.makepyfile(test_overrun=OVERRUN)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = pytester.runpytest(*ARGS, *args)
    result.assert_outcomes(passed=1, errors=1)
    out = result.stdout.str()
    assert "1 red-zone violation(s):" in out
    site = re.escape(_site(pytester, "test_overrun.py", 3))
    assert re.search(rf"red zone trail: a write past the end of allocation #\d+ \(100 bytes at 0x[0-9a-f]+, "
                     rf"allocated at {site}\), first changed byte at zone offset 0", out), out
    assert "leaked" not in out


def test_an_overrun_of_a_leaked_buffer_names_both(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_both="""
        def test_both(metrale_backend):
            buf = metrale_backend.alloc(256)
            metrale_backend.memset(buf.ptr + buf.nbytes + 3, 7, nbytes=2)
    """)
    result = pytester.runpytest(*ARGS, "--metrale-redzone", "64")
    result.assert_outcomes(passed=1, errors=1)
    out = result.stdout.str()
    assert f"{_site(pytester, 'test_both.py', 2)}: 1 allocation of 256 bytes (256 B)" in out
    assert "first changed byte at zone offset 3" in out
    # The ERRORS section only: the short summary repeats the whole message where pytest sees CI set.
    errors = out.split("short test summary info")[0]
    assert errors.count("\n    red zone trail:") == 1, "a zone found by several checks (logged by each) is named once"


def test_a_verdict_queued_behind_a_graph_launch_is_judged_at_teardown(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_queued="""
        import pytest

        @pytest.mark.metrale_settings(redzone=64, redzone_scan_graphs=True, redzone_scan_queued=True)
        def test_graph_overruns(metrale_backend):
            gpu = metrale_backend
            buf = gpu.alloc(100)
            stream = gpu.create_stream()
            gpu.begin_capture(stream)
            gpu.memset(buf.ptr + buf.nbytes, 0, nbytes=3, stream=stream)
            graph = gpu.end_capture(stream).instantiate()
            graph.launch(stream)                     # returns at once: its verdict is queued, never waited for here
            graph.close()
            gpu.free(buf)
    """)
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*1 red-zone violation(s):*",
        f"*red zone trail: a write past the end of allocation #* (100 bytes at 0x*, allocated at "
        f"{_site(pytester, 'test_queued.py', 6)}), first changed byte at zone offset 0*",
    ])


def test_a_capture_left_running_fails_as_checks_not_judged(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_capture="""
        def test_capture_left_open(metrale_backend):
            metrale_backend.begin_capture(metrale_backend.create_stream())   # and never ended
    """)
    result = pytester.runpytest(*ARGS, "--metrale-redzone", "64")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*checks not judged:*",
        "*a stream capture still runs, so no check may wait for the device: the red zones of the test were not "
        "judged (synchronize(): CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)*",
        "*end every capture the test begins*",
    ])


def test_the_marker_allows_a_leak_but_not_an_overrun(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_allowed="""
        import pytest

        @pytest.mark.metrale_allow_leaks(reason="the weights stay cached for the backend's life")
        def test_cache(metrale_backend):
            metrale_backend.alloc(1 << 20)

        @pytest.mark.metrale_allow_leaks("a reason as the argument")
        def test_cache_positional(metrale_backend):
            metrale_backend.alloc(1 << 20)

        @pytest.mark.metrale_allow_leaks
        @pytest.mark.metrale_settings(redzone_lead=True)
        def test_overrun_still_fails(metrale_backend):
            buf = metrale_backend.alloc(100)
            metrale_backend.memset(buf.ptr - 1, 0, nbytes=1)   # before the start: the leading zone
    """)
    result = pytester.runpytest(*ARGS, "--metrale-redzone", "64")
    result.assert_outcomes(passed=3, errors=1)
    out = result.stdout.str()
    assert "ERROR at teardown of test_overrun_still_fails" in out
    assert "red zone lead: a write before the start of allocation #" in out
    assert f"allocated at {_site(pytester, 'test_allowed.py', 14)}" in out
    assert "leaked" not in out


@pytest.mark.parametrize(
    "mark", ["metrale_allow_leaks(1)", "metrale_allow_leaks('a', 'b')", "metrale_allow_leaks(because='x')"]
)
def test_a_malformed_marker_is_refused(pytester: pytest.Pytester, mark: str) -> None:
    pytester.makepyfile(test_bad=f"""
        import pytest

        @pytest.mark.{mark}
        def test_it(metrale_backend):
            pass
    """)
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*metrale_allow_leaks takes one argument, a reason (a str)*"])


def test_the_option_and_the_ini_pick_the_backend(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_pick="""
        def test_pick(metrale_backend):
            assert metrale_backend.name == "fake"
            assert metrale_backend.settings.backend == "fake"
    """)
    monkeypatch.setenv("METRALE_BACKEND", "no-such-backend")
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(errors=1)  # METRALE_BACKEND is read: the fixture cannot open it
    result.stdout.fnmatch_lines(["*BackendUnavailableError*no-such-backend*"])
    pytester.runpytest(*ARGS, "--metrale-backend", "fake").assert_outcomes(passed=1)
    pytester.makeini("[pytest]\nmetrale_backend = fake\n")
    pytester.runpytest(*ARGS).assert_outcomes(passed=1)
    result = pytester.runpytest(*ARGS, "--metrale-backend", "still-no-such-backend")  # the option over the ini
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*still-no-such-backend*"])


def test_the_settings_marker_changes_the_test_s_settings(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_marked="""
        import pytest

        pytestmark = pytest.mark.metrale_settings(redzone=256, fake_memory_bytes="1 GiB")

        @pytest.mark.metrale_settings(fake_defer=True, redzone=32)
        def test_marked(metrale_backend):
            settings = metrale_backend.settings
            assert (settings.fake_defer, settings.redzone, settings.fake_memory_bytes) == (True, 32, 1 << 30)

        def test_module_marked(metrale_backend):
            assert (metrale_backend.settings.fake_defer, metrale_backend.settings.redzone) == (False, 256)

        @pytest.mark.metrale_settings(no_such_setting=1)
        def test_bad_setting(metrale_backend):
            pass
    """)
    result = pytester.runpytest(*ARGS, "--metrale-redzone", "64")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ConfigError: invalid setting keyword no_such_setting=1: no such setting*"])


def test_a_bad_redzone_option_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_any="def test_any():\n    pass\n")
    result = pytester.runpytest(*ARGS, "--metrale-redzone", "lots")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--metrale-redzone: invalid setting keyword redzone='lots'*"])


def test_a_failing_test_s_backend_is_closed_and_not_failed_twice(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fails="""
        import logging

        SEEN = []

        def test_fails(metrale_backend):
            SEEN.append(metrale_backend)
            metrale_backend.alloc(2048)              # left behind by the failure below
            assert False, "the test's own failure"

        def test_the_backend_was_closed(metrale_backend):
            assert SEEN[0].closed and SEEN[0] is not metrale_backend
            assert metrale_backend.live_alloc_len() == 0
    """)
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(passed=1, failed=1)  # no error at teardown on top of the failure
    out = result.stdout.str()
    assert "the test's own failure" in out
    assert "Captured log teardown" in out and "leaked: 1 allocation(s) still on the ledger, 2048 bytes" in out


def test_a_test_that_closes_the_backend_itself_still_has_its_zones_checked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_closes="""
        def test_closes(metrale_backend):
            buf = metrale_backend.alloc(100)
            metrale_backend.memset(buf.ptr + 100, 0, nbytes=1)
            metrale_backend.close()                  # as an application's shutdown does
    """)
    result = pytester.runpytest(*ARGS, "--metrale-redzone", "64")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*red zone trail: a write past the end of allocation #*"])


def test_after_a_device_fault_the_fixture_checks_nothing_and_says_so(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_fault="""
        import pytest
        from metrale_core import DeviceFaultError

        def test_fault_path(metrale_backend):
            metrale_backend.alloc(100)                      # cannot be freed once the device faulted
            metrale_backend.inject_fault("synchronize", code="CUDA_ERROR_ILLEGAL_ADDRESS")
            with pytest.raises(DeviceFaultError):
                metrale_backend.synchronize()
    """)
    result = pytester.runpytest(*ARGS, "--metrale-redzone", "64", "-rP")  # -rP: a passed test's captured log
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "*test_fault.py::test_fault_path: the device faulted (*): metrale_backend judged no red zone and checked no "
        "leak*",
    ])


def test_a_session_that_does_not_use_the_fixture_is_not_disturbed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    pytester.runpytest(*ARGS).assert_outcomes(passed=1)
    result = pytester.runpytest(*ARGS, "-p", "no:metrale")
    result.assert_outcomes(passed=1)
    pytester.makepyfile(test_wants="def test_wants(metrale_backend):\n    pass\n")
    result = pytester.runpytest(*ARGS, "-p", "no:metrale", "test_wants.py")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'metrale_backend' not found*"])


def test_the_testing_page_shows_the_host_app_s_tests_as_they_are() -> None:
    page = (ROOT / "docs" / "testing.md").read_text()
    shown = page.split("examples/host-app/tests/test_app.py) -->\n```python\n", 1)[1].split("```\n", 1)[0]
    code = (ROOT / "examples" / "host-app" / "tests" / "test_app.py").read_text()
    assert code.split("from __future__ import annotations\n\n", 1)[1] == shown


def test_the_violations_marker_allows_a_planted_overrun_but_not_a_leak(pytester: pytest.Pytester) -> None:
    """The review's case: a test that plants an overrun to see it caught passes with the marker."""
    pytester.makepyfile(test_planted="""
        import pytest
        from metrale_core import RedZoneError

        @pytest.mark.metrale_settings(redzone=64, redzone_action="raise")
        @pytest.mark.metrale_allow_violations(reason="the overrun is the point")
        def test_caught(metrale_backend):
            gpu = metrale_backend
            buf = gpu.alloc(100)
            gpu.memset(buf.ptr + buf.nbytes, 0, nbytes=1)
            with pytest.raises(RedZoneError):
                gpu.scan_redzones()
            gpu.free(buf)

        @pytest.mark.metrale_allow_violations(reason="the overrun is the point")
        def test_leaks_still_fail(metrale_backend):
            metrale_backend.alloc(64)
    """)
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(passed=2, errors=1)
    assert "ERROR at teardown of test_leaks_still_fail" in result.stdout.str()


def test_arena_memory_still_held_is_a_leak(pytester: pytest.Pytester) -> None:
    """The review's case: ``alloc_arena`` blocks and arenas left open are not on the ledger; they fail all the same."""
    pytester.makepyfile(test_arena="""
        def test_block(metrale_backend):
            metrale_backend.alloc_arena(4096)

        def test_arena(metrale_backend):
            metrale_backend.create_arena(8192).alloc(100)

        def test_closed(metrale_backend):
            with metrale_backend.create_arena(8192) as arena:
                arena.alloc(100)
    """)
    result = pytester.runpytest(*ARGS)
    result.assert_outcomes(passed=3, errors=2)
    out = result.stdout.str()
    assert "leaked: 4096 bytes (4.0 KiB) of arena memory still held" in out
    assert "leaked: 8192 bytes (8.0 KiB) of arena memory still held" in out
