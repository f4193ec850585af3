"""Discovery through entry points: real distributions on sys.path, good and broken."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import SETTINGS, install_distribution
from metrale_core import (
    BackendNotFoundError,
    BackendUnavailableError,
    GpuBackend,
    available_backends,
    open_backend,
)

GOOD = """
    from metrale_core import BackendRegistration, hookimpl
    from metrale_fake import FakeDevice

    @hookimpl
    def metrale_backend(settings):
        return BackendRegistration(open=FakeDevice, description="a third-party test backend")
"""


def test_bundled_backends_register_through_entry_points() -> None:
    infos = available_backends(SETTINGS)
    assert infos["fake"].available and infos["fake"].distribution == "metrale-fake"
    assert "cuda" in infos and infos["cuda"].distribution == "metrale-cuda"
    if not infos["cuda"].available:
        assert infos["cuda"].reason


def test_third_party_backend_opens(site: Path) -> None:
    install_distribution(site, "mtp-good", "mtp_good", GOOD, {"thirdparty": "mtp_good"})
    info = available_backends(SETTINGS)["thirdparty"]
    assert (info.available, info.distribution, info.description) == (True, "mtp-good", "a third-party test backend")
    with open_backend("thirdparty", settings=SETTINGS) as gpu:
        assert type(gpu) is GpuBackend and gpu.name == "thirdparty"
        buf = gpu.alloc(16)
        assert buf.site.startswith(__file__), "frames of the plugin's package are not call sites"
        gpu.free(buf)


def test_broken_plugin_does_not_take_others_down(site: Path) -> None:
    install_distribution(site, "mtp-broken", "mtp_broken", "import no_such_module_anywhere\n", {"broken": "mtp_broken"})
    infos = available_backends(SETTINGS)
    assert infos["fake"].available
    broken = infos["broken"]
    assert not broken.available and broken.distribution == "mtp-broken"
    assert "mtp-broken" in (broken.reason or "") and "no_such_module_anywhere" in (broken.reason or "")
    with pytest.raises(BackendUnavailableError, match="mtp-broken"):
        open_backend("broken", settings=SETTINGS)
    with open_backend("fake", settings=SETTINGS):
        pass


def test_name_clash_names_both_distributions(site: Path) -> None:
    install_distribution(site, "mtp-one", "mtp_one", GOOD, {"twin": "mtp_one"})
    install_distribution(site, "mtp-two", "mtp_two", GOOD, {"twin": "mtp_two"})
    twin = available_backends(SETTINGS)["twin"]
    assert not twin.available
    assert "mtp-one" in (twin.reason or "") and "mtp-two" in (twin.reason or "")
    with pytest.raises(BackendUnavailableError, match="mtp-one and mtp-two"):
        open_backend("twin", settings=SETTINGS)


@pytest.mark.parametrize(
    "body",
    [
        "    return 42",
        "    raise RuntimeError('hook blew up')",
        "    return None",
    ],
)
def test_hook_results_are_validated(site: Path, body: str) -> None:
    source = f"from metrale_core import hookimpl\n\n@hookimpl\ndef metrale_backend(settings):\n{body}\n"
    install_distribution(site, "mtp-odd", "mtp_odd", source, {"odd": "mtp_odd"})
    odd = available_backends(SETTINGS)["odd"]
    assert not odd.available and "mtp-odd" in (odd.reason or "")
    assert available_backends(SETTINGS)["fake"].available


def test_probe_that_raises_is_unavailable(site: Path) -> None:
    source = GOOD.replace('description="a third-party test backend"', "probe=lambda s: 1 / 0")
    install_distribution(site, "mtp-probe", "mtp_probe", source, {"probing": "mtp_probe"})
    info = available_backends(SETTINGS)["probing"]
    assert not info.available and "ZeroDivisionError" in (info.reason or "")


def test_unknown_names() -> None:
    with pytest.raises(BackendNotFoundError, match="fake"):
        open_backend("nonexistent", settings=SETTINGS)
    with pytest.raises(BackendUnavailableError, match="configured backend 'nonexistent'"):
        open_backend(settings=SETTINGS.updated(backend="nonexistent"))


def test_auto_picks_cuda_only_when_it_answers() -> None:
    cuda = available_backends(SETTINGS).get("cuda")
    with open_backend("auto", settings=SETTINGS) as gpu:
        assert gpu.name == ("cuda" if cuda is not None and cuda.available else "fake")


KERNELS = """
    import numpy as np
    from metrale_core import hookimpl, kernel_implementation

    @kernel_implementation("app", "mine")
    def mine(launch, p):
        p[:4] = 42

    @hookimpl
    def metrale_kernel_implementations(settings):
        return [mine]
"""
JUNK_KERNELS = """
    from metrale_core import hookimpl

    @hookimpl
    def metrale_kernel_implementations(settings):
        return [print]
"""


def test_plugins_provide_kernel_implementations(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    install_distribution(site, "mtp-kernels", "mtp_kernels", KERNELS, {"kernels": "mtp_kernels"})
    install_distribution(site, "mtp-junk", "mtp_junk", JUNK_KERNELS, {"junk": "mtp_junk"})
    image = b".version 8.0\n.target sm_80\n.visible .entry mine(.param .u64 p)\n{ ret; }\n"
    with caplog.at_level("WARNING", logger="metrale"), open_backend("fake", settings=SETTINGS) as gpu:
        kernel = gpu.load_modules({"app": image}).kernel("app", "mine")
        buf = gpu.alloc(4)
        gpu.launch(kernel, 1, 1, [buf])
        out = bytearray(4)
        gpu.copy_to_host(out, buf)
        assert out == b"\x2a" * 4
    assert any("junk" in r.getMessage() and "KernelImplementation" in r.getMessage() for r in caplog.records)
