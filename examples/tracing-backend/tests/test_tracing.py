"""The tracing backend's tests, run exactly as any plugin author would run metrale's conformance suite."""

from __future__ import annotations

import pytest

from metrale_core import MetraleSettings, available_backends, open_backend
from metrale_core.testing import BAD_INPUTS, BadInput, backend_state_machine, bad_input_fixture, check_bad_input
from metrale_tracing import TracingBackend, TracingSettings

# The conformance state machine, bound to this backend: pytest collects it as a unittest TestCase.
TestTracingConformance = backend_state_machine("tracing").TestCase


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.name for c in BAD_INPUTS])
def test_bad_input(case: BadInput) -> None:
    with open_backend("tracing") as gpu, bad_input_fixture(gpu) as fixture:
        check_bad_input(fixture, case)


def test_discovered_through_the_entry_point() -> None:
    info = available_backends()["tracing"]
    assert info.available and info.distribution == "metrale-tracing"


def test_records_the_raw_calls() -> None:
    with open_backend("tracing", settings=MetraleSettings(redzone=0)) as gpu:
        assert isinstance(gpu, TracingBackend)
        buf = gpu.alloc(64)
        gpu.memset(buf, 1)
        gpu.free(buf)
        assert gpu.raw_calls()[-3:] == ["alloc", "memset", "free"]


def test_keeps_as_many_calls_as_its_own_setting_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_TRACING_MAX_CALLS", "3")
    settings = MetraleSettings(redzone=0)
    assert settings.plugin(TracingSettings).max_calls == 3 and settings.tracing_max_calls == 3
    with open_backend("tracing", settings=settings.updated(tracing_max_calls=2)) as gpu:
        assert isinstance(gpu, TracingBackend)
        gpu.free(gpu.alloc(64))
        assert gpu.raw_calls() == ["alloc", "free"]


def test_auto_never_opens_it() -> None:
    with open_backend("auto") as gpu:
        assert gpu.name != "tracing", "it declares a lower preference than the fake it wraps"
