"""Tensor maps (TMA descriptors) on every backend: the spec, the driver's rules (a table of the named cases
and a random agreement test against each backend's own encoder), the API's own rules, the shipped TMA kernel."""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_core import (
    TENSOR_MAP_DTYPES,
    TENSOR_MAP_RULES,
    BackendClosedError,
    DeviceFaultError,
    GpuBackend,
    InvalidArgumentError,
    InvalidBufferError,
    Kernel,
    MetraleError,
    TensorMap,
    TensorMapError,
    TensorMapSpec,
    available_backends,
    check_tensor_map,
    kernel_implementation,
    open_backend,
)
from metrale_core.kernels import shipped_modules
from metrale_fake import FakeLaunch
from tests._support import SETTINGS, examples

pytestmark = pytest.mark.needs("kernels", "tensor_maps")

BASE = 0x7F00_0000_0000  # an address aligned to everything (the driver never follows it)
H200 = {"compute_capability": (9, 0), "smem_per_sm": 233472}


def spec(dtype: str = "float32", shape: tuple[int, ...] = (64, 64), box: tuple[int, ...] | None = None,
         strides: tuple[int, ...] | None = None, **kw: object) -> TensorMapSpec:
    size = TENSOR_MAP_DTYPES[dtype]
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * size for i in range(len(shape)))
    return TensorMapSpec(dtype, shape, strides, box or tuple(min(d, 16) for d in shape), **kw)  # type: ignore[arg-type]


# -- the spec ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kw", "words"),
    [
        (("float33", (4,), (4,), (4,)), {}, "dtype must be one of"),
        ((7, (4,), (4,), (4,)), {}, "dtype must be one of"),
        (("float32", (4, 4), (16,), (4, 4)), {}, "one length"),
        (("float32", (4,), (4,), (4,)), {"element_strides": (1, 1)}, "one length"),
        (("float32", (4, 4), (16, 8), (4, 4)), {}, "strides[-1] is 8"),
        (("float32", (4, -1), (16, 4), (4, 4)), {}, "shape[1] is -1"),
        (("float32", (4, True), (16, 4), (4, 4)), {}, "shape[1] is True"),
        (("float32", (4, 4), (16, 4), (4, 1 << 32)), {}, "box[1]"),
        (("float32", (1 << 64, 4), (16, 4), (4, 4)), {}, "shape[0]"),
        (("float32", "44", (16, 4), (4, 4)), {}, "shape must be a tuple of ints"),
        (("float32", (4,), (4,), (4,)), {"interleave": "8b"}, "interleave must be one of"),
        (("float32", (4,), (4,), (4,)), {"swizzle": "256b"}, "swizzle must be one of"),
        (("float32", (4,), (4,), (4,)), {"l2_promotion": None}, "l2_promotion must be one of"),
        (("float32", (4,), (4,), (4,)), {"oob_fill": "inf"}, "oob_fill must be one of"),
    ],
)
def test_spec_refuses_what_it_cannot_hold(args: tuple[object, ...], kw: dict[str, object], words: str) -> None:
    with pytest.raises(InvalidArgumentError, match=None) as info:
        TensorMapSpec(*args, **kw)  # type: ignore[arg-type]
    assert words in str(info.value)
    assert not isinstance(info.value, TensorMapError)  # the driver's rules are check_tensor_map's


def test_spec_is_immutable_and_encodes_innermost_first() -> None:
    s = TensorMapSpec("bfloat16", [8, 32, 64], [4096, 128, 2], [2, 16, 64], element_strides=[1, 2, 1],
                      swizzle="128b", oob_fill="nan", l2_promotion="256b", interleave="none")
    with pytest.raises(AttributeError):
        s.dtype = "float32"  # type: ignore[misc]
    e = s.encoding()
    assert (e.data_type, e.rank, e.global_dim, e.global_strides) == (9, 3, (64, 32, 8), (128, 4096))
    assert (e.box_dim, e.element_strides, e.swizzle, e.l2_promotion, e.oob_fill) == ((64, 16, 2), (1, 2, 1), 3, 3, 1)
    assert e.spec() == s
    assert s.extent == 7 * 4096 + 31 * 128 + 63 * 2 + 2
    assert s.tile_shape == (2, 8, 64)
    assert list(TENSOR_MAP_DTYPES) == [
        "uint8", "uint16", "uint32", "int32", "uint64", "int64", "float16", "float32", "float64", "bfloat16",
        "float32_ftz", "tfloat32", "tfloat32_ftz",
    ]


# -- the driver's rules: the named cases (measured on the H200, driver 580.159.04) --------------------------

U8_BIG = dict(dtype="uint8", shape=(8, 256, 256))


def _case(rule: str | None, address: int = BASE, **kw: object) -> tuple[str | None, int, dict[str, object]]:
    return rule, address, kw


