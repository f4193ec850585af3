"""MetraleSettings: the one reader of the environment."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic.fields import FieldInfo

from metrale_core import ConfigError, LaunchEnvironment, MetraleSettings


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


def _integer_settings() -> list[str]:
    """Every plain integer setting, the core's and the installed plugins' (as ``MetraleSettings`` keywords)."""
    from metrale_core._settings.model import installed_plugin_settings
    from metrale_core._settings.parsing import is_size

    def integer(field: FieldInfo) -> bool:
        return field.annotation in (int, int | None) and not is_size(field)

    names = [name for name, field in MetraleSettings.model_fields.items() if integer(field)]
    for p in installed_plugin_settings():
        names += [p.keyword(name) for name, field in p.model.model_fields.items() if integer(field)]
    return names


def test_every_integer_setting_is_listed() -> None:
    names = _integer_settings()
    assert {"oom_retries", "memory_history", "redzone_min_idx", "redzone_fill", "redzone_trace_idx"} <= set(names)
    assert "redzone" not in names and "fake_memory_bytes" not in names  # sizes, which take units too


@pytest.mark.parametrize("name", _integer_settings())
def test_every_integer_setting_takes_hex_and_refuses_booleans(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    _clear_metrale_env(monkeypatch)
    monkeypatch.setenv(f"METRALE_{name.upper()}", "0x3")
    assert getattr(MetraleSettings(), name) == 3
    assert getattr(MetraleSettings(**{name: "0X3"}), name) == 3
    with pytest.raises(ConfigError, match=rf"keyword {name}=True: expected an integer, not a boolean"):
        MetraleSettings(**{name: True})


def test_oom_retries_and_memory_history_take_hex(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_metrale_env(monkeypatch)
    monkeypatch.setenv("METRALE_OOM_RETRIES", "0x3")
    monkeypatch.setenv("METRALE_MEMORY_HISTORY", "0x10")
    s = MetraleSettings()
    assert (s.oom_retries, s.memory_history) == (3, 16)


@pytest.mark.parametrize(
    ("var", "value", "allowed"),
    [
        ("METRALE_OOM_RETRIES", "-1", "expected an integer from 0 to 100"),
        ("METRALE_OOM_RETRIES", "101", "expected an integer from 0 to 100"),
        ("METRALE_OOM_RETRIES", "0x65", "expected an integer from 0 to 100, got 101"),
        ("METRALE_MEMORY_HISTORY", "-1", "expected an integer from 0 to 10000000"),
        ("METRALE_REDZONE_MIN_IDX", "-1", "expected an integer of at least 0"),
        ("METRALE_REDZONE_TRACE_IDX", "-5", "expected an integer of at least 0"),
        ("METRALE_REDZONE_FILL", "256", "expected an integer from 0 to 255"),
        ("METRALE_REDZONE", "-1", "expected a size in bytes of at least 0"),
        ("METRALE_FAKE_MEMORY_BYTES", "0", "expected a size in bytes of at least 1"),
        ("METRALE_FAKE_MEMORY_BYTES", "-1 KiB", "expected a size in bytes of at least 1, got -1024"),
        ("METRALE_DEBUG_SYNC_KERNELS", "perhaps", "expected a boolean: 1 or 0, true or false, yes or no, on or off"),
        ("METRALE_REDZONE_ACTION", "explode", "expected 'warn' or 'raise'"),
    ],
)
def test_refusals_are_in_metrales_words(monkeypatch: pytest.MonkeyPatch, var: str, value: str, allowed: str) -> None:
    _clear_metrale_env(monkeypatch)
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        MetraleSettings()
    text = str(info.value)
    assert f"invalid setting {var}={value!r}: {allowed}" in text, text
    assert "Input should" not in text and "greater than or equal" not in text


@pytest.mark.parametrize(
    ("keyword", "value", "allowed"),
    [
        ("oom_retries", -1, "expected an integer from 0 to 100"),
        ("oom_retries", "-1", "expected an integer from 0 to 100"),
        ("memory_history", 10**8, "expected an integer from 0 to 10000000"),
        ("redzone_fill", 300, "expected an integer from 0 to 255"),
        ("fake_memory_bytes", -1, "expected a size in bytes of at least 1"),
        ("oom_retries", 2.5, "expected a valid integer, got a number with a fractional part"),
        ("fake_memry_bytes", 1, "no such setting (did you mean fake_memory_bytes?)"),
    ],
)
def test_keyword_refusals_are_in_metrales_words(keyword: str, value: object, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        MetraleSettings(**{keyword: value})
    assert f"invalid setting keyword {keyword}={value!r}: {allowed}" in str(info.value), str(info.value)


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


@pytest.mark.parametrize(
    ("keyword", "value", "allowed"),
    [
        ("rank", -1, "expected an integer of at least 0"),
        ("world_size", 0, "expected an integer of at least 1"),
        ("local_rank", "first", "expected an integer (decimal or 0x hex)"),
        ("rnak", 1, "no such setting (did you mean rank?)"),
        ("rank", True, "expected an integer, not a boolean"),
    ],
)
def test_launch_environment_keywords_are_refused_as_its_variables_are(
    monkeypatch: pytest.MonkeyPatch, keyword: str, value: object, allowed: str
) -> None:
    """issue 37 item 9: a bad keyword of LaunchEnvironment is a ConfigError in metrale's words, as a bad
    variable is (not pydantic's ValidationError), and an unknown keyword is refused, naming it."""
    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(ConfigError) as info:
        LaunchEnvironment(**{keyword: value})
    assert f"invalid setting keyword {keyword}={value!r}: {allowed}" in str(info.value), str(info.value)
    monkeypatch.setenv("RANK", "-1")
    with pytest.raises(ConfigError, match=r"invalid setting RANK='-1': expected an integer of at least 0"):
        LaunchEnvironment()
    assert (LaunchEnvironment(rank=3).rank, LaunchEnvironment(rank="0x3").rank) == (3, 3)


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
    with pytest.raises(ConfigError, match=r"keyword fake_memory_bytes=-1: expected a size in bytes of at least 1"):
        MetraleSettings(fake_memory_bytes=-1)
    with pytest.raises(ConfigError, match=r"keyword fake_compute_capability='sm_90'"):
        MetraleSettings().updated(fake_compute_capability="sm_90")
    with pytest.raises(ConfigError, match=r"keyword fake_memry_bytes=1: no such setting"):
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

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "tools"))
    import mkdocs_hooks

    table = mkdocs_hooks.on_page_markdown(f"x\n{mkdocs_hooks.PLACEHOLDER}\ny")
    assert "| `METRALE_REDZONE` | int (size) | `0` |" in table
    assert "| `METRALE_FAKE_MEMORY_BYTES` | int (size) | `16 GiB` |" in table
    assert "`METRALE_FAKE_DEFER`" in table and "metrale-fake" in table
    del sys.modules["mkdocs_hooks"]


