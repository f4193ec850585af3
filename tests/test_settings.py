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
