"""Discovery through entry points: real distributions on sys.path, good and broken."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale_core import (
    BackendNotFoundError,
    BackendUnavailableError,
    ConfigError,
    GpuBackend,
    MetraleSettings,
    available_backends,
    open_backend,
)
from tests._support import SETTINGS, install_distribution

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


FEWER_ARGUMENTS = """
    from metrale_core import hookimpl, kernel_implementation

    SEEN = []

    @kernel_implementation("app", "mine")
    def mine(launch, p):
        p[:4] = 7

    @hookimpl
    def metrale_kernel_implementations():
        return [mine]

    @hookimpl
    def metrale_redzone_violation(violation):
        SEEN.append(violation.offset)
"""


def test_hooks_that_take_fewer_arguments_than_the_spec_work(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    """pluggy lets an implementation take fewer arguments than its spec; every hook is called through pluggy.

    ``metrale_kernel_implementations()`` taking no settings was called as ``function(settings=...)``: a
    ``TypeError`` logged at every open, and its kernels dropped."""
    install_distribution(site, "mtp-fewer", "mtp_fewer", FEWER_ARGUMENTS, {"fewer": "mtp_fewer"})
    image = b".version 8.0\n.target sm_80\n.visible .entry mine(.param .u64 p)\n{ ret; }\n"
    settings = SETTINGS.updated(redzone=64, redzone_action="warn")
    with caplog.at_level("WARNING", logger="metrale"), open_backend("fake", settings=settings) as gpu:
        kernel = gpu.load_modules({"app": image}).kernel("app", "mine")
        buf = gpu.alloc(4)
        gpu.launch(kernel, 1, 1, [buf])
        out = bytearray(4)
        gpu.copy_to_host(out, buf)
        assert out == b"\x07" * 4
        gpu.memset(buf.ptr + buf.nbytes + 3, 0x00, nbytes=1)  # into the red zone
        gpu.scan_redzones()
    import mtp_fewer  # type: ignore[import-not-found]

    assert mtp_fewer.SEEN[0] == 3
    assert not [r for r in caplog.records if "mtp_fewer" in r.getMessage() or "fewer" in r.getMessage()]


def test_a_hook_that_takes_an_argument_its_spec_lacks_is_refused(
    site: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The hooks are validated against their spec, ``metrale_settings`` too (the settings scan had no spec)."""
    source = WITH_SETTINGS.replace("def metrale_settings():", "def metrale_settings(settings):")
    install_distribution(site, "mtp-owned", "mtp_owned", source, {"owned": "mtp_owned"})
    with caplog.at_level("WARNING", logger="metrale"):
        settings = MetraleSettings()
    assert not hasattr(settings, "owned_window_bytes")
    assert any("mtp-owned" in r.getMessage() and "spec" in r.getMessage() and "settings" in r.getMessage()
               for r in caplog.records)
    owned = available_backends(SETTINGS)["owned"]
    assert not owned.available and "hookspec" in (owned.reason or "")
    assert available_backends(SETTINGS)["fake"].available


NOT_A_DEVICE = """
    from metrale_core import BackendRegistration, hookimpl

    CLOSED = []

    class NotADevice:
        def close(self):
            CLOSED.append(self)

    @hookimpl
    def metrale_backend(settings):
        return BackendRegistration(open=lambda settings, ordinal: NotADevice())
"""


def test_open_that_returns_no_raw_device_is_unavailable_and_closed(site: Path) -> None:
    """Bug 7: an ``open()`` that returns something other than a ``RawDevice`` raised a raw ``AttributeError``."""
    install_distribution(site, "mtp-notraw", "mtp_notraw", NOT_A_DEVICE, {"notraw": "mtp_notraw"})
    with pytest.raises(BackendUnavailableError, match=r"mtp-notraw.*NotADevice, not a RawDevice"):
        open_backend("notraw", settings=SETTINGS)
    import mtp_notraw  # type: ignore[import-not-found]

    assert len(mtp_notraw.CLOSED) == 1


# -- auto by preference, not by name --


def _preferring(preference: object, probe: str = "None") -> str:
    return GOOD.replace(
        'description="a third-party test backend"', f"preference={preference!r}, probe=lambda s: {probe}"
    )


def test_auto_opens_the_available_backend_with_the_highest_preference(site: Path) -> None:
    install_distribution(site, "mtp-high", "mtp_high", _preferring(10_000), {"zhigh": "mtp_high"})
    install_distribution(site, "mtp-higher", "mtp_higher", _preferring(20_000, "'no device here'"),
                         {"zhigher": "mtp_higher"})
    with open_backend("auto", settings=SETTINGS) as gpu:
        assert gpu.name == "zhigh", "the highest available preference wins; an unavailable one never does"
    with open_backend(settings=SETTINGS.updated(backend="auto")) as gpu:
        assert gpu.name == "zhigh"


def test_auto_breaks_a_tie_by_name(site: Path) -> None:
    install_distribution(site, "mtp-tie-b", "mtp_tie_b", _preferring(10_000), {"tieb": "mtp_tie_b"})
    install_distribution(site, "mtp-tie-a", "mtp_tie_a", _preferring(10_000), {"tiea": "mtp_tie_a"})
    for _ in range(2):
        with open_backend("auto", settings=SETTINGS) as gpu:
            assert gpu.name == "tiea"


