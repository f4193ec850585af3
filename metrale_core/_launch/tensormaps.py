"""Tensor maps of one backend: [`TensorMap`][metrale_core.TensorMap] and its owner, the `TensorMapFront`.

The front checks a map with [`check_tensor_map`][metrale_core.check_tensor_map] and the device's own values (compute
capability, shared memory per multiprocessor), then metrale's rules (the buffer live on this backend, the
tensor within it), then has the backend encode it. It keeps the live maps weakly, to warn when a buffer under
one is freed, and chooses GEMM tiles with the device's multiprocessor count ([`n_tile`][metrale_core.n_tile]).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from .._device.args import integer, invalid_argument
from .._device.buffer import DeviceBuffer
from .._device.context import DeviceContext, gated
from .._errors import InvalidArgumentError, InvalidBufferError
from .._memory.holdings import Holdings
from ..kernels._ntile import NTile, n_tile
from ..kernels._tensormap import TensorMapSpec, check_tensor_map

__all__ = ["TENSOR_MAP_BYTES", "TensorMap", "TensorMapFront"]

_log = logging.getLogger("metrale")

#: The size of a tensor map's image: CUDA's ``CUtensorMap``.
TENSOR_MAP_BYTES = 128


class TensorMap:
    """A tensor map (TMA descriptor) over a live buffer of one backend, from ``backend.tensor_map``.

    ``image`` is the 128 bytes a kernel receives: pass the map itself as the argument of a kernel's 128-byte
    ``.param .align 64 .b8`` parameter (``const __grid_constant__ CUtensorMap``).
    [`replace_address`][metrale_core.TensorMap.replace_address] points it at another buffer, checked again; a launch
    reads the map as it is at that launch (a captured graph keeps what it captured, as the driver's kernel node keeps
    its parameter's bytes).
    """

    __slots__ = ("__weakref__", "_ctx", "_front", "_state", "spec")

    def __init__(self, front: TensorMapFront, spec: TensorMapSpec, buffer: DeviceBuffer, offset: int, image: bytes):
        self._front = front
        self._ctx = front.ctx  # (for @gated)
        self.spec = spec
        #: ``(buffer, offset, image)``, replaced as one by ``replace_address`` (one store: a launch on another
        #: thread reads either the old map or the new one, never a mix).
        self._state = (buffer, offset, image)

    @property
    def buffer(self) -> DeviceBuffer:
        """The buffer the map points into."""
        return self._state[0]

    @property
    def offset(self) -> int:
        """Where the tensor starts in [`buffer`][metrale_core.TensorMap.buffer], in bytes."""
        return self._state[1]

    @property
    def image(self) -> bytes:
        """The 128 bytes a kernel receives."""
        return self._state[2]

    @property
    def address(self) -> int:
        """The tensor's device address: ``buffer.ptr + offset``."""
        return self._state[0].ptr + self._state[1]

    @gated
    def replace_address(self, buffer: DeviceBuffer, offset: int = 0) -> None:
        """Point the map at ``buffer`` (at ``offset``), checked as ``backend.tensor_map`` checks a new one;
        refused, the map is left as it was (``cuTensorMapReplaceAddress``)."""
        buf, off, address = self._front.place(buffer, offset, "replace_address")
        check_tensor_map(self.spec, address, **self._front.device_limits())
        self._front.require_room(self.spec, buf, off, "replace_address")
        image = self._front.ctx.raw.tensor_map_replace_address(self.image, address)
        self._state = (buf, off, _image(image, "tensor_map_replace_address"))

    def frozen(self) -> TensorMap:
        """A copy of the map as it is now (what a launch hands a backend: later replacements leave it alone)."""
        copy = TensorMap.__new__(TensorMap)
        copy._front, copy._ctx, copy.spec, copy._state = self._front, self._ctx, self.spec, self._state
        return copy

    def __repr__(self) -> str:
        buf, off, _ = self._state
        s = self.spec
        return (f"<TensorMap {s.dtype}{list(s.shape)} box {list(s.box)} at allocation #{buf.index}"
                f"{f' + {off}' if off else ''} ({self.address:#x})>")


def _image(value: object, what: str) -> bytes:
    if not isinstance(value, bytes | bytearray) or len(value) != TENSOR_MAP_BYTES:
        raise InvalidArgumentError(f"the backend's {what} returned {value!r}, not {TENSOR_MAP_BYTES} bytes")
    return bytes(value)


class TensorMapFront:
    """One backend's tensor maps and tile choice."""

    __slots__ = ("_holdings", "_limits", "_lock", "_mapped", "_maps", "ctx")

    def __init__(self, ctx: DeviceContext, holdings: Holdings) -> None:
        self.ctx = ctx
        self._holdings = holdings
        self._lock = threading.Lock()
        self._maps: weakref.WeakSet[TensorMap] = weakref.WeakSet()
        #: Whether a map was made since `_maps` was last found empty (a free's check without the WeakSet's
        #: ``__len__``, which is Python; true while maps die unseen costs only the slower check).
        self._mapped = False
        self._limits: tuple[tuple[int, int], int, int] | None = None

    def _device(self) -> tuple[tuple[int, int], int, int]:
        """``(compute capability, multiprocessors, shared memory per multiprocessor)``, asked once."""
        if self._limits is None:
            sms, smem = self.ctx.raw.multiprocessors()
            self._limits = (self.ctx.raw.compute_capability(), int(sms), int(smem))
        return self._limits

    def device_limits(self) -> dict[str, Any]:
        """``check_tensor_map``'s keywords for this device."""
        cc, _, smem = self._device()
        return {"compute_capability": cc, "smem_per_sm": smem}

    def place(self, buffer: object, offset: object, what: str) -> tuple[DeviceBuffer, int, int]:
        """``(buffer, offset, address)``, of the right kinds (their liveness is checked later)."""
        if not isinstance(buffer, DeviceBuffer):
            raise invalid_argument(what, "a DeviceBuffer", buffer)
        off = integer(offset, what, "offset")
        if off > buffer.nbytes:
            raise InvalidBufferError(f"{what}: offset {off} is past the end of allocation #{buffer.index} "
                                     f"({buffer.nbytes} bytes)")
        return buffer, off, buffer.ptr + off

    def require_room(self, spec: TensorMapSpec, buffer: DeviceBuffer, offset: int, what: str) -> None:
        """metrale's rules: ``buffer`` live on this backend and the whole tensor within it."""
        self._holdings.require_live(buffer, what)
        end = offset + spec.extent
        if end > buffer.nbytes:
            raise InvalidBufferError(
                f"{what}: the tensor {list(spec.shape)} with strides {list(spec.strides)} spans bytes [{offset}, "
                f"{end}) of allocation #{buffer.index}, which holds {buffer.nbytes}; use a larger buffer or a "
                f"smaller shape"
            )

    def make(self, buffer: object, spec: object, offset: object) -> TensorMap:
        what = "tensor_map"
        if not isinstance(spec, TensorMapSpec):
            raise invalid_argument(what, "a TensorMapSpec", spec)
        buf, off, address = self.place(buffer, offset, what)
        check_tensor_map(spec, address, **self.device_limits())
        self.require_room(spec, buf, off, what)
        image = _image(self.ctx.raw.tensor_map_encode(spec.encoding(), address), "tensor_map_encode")
        tmap = TensorMap(self, spec, buf, off, image)
        with self._lock:
            self._maps.add(tmap)
            self._mapped = True
            self._holdings.releases.watch(self.warn_if_mapped, True)
        return tmap

    def warn_if_mapped(self, buf: DeviceBuffer) -> None:
        """An allocator release observer, switched on while maps may live: warn when live tensor maps still point
        into ``buf``."""
        if not self._mapped:  # read without the lock: a map made meanwhile cannot point at a buffer being freed
            return
        if not self._maps:  # every map is gone: forget them, under the lock a new map's add takes
            with self._lock:
                if not self._maps:
                    self._mapped = False
                    self._holdings.releases.watch(self.warn_if_mapped, False)
            return
        with self._lock:
            users = [m for m in self._maps if m.buffer == buf]  # (the same allocation: equal values)
        if users:
            _log.warning(
                "free of allocation #%d (%d bytes from %s) while %d live tensor map(s) still point into it; "
                "launching with them now raises InvalidBufferError: point them elsewhere with replace_address",
                buf.index, buf.nbytes, buf.site, len(users),
            )

    def n_tile(self, m: object, n: object, options: dict[str, Any]) -> NTile:
        if "num_sms" in options:
            raise InvalidArgumentError("n_tile: num_sms is the device's; call metrale_core.n_tile to choose another")
        unknown = sorted(set(options) - _N_TILE_OPTIONS)
        if unknown:
            raise InvalidArgumentError(f"n_tile: unknown option(s) {unknown}; it takes {sorted(_N_TILE_OPTIONS)}")
        return n_tile(m, n, num_sms=self._device()[1], **options)  # type: ignore[arg-type]


#: The keywords ``backend.n_tile`` passes on to [`n_tile`][metrale_core.n_tile].
_N_TILE_OPTIONS = frozenset({"candidates", "block_m", "groups", "occupancy", "element_bytes", "swizzle_bytes"})
