"""``n_tile``: golden values on 132 multiprocessors (an H200), its properties, its refusals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale_core import InvalidArgumentError, NTile, TensorMapSpec, check_tensor_map, n_tile


@pytest.mark.parametrize(
    ("m", "n", "expected"),
    [
        # decode: one row of 64, 64 tiles of 64 fill one wave at half the SMs; wider tiles only cost more
        (1, 4096, (64, 64, 64, 1, 64)),
        (128, 4096, (64, 128, 64, 1, 64)),
        # 64 and 128 both take 128 columns' time; 128 fills its one wave fuller (112 against 92 in the second)
        (256, 7168, (128, 128, 112, 1, 112)),
        # 528 tiles of 64 are exactly 4 full waves
        (2048, 2112, (64, 128, 528, 4, 132)),
        # every width takes 1024 columns' time; 256 has the fullest last wave (116 against 100 and 68)
        (4096, 4096, (256, 128, 512, 4, 116)),
        (64, 7168, (64, 64, 112, 1, 112)),
        (4096, 7168, (256, 128, 896, 7, 104)),
    ],
)
def test_golden_values_on_132_sms(m: int, n: int, expected: tuple[int, int, int, int, int]) -> None:
    got = n_tile(m, n, num_sms=132)
    assert (got.n_tile, got.block_m, got.tiles, got.waves, got.last_wave_util) == expected
    assert got.efficiency == pytest.approx(got.tiles / (got.waves * 132))


def test_the_options() -> None:
    assert n_tile(4096, 4096, num_sms=132, candidates=(128,)).waves == 8
    assert n_tile(4096, 4096, num_sms=132, occupancy=2).waves == 2
    assert n_tile(64, 4096, num_sms=132, block_m=32).tiles == 2 * 64
    assert n_tile(128, 4096, num_sms=132, groups=8, candidates=(64,)).tiles == 8 * 64
    assert n_tile(128, 4096, num_sms=132, groups=8).n_tile == 256  # one wave of 128 tiles: as fast, fuller
    # with 4-byte elements a 256-wide tile spans 1024 bytes: past a 128-byte swizzle, so 32 is the widest kept
    assert n_tile(128, 4096, num_sms=132, candidates=(32, 256), element_bytes=4, swizzle_bytes=128).n_tile == 32


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"m": 0, "n": 1}, "m must be a positive int"),
        ({"m": 1, "n": -4}, "n must be a positive int"),
        ({"m": 1, "n": 1, "num_sms": 0}, "num_sms must be a positive int"),
        ({"m": 1, "n": 1, "candidates": ()}, "non-empty sequence"),
        ({"m": 1, "n": 1, "candidates": "64"}, "non-empty sequence"),
        ({"m": 1, "n": 1, "candidates": (512,)}, "no candidate of [512] fits"),
        ({"m": 1, "n": 1, "candidates": (12,)}, "no candidate of [12] fits"),
        ({"m": 1, "n": 1, "candidates": (64, 128), "swizzle_bytes": 64, "element_bytes": 4}, "at most 64 bytes"),
        ({"m": 1.5, "n": 1}, "m must be a positive int"),
        ({"m": 1, "n": 1, "block_m": 0}, "block_m must be a positive int"),
        ({"m": 1, "n": 128, "element_bytes": 3}, "element_bytes must be the size of a TMA data type"),
        ({"m": 1, "n": 128, "element_bytes": 1 << 64}, "element_bytes must be the size of a TMA data type"),
        ({"m": 1, "n": 128, "swizzle_bytes": 48}, "swizzle_bytes must be a swizzle's span"),
    ],
)
def test_refusals(kw: dict[str, object], words: str) -> None:
    kw = {"num_sms": 132, **kw}
    with pytest.raises(InvalidArgumentError) as info:
        n_tile(**kw)  # type: ignore[arg-type]
    assert words in str(info.value)


_SIZES = st.integers(1, 1 << 15)
_ELEMENT = st.sampled_from([1, 2, 4, 8])
_DTYPE = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}
_SWIZZLE = {32: "32b", 64: "64b", 128: "128b"}


@given(m=_SIZES, n=_SIZES, sms=st.integers(1, 264), element=_ELEMENT, swizzle=st.sampled_from([None, 32, 64, 128]),
       candidates=st.lists(st.sampled_from([8, 16, 32, 48, 64, 96, 128, 192, 256]), min_size=1, max_size=4))
def test_the_chosen_tile_is_a_box_width_the_driver_takes(
    m: int, n: int, sms: int, element: int, swizzle: int | None, candidates: list[int]
) -> None:
    try:
        chosen = n_tile(m, n, num_sms=sms, candidates=candidates, element_bytes=element, swizzle_bytes=swizzle)
    except InvalidArgumentError:
        return  # no candidate fits: refused, as the next test checks
    spec = TensorMapSpec(_DTYPE[element], (4, 4096), (4096 * element, element), (1, chosen.n_tile),
                         swizzle=_SWIZZLE[swizzle] if swizzle else "none")
    check_tensor_map(spec, 0x10000)


@given(m=_SIZES, n=_SIZES, sms=st.integers(1, 263), groups=st.integers(1, 8), occupancy=st.integers(1, 4),
       width=st.sampled_from([64, 128, 256]))
def test_waves_never_increase_when_sms_are_added(m: int, n: int, sms: int, groups: int, occupancy: int,
                                                 width: int) -> None:
    """For a tile width, more SMs never make more waves; for the choice, the wave-quantised time (waves *
    n_tile) never grows. (The choice's waves alone can grow: at 106 SMs a 1024 x 2560 GEMM takes one wave of
    80 tiles of 256, at 107 three waves of 64, 320 tiles, which take 192 columns' time instead of 256.)"""
    kw = {"groups": groups, "occupancy": occupancy}
    fewer, more = n_tile(m, n, num_sms=sms, candidates=(width,), **kw), n_tile(m, n, num_sms=sms + 1,
                                                                               candidates=(width,), **kw)
    assert more.waves <= fewer.waves
    a, b = n_tile(m, n, num_sms=sms, **kw), n_tile(m, n, num_sms=sms + 1, **kw)
    assert b.waves * b.n_tile <= a.waves * a.n_tile


@given(m=_SIZES, n=_SIZES, sms=st.integers(1, 264), occupancy=st.integers(1, 4))
def test_the_figures_follow_their_formulas(m: int, n: int, sms: int, occupancy: int) -> None:
    t = n_tile(m, n, num_sms=sms, occupancy=occupancy)
    assert isinstance(t, NTile)
    slots = sms * occupancy
    assert t.tiles == -(-m // t.block_m) * -(-n // t.n_tile)
    assert t.waves == -(-t.tiles // slots) and 1 <= t.last_wave_util <= slots
    assert t.tiles == (t.waves - 1) * slots + t.last_wave_util
    assert 0 < t.efficiency <= 1
    for other in (64, 128, 256):
        alt = n_tile(m, n, num_sms=sms, occupancy=occupancy, candidates=(other,))
        assert (t.waves * t.n_tile, -t.last_wave_util, t.n_tile) <= (alt.waves * alt.n_tile, -alt.last_wave_util,
                                                                       alt.n_tile)
