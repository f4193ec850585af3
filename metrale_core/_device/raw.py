"""The raw primitives a backend implements: [`RawDevice`][metrale_core.RawDevice].

A backend plugin implements this class and nothing of metrale's semantics:
the ledger, red zones, bounds checks, stale-handle checks and the capture
rules all live in the core (behind [`metrale_core.GpuBackend`][metrale_core.GpuBackend]), which
calls these primitives only after its own checks have passed. So a backend
that forgets an invariant cannot break it. The core also decides when a
primitive may block: it never calls a waiting primitive (a synchronize, a
query) while a capture in global mode runs anywhere in the process, and it
tells [`RawDevice.copy_dtoh`][metrale_core.RawDevice.copy_dtoh] whether it may wait (``may_wait``); a
primitive never decides that on its own.

Conventions for implementers:

- Handles (streams, events, graphs, executable graphs) are opaque objects of
  the backend's own; the core only hands them back.
- Pointers are plain ``int`` device addresses. Raw-pointer operations reach
  the primitives unchecked; a primitive refuses an address outside any
  allocation exactly as the driver does (``CUDA_ERROR_INVALID_VALUE``).
- Every failure is raised as a [`MetraleError`][metrale_core.MetraleError], built by
  [`metrale_core.error_for_code`][metrale_core.error_for_code] from CUDA's result code or name. No
  foreign exception may escape.
- Work on a stream in capture mode is recorded into the capture, not run.
- Every method may be called from any thread.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Final, Literal

from .._errors import error_for_code
from .._types import AllocKind, ForeignMemory

if TYPE_CHECKING:
    from .._types import KernelImplementation, LaunchArg
    from ..kernels._tensormap import TensorMapEncoding

__all__ = ["DEVICE_CALLS", "AllocKind", "Baseline", "CaptureMode", "CopyDirection", "ForeignMemory", "RawDevice"]

#: The name of the capsule [`RawDevice.device_calls`][metrale_core.RawDevice.device_calls] returns: its struct's
#: version is in it.
DEVICE_CALLS: Final = "metrale_core.device_calls.v1"

#: A thread's stream capture mode (`RawDevice.exchange_capture_mode`), as CUDA's ``CUstreamCaptureMode`` names them.
CaptureMode = Literal["global", "thread_local", "relaxed"]

#: The directions of [`Baseline.copy`][metrale_core.Baseline.copy]: device to device, pinned host to device, device to
#: pinned host.
CopyDirection = Literal["dtod", "htod", "dtoh"]


class Baseline(abc.ABC):
    """The vendor's own API, called directly with nothing of metrale in between: what ``metrale bench``
    times metrale against.

    A backend returns one from [`RawDevice.baseline`][metrale_core.RawDevice.baseline]. Each factory prepares one
    operation the way a user without metrale would write it (allocating what it needs, owned by the baseline until
    [`close`][metrale_core.Baseline.close]) and returns a callable that performs it once. Operations on a stream are
    queued on the baseline's own stream and not waited for; [`synchronize`][metrale_core.Baseline.synchronize] waits for
    them.
    """

    @property
    @abc.abstractmethod
    def label(self) -> str:
        """What the baseline calls, with its version, e.g. ``"cuda.bindings 13.3.1"``."""

    @property
    def versions(self) -> Mapping[str, str]:
        """The versions of what the baseline runs on (the bindings, the driver), for the record."""
        return {}

    @abc.abstractmethod
    def alloc_free(self, nbytes: int) -> Callable[[], None]:
        """One allocation of ``nbytes`` of device memory and its release."""

    @abc.abstractmethod
    def memset(self, nbytes: int) -> Callable[[], None]:
        """One asynchronous memset of ``nbytes``."""

    @abc.abstractmethod
    def copy(self, direction: CopyDirection, nbytes: int) -> Callable[[], None]:
        """One asynchronous copy of ``nbytes`` in ``direction`` (host memory pinned)."""

    @abc.abstractmethod
    def vector_add(self, n: int) -> Callable[[], None]:
        """One launch of the shipped ``vector_add`` over ``n`` float32 elements, 256 threads a block."""

    def copy_peer(self, nbytes: int, peer_ordinal: int) -> Callable[[], None]:
        """One asynchronous copy of ``nbytes`` from device ``peer_ordinal``'s memory into this device's
        (CUDA: ``cuMemcpyPeerAsync``; the same ordinal: a copy within the device). Optional: by default
        ``CUDA_ERROR_NOT_SUPPORTED``, and the bench shows metrale's peer copy without a raw row."""
        raise error_for_code("CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} has no peer copy: copy_peer")

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for everything the baseline queued."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything the factories allocated."""


