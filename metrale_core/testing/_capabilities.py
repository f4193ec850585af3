"""Which optional primitives a backend has: the probe behind the tests' skips.

A [`RawDevice`][metrale_core.RawDevice] must implement its abstract methods; the others are optional,
and their defaults raise ``CUDA_ERROR_NOT_SUPPORTED`` (see ``metrale_core/_raw.py``). A test that
needs an optional primitive skips, with the reason, on a backend that lacks it, rather than
failing: [`backend_capabilities`][metrale_core.testing.backend_capabilities] says which of
[`CAPABILITIES`][metrale_core.testing.CAPABILITIES] a backend has, and
[`backend_params`][metrale_core.testing.backend_params] (``needs=``) and metrale's own ``needs`` marker use it.

A capability is missing only where the backend says so, by answering ``CUDA_ERROR_NOT_SUPPORTED``
(or by keeping ``RawDevice``'s default, which does): any other failure of a probe counts as
present, so the test runs and shows the failure instead of hiding it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Final

from .. import ArchitectureError, GpuBackend, MetraleError, MetraleSettings, RawDevice, TensorMapSpec, open_backend
from ..kernels import shipped_modules

__all__ = ["CAPABILITIES", "Capabilities", "backend_capabilities", "probe_capabilities"]

#: The optional primitives a test may need, and what each covers.
CAPABILITIES: Final[Mapping[str, str]] = {
    "kernels": "kernel modules and launches (compute_capability, module_load, module_function, launch): "
    "the shipped kernels, queued red-zone scans, the pipeline example, the bench's launches",
    "interop": "memory shared with other libraries (export_memory, import_memory, address_range): "
    "DLPack and the CUDA array interface, wrap()",
    "baseline": "the vendor's own API to time against (baseline()): metrale bench's baselines",
    "tensor_maps": "tensor maps and the device's multiprocessors (multiprocessors, tensor_map_encode, "
    "tensor_map_replace_address): backend.tensor_map, backend.n_tile, the shipped TMA kernel",
    "peers": "copies between two backends of one plugin (copy_peer, enable_peer_access): backend.copy_peer",
}

_NOT_SUPPORTED: Final = "CUDA_ERROR_NOT_SUPPORTED"


@dataclasses.dataclass(frozen=True, slots=True)
class Capabilities:
    """The optional primitives of one backend: ``missing`` maps each one it lacks to why."""

    backend: str
    missing: Mapping[str, str]

    def has(self, capability: str) -> bool:
        """Whether the backend has ``capability`` (one of [`CAPABILITIES`][metrale_core.testing.CAPABILITIES])."""
        return self.why_not(capability) is None

    def why_not(self, capability: str) -> str | None:
        """Why the backend lacks ``capability``, as a skip reason; ``None`` when it has it."""
        if capability not in CAPABILITIES:
            raise ValueError(f"no capability {capability!r}; choose from {', '.join(CAPABILITIES)}")
        return self.missing.get(capability)


def _declined(exc: BaseException) -> bool:
    return isinstance(exc, MetraleError) and exc.name == _NOT_SUPPORTED


def _kernels(gpu: GpuBackend) -> str | None:
    try:
        registry = gpu.load_modules(shipped_modules("vector"))
    except ArchitectureError as exc:
        return f"needs kernels; backend {gpu.name} cannot run the shipped ones: {exc}"
    except MetraleError as exc:
        return f"needs kernels, which backend {gpu.name} lacks: {exc}" if _declined(exc) else None
    registry.close()
    return None


def _interop(gpu: GpuBackend) -> str | None:
    raw = gpu.raw
    if type(raw).import_memory is RawDevice.import_memory:
        return f"needs interop, which backend {gpu.name} lacks: its raw layer keeps RawDevice's import_memory"
    buf = gpu.alloc(256)
    try:
        for probe in (lambda: raw.export_memory(buf.ptr, buf.nbytes), lambda: raw.address_range(buf.ptr)):
            try:
                probe()
            except Exception as exc:  # a plugin's own exception counts as present: the tests show it
                if _declined(exc):
                    return f"needs interop, which backend {gpu.name} lacks: {exc}"
    finally:
        gpu.free(buf)
    return None


def _baseline(gpu: GpuBackend) -> str | None:
    try:
        baseline = gpu.raw.baseline()
    except Exception as exc:
        return f"needs a baseline, which backend {gpu.name} lacks: {exc}" if _declined(exc) else None
    with contextlib.suppress(Exception):  # a baseline that fails to close: the bench's own tests show it
        baseline.close()
    return None


def _tensor_maps(gpu: GpuBackend) -> str | None:
    spec = TensorMapSpec("float32", (16, 16), (64, 4), (16, 16))
    try:
        gpu.raw.multiprocessors()
        gpu.raw.tensor_map_encode(spec.encoding(), 1 << 20)
    except Exception as exc:
        return f"needs tensor maps, which backend {gpu.name} lacks: {exc}" if _declined(exc) else None
    return None


def _peers(gpu: GpuBackend) -> str | None:
    raw = gpu.raw
    if type(raw).copy_peer is RawDevice.copy_peer:
        return f"needs peer copies, which backend {gpu.name} lacks: its raw layer keeps RawDevice's copy_peer"
    return None


_PROBES: Final[Mapping[str, Callable[[GpuBackend], str | None]]] = {
    "kernels": _kernels, "interop": _interop, "baseline": _baseline, "tensor_maps": _tensor_maps, "peers": _peers,
}


def probe_capabilities(gpu: GpuBackend) -> Capabilities:
    """Probe the open backend ``gpu`` for every one of [`CAPABILITIES`][metrale_core.testing.CAPABILITIES] (it
    allocates, loads the shipped ``vector`` module and frees what it made)."""
    missing = {}
    for capability, probe in _PROBES.items():
        why = probe(gpu)
        if why is not None:
            missing[capability] = why
    return Capabilities(gpu.name, missing)


_cache: dict[tuple[str, str], Capabilities] = {}
_lock = threading.Lock()


def backend_capabilities(name: str, settings: MetraleSettings | None = None) -> Capabilities:
    """The capabilities of backend ``name`` (opened once with ``settings`` to probe, then remembered)."""
    settings = settings or MetraleSettings()
    key = (name, settings.model_dump_json())
    with _lock:
        known = _cache.get(key)
    if known is not None:
        return known
    with open_backend(name, settings=settings) as gpu:
        found = probe_capabilities(gpu)
    with _lock:
        return _cache.setdefault(key, found)