CASES = {
    "rank 1": _case(None, shape=(64,), box=(16,)),
    "rank 5": _case(None, shape=(2, 2, 2, 2, 16), box=(2, 2, 2, 2, 16)),
    "rank 6": _case("rank", shape=(2, 2, 2, 2, 2, 16), box=(2, 2, 2, 2, 2, 16)),
    "rank 0": _case("rank", shape=(), box=(), strides=()),
    "interleave with rank 2": _case("interleave_rank", shape=(16, 16), interleave="16b"),
    "interleave with rank 3": _case(None, shape=(4, 16, 16), interleave="16b"),
    "address NULL (not checked)": _case(None, address=0),
    "address + 16": _case(None, address=BASE + 16),
    "address + 8": _case("address_alignment", address=BASE + 8),
    "address + 16, 32-byte interleave": _case("address_alignment", address=BASE + 16, shape=(4, 16, 16),
                                              interleave="32b"),
    "dimension 0": _case("global_dim", shape=(0, 64)),
    "dimension 2**32": _case(None, shape=(1 << 32,), box=(16,)),
    "dimension 2**32 + 1": _case("global_dim", shape=((1 << 32) + 1,), box=(16,)),
    "stride 0 (overlapping, accepted)": _case(None, shape=(64, 64), strides=(0, 4)),
    "stride 8": _case("global_stride", shape=(64, 2), strides=(8, 4), box=(16, 4)),
    "stride 2**40 - 16": _case(None, shape=(2, 64), strides=((1 << 40) - 16, 4)),
    "stride 2**40": _case("global_stride", shape=(2, 64), strides=(1 << 40, 4)),
    "stride 48, 32-byte interleave": _case("global_stride", shape=(4, 2, 16), strides=(96, 48, 4), box=(4, 2, 8),
                                           interleave="32b"),
    "stride 64, 32-byte interleave": _case(None, shape=(4, 2, 16), strides=(128, 64, 4), box=(4, 2, 8),
                                           interleave="32b"),
    "box 0": _case("box_dim", box=(0, 16)),
    "box 257": _case("box_dim", shape=(512, 64), box=(257, 16)),
    "box 256": _case(None, shape=(512, 64), box=(256, 16)),
    "box larger than the tensor": _case(None, shape=(3, 64), box=(16, 16)),
    "inner box 8 bytes": _case("box_inner_bytes", box=(16, 2)),
    "inner box 8 bytes, 32-byte interleave": _case("box_inner_bytes", shape=(4, 16, 16), box=(4, 16, 2),
                                                   interleave="32b"),
    "element stride 0 of the innermost": _case("element_stride", element_strides=(1, 0)),
    "element stride 9": _case("element_stride", element_strides=(9, 1)),
    "element stride 8": _case(None, element_strides=(8, 1)),
    "box of 233,472 bytes": _case(None, box=(4, 228, 256), **U8_BIG),
    "box of 235,520 bytes": _case("box_bytes", box=(4, 230, 256), **U8_BIG),
    "box of 235,520 bytes, every other row": _case(None, box=(4, 230, 256), element_strides=(1, 2, 1), **U8_BIG),
    "swizzle 32B over 32 bytes": _case(None, box=(16, 8), swizzle="32b"),
    "swizzle 32B over 48 bytes": _case("swizzle_span", box=(16, 12), swizzle="32b"),
    "swizzle 64B over 64 bytes": _case(None, box=(16, 16), swizzle="64b"),
    "swizzle 64B over 80 bytes": _case("swizzle_span", shape=(64, 80), box=(16, 20), swizzle="64b"),
    "swizzle 128B over 128 bytes": _case(None, shape=(64, 64), box=(16, 32), swizzle="128b"),
    "swizzle 128B over 144 bytes": _case("swizzle_span", shape=(64, 64), box=(16, 36), swizzle="128b"),
    "swizzle 128B with 32B atoms on 9.0": _case("swizzle_mode", box=(16, 8), swizzle="128b_atom_32b"),
    "swizzle 128B, 32B atoms, 8B flip on 9.0": _case("swizzle_mode", box=(16, 8), swizzle="128b_atom_32b_flip_8b"),
    "swizzle 128B with 64B atoms on 9.0": _case("swizzle_mode", box=(16, 8), swizzle="128b_atom_64b"),
    "32-byte interleave, swizzle 64B": _case(None, shape=(4, 16, 16), box=(4, 16, 8), interleave="32b",
                                             swizzle="64b"),
    "32-byte interleave, swizzle 128B": _case(None, shape=(4, 16, 16), box=(4, 16, 8), interleave="32b",
                                              swizzle="128b"),
    "NaN fill for float16": _case(None, dtype="float16", oob_fill="nan"),
    "NaN fill for bfloat16": _case(None, dtype="bfloat16", oob_fill="nan"),
    "NaN fill for uint8": _case("nan_fill", dtype="uint8", oob_fill="nan"),
    "NaN fill for int32": _case("nan_fill", dtype="int32", oob_fill="nan"),
    "L2 promotion 256B": _case(None, l2_promotion="256b"),
    "every data type": _case(None, dtype="tfloat32_ftz"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_named_cases(name: str) -> None:
    rule, address, kw = CASES[name]
    s = spec(**kw)  # type: ignore[arg-type]
    if rule is None:
        check_tensor_map(s, address, **H200)  # type: ignore[arg-type]
        return
    with pytest.raises(TensorMapError) as info:
        check_tensor_map(s, address, **H200)  # type: ignore[arg-type]
    err = info.value
    assert (err.rule, err.code, err.name) == (rule, 1, "CUDA_ERROR_INVALID_VALUE")
    assert f"[rule {rule}]" in str(err) and TENSOR_MAP_RULES[rule] in str(err)


@pytest.mark.parametrize("name", list(CASES))
def test_the_named_cases_on_the_backends_encoder(gpu: GpuBackend, name: str) -> None:
    """The backend's own encoder (on CUDA, ``cuTensorMapEncodeTiled``) accepts and refuses the same cases."""
    rule, address, kw = CASES[name]
    s = spec(**kw)  # type: ignore[arg-type]
    if gpu.compute_capability() != (9, 0):
        pytest.skip(f"the cases were measured on compute capability 9.0; this device has {gpu.compute_capability()}")
    if rule is None:
        assert len(gpu.raw.tensor_map_encode(s.encoding(), address)) == 128
    else:
        with pytest.raises(InvalidArgumentError) as info:
            gpu.raw.tensor_map_encode(s.encoding(), address)
        assert info.value.name == "CUDA_ERROR_INVALID_VALUE"


@pytest.mark.parametrize("cc", [9, None, {9: 0, 1: 1}, (9, "0"), (9, 0, 1), "9.0"])
def test_check_refuses_a_capability_it_cannot_read(cc: object) -> None:
    with pytest.raises(InvalidArgumentError, match="compute_capability must be"):
        check_tensor_map(spec(), 0, compute_capability=cc)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field", [{"data_type": 1.0}, {"data_type": "7"}, {"rank": "2"}, {"rank": None}, {"global_dim": None},
              {"box_dim": iter([16, 16])}, {"swizzle": 9}, {"global_strides": ()}, {"global_dim": (1 << 65, 16)}],
)
def test_an_encoding_a_backend_cannot_read_is_the_drivers_refusal(field: dict[str, object]) -> None:
    import dataclasses

    bad = dataclasses.replace(spec().encoding(), **field)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError) as info:
        bad.spec()
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"