# -- random environments: a ConfigError or settings that round-trip, nothing else --------------------------


def _every_setting() -> list[tuple[str, str]]:
    """``(variable, keyword)`` of every setting: the core's, and the installed plugins' (read through
    ``MetraleSettings``)."""
    from metrale_core._settings.model import installed_plugin_settings
    from metrale_core._settings.plugins import ENV_PREFIX

    pairs = [(f"{ENV_PREFIX}{name.upper()}", name) for name in MetraleSettings.model_fields]
    for p in installed_plugin_settings():
        pairs += [(f"{p.env_prefix}{name.upper()}", p.keyword(name)) for name in p.model.model_fields]
    return pairs


_SETTINGS = _every_setting()
#: What an environment variable can hold: any text but NUL and lone surrogates.
_TEXT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=12)
_ENV_VALUES = st.one_of(
    _TEXT,
    st.integers(-(1 << 70), 1 << 70).map(str),
    st.integers(-(1 << 70), 1 << 70).map(hex),
    st.builds(
        "{}{}{}".format,
        st.one_of(st.integers(-3, 1 << 40), st.integers(0, 1 << 40).map(hex)),
        st.sampled_from(["", " ", "  "]),
        st.sampled_from(["B", "KiB", "MiB", "GiB", "kib", "GIB", "kB", "GB", "TiB", "b", "x"]),
    ),
    st.sampled_from([
        "", " ", "0", "-0", "+3", "0x", "0X1F", "1.5", "1e3", "nan", "inf", "1_000", "\u0663", "\uff17", "true",
        "FALSE", "yes", "Off", "perhaps", "warn", "raise", "null", "None", "[]", "{}", "9.0", "12.0", "sm_90", "fake",
        "auto", "strix-halo", "/tmp/snapshots", " 64 KiB ", "0x10 KiB", "2 GiB", "18446744073709551616", "-1", "-0x10",
    ]),
)


