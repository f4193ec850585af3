"""Tensor-map specs and the rules of ``cuTensorMapEncodeTiled``: [`TensorMapSpec`][metrale_core.TensorMapSpec],
[`check_tensor_map`][metrale_core.check_tensor_map].

A tensor map (a TMA descriptor) is the 128 bytes a Hopper kernel's Tensor Memory Accelerator reads to move a tile
between global and shared memory. The driver refuses a bad one with a bare ``CUDA_ERROR_INVALID_VALUE``, or accepts
it and the kernel faults or reads garbage later; this module says which rule broke, before any driver is asked.

The rules are those the driver enforces as measured on the H200 (driver 580.159.04, CUDA 13.0, compute capability
9.0), not as documented: the documentation is wrong both ways (overlapping strides are accepted, element stride 0 of
the innermost dimension is checked, the box is bounded by the shared memory of a multiprocessor, 32-byte interleave
takes 64- and 128-byte swizzles). Pure functions: no backend, no driver.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Final

from .._errors import InvalidArgumentError, TensorMapError, error_for_code
from .._types import WORD_LIMIT, as_index

__all__ = [
    "TENSOR_MAP_DTYPES",
    "TENSOR_MAP_RULES",
    "TensorMapEncoding",
    "TensorMapSpec",
    "check_tensor_map",
]

#: The data types of a tensor map, in the order of CUDA's ``CUtensorMapDataType`` (0-12), with their sizes.
TENSOR_MAP_DTYPES: Final = {
    "uint8": 1, "uint16": 2, "uint32": 4, "int32": 4, "uint64": 8, "int64": 8, "float16": 2, "float32": 4,
    "float64": 8, "bfloat16": 2, "float32_ftz": 4, "tfloat32": 4, "tfloat32_ftz": 4,
}
_DTYPE_CODES: Final = {name: code for code, name in enumerate(TENSOR_MAP_DTYPES)}
_FLOATS: Final = frozenset(name for name in TENSOR_MAP_DTYPES if name.startswith(("float", "bfloat", "tfloat")))
_INTERLEAVES: Final = ("none", "16b", "32b")
_SWIZZLES: Final = ("none", "32b", "64b", "128b", "128b_atom_32b", "128b_atom_32b_flip_8b", "128b_atom_64b")
_L2_PROMOTIONS: Final = ("none", "64b", "128b", "256b")
_OOB_FILLS: Final = ("zero", "nan")
#: The inner box's bytes a swizzle mode spans (interleave ``"none"``).
_SWIZZLE_SPAN: Final = {"32b": 32, "64b": 64, "128b": 128, "128b_atom_32b": 128, "128b_atom_32b_flip_8b": 128,
                        "128b_atom_64b": 128}

#: Every rule [`check_tensor_map`][metrale_core.check_tensor_map] enforces, by the name a
#: [`TensorMapError`][metrale_core.TensorMapError] carries in ``rule``.
TENSOR_MAP_RULES: Final = {
    "compute_capability": "tensor maps need a device of compute capability 9.0 or later (the TMA)",
    "rank": "1 to 5 dimensions",
    "interleave_rank": "an interleaved layout needs 3 dimensions or more",
    "address_alignment": "the global address a multiple of 16 bytes (32 with 32-byte interleave)",
    "global_dim": "each dimension 1 to 2**32 elements",
    "global_stride": "each stride but the innermost a multiple of 16 bytes (32 with 32-byte interleave), below 2**40",
    "box_dim": "each box dimension 1 to 256 elements",
    "box_inner_bytes": "the innermost box dimension times the element size a multiple of 16 bytes",
    "element_stride": "each element stride 1 to 8 (the innermost too)",
    "box_bytes": "the element size times the product of floor(box / element stride) at most the shared memory of "
                 "one multiprocessor",
    "swizzle_mode": "the 128-byte swizzles with 32- or 64-byte atoms need compute capability 10.0 or later",
    "swizzle_span": "without interleave, the innermost box at most the swizzle's span: 32, 64 or 128 bytes",
    "nan_fill": "a NaN out-of-bounds fill only for floating-point data types",
}

_U32_LIMIT: Final = 1 << 32


def _ints(value: object, name: str, limit: int) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise InvalidArgumentError(f"TensorMapSpec: {name} must be a tuple of ints, got {value!r}")
    out = []
    for i, v in enumerate(value):
        n = as_index(v)
        if n is None or not 0 <= n < limit:
            raise InvalidArgumentError(
                f"TensorMapSpec: {name}[{i}] is {v!r}; each must be an int in 0..{limit - 1} (what the driver's "
                f"{'cuuint64_t' if limit == WORD_LIMIT else 'cuuint32_t'} holds)"
            )
        out.append(n)
    return tuple(out)


def _choice(value: object, name: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(f"TensorMapSpec: {name} must be one of {', '.join(map(repr, choices))}; "
                                   f"got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class TensorMapSpec:
    """What a tensor map describes: a tiled view of a tensor in device memory. Immutable.

    ``shape``, ``strides`` (bytes), ``box`` and ``element_strides`` (default all 1) are tuples of one length,
    **outermost dimension first**, as in numpy; ``strides[-1]`` equals the element size (the innermost
    dimension is contiguous). CUDA's ``globalDim``, ``globalStrides``, ``boxDim`` and ``elementStrides``
    are these reversed, without the innermost stride ([`encoding`][metrale_core.TensorMapSpec.encoding]). A wrong type,
    an unknown name or lengths that differ raise [`InvalidArgumentError`][metrale_core.InvalidArgumentError] here; the
    driver's own rules are [`check_tensor_map`][metrale_core.check_tensor_map]'s.
    """

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: str
    swizzle: str
    l2_promotion: str
    oob_fill: str

    def __init__(
        self,
        dtype: str,
        shape: Sequence[int],
        strides: Sequence[int],
        box: Sequence[int],
        *,
        element_strides: Sequence[int] | None = None,
        interleave: str = "none",
        swizzle: str = "none",
        l2_promotion: str = "none",
        oob_fill: str = "zero",
    ) -> None:
        dtype = _choice(dtype, "dtype", tuple(TENSOR_MAP_DTYPES))
        dims = _ints(shape, "shape", WORD_LIMIT)
        steps = _ints(strides, "strides", WORD_LIMIT)
        boxes = _ints(box, "box", _U32_LIMIT)
        every = (1,) * len(dims) if element_strides is None else _ints(element_strides, "element_strides", _U32_LIMIT)
        if not len(dims) == len(steps) == len(boxes) == len(every):
            raise InvalidArgumentError(
                f"TensorMapSpec: shape, strides, box and element_strides must have one length (one entry per "
                f"dimension), got {len(dims)}, {len(steps)}, {len(boxes)} and {len(every)}"
            )
        itemsize = TENSOR_MAP_DTYPES[dtype]
        if steps and steps[-1] != itemsize:
            raise InvalidArgumentError(
                f"TensorMapSpec: strides[-1] is {steps[-1]}; the innermost dimension must be contiguous, its "
                f"stride the element size of {dtype} ({itemsize} bytes)"
            )
        fields = {
            "dtype": dtype, "shape": dims, "strides": steps, "box": boxes, "element_strides": every,
            "interleave": _choice(interleave, "interleave", _INTERLEAVES),
            "swizzle": _choice(swizzle, "swizzle", _SWIZZLES),
            "l2_promotion": _choice(l2_promotion, "l2_promotion", _L2_PROMOTIONS),
            "oob_fill": _choice(oob_fill, "oob_fill", _OOB_FILLS),
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @property
    def itemsize(self) -> int:
        """The element size in bytes."""
        return TENSOR_MAP_DTYPES[self.dtype]

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def extent(self) -> int:
        """The bytes from the first element to the end of the last: ``Σ (shape[i] - 1) * strides[i] + itemsize``."""
        return sum((d - 1) * s for d, s in zip(self.shape, self.strides, strict=True)) + self.itemsize

    @property
    def tile_shape(self) -> tuple[int, ...]:
        """The elements one load brings to shared memory per dimension: ``ceil(box / element stride)``, and
        without interleave the whole innermost box (the TMA ignores the innermost element stride there, as
        seen on the H200: the driver checks it, the copy does not use it)."""
        every = [*self.element_strides]
        if every and self.interleave == "none":
            every[-1] = 1
        return tuple(-(-b // e) if e else 0 for b, e in zip(self.box, every, strict=True))

    @property
    def shared_bytes(self) -> int:
        """The bytes one load of the box takes in shared memory: the `tile_shape` elements, and where the map
        swizzles (interleave ``"none"``), each innermost row padded to the swizzle's span. Measured on the
        H100: a 64-byte row under the 128-byte swizzle takes 128 bytes, and a kernel given only the box's
        bytes of shared memory faulted (``CUDA_ERROR_ILLEGAL_ADDRESS``). Give a TMA kernel at least this much
        dynamic shared memory per box in flight; the load's transaction count is still the box's bytes,
        ``prod(tile_shape) * itemsize``."""
        tile = self.tile_shape
        if not tile:  # a rank-0 spec (which `check_tensor_map` refuses) loads nothing
            return 0
        row = tile[-1] * self.itemsize
        span = _SWIZZLE_SPAN.get(self.swizzle)
        if span is not None and self.interleave == "none":
            row = max(row, span)
        return math.prod(tile[:-1]) * row

    def encoding(self) -> TensorMapEncoding:
        """The spec as ``cuTensorMapEncodeTiled`` takes it: CUDA's enums, dimensions innermost first."""
        return TensorMapEncoding(
            data_type=_DTYPE_CODES[self.dtype],
            rank=self.rank,
            global_dim=self.shape[::-1],
            global_strides=self.strides[-2::-1],
            box_dim=self.box[::-1],
            element_strides=self.element_strides[::-1],
            interleave=_INTERLEAVES.index(self.interleave),
            swizzle=_SWIZZLES.index(self.swizzle),
            l2_promotion=_L2_PROMOTIONS.index(self.l2_promotion),
            oob_fill=_OOB_FILLS.index(self.oob_fill),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class TensorMapEncoding:
    """A [`TensorMapSpec`][metrale_core.TensorMapSpec] as a backend's ``RawDevice.tensor_map_encode`` receives it: the
    arguments of ``cuTensorMapEncodeTiled`` in CUDA's order and enums (dimensions innermost first; ``global_strides``
    has ``rank - 1`` entries, the innermost stride being the element size)."""

    data_type: int
    rank: int
    global_dim: tuple[int, ...]
    global_strides: tuple[int, ...]
    box_dim: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int

    def spec(self) -> TensorMapSpec:
        """The [`TensorMapSpec`][metrale_core.TensorMapSpec] this encodes (for a backend that checks what it is given
        with [`check_tensor_map`][metrale_core.check_tensor_map]); an enum out of range, or lengths that are not the
        rank's, raise [`InvalidArgumentError`][metrale_core.InvalidArgumentError] with ``CUDA_ERROR_INVALID_VALUE``, as
        the driver refuses."""
        bad = error_for_code("CUDA_ERROR_INVALID_VALUE", f"tensor map encoding {self}")
        enums = [as_index(v) for v in (self.data_type, self.interleave, self.swizzle, self.l2_promotion,
                                       self.oob_fill, self.rank)]
        arrays = (self.global_dim, self.global_strides, self.box_dim, self.element_strides)
        if None in enums or not all(isinstance(a, tuple | list) for a in arrays):
            raise bad
        code, interleave, swizzle, l2, oob, rank = (int(v) for v in enums)  # type: ignore[arg-type]
        tables = ((code, TENSOR_MAP_DTYPES), (interleave, _INTERLEAVES), (swizzle, _SWIZZLES),
                  (l2, _L2_PROMOTIONS), (oob, _OOB_FILLS))
        lengths = (len(self.global_dim), len(self.box_dim), len(self.element_strides))
        if any(not 0 <= v < len(t) for v, t in tables) or any(n != rank for n in lengths) or (
            len(self.global_strides) != max(rank - 1, 0)
        ):
            raise bad
        dtype = tuple(TENSOR_MAP_DTYPES)[code]
        strides = (*self.global_strides[::-1], TENSOR_MAP_DTYPES[dtype]) if rank else ()
        try:
            return TensorMapSpec(
                dtype, self.global_dim[::-1], strides, self.box_dim[::-1], element_strides=self.element_strides[::-1],
                interleave=_INTERLEAVES[interleave], swizzle=_SWIZZLES[swizzle], l2_promotion=_L2_PROMOTIONS[l2],
                oob_fill=_OOB_FILLS[oob],
            )
        except InvalidArgumentError as exc:  # a value the driver's integer types cannot hold
            raise bad from exc


def _refuse(rule: str, detail: str) -> TensorMapError:
    return TensorMapError(f"tensor map: {detail}; {TENSOR_MAP_RULES[rule]} [rule {rule}]", rule=rule)


def check_tensor_map(
    spec: TensorMapSpec,
    address: int,
    *,
    compute_capability: tuple[int, int] = (9, 0),
    smem_per_sm: int = 233472,
) -> None:
    """Raise [`TensorMapError`][metrale_core.TensorMapError] where ``cuTensorMapEncodeTiled`` would refuse ``spec`` at
    ``address`` on a device of ``compute_capability`` with ``smem_per_sm`` bytes of shared memory per
    multiprocessor; return ``None`` where it would accept. The driver's rules and nothing else: the address
    is not followed (the driver accepts NULL and host pointers), and overlapping strides pass.

    The message names the rule, the dimension (outermost first, as in the spec) and the values.
    """
    if not isinstance(spec, TensorMapSpec):
        raise InvalidArgumentError(f"check_tensor_map: expected a TensorMapSpec, got {spec!r}")
    addr = as_index(address)
    if addr is None or not 0 <= addr < WORD_LIMIT:
        raise InvalidArgumentError(f"check_tensor_map: address must be a 64-bit int, got {address!r}")
    parts = [as_index(c) for c in compute_capability] if isinstance(compute_capability, tuple | list) else []
    smem = as_index(smem_per_sm)
    if len(parts) != 2 or None in parts or smem is None or smem < 0:
        raise InvalidArgumentError(
            f"check_tensor_map: compute_capability must be (major, minor) and smem_per_sm a byte count, got "
            f"{compute_capability!r} and {smem_per_sm!r}"
        )
    cc = (int(parts[0]), int(parts[1]))  # type: ignore[arg-type]
    if cc < (9, 0):
        raise _refuse("compute_capability", f"the device has compute capability {cc[0]}.{cc[1]}")
    rank, e = spec.rank, spec.itemsize
    if not 1 <= rank <= 5:
        raise _refuse("rank", f"the spec has {rank} dimension(s)")
    if spec.interleave != "none" and rank < 3:
        raise _refuse("interleave_rank", f"interleave {spec.interleave!r} with {rank} dimension(s)")
    align = 32 if spec.interleave == "32b" else 16
    if addr % align:
        raise _refuse("address_alignment", f"the address {addr:#x} is not a multiple of {align}")
    for i, d in enumerate(spec.shape):
        if not 1 <= d <= _U32_LIMIT:
            raise _refuse("global_dim", f"shape[{i}] is {d}")
    for i, s in enumerate(spec.strides[:-1]):
        if s % align or s >= 1 << 40:
            raise _refuse("global_stride", f"strides[{i}] is {s} bytes")
    for i, b in enumerate(spec.box):
        if not 1 <= b <= 256:
            raise _refuse("box_dim", f"box[{i}] is {b}")
    inner = spec.box[-1] * e
    if inner % 16:
        raise _refuse("box_inner_bytes", f"box[{rank - 1}] is {spec.box[-1]} elements of {e} bytes, {inner} bytes")
    for i, es in enumerate(spec.element_strides):
        if not 1 <= es <= 8:
            raise _refuse("element_stride", f"element_strides[{i}] is {es}")
    tile = e * math.prod(b // es for b, es in zip(spec.box, spec.element_strides, strict=True))
    if tile > smem:
        raise _refuse("box_bytes", f"the box holds {tile} bytes, the device's multiprocessor {smem}")
    if spec.swizzle.startswith("128b_atom") and cc < (10, 0):
        raise _refuse("swizzle_mode", f"swizzle {spec.swizzle!r} on compute capability {cc[0]}.{cc[1]}")
    span = _SWIZZLE_SPAN.get(spec.swizzle)
    if span is not None and spec.interleave == "none" and inner > span:
        raise _refuse("swizzle_span", f"swizzle {spec.swizzle!r} with an innermost box of {inner} bytes")
    if spec.oob_fill == "nan" and spec.dtype not in _FLOATS:
        raise _refuse("nan_fill", f"oob_fill 'nan' with dtype {spec.dtype!r}")
