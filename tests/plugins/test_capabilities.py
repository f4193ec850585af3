"""The capability probe behind the skips: a backend lacks an optional primitive only where its raw layer says
so (``CUDA_ERROR_NOT_SUPPORTED``, RawDevice's default); a test that needs it then skips, with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale_core import testing
from tests._support import SETTINGS, install_distribution, missing

# The fake's raw layer with RawDevice's defaults for every optional primitive: a backend that runs no
# kernels, shares no memory and has no baseline (as the toy of docs/plugin-authors.md).
BARE = """
    from metrale_core import BackendRegistration, RawDevice, hookimpl
    from metrale_fake import FakeDevice

    class Bare(FakeDevice):
        compute_capability = RawDevice.compute_capability
        module_load = RawDevice.module_load
        module_function = RawDevice.module_function
        launch = RawDevice.launch
        export_memory = RawDevice.export_memory
        import_memory = RawDevice.import_memory
        address_range = RawDevice.address_range
        baseline = RawDevice.baseline

    @hookimpl
    def metrale_backend(settings):
        return BackendRegistration(open=Bare)
"""

# A backend whose baseline is there but broken: that is a failure for the tests to show, not a skip.
BROKEN_BASELINE = """
    from metrale_core import BackendRegistration, hookimpl
    from metrale_fake import FakeDevice

    class BrokenBaseline(FakeDevice):
        def baseline(self):
            raise RuntimeError("the baseline's own bug")

    @hookimpl
    def metrale_backend(settings):
        return BackendRegistration(open=BrokenBaseline)
"""


def test_the_fake_has_every_capability() -> None:
    found = testing.backend_capabilities("fake", SETTINGS)
    assert found.missing == {} and all(found.has(c) for c in testing.CAPABILITIES)
    assert missing("fake", "capacity") is None


def test_a_backend_that_keeps_the_raw_defaults_lacks_them_with_reasons(site: Path) -> None:
    install_distribution(site, "mtp-bare", "mtp_bare", BARE, {"bare": "mtp_bare"})
    found = testing.backend_capabilities("bare", SETTINGS)
    assert set(found.missing) == {"kernels", "interop", "baseline"}, found
    assert "CUDA_ERROR_NOT_SUPPORTED" in (found.why_not("kernels") or "")
    assert "CUDA_ERROR_NOT_SUPPORTED" in (found.why_not("baseline") or "")
    assert "import_memory" in (found.why_not("interop") or "")
    assert missing("bare", "kernels") == found.why_not("kernels")
    with pytest.raises(ValueError, match="no capability 'warp'"):
        found.has("warp")


def test_backend_params_skip_a_backend_that_lacks_what_is_needed(site: Path) -> None:
    install_distribution(site, "mtp-bare", "mtp_bare", BARE, {"bare": "mtp_bare"})
    params = {p.values[0]: p for p in testing.backend_params(SETTINGS, needs=("kernels",))}
    (skip,) = params["bare"].marks
    assert skip.name == "skip" and skip.kwargs["reason"].startswith("needs kernels, which backend bare lacks")
    assert not params["fake"].marks


def test_a_primitive_that_is_there_but_broken_is_not_a_skip(site: Path) -> None:
    install_distribution(site, "mtp-brokenbase", "mtp_brokenbase", BROKEN_BASELINE, {"brokenbase": "mtp_brokenbase"})
    assert testing.backend_capabilities("brokenbase", SETTINGS).has("baseline")