def _as_variable(value: object) -> str:
    """A setting's value written back as its variable would hold it (``None``: unset)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):  # package names: comma-separated, ``none`` for none
        return ",".join(value) or "none"
    return str(value)


def _settings_or_config_error(build: Callable[[], MetraleSettings], named: list[str]) -> MetraleSettings | None:
    """``build()``, or ``None`` where it raised a ``ConfigError`` naming one of ``named``; nothing else may come out."""
    try:
        return build()
    except ConfigError as exc:
        assert any(name in str(exc) for name in named), str(exc)
        return None
    except Exception as exc:  # pragma: no cover - the failure being guarded against
        pytest.fail(f"{type(exc).__module__}.{type(exc).__name__} escaped: {exc}")


def _field(keyword: str) -> FieldInfo:
    from metrale_core._settings.model import installed_plugin_settings

    if keyword in MetraleSettings.model_fields:
        return MetraleSettings.model_fields[keyword]
    for p in installed_plugin_settings():
        if keyword.startswith(p.keyword("")) and keyword.removeprefix(p.keyword("")) in p.model.model_fields:
            return p.model.model_fields[keyword.removeprefix(p.keyword(""))]
    raise AssertionError(keyword)


def _in_bounds(field: FieldInfo, n: int) -> bool:
    import annotated_types as at

    for m in field.metadata:
        if (isinstance(m, at.Ge) and n < m.ge) or (isinstance(m, at.Gt) and n <= m.gt):
            return False
        if (isinstance(m, at.Le) and n > m.le) or (isinstance(m, at.Lt) and n >= m.lt):
            return False
    return True


def _integer_literal(text: str) -> int | None:
    """The integer an ASCII decimal or ``0x`` hex literal (spaces around it allowed) writes, else ``None``."""
    match = re.fullmatch(r"[ \t]*(0[xX][0-9a-fA-F]+|-?[0-9]+)[ \t]*", text)
    if match is None:
        return None
    digits = match.group(1)
    return int(digits, 16) if digits[:2].lower() == "0x" else int(digits)


@pytest.mark.parametrize(("variable", "keyword"), _SETTINGS, ids=[v for v, _ in _SETTINGS])
@given(value=_ENV_VALUES, other=st.sampled_from(_SETTINGS), other_value=_ENV_VALUES)
def test_any_environment_gives_settings_that_round_trip_or_a_config_error(
    variable: str, keyword: str, value: str, other: tuple[str, str], other_value: str
) -> None:
    env = {variable: value, other[0]: other_value} if other[0] != variable else {variable: value}
    keywords = {variable: keyword, other[0]: other[1]}
    field = _field(keyword)
    with pytest.MonkeyPatch.context() as mp:
        _clear_metrale_env(mp)
        literal = _integer_literal(value)
        if field.annotation in (int, int | None) and literal is not None and _in_bounds(field, literal):
            # an integer setting takes every decimal or 0x hex integer in its range, sizes too
            mp.setenv(variable, value)
            alone = _settings_or_config_error(MetraleSettings, [variable])
            assert alone is not None and getattr(alone, keyword) == literal, (variable, value)
        for var, text in env.items():
            mp.setenv(var, text)
        s = _settings_or_config_error(MetraleSettings, list(env))
        if s is None:
            return
        assert MetraleSettings(**s.model_dump()) == s
        for var in env:
            mp.setenv(var, _as_variable(getattr(s, keywords[var])))
        assert MetraleSettings() == s


_KEYWORD_VALUES = st.one_of(
    _ENV_VALUES, st.integers(-(1 << 70), 1 << 70), st.floats(), st.booleans(), st.none(), st.binary(max_size=4),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
    st.builds(object), st.just(Path("/tmp/x")), st.complex_numbers(),
)


@pytest.mark.parametrize("keyword", [k for _, k in _SETTINGS])
@given(value=_KEYWORD_VALUES)
def test_any_keyword_value_gives_settings_that_round_trip_or_a_config_error(keyword: str, value: object) -> None:
    with pytest.MonkeyPatch.context() as mp:
        _clear_metrale_env(mp)
        s = _settings_or_config_error(lambda: MetraleSettings(**{keyword: value}), [keyword])
        if s is None:
            return
        assert MetraleSettings(**s.model_dump()) == s
        assert s.updated(**{keyword: getattr(s, keyword)}) == s