def test_check_refuses_what_it_cannot_read() -> None:
    with pytest.raises(InvalidArgumentError, match="expected a TensorMapSpec"):
        check_tensor_map("spec", 0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="64-bit int"):
        check_tensor_map(spec(), -16)
    with pytest.raises(InvalidArgumentError, match="compute_capability must be"):
        check_tensor_map(spec(), 0, compute_capability=(9,))  # type: ignore[arg-type]
    with pytest.raises(TensorMapError, match=r"compute capability 8\.0") as info:
        check_tensor_map(spec(), 0, compute_capability=(8, 0))
    assert info.value.rule == "compute_capability"
    check_tensor_map(spec(box=(16, 8), swizzle="128b_atom_64b"), 0, compute_capability=(10, 0))


# -- the agreement test: random specs, the core's checker against the backend's encoder ----------------------

_DIMS = st.one_of(st.integers(1, 300), st.sampled_from([0, 1, 255, 256, 257, 1 << 32, (1 << 32) + 1, 1 << 40]))
_BOXES = st.one_of(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256]), st.integers(0, 300))
_STEPS = st.one_of(st.integers(0, 64).map(lambda k: 16 * k), st.integers(0, 4096),
                   st.sampled_from([(1 << 40) - 16, 1 << 40, (1 << 40) + 16, 32, 48, 96]))


_SWIZZLES = ["none", "32b", "64b", "128b", "128b_atom_32b", "128b_atom_32b_flip_8b", "128b_atom_64b"]


@st.composite
def _wild(draw: st.DrawFn) -> dict[str, object]:
    """Any spec at all: every field drawn on its own, most of them broken somewhere."""
    rank = draw(st.one_of(st.integers(1, 5), st.sampled_from([0, 6])), label="rank")
    dtype = draw(st.sampled_from(list(TENSOR_MAP_DTYPES)), label="dtype")
    steps = tuple(draw(st.lists(_STEPS, min_size=max(rank - 1, 0), max_size=max(rank - 1, 0))))
    return {
        "dtype": dtype,
        "shape": tuple(draw(st.lists(_DIMS, min_size=rank, max_size=rank))),
        "strides": (*steps, TENSOR_MAP_DTYPES[dtype]) if rank else (),
        "box": tuple(draw(st.lists(_BOXES, min_size=rank, max_size=rank))),
        "element_strides": tuple(draw(st.lists(st.one_of(st.just(1), st.integers(0, 9)), min_size=rank,
                                               max_size=rank))),
        "interleave": draw(st.sampled_from(["none", "none", "16b", "32b"])),
        "swizzle": draw(st.sampled_from(_SWIZZLES)),
        "l2_promotion": draw(st.sampled_from(["none", "64b", "128b", "256b"])),
        "oob_fill": draw(st.sampled_from(["zero", "nan"])),
    }