def test_auto_prefers_the_fake_to_a_wrapper_of_it() -> None:
    infos = available_backends(SETTINGS)
    if infos.get("cuda") is not None and infos["cuda"].available:
        pytest.skip("a GPU answers here: auto opens cuda")
    with open_backend("auto", settings=SETTINGS) as gpu:
        assert gpu.name == "fake", "the tracing example declares a lower preference than the fake it wraps"


@pytest.mark.parametrize("preference", ["high", True, 1.5])
def test_a_preference_that_is_not_an_integer_is_unavailable(site: Path, preference: object) -> None:
    install_distribution(site, "mtp-pref", "mtp_pref", _preferring(preference), {"pref": "mtp_pref"})
    info = available_backends(SETTINGS)["pref"]
    assert not info.available and "mtp-pref" in (info.reason or "") and "preference" in (info.reason or "")


def test_backend_class_must_be_a_gpu_backend(site: Path) -> None:
    source = GOOD.replace('description="a third-party test backend"', "backend_class=dict")
    install_distribution(site, "mtp-cls", "mtp_cls", source, {"cls": "mtp_cls"})
    info = available_backends(SETTINGS)["cls"]
    assert not info.available and "backend_class" in (info.reason or "")


# -- settings of a plugin's own --

WITH_SETTINGS = """
    from typing import ClassVar

    from pydantic import Field
    from pydantic_settings import SettingsConfigDict

    from metrale_core.plugin import BackendRegistration, PluginSettings, Size, hookimpl
    from metrale_fake import FakeDevice

    class OwnSettings(PluginSettings):
        model_config: ClassVar[SettingsConfigDict] = SettingsConfigDict(env_prefix="METRALE_OWNED_")

        window_bytes: Size = Field(4096, gt=0, description="a size of its own")
        verbose: bool = False

    SEEN = []

    def _open(settings, ordinal):
        SEEN.append(settings.plugin(OwnSettings))
        return FakeDevice(settings, ordinal)

    @hookimpl
    def metrale_backend(settings):
        return BackendRegistration(open=_open)

    @hookimpl
    def metrale_settings():
        return OwnSettings
"""


def test_a_third_party_plugin_declares_settings(
    site: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    install_distribution(site, "mtp-owned", "mtp_owned", WITH_SETTINGS, {"owned": "mtp_owned"})
    monkeypatch.setenv("METRALE_OWNED_WINDOW_BYTES", "64 KiB")
    monkeypatch.setenv("METRALE_OWNED_VERBOSE_", "1")
    with caplog.at_level("WARNING", logger="metrale"):
        settings = MetraleSettings(owned_verbose=True)
    assert (settings.owned_window_bytes, settings.owned_verbose) == (64 << 10, True)
    assert any("METRALE_OWNED_VERBOSE_ is not a metrale setting" in r.getMessage()
               and "did you mean METRALE_OWNED_VERBOSE?" in r.getMessage() for r in caplog.records)
    with open_backend("owned", settings=settings):
        import mtp_owned  # type: ignore[import-not-found]

        assert mtp_owned.SEEN[-1].window_bytes == 64 << 10 and mtp_owned.SEEN[-1].verbose
    with pytest.raises(ConfigError, match=r"keyword owned_window_bytes=0"):
        settings.updated(owned_window_bytes=0)
    monkeypatch.setenv("METRALE_OWNED_WINDOW_BYTES", "wide")
    with pytest.raises(ConfigError, match=r"METRALE_OWNED_WINDOW_BYTES='wide'"):
        MetraleSettings()


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (('env_prefix="METRALE_OWNED_"', 'env_prefix="METRALE_OTHER_"'), "must read 'METRALE_OWNED_'"),
        (("return OwnSettings", "return 42"), "must return one PluginSettings subclass"),
        (("return OwnSettings", "raise RuntimeError('settings blew up')"), "settings blew up"),
        (("verbose: bool = False", "redzone_fill: int = 0"), None),  # named "owned_redzone_fill": no clash
    ],
)
def test_a_plugin_whose_settings_are_wrong_does_not_break_settings(
    site: Path, caplog: pytest.LogCaptureFixture, change: tuple[str, str], complaint: str | None
) -> None:
    install_distribution(site, "mtp-owned", "mtp_owned", WITH_SETTINGS.replace(*change), {"owned": "mtp_owned"})
    with caplog.at_level("WARNING", logger="metrale"):
        settings = MetraleSettings(redzone=64)
    assert settings.redzone == 64
    if complaint is None:
        assert settings.owned_redzone_fill == 0
        return
    assert any("mtp-owned" in r.getMessage() and complaint in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="owned_window_bytes"):
        MetraleSettings(owned_window_bytes=1)
    assert settings.fake_memory_bytes == SETTINGS.fake_memory_bytes


def test_a_plugin_settings_name_clash_is_skipped(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = WITH_SETTINGS.replace("METRALE_OWNED_", "METRALE_REDZONE_").replace("verbose: bool", "fill: int")
    install_distribution(site, "mtp-clash", "mtp_clash", source, {"redzone": "mtp_clash"})
    with caplog.at_level("WARNING", logger="metrale"):
        settings = MetraleSettings()
    assert settings.redzone_fill == 0xA5
    assert any("mtp-clash" in r.getMessage() and "redzone_fill" in r.getMessage() for r in caplog.records)


def test_a_plugin_that_fails_to_load_does_not_break_settings(site: Path) -> None:
    install_distribution(site, "mtp-broken", "mtp_broken", "import no_such_module_anywhere\n", {"broken": "mtp_broken"})
    settings = MetraleSettings(fake_defer=True)
    assert settings.fake_defer
