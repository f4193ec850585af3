"""MetraleSettings: the one reader of the environment."""

from __future__ import annotations

import pytest

from metrale_core import ConfigError, MetraleSettings


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(__import__("os").environ):
        if var.startswith("METRALE_"):
            monkeypatch.delenv(var)
    s = MetraleSettings()
    assert (s.backend, s.redzone, s.redzone_fill, s.redzone_trace_idx) == ("auto", 0, 0xA5, None)
    assert s.fake_memory_bytes == 16 << 30 and not s.scale_variant


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("0x100", 256), ("2GiB", 2 << 30), ("2 gib", 2 << 30), ("64 KiB", 64 << 10), ("3mib", 3 << 20)],
)
def test_sizes(monkeypatch: pytest.MonkeyPatch, text: str, value: int) -> None:
    monkeypatch.setenv("METRALE_REDZONE", text)
    monkeypatch.setenv("METRALE_FAKE_MEMORY_BYTES", text)
    s = MetraleSettings()
    assert s.redzone == value and s.fake_memory_bytes == value


def test_hex_for_plain_integers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_REDZONE_FILL", "0x5a")
    monkeypatch.setenv("METRALE_REDZONE_TRACE_IDX", "0x10")
    s = MetraleSettings()
    assert (s.redzone_fill, s.redzone_trace_idx) == (0x5A, 16)


def test_empty_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_REDZONE", "")
    monkeypatch.setenv("METRALE_BACKEND", "")
    s = MetraleSettings()
    assert (s.redzone, s.backend) == (0, "auto")


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("METRALE_REDZONE", "lots"),
        ("METRALE_REDZONE", "-1"),
        ("METRALE_REDZONE_FILL", "256"),
        ("METRALE_REDZONE_FILL", "1KiB"),
        ("METRALE_DEBUG_SYNC_KERNELS", "perhaps"),
        ("METRALE_FAKE_MEMORY_BYTES", "0"),
        ("METRALE_REDZONE_TRACE_IDX", "x"),
    ],
)
def test_bad_values_name_the_variable(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        MetraleSettings()
    assert var in str(info.value) and value in str(info.value)


def test_bad_keyword_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"keyword redzone_fill=300"):
        MetraleSettings(redzone_fill=300)
    with pytest.raises(ConfigError, match="redzone"):
        MetraleSettings(redzone=True)


def test_keywords_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_REDZONE", "64")
    assert MetraleSettings(redzone=128).redzone == 128


def test_scale_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_TARGET_HW", "strix-halo")
    assert MetraleSettings().scale_variant
    assert not MetraleSettings(target_hw="h200").scale_variant


# -- the fake's settings: a plugin's model, contributed through the metrale_settings hook --


def _clear_metrale_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(__import__("os").environ):
        if var.startswith("METRALE_"):
            monkeypatch.delenv(var)


def test_the_core_model_names_no_plugin_setting() -> None:
    assert not [name for name in MetraleSettings.model_fields if name.startswith("fake_")]


def test_fake_settings_keep_their_keywords_attributes_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from metrale_fake import FakeSettings

    _clear_metrale_env(monkeypatch)
    monkeypatch.setenv("METRALE_FAKE_INTEGRATED", "yes")
    s = MetraleSettings(fake_memory_bytes="1 MiB", fake_compute_capability="7.5")
    assert (s.fake_memory_bytes, s.fake_integrated, s.fake_compute_capability, s.fake_defer) == (
        1 << 20, True, "7.5", False)
    own = s.plugin(FakeSettings)
    assert (own.memory_bytes, own.integrated, own.compute_capability, own.defer) == (1 << 20, True, "7.5", False)
    changed = s.updated(fake_defer=True)
    assert changed.fake_defer and changed.fake_memory_bytes == 1 << 20 and changed.redzone == s.redzone
    assert changed != s and s.updated() == s
    dumped = s.model_dump()
    assert dumped["fake_memory_bytes"] == 1 << 20 and "fake_defer" in dumped
    assert MetraleSettings(**dumped) == s
    assert "fake_memory_bytes=1048576" in repr(s)
    assert s.model_dump(include={"redzone", "fake_defer"}) == {"redzone": s.redzone, "fake_defer": False}
    with pytest.raises(AttributeError):
        _ = s.fake_no_such_setting


def test_bad_fake_values_raise_config_error_naming_the_keyword_or_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_metrale_env(monkeypatch)
    with pytest.raises(ConfigError, match=r"keyword fake_memory_bytes=-1: Input should be greater than 0"):
        MetraleSettings(fake_memory_bytes=-1)
    with pytest.raises(ConfigError, match=r"keyword fake_compute_capability='sm_90'"):
        MetraleSettings().updated(fake_compute_capability="sm_90")
    with pytest.raises(ConfigError, match=r"keyword fake_memry_bytes=1: Extra inputs are not permitted"):
        MetraleSettings(fake_memry_bytes=1)
    monkeypatch.setenv("METRALE_FAKE_DEFER", "perhaps")
    with pytest.raises(ConfigError, match=r"keyword redzone_fill=300: .*and 1 more: METRALE_FAKE_DEFER='perhaps'"):
        MetraleSettings(redzone_fill=300)


def test_unknown_variables_warn_for_plugin_prefixes_too(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _clear_metrale_env(monkeypatch)
    monkeypatch.setenv("METRALE_FAKE_MEMRY_BYTES", "1")
    monkeypatch.setenv("METRALE_FAKE_MEMORY_BYTES", "2 GiB")
    with caplog.at_level("WARNING", logger="metrale"):
        assert MetraleSettings().fake_memory_bytes == 2 << 30
    messages = [r.getMessage() for r in caplog.records]
    assert any("METRALE_FAKE_MEMRY_BYTES" in m and "did you mean METRALE_FAKE_MEMORY_BYTES?" in m for m in messages)
    assert not any(m.startswith("METRALE_FAKE_MEMORY_BYTES ") for m in messages), messages


def test_plugin_needs_a_plugin_settings_model() -> None:
    from metrale_core import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="PluginSettings"):
        MetraleSettings().plugin(dict)  # type: ignore[type-var]


def test_plugin_settings_alone_raise_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from metrale_fake import FakeSettings

    _clear_metrale_env(monkeypatch)
    with pytest.raises(ConfigError, match=r"keyword memory_bytes=0"):
        FakeSettings(memory_bytes=0)
    monkeypatch.setenv("METRALE_FAKE_MEMORY_BYTES", "lots")
    with pytest.raises(ConfigError, match=r"METRALE_FAKE_MEMORY_BYTES='lots'"):
        FakeSettings()


def test_the_settings_table_lists_the_core_and_the_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))
    import mkdocs_hooks

    table = mkdocs_hooks.on_page_markdown(f"x\n{mkdocs_hooks.PLACEHOLDER}\ny")
    assert "| `METRALE_REDZONE` | int (size) | `0` |" in table
    assert "| `METRALE_FAKE_MEMORY_BYTES` | int (size) | `16 GiB` |" in table
    assert "`METRALE_FAKE_DEFER`" in table and "metrale-fake" in table
    del sys.modules["mkdocs_hooks"]