@st.composite
def _plausible(draw: st.DrawFn) -> dict[str, object]:
    """A spec written the way a kernel author would: most of them valid, near the limits."""
    rank = draw(st.integers(1, 5), label="rank")
    dtype = draw(st.sampled_from(list(TENSOR_MAP_DTYPES)), label="dtype")
    e = TENSOR_MAP_DTYPES[dtype]
    interleave = draw(st.sampled_from(["none", "none", "none", "16b", "32b"])) if rank >= 3 else "none"
    align = 32 if interleave == "32b" else 16
    shape = tuple(draw(st.lists(st.integers(1, 2048), min_size=rank, max_size=rank)))
    steps = tuple(draw(st.integers(0, 4096).map(lambda k: k * align)) for _ in range(rank - 1))
    inner = draw(st.integers(1, 256 * e // 16).map(lambda k: k * 16), label="inner box bytes")
    outer = tuple(draw(st.lists(st.integers(1, 32), min_size=rank - 1, max_size=rank - 1)))
    spans = [s for s, span in (("none", 1 << 20), ("32b", 32), ("64b", 64), ("128b", 128)) if inner <= span]
    return {
        "dtype": dtype, "shape": shape, "strides": (*steps, e), "box": (*outer, inner // e),
        "element_strides": tuple(draw(st.lists(st.sampled_from([1, 1, 1, 2, 4, 8]), min_size=rank, max_size=rank))),
        "interleave": interleave,
        "swizzle": draw(st.sampled_from(spans if interleave == "none" else ["none", "32b", "64b", "128b"])),
        "l2_promotion": draw(st.sampled_from(["none", "64b", "128b", "256b"])),
        "oob_fill": "nan" if dtype.startswith(("float", "bfloat", "tfloat")) and draw(st.booleans()) else "zero",
    }


@st.composite
def random_specs(draw: st.DrawFn) -> tuple[TensorMapSpec, int]:
    """A plausible spec as it is (four in ten), with one field broken or pushed to a limit (four in ten), or a
    wild one (two in ten); an address aligned to 256 bytes, or 4, 8, 16, 32 or 48 past it."""
    mode = draw(st.integers(0, 9), label="mode")
    fields = draw(_wild() if mode >= 8 else _plausible())
    if 4 <= mode < 8:
        rank = len(fields["shape"])  # type: ignore[arg-type]
        which = draw(st.sampled_from(["shape", "strides", "box", "element_strides", "swizzle", "interleave",
                                      "oob_fill", "dtype"]), label="broken field")
        i = draw(st.integers(0, rank - 1), label="dimension")
        if which in ("shape", "strides", "box", "element_strides"):
            values = list(fields[which])  # type: ignore[call-overload]
            if which == "strides" and i == rank - 1:
                i = max(rank - 2, 0)
            if not (which == "strides" and rank == 1):
                pool = {"shape": _DIMS, "strides": _STEPS, "box": _BOXES, "element_strides": st.integers(0, 9)}
                values[i] = draw(pool[which])
            fields[which] = tuple(values)
        elif which == "dtype":  # another type of the same size, so strides[-1] still holds
            size = TENSOR_MAP_DTYPES[fields["dtype"]]  # type: ignore[index]
            fields["dtype"] = draw(st.sampled_from([d for d, n in TENSOR_MAP_DTYPES.items() if n == size]))
        else:
            fields[which] = draw(st.sampled_from({"swizzle": _SWIZZLES, "interleave": ["none", "16b", "32b"],
                                                  "oob_fill": ["zero", "nan"]}[which]))
    s = TensorMapSpec(
        fields["dtype"], fields["shape"], fields["strides"], fields["box"],  # type: ignore[arg-type]
        element_strides=fields["element_strides"],  # type: ignore[arg-type]
        interleave=fields["interleave"], swizzle=fields["swizzle"],  # type: ignore[arg-type]
        l2_promotion=fields["l2_promotion"], oob_fill=fields["oob_fill"],  # type: ignore[arg-type]
    )
    address = BASE + draw(st.sampled_from([0, 0, 0, 16, 32, 8, 4, 48]))
    return s, address


#: Specs drawn per backend: ten thousand where a driver answers, fewer where the checker answers itself (the fake).
def _examples(name: str) -> int:
    return 10_000 if name == "cuda" else 400


def test_the_checker_agrees_with_the_backends_encoder(gpu: GpuBackend, capsys: pytest.CaptureFixture[str]) -> None:
    """At least 10,000 random specs on a GPU: the core's checker and the driver both accept or both refuse each."""
    limits = {"compute_capability": gpu.compute_capability(), "smem_per_sm": gpu.raw.multiprocessors()[1]}
    counts: collections.Counter[str] = collections.Counter()
    rules: collections.Counter[str] = collections.Counter()

    @settings(max_examples=examples(_examples(gpu.name)), derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(random_specs())
    def agree(case: tuple[TensorMapSpec, int]) -> None:
        s, address = case
        try:
            check_tensor_map(s, address, **limits)
            ours = None
        except TensorMapError as exc:
            ours = exc.rule
        try:
            gpu.raw.tensor_map_encode(s.encoding(), address)
            theirs = True
        except InvalidArgumentError:
            theirs = False
        assert theirs == (ours is None), f"{s} at {address:#x}: metrale says {ours or 'accept'}, the backend " \
                                         f"{'accepts' if theirs else 'refuses'}"
        counts["accepted by both" if theirs else "refused by both"] += 1
        if ours:
            rules[ours] += 1

    agree()
    total = sum(counts.values())
    with capsys.disabled():
        print(f"\ntensor-map agreement on {gpu.name}: {total} specs, {counts['accepted by both']} accepted by both, "
              f"{counts['refused by both']} refused by both, 0 disagreements; refused by rule: {dict(rules)}")
    assert total >= examples(_examples(gpu.name)) // 2
    assert counts["accepted by both"] >= total // 10 and counts["refused by both"] >= total // 10


# -- the API: backend.tensor_map, replace_address, launches --------------------------------------------------


@pytest.fixture
def tma(gpu: GpuBackend) -> Iterator[Kernel]:
    if gpu.compute_capability() < (9, 0):
        pytest.skip("the TMA kernel needs compute capability 9.0")
    with gpu.load_modules(shipped_modules("tma")) as registry:
        yield registry.kernel("tma", "tma_copy_2d")


def test_a_tensor_map_over_a_buffer(gpu: GpuBackend) -> None:
    buf = gpu.alloc(64 * 64 * 4)
    s = spec()
    tmap = gpu.tensor_map(buf, s)
    assert isinstance(tmap, TensorMap) and tmap.spec is s and tmap.buffer == buf and tmap.offset == 0
    assert len(tmap.image) == 128 and tmap.address == buf.ptr
    other = gpu.alloc(64 * 64 * 4 + 256)
    tmap.replace_address(other, 256)
    assert (tmap.buffer, tmap.offset, tmap.address) == (other, 256, other.ptr + 256)
    del tmap
    gpu.free(buf)
    gpu.free(other)


@pytest.mark.parametrize(
    ("make", "error", "words"),
    [
        (lambda gpu, buf: gpu.tensor_map(buf, spec(), offset=8), TensorMapError, "rule address_alignment"),
        (lambda gpu, buf: gpu.tensor_map(buf, spec(), offset=16), InvalidBufferError, "spans bytes [16, 16400)"),
        (lambda gpu, buf: gpu.tensor_map(buf, spec(shape=(65, 64))), InvalidBufferError, "which holds 16384"),
        (lambda gpu, buf: gpu.tensor_map(buf, "spec"), InvalidArgumentError, "a TensorMapSpec"),
        (lambda gpu, buf: gpu.tensor_map(buf.ptr, spec()), InvalidArgumentError, "a DeviceBuffer"),
        (lambda gpu, buf: gpu.tensor_map(buf, spec(), offset=-16), InvalidArgumentError, "offset"),
        (lambda gpu, buf: gpu.tensor_map(buf, spec(box=(16, 2))), TensorMapError, "box[1] is 2 elements"),
        (lambda gpu, buf: gpu.tensor_map(buf, spec(), offset=1 << 64), InvalidBufferError, "past the end"),
    ],
)
def test_tensor_map_refusals(gpu: GpuBackend, make: object, error: type[MetraleError], words: str) -> None:
    buf = gpu.alloc(64 * 64 * 4)
    with pytest.raises(error) as info:
        make(gpu, buf)  # type: ignore[operator]
    assert type(info.value) is error and words in str(info.value)
    gpu.free(buf)


def test_a_tensor_map_over_a_freed_buffer_is_refused(gpu: GpuBackend) -> None:
    buf = gpu.alloc(64 * 64 * 4)
    gpu.free(buf)
    with pytest.raises(InvalidBufferError, match="not live"):
        gpu.tensor_map(buf, spec())


def test_a_refused_replacement_leaves_the_map_as_it_was(gpu: GpuBackend) -> None:
    buf, small = gpu.alloc(64 * 64 * 4), gpu.alloc(1024)
    tmap = gpu.tensor_map(buf, spec())
    before = (tmap.buffer, tmap.offset, tmap.image)
    for args, error in [((buf, 8), TensorMapError), ((small, 0), InvalidBufferError), ((buf, 16), InvalidBufferError),
                        (("x", 0), InvalidArgumentError)]:
        with pytest.raises(error):
            tmap.replace_address(*args)  # type: ignore[arg-type]
        assert (tmap.buffer, tmap.offset, tmap.image) == before
    gpu.free(small)
    with pytest.raises(InvalidBufferError, match="not live"):
        tmap.replace_address(small)
    del tmap
    gpu.free(buf)


def test_freeing_a_mapped_buffer_warns(gpu: GpuBackend, caplog: pytest.LogCaptureFixture) -> None:
    buf = gpu.alloc(64 * 64 * 4)
    tmap = gpu.tensor_map(buf, spec())
    with caplog.at_level(logging.WARNING, logger="metrale"):
        gpu.free(buf)
    assert "1 live tensor map(s) still point into it" in caplog.text
    caplog.clear()
    del tmap
    spare = gpu.alloc(4096)
    with caplog.at_level(logging.WARNING, logger="metrale"):
        gpu.free(spare)
    assert "tensor map" not in caplog.text


def test_n_tile_on_the_backend(gpu: GpuBackend) -> None:
    sms = gpu.raw.multiprocessors()[0]
    assert sms >= 1
    from metrale_core import n_tile

    assert gpu.n_tile(4096, 4096) == n_tile(4096, 4096, num_sms=sms)
    assert gpu.n_tile(256, 7168, candidates=(64, 128)) == n_tile(256, 7168, num_sms=sms, candidates=(64, 128))
    with pytest.raises(InvalidArgumentError, match="num_sms is the device's"):
        gpu.n_tile(1, 1, num_sms=8)
    with pytest.raises(InvalidArgumentError, match="unknown option"):
        gpu.n_tile(1, 1, waves=8)
    with pytest.raises(InvalidArgumentError, match="m must be a positive int"):
        gpu.n_tile(0, 1)
    assert gpu.n_tile(m=1, n=4096) == n_tile(1, 4096, num_sms=sms)


# -- the shipped TMA kernel ----------------------------------------------------------------------------------


def _tma_copy(gpu: GpuBackend, kernel: Kernel, a: np.ndarray, box: tuple[int, int], fill: str,
              captured: bool = False, src_kw: dict[str, object] | None = None,
              dst_kw: dict[str, object] | None = None) -> np.ndarray:
    """Copy ``a`` through the TMA into a buffer padded to whole boxes; the padded result (``src_kw`` and
    ``dst_kw``: more of each map's spec, a swizzle or element strides)."""
    (rows, cols), (bh, bw), size = a.shape, box, a.itemsize
    prows, pcols = -(-rows // bh) * bh, -(-cols // bw) * bw
    dtype = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.uint8): "uint8",
             np.dtype(np.float64): "float64"}[a.dtype]
    src, dst = gpu.alloc(a.nbytes), gpu.alloc(prows * pcols * size)
    gpu.copy_to_device(src, np.ascontiguousarray(a))
    gpu.memset(dst, 0xAB)
    sspec = TensorMapSpec(dtype, (rows, cols), (cols * size, size), box, oob_fill=fill, **(src_kw or {}))
    dspec = TensorMapSpec(dtype, (prows, pcols), (pcols * size, size), box, **(dst_kw or {}))
    tsrc, tdst = gpu.tensor_map(src, sspec), gpu.tensor_map(dst, dspec)
    tile = int(np.prod(sspec.tile_shape)) * size  # what the load brings (its barrier's transaction count)
    smem = max(sspec.shared_bytes, dspec.shared_bytes)  # what the box takes in shared memory, padded
    args = [tsrc, tdst, np.uint32(bw), np.uint32(bh), np.uint32(tile)]
    grid = (pcols // bw, prows // bh)
    if captured:
        stream = gpu.create_stream()
        gpu.default_stream.synchronize()
        gpu.begin_capture(stream)
        gpu.launch(kernel, grid, 32, args, shared_mem=smem, stream=stream)
        graph = gpu.end_capture(stream)
        exe = graph.instantiate()
        exe.launch(stream)
        stream.synchronize()
        exe.close()
        graph.close()
        stream.close()
    else:
        gpu.launch(kernel, grid, 32, args, shared_mem=smem)
    out = np.empty((prows, pcols), dtype=a.dtype)
    gpu.copy_to_host(out, dst)
    del tsrc, tdst, args
    gpu.free(src)
    gpu.free(dst)
    return out


def _expected(a: np.ndarray, padded: tuple[int, int], fill: str) -> np.ndarray:
    out = np.zeros(padded, dtype=a.dtype)
    if fill == "nan":
        out.view(f"u{a.itemsize}")[...] = {2: 0x7FF7, 4: 0x7FF77FF7, 8: 0x7FF77FF77FF77FF7}[a.itemsize]
    out[: a.shape[0], : a.shape[1]] = a
    return out


@pytest.mark.parametrize(
    ("shape", "box", "dtype", "fill"),
    [
        ((64, 64), (16, 16), np.float32, "zero"),  # whole tiles
        ((50, 68), (16, 32), np.float32, "zero"),  # a partial last tile both ways
        ((50, 68), (16, 32), np.float32, "nan"),
        ((33, 40), (8, 16), np.float16, "nan"),
        ((20, 24), (8, 8), np.float64, "nan"),
        ((100, 48), (32, 16), np.uint8, "zero"),
        ((7, 256), (4, 256), np.float16, "zero"),
    ],
)
def test_the_tma_kernel_copies_tiles(gpu: GpuBackend, tma: Kernel, shape: tuple[int, int], box: tuple[int, int],
                                     dtype: type[np.generic], fill: str) -> None:
    rng = np.random.default_rng(3)
    a = (rng.integers(1, 200, size=shape)).astype(dtype)
    out = _tma_copy(gpu, tma, a, box, fill)
    expected = _expected(a, out.shape, fill)
    assert out.tobytes() == expected.tobytes()


def test_the_tma_kernel_in_a_captured_graph(gpu: GpuBackend, tma: Kernel) -> None:
    a = np.arange(50 * 68, dtype=np.float32).reshape(50, 68)
    out = _tma_copy(gpu, tma, a, (16, 32), "zero", captured=True)
    assert out.tobytes() == _expected(a, out.shape, "zero").tobytes()


def test_a_tensor_map_launch_is_refused_before_the_device_sees_it(gpu: GpuBackend, tma: Kernel) -> None:
    buf = gpu.alloc(64 * 64 * 4)
    good = gpu.tensor_map(buf, spec(box=(16, 16)))
    args = [good, good, np.uint32(16), np.uint32(16), np.uint32(1024)]
    with pytest.raises(InvalidArgumentError, match="tensor-map slot: pass a TensorMap"):
        gpu.launch(tma, 1, 32, [good.image, *args[1:]], shared_mem=1024)
    gpu.free(buf)
    with pytest.raises(InvalidBufferError, match="not live"):
        gpu.launch(tma, 1, 32, args, shared_mem=1024)
    assert gpu.faulted is None


def test_a_graph_keeps_the_map_it_captured(gpu: GpuBackend, tma: Kernel) -> None:
    """A replacement after the capture changes later launches, not the graph; freeing the buffer the graph's
    map points into makes the graph's launch refused."""
    a = np.arange(16 * 16, dtype=np.float32).reshape(16, 16)
    src, dst, dst2 = gpu.alloc(a.nbytes), gpu.alloc(a.nbytes), gpu.alloc(a.nbytes)
    gpu.copy_to_device(src, a)
    s = spec(shape=(16, 16), box=(16, 16))
    tsrc, tdst = gpu.tensor_map(src, s), gpu.tensor_map(dst, s)
    stream = gpu.create_stream()
    gpu.synchronize()
    gpu.begin_capture(stream)
    gpu.launch(tma, 1, 32, [tsrc, tdst, np.uint32(16), np.uint32(16), np.uint32(1024)], shared_mem=1024,
               stream=stream)
    graph = gpu.end_capture(stream)
    exe = graph.instantiate()
    tdst.replace_address(dst2)
    gpu.memset(dst, 0)
    gpu.memset(dst2, 0)
    gpu.synchronize()
    exe.launch(stream)
    stream.synchronize()
    out, out2 = np.empty_like(a), np.empty_like(a)
    gpu.copy_to_host(out, dst)
    gpu.copy_to_host(out2, dst2)
    assert (out == a).all() and not out2.any()
    gpu.free(dst)
    with pytest.raises(InvalidBufferError):
        exe.launch(stream)
    for h in (exe, graph, stream):
        h.close()
    del tsrc, tdst
    gpu.free(src)
    gpu.free(dst2)


def test_a_map_of_another_backend_is_refused(gpu: GpuBackend, tma: Kernel) -> None:
    with open_backend("fake", settings=SETTINGS) as other:
        buf = other.alloc(64 * 64 * 4)
        foreign = other.tensor_map(buf, spec(box=(16, 16)))
        with pytest.raises(InvalidBufferError, match="belongs to another backend"):
            gpu.launch(tma, 1, 32, [foreign, foreign, np.uint32(16), np.uint32(16), np.uint32(1024)],
                       shared_mem=1024)
        del foreign
        other.free(buf)


def test_a_map_after_close(tmp_path: object) -> None:
    gpu = open_backend("fake", settings=SETTINGS)
    buf = gpu.alloc(64 * 64 * 4)
    tmap = gpu.tensor_map(buf, spec())
    gpu.close()
    with pytest.raises(BackendClosedError):
        tmap.replace_address(buf)


@pytest.mark.skipif(not available_backends(SETTINGS).get("cuda", None) or
                    not available_backends(SETTINGS)["cuda"].available, reason="needs the cuda backend and a GPU")
def test_the_fake_and_the_gpu_copy_the_same_bytes() -> None:
    """The fake's TMA implementation against the H200's TMA: the same bytes, OOB fills included."""
    rng = np.random.default_rng(11)
    with open_backend("cuda", settings=SETTINGS) as cuda, open_backend("fake", settings=SETTINGS) as fake:
        kernels = [g.load_modules(shipped_modules("tma")).kernel("tma", "tma_copy_2d") for g in (cuda, fake)]
        f32 = np.float32
        cases: list[tuple[tuple[int, int], tuple[int, int], type[np.generic], str, dict[str, object],
                          dict[str, object]]] = [
            ((50, 68), (16, 32), f32, "nan", {}, {}), ((33, 40), (8, 16), np.float16, "nan", {}, {}),
            ((20, 24), (8, 8), np.float64, "nan", {}, {}), ((21, 48), (16, 16), np.uint8, "zero", {}, {}),
            # swizzled one way and not the other: the 16-byte chunks of shared memory come out permuted
            ((32, 32), (8, 32), f32, "zero", {"swizzle": "128b"}, {}),
            ((32, 32), (8, 32), f32, "zero", {}, {"swizzle": "128b"}),
            ((32, 32), (16, 16), f32, "zero", {"swizzle": "64b"}, {}),
            ((32, 32), (16, 8), f32, "zero", {"swizzle": "32b"}, {}),
            ((32, 32), (16, 32), f32, "zero", {"swizzle": "128b"}, {"swizzle": "128b"}),
            # rows narrower than the swizzle's span: each takes the whole span in shared memory, both ways
            ((32, 32), (16, 16), f32, "zero", {"swizzle": "128b"}, {"swizzle": "128b"}),
            ((32, 32), (16, 8), f32, "zero", {"swizzle": "64b"}, {"swizzle": "64b"}),
            ((21, 48), (16, 16), np.uint8, "zero", {"swizzle": "128b"}, {"swizzle": "128b"}),
            # element strides: the outer one skips rows; the innermost one the TMA ignores
            ((32, 32), (16, 16), f32, "zero", {"element_strides": (2, 1)}, {"element_strides": (2, 1)}),
            ((32, 32), (16, 16), f32, "zero", {"element_strides": (1, 2)}, {"element_strides": (1, 2)}),
        ]
        for shape, box, dtype, fill, src_kw, dst_kw in cases:
            a = rng.integers(0, 255, size=shape).astype(dtype)
            on_gpu = _tma_copy(cuda, kernels[0], a, box, fill, src_kw=src_kw, dst_kw=dst_kw)
            on_fake = _tma_copy(fake, kernels[1], a, box, fill, src_kw=src_kw, dst_kw=dst_kw)
            assert on_gpu.tobytes() == on_fake.tobytes(), f"{shape} {box} {dtype} {fill} {src_kw} {dst_kw}"


# -- where a box lies in shared memory --------------------------------------------------------------------------

#: (swizzle, the innermost box's bytes): rows as wide as the span, and narrower ones.
_LAYOUT_CASES = [("32b", 16), ("64b", 16), ("64b", 32), ("128b", 16), ("128b", 32), ("128b", 64), ("128b", 128)]
_SPAN = {"32b": 32, "64b": 64, "128b": 128}


def test_shared_bytes_pads_each_row_to_the_swizzle_span() -> None:
    assert spec(box=(16, 16)).shared_bytes == 16 * 16 * 4
    assert spec(box=(16, 16), swizzle="128b").shared_bytes == 16 * 128
    assert spec(box=(16, 32), swizzle="128b").shared_bytes == 16 * 128
    assert spec(box=(16, 8), swizzle="64b").shared_bytes == 16 * 64
    assert spec(box=(16, 4), swizzle="32b").shared_bytes == 16 * 32
    assert spec("float16", box=(4, 16, 16), shape=(8, 32, 32), swizzle="128b").shared_bytes == 4 * 16 * 128
    assert spec(box=(16, 16), element_strides=(2, 1), swizzle="128b").shared_bytes == 8 * 128


def test_a_rank_0_spec_takes_no_shared_memory_and_is_refused() -> None:
    empty = TensorMapSpec("float32", (), (), ())
    assert empty.shared_bytes == 0 and empty.tile_shape == ()
    with pytest.raises(TensorMapError) as info:
        check_tensor_map(empty, BASE, **H200)  # type: ignore[arg-type]
    assert info.value.rule == "rank"


@pytest.mark.parametrize(("map_dtype", "good", "bad"), [("float32", "float32", "float64"),
                                                        ("bfloat16", "bfloat16", "float32")])
def test_the_fake_refuses_a_tile_of_another_element_type_rather_than_reinterpret_it(
        map_dtype: str, good: str, bad: str) -> None:
    """A float64 tile stored through a float32 map would write its bytes as float32 garbage: the fake's
    ``tma_store`` takes the map's element type (ml_dtypes' bfloat16 for a bfloat16 map), or shared memory's
    bytes as uint8 (stored as they are); so is a tile of the map's type in the other byte order. The refusal
    is the implementation's mistake, not a memory fault: the launch fails naming it."""
    bfloat16 = pytest.importorskip("ml_dtypes").bfloat16 if map_dtype == "bfloat16" else None

    def kind(name: str) -> np.dtype:
        return np.dtype(bfloat16 if name == "bfloat16" else name)

    stored: list[str] = []

    @kernel_implementation("tma", "tma_copy_2d")
    def store(launch: FakeLaunch, src: TensorMap, dst: TensorMap, cols: np.uint32, rows: np.uint32,
              nbytes: np.uint32) -> None:
        tile = np.full((16, 16), 2.5, dtype=kind(good))
        swapped = tile.astype(tile.dtype.newbyteorder())
        for candidate in (tile, tile.view(np.uint8), tile.astype(kind(bad)), swapped):
            try:
                launch.tma_store(dst, (0, 0), candidate)
                stored.append(f"{candidate.dtype}")
            except TypeError as exc:
                stored.append(f"{candidate.dtype}: {exc}")

    size = TENSOR_MAP_DTYPES[map_dtype]
    with open_backend("fake", settings=SETTINGS) as gpu:
        kernel = gpu.load_modules(shipped_modules("tma")).kernel("tma", "tma_copy_2d")
        gpu.add_kernel_implementations(store)
        s = TensorMapSpec(map_dtype, (16, 16), (16 * size, size), (16, 16))
        src, dst = gpu.alloc(256 * size), gpu.alloc(256 * size)
        gpu.memset(dst, 0)
        tsrc, tdst = gpu.tensor_map(src, s), gpu.tensor_map(dst, s)
        gpu.launch(kernel, 1, 32, [tsrc, tdst, np.uint32(16), np.uint32(16), np.uint32(256 * size)],
                   shared_mem=256 * size)
        gpu.synchronize()
        out = np.empty(256 * size, dtype=np.uint8)
        gpu.copy_to_host(out, dst)
        del tsrc, tdst
        gpu.free(src)
        gpu.free(dst)
    assert stored[:2] == [good, "uint8"]
    assert stored[2].startswith(f"{bad}: a tile of {bad} stored through a {map_dtype} tensor map")
    assert "tile.view(np.uint8)" in stored[2]
    assert ("give ml_dtypes.bfloat16 elements" if map_dtype == "bfloat16" else f"give {good} elements") in stored[2]
    assert "(byte order '>')" in stored[3] and f"through a {map_dtype} tensor map" in stored[3]
    assert (out.view(kind(good)).astype(np.float32) == 2.5).all()


def test_a_tile_of_another_element_type_fails_the_launch_naming_it() -> None:
    @kernel_implementation("tma", "tma_copy_2d")
    def store(launch: FakeLaunch, src: TensorMap, dst: TensorMap, cols: np.uint32, rows: np.uint32,
              nbytes: np.uint32) -> None:
        launch.tma_store(dst, (0, 0), np.zeros((16, 16)))  # float64, through a float32 map

    with open_backend("fake", settings=SETTINGS) as gpu:
        kernel = gpu.load_modules(shipped_modules("tma")).kernel("tma", "tma_copy_2d")
        gpu.add_kernel_implementations(store)
        s = TensorMapSpec("float32", (16, 16), (64, 4), (16, 16))
        src, dst = gpu.alloc(1024), gpu.alloc(1024)
        tsrc, tdst = gpu.tensor_map(src, s), gpu.tensor_map(dst, s)
        with pytest.raises(MetraleError) as info:
            gpu.launch(kernel, 1, 32, [tsrc, tdst, np.uint32(16), np.uint32(16), np.uint32(1024)], shared_mem=1024)
            gpu.synchronize()
        assert info.value.name == "CUDA_ERROR_LAUNCH_FAILED"
        assert "raised TypeError: a tile of float64 stored through a float32 tensor map" in str(info.value)


@pytest.mark.parametrize(("swizzle", "inner"), _LAYOUT_CASES)
def test_narrow_swizzled_rows_take_the_whole_span(gpu: GpuBackend, tma: Kernel, swizzle: str, inner: int) -> None:
    """A 16-row box loaded through a swizzled map, its shared memory stored row-major through a map tall
    enough to show every byte: each row starts a span apart, its 16-byte chunks XORed in place (the H100 put
    every element there for each case; the fake does the same).

    Only the box's own bytes are read: the rest of the tall store (and each row's padding) is shared memory the
    load never wrote, which on a GPU still holds what an earlier launch left there. Issue 37, item 6: that is
    why this test failed in whole-suite runs and passed alone; it looked for each value anywhere in the store,
    and the earlier case, with the same values at other places, had left them there.
    """
    rows, cols = 16, inner // 4
    tall = rows * _SPAN[swizzle] // inner * 2
    first = 100_000 * (1 + _LAYOUT_CASES.index((swizzle, inner)))  # no case finds another's values
    a = (np.arange(rows * cols, dtype=np.float32) + first).reshape(rows, cols)
    src, dst = gpu.alloc(a.nbytes), gpu.alloc(tall * inner)
    gpu.copy_to_device(src, a)
    gpu.memset(dst, 0)
    sspec = TensorMapSpec("float32", (rows, cols), (inner, 4), (rows, cols), swizzle=swizzle)
    tsrc = gpu.tensor_map(src, sspec)
    tdst = gpu.tensor_map(dst, TensorMapSpec("float32", (tall, cols), (inner, 4), (tall, cols)))
    gpu.launch(tma, 1, 32, [tsrc, tdst, np.uint32(cols), np.uint32(rows), np.uint32(a.nbytes)],
               shared_mem=tall * inner)
    out = np.empty(tall * cols, dtype=np.float32)
    gpu.copy_to_host(out, dst)
    box = out[: rows * _SPAN[swizzle] // 4]  # what the load wrote: the box, its rows padded to the span
    where: dict[float, int] = {}
    for i, v in enumerate(box):
        where.setdefault(float(v), i)
    bits = {"32b": 0x10, "64b": 0x30, "128b": 0x70}[swizzle]
    padded = [(o ^ ((o >> 3) & bits)) // 4 for r in range(rows) for c in range(cols)
              for o in [r * _SPAN[swizzle] + c * 4]]
    assert [where.get(float(first + i), -1) for i in range(a.size)] == padded
    assert sspec.shared_bytes == rows * _SPAN[swizzle]
    del tsrc, tdst
    gpu.free(src)
    gpu.free(dst)


def test_the_fake_s_shared_memory_keeps_what_earlier_launches_left() -> None:
    """As on a GPU (issue 37, item 6): a launch's shared memory holds what an earlier one wrote there; only a
    closed device forgets it."""
    seen: list[bytes] = []

    @kernel_implementation("tma", "tma_copy_2d")
    def scribble(launch: FakeLaunch, src: TensorMap, dst: TensorMap, cols: np.uint32, rows: np.uint32,
                 nbytes: np.uint32) -> None:
        smem = launch.shared()
        assert len(smem) == launch.shared_mem
        seen.append(bytes(smem[:8]))
        smem[:8] = 0xAB

    for _ in range(2):
        with open_backend("fake", settings=SETTINGS) as gpu:
            kernel = gpu.load_modules(shipped_modules("tma")).kernel("tma", "tma_copy_2d")
            gpu.add_kernel_implementations(scribble)
            s = TensorMapSpec("float32", (16, 16), (64, 4), (16, 16))
            buf = gpu.alloc(1024)
            tmap = gpu.tensor_map(buf, s)
            for shared in (1024, 4096):
                gpu.launch(kernel, 1, 32, [tmap, tmap, np.uint32(16), np.uint32(16), np.uint32(1024)],
                           shared_mem=shared)
            gpu.synchronize()
            del tmap
            gpu.free(buf)
    assert seen == [bytes(8), b"\xab" * 8, bytes(8), b"\xab" * 8]


def test_too_little_shared_memory_for_a_padded_box_faults_on_the_fake() -> None:
    """The H100 faulted (``CUDA_ERROR_ILLEGAL_ADDRESS``, named by the launch) when a 64-byte row under the
    128-byte swizzle was given only the box's bytes of shared memory; the fake faults the same way."""
    with open_backend("fake", settings=SETTINGS) as gpu:
        tma = gpu.load_modules(shipped_modules("tma")).kernel("tma", "tma_copy_2d")
        a = np.zeros((16, 16), dtype=np.float32)
        src, dst = gpu.alloc(a.nbytes), gpu.alloc(a.nbytes)
        s = TensorMapSpec("float32", (16, 16), (64, 4), (16, 16), swizzle="128b")
        tsrc, tdst = gpu.tensor_map(src, s), gpu.tensor_map(dst, s)
        with pytest.raises(DeviceFaultError) as info:
            gpu.launch(tma, 1, 32, [tsrc, tdst, np.uint32(16), np.uint32(16), np.uint32(a.nbytes)],
                       shared_mem=a.nbytes)
            gpu.synchronize()
        assert "tma.tma_copy_2d" in str(info.value) and "2048 bytes of shared memory" in str(info.value)
        assert gpu.faulted is not None