class RawDevice(abc.ABC):
    """One device's raw primitives, as a backend plugin implements them."""

    # -- the device -----------------------------------------------------------

    @abc.abstractmethod
    def device_name(self) -> str:
        """A human-readable name for the device, e.g. ``"NVIDIA H200"``."""

    @abc.abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of device memory, as the driver reports them."""

    @abc.abstractmethod
    def is_integrated(self) -> bool | None:
        """Whether the device shares memory with the host; ``None`` if the query failed."""

    def bind_to_thread(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Make this device's context current on the calling thread."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the device (context, default resources). Must not raise at teardown.

        The core has waited for the device before (``synchronize``) whenever waiting was
        allowed, and has released every handle and allocation it made.
        """

    # -- memory ---------------------------------------------------------------

    def fresh_memory_reads_zeros(self) -> bool:
        """Whether memory fresh from [`alloc`][metrale_core.RawDevice.alloc] reads as zeros (the fake's
        promise; CUDA makes none; default ``False``). The core keeps the promise when it hands a block it
        recycled (a red-zoned block kept for reuse) to a new allocation: it zeroes the block first."""
        return False

    @abc.abstractmethod
    def alloc(self, nbytes: int, kind: AllocKind) -> int:
        """Allocate ``nbytes`` of device memory of ``kind``; returns a 256-byte-aligned pointer."""

    @abc.abstractmethod
    def free(self, ptr: int, kind: AllocKind) -> None:
        """Release memory [`alloc`][metrale_core.RawDevice.alloc] returned."""

    def device_calls(self) -> object | None:
        """Optional: [`alloc`][metrale_core.RawDevice.alloc] and [`free`][metrale_core.RawDevice.free] of
        ``"device"`` memory, [`memset`][metrale_core.RawDevice.memset],
        [`graph_launch`][metrale_core.RawDevice.graph_launch] and [`launch`][metrale_core.RawDevice.launch], as C
        functions, for the core's compiled lanes (default
        ``None``: they call the methods).

        A ``PyCapsule`` named ``DEVICE_CALLS`` (``"metrale_core.device_calls.v1"``) whose pointer is a
        ``metrale_device_calls_v1``, valid as long as the capsule lives. The struct, each function's arguments and the
        return convention are defined once, in the C header ``metrale/device_calls.h``: compile against
        [`metrale_core.plugin.get_include()`][metrale_core.plugin.get_include]. In short:

        - Each is called with the GIL held, only while the backend is open. ``alloc`` and ``free`` are required; the
          optional ``memset``, ``graph_launch`` and ``launch`` may be ``NULL``, or past the end of a shorter struct:
          the method is called.
        - ``0``: done, as the method would have done it. ``1``: declined, nothing done: the core calls the method,
          which does the work or raises. ``-1``, with a Python exception set: the typed error the method would raise
          (``OutOfMemoryError`` for an allocation: the core then reclaims and retries, through the method); the call
          is not made again.

        docs/plugin-authors.md ("Device calls in C") shows a backend that offers them.
        """
        return None

    @abc.abstractmethod
    def alloc_host(self, nbytes: int) -> tuple[int, memoryview]:
        """Pinned host memory: its address and a writable byte view of it."""

    @abc.abstractmethod
    def free_host(self, ptr: int) -> None:
        """Release memory [`alloc_host`][metrale_core.RawDevice.alloc_host] returned."""

    def alloc_host_mapped(self, nbytes: int) -> tuple[int, memoryview, int]:
        """Pinned host memory the device can address too (``cuMemHostAlloc`` with
        ``CU_MEMHOSTALLOC_DEVICEMAP``): its host address, a writable byte view, and the device
        address kernels write it at (``cuMemHostGetDevicePointer``). Released with
        [`free_host`][metrale_core.RawDevice.free_host].

        Optional: the core's in-graph red-zone checks leave their verdicts here; a backend without
        it keeps the checks queued behind each graph launch instead.
        """
        raise error_for_code(
            "CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} maps no host memory: alloc_host_mapped"
        )

    @abc.abstractmethod
    def memset(self, ptr: int, value: int, nbytes: int, stream: object) -> None:
        """Set ``nbytes`` bytes at ``ptr`` to ``value``, on ``stream``."""

    @abc.abstractmethod
    def copy_htod(self, dst: int, src: memoryview, stream: object, *, pinned: bool) -> None:
        """Copy all of ``src`` (host bytes) to ``dst``, on ``stream``.

        ``pinned`` says ``src`` is a view of [`alloc_host`][metrale_core.RawDevice.alloc_host] memory; a copy
        from pageable memory has consumed ``src`` when this returns.
        """

    @abc.abstractmethod
    def copy_dtoh(self, dst: memoryview, src: int, stream: object, *, pinned: bool, may_wait: bool = True) -> None:
        """Fill all of ``dst`` (host bytes) from ``src``, on ``stream``.

        A copy into pageable memory (``pinned`` false) has completed when this returns, waiting
        for ``stream`` if the driver does not (host memory another library page-locked is copied
        asynchronously) — where ``may_wait`` allows. The core decides ``may_wait``: it passes
        ``may_wait=False``, and only then, while a capture in global mode runs anywhere in the
        process, where a wait would invalidate it.
        A backend never decides that on its own.
        """

    @abc.abstractmethod
    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: object) -> None:
        """Copy ``nbytes`` from ``src`` to ``dst`` on the device, on ``stream``."""

    # -- streams and events ---------------------------------------------------

    @abc.abstractmethod
    def stream_create(self) -> object:
        """A new non-blocking stream."""

    @abc.abstractmethod
    def stream_destroy(self, stream: object) -> None:
        """Destroy a stream of [`stream_create`][metrale_core.RawDevice.stream_create]."""

    @abc.abstractmethod
    def stream_synchronize(self, stream: object) -> None:
        """Wait for all work issued to ``stream``."""

    @abc.abstractmethod
    def stream_query(self, stream: object) -> bool:
        """Whether all work issued to ``stream`` has completed."""

    @abc.abstractmethod
    def stream_wait_event(self, stream: object, event: object) -> None:
        """Make later work on ``stream`` wait for the last record of ``event``."""

    @abc.abstractmethod
    def event_create(self) -> object:
        """A new event (timing enabled)."""

    @abc.abstractmethod
    def event_destroy(self, event: object) -> None:
        """Destroy an event of [`event_create`][metrale_core.RawDevice.event_create]."""

    @abc.abstractmethod
    def event_record(self, event: object, stream: object) -> None:
        """Record ``event`` on ``stream``."""

    @abc.abstractmethod
    def event_synchronize(self, event: object) -> None:
        """Wait until the work before the event's last record has completed."""

    @abc.abstractmethod
    def event_query(self, event: object) -> bool:
        """Whether the work before the event's last record has completed."""

    @abc.abstractmethod
    def event_elapsed_ms(self, start: object, end: object) -> float:
        """Milliseconds between two completed records."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all work on the device."""

    # -- capture and graphs ---------------------------------------------------

    @abc.abstractmethod
    def begin_capture(self, stream: object) -> None:
        """Begin capturing ``stream`` in global mode."""

    @abc.abstractmethod
    def end_capture(self, stream: object) -> object:
        """End the capture of ``stream``; returns the recorded graph."""

    @abc.abstractmethod
    def is_capturing(self, stream: object) -> bool:
        """The driver's own answer: is ``stream`` capturing?"""

    def exchange_capture_mode(self, mode: CaptureMode) -> CaptureMode:
        """Set the calling thread's stream capture mode; returns the mode it had (a thread starts in ``"global"``).

        A ``"relaxed"`` thread may allocate and free device memory while a capture in global mode runs anywhere in
        the process; the allocation is not captured (CUDA: ``cuThreadExchangeStreamCaptureMode``, which torch's
        caching allocator uses so to grow a graph's private pool during its capture). A wait for a capturing stream
        stays refused in any mode. The core relaxes a thread only while a pool made for another library's capture
        grows (``create_pool(for_capture=True)``), and sets it back at once. Optional: without it (this default,
        ``CUDA_ERROR_NOT_SUPPORTED``) such a pool grows as any other, which a capture in global mode refuses.
        """
        raise error_for_code(
            "CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} has no capture modes: exchange_capture_mode"
        )

    @abc.abstractmethod
    def graph_instantiate(self, graph: object) -> object:
        """An executable graph of ``graph``."""

    @abc.abstractmethod
    def graph_launch(self, graph_exec: object, stream: object) -> None:
        """Launch an executable graph on ``stream``."""

    @abc.abstractmethod
    def graph_destroy(self, graph: object) -> None:
        """Destroy a graph of [`end_capture`][metrale_core.RawDevice.end_capture]."""

    @abc.abstractmethod
    def graph_exec_destroy(self, graph_exec: object) -> None:
        """Destroy an executable graph of [`graph_instantiate`][metrale_core.RawDevice.graph_instantiate]."""

    # -- kernel modules (optional: the defaults say the backend runs no kernels) --------

    def compute_capability(self) -> tuple[int, int]:
        """``(major, minor)``, read without needing a current context."""
        raise error_for_code("CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} runs no kernels: compute_capability")

    def module_load(self, name: str, image: bytes) -> object:
        """Load a PTX image (already checked against the device's architecture)."""
        raise error_for_code("CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} runs no kernels: module_load")

    def module_unload(self, module: object) -> None:
        """Unload a module of [`module_load`][metrale_core.RawDevice.module_load]."""
        raise error_for_code("CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} runs no kernels: module_unload")

    def module_function(self, module: object, kernel: str) -> object:
        """The handle of kernel ``kernel`` in ``module`` (which the core checked it holds)."""
        raise error_for_code("CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} runs no kernels: module_function")

    def launch(
        self,
        function: object,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: object,
        args: Sequence[LaunchArg],
    ) -> None:
        """Launch ``function`` on ``stream`` with ``args``, already checked and packed."""
        raise error_for_code("CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} runs no kernels: launch")

    def multiprocessors(self) -> tuple[int, int]:
        """``(multiprocessor count, shared memory per multiprocessor in bytes)``
        (``CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT``, ``..._MAX_SHARED_MEMORY_PER_MULTIPROCESSOR``)."""
        raise error_for_code("CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} runs no kernels: multiprocessors")

    def tensor_map_encode(self, encoding: TensorMapEncoding, address: int) -> bytes:
        """The 128 bytes of a tensor map (``cuTensorMapEncodeTiled``) of ``encoding`` at ``address``.

        The core has checked it with [`check_tensor_map`][metrale_core.check_tensor_map] and the device's values first;
        a backend refuses what the driver refuses all the same (``CUDA_ERROR_INVALID_VALUE``).
        """
        raise error_for_code("CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} has no tensor maps: tensor_map_encode")

    def tensor_map_replace_address(self, image: bytes, address: int) -> bytes:
        """``image`` (of [`tensor_map_encode`][metrale_core.RawDevice.tensor_map_encode]) pointed at ``address``
        (``cuTensorMapReplaceAddress``)."""
        raise error_for_code(
            "CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} has no tensor maps: tensor_map_replace_address"
        )

    def add_kernel_implementations(self, implementations: Iterable[KernelImplementation]) -> None:  # noqa: B027
        """Python implementations of kernels, for a backend that runs kernels on the CPU; others ignore them."""

    # -- interop (optional: the defaults say the backend shares no memory) --------------

    def export_memory(self, ptr: int, nbytes: int) -> ForeignMemory:
        """The live bytes ``[ptr, ptr + nbytes)`` as other libraries can address them."""
        raise error_for_code("CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} shares no memory: export_memory")

    def import_memory(self, memory: ForeignMemory) -> int:
        """Make another library's memory addressable here; returns the pointer metrale uses for it.

        Refuse memory the device cannot address (``CUDA_ERROR_INVALID_DEVICE``).
        """
        raise error_for_code("CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} shares no memory: import_memory")

    def order_foreign_stream(self, stream: int) -> None:
        """Make later work on another library's stream wait for the work issued so far on every stream of
        this device, on the device: no host wait (CUDA: an event recorded on each of them, then
        ``cuStreamWaitEvent(stream, event, 0)``).

        ``stream`` is the consumer's, as DLPack's ``__dlpack__(stream=...)`` gives it: 1 for CUDA's
        legacy default stream, 2 for the per-thread default stream, any other integer a ``CUstream``'s
        address (the consumer's to keep valid). The core calls it for a DLPack export whose consumer
        names its stream, never during a capture. Optional: without it (this default,
        ``CUDA_ERROR_NOT_SUPPORTED``) the core waits for the device
        ([`synchronize`][metrale_core.RawDevice.synchronize]) instead.
        """
        raise error_for_code(
            "CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} orders no foreign streams: order_foreign_stream"
        )

    def foreign_stream(self, stream: int) -> object:
        """Another library's stream as a stream of this device that work may be issued to (``memset``, ``launch``,
        copies, ``event_record``, ``stream_synchronize``): borrowed, never destroyed nor captured by metrale.

        ``stream`` is numbered as DLPack numbers it (1 CUDA's legacy default stream, 2 the per-thread one, any other
        integer a ``CUstream``'s address, the other library's to keep valid). The core fills the red zones of a pool's
        piece for that stream there (`MemoryPool.alloc_on`, the allocator doors): in the stream's own order, with no
        event per piece. It calls this once per stream handle and keeps the answer. Optional: without it (this
        default, ``CUDA_ERROR_NOT_SUPPORTED``) the fills go to the default stream and
        [`order_foreign_stream`][metrale_core.RawDevice.order_foreign_stream] orders the stream after them.
        """
        raise error_for_code(
            "CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} lends no foreign streams: foreign_stream"
        )

    def forget_memory(self, ptr: int) -> None:  # noqa: B027 - optional hook, default no-op
        """Stop addressing memory of [`import_memory`][metrale_core.RawDevice.import_memory] (it stays its owner's to
        free)."""

    def address_range(self, ptr: int) -> tuple[int, int]:
        """``(base, nbytes)`` of the one allocation the device knows that holds address ``ptr``
        (``cuMemGetAddressRange``); an address inside none raises ``CUDA_ERROR_NOT_FOUND``.

        The core asks it of every pointer [`import_memory`][metrale_core.RawDevice.import_memory] returns, and refuses a
        wrap whose extent runs past that allocation: a producer that claims more than it owns must never let
        metrale write into a neighbour. A backend that imports memory implements it; without it,
        ``wrap`` is refused with ``CUDA_ERROR_NOT_SUPPORTED``.
        """
        raise error_for_code(
            "CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} knows no address ranges: address_range"
        )

    # -- several devices (optional) -------------------------------------------------------

    def device_uuid(self) -> str:
        """The device's UUID as ``nvidia-smi -L`` writes it (``"GPU-1a2b…"``), or ``""`` where the backend
        has none; it names the device in every report's origin. Optional: ``""`` by default."""
        return ""

    def copy_peer(self, dst: int, src_device: RawDevice, src: int, nbytes: int, stream: object) -> None:
        """Copy ``nbytes`` from ``src`` on ``src_device`` (another raw device of the same plugin, possibly
        on the same device ordinal) to ``dst`` on this device, ordered on ``stream``, one of this device's
        (CUDA: ``cuMemcpyAsync`` between devices, ``cuMemcpyDtoDAsync`` within one context; not
        ``cuMemcpyPeerAsync``, which a capture refuses). A capture must record it as any copy. The core
        checked both ranges live and in bounds. Optional: without it (``CUDA_ERROR_NOT_SUPPORTED``)
        ``copy_peer`` is refused. A ``src_device`` this backend cannot read raises ``CUDA_ERROR_INVALID_DEVICE``."""
        raise error_for_code("CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} copies between no devices: copy_peer")

    def enable_peer_access(self, peer: RawDevice) -> None:
        """Let this device read and write ``peer``'s memory directly (CUDA: ``cuDeviceCanAccessPeer``, then
        ``cuCtxEnablePeerAccess``); enabling it twice, or for the same device, does nothing. Devices that
        cannot reach each other raise ``CUDA_ERROR_PEER_ACCESS_UNSUPPORTED``. Optional: by default
        ``CUDA_ERROR_NOT_SUPPORTED``."""
        raise error_for_code(
            "CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} has no peer access: enable_peer_access"
        )

    # -- benchmarks (optional) -------------------------------------------------------------

    def baseline(self) -> Baseline:
        """The vendor API on this device, for ``metrale bench`` to compare metrale with (the caller closes it)."""
        raise error_for_code("CUDA_ERROR_NOT_SUPPORTED", f"{type(self).__name__} has no baseline: baseline")
