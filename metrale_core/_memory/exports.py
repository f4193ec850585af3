"""The export table: one backend's memory handed to other libraries, and theirs taken in.

It answers the exports of [`DeviceBuffer`][metrale_core.DeviceBuffer] and
[`DeviceArray`][metrale_core.DeviceArray] (the `BufferOwner` of this
backend's buffers: checked live, after the device's work: waited for on the host, or, for a
DLPack consumer that names its stream, ordered before that stream on the device with
``RawDevice.order_foreign_stream``), counts the DLPack tensors and
views still held so ``free`` can warn, and owns wrapped memory (``wrap``/``unwrap``): each
wrap is its own live buffer, keyed by its creation index, never by the producer's address.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator

from .._device.buffer import NO_SYNC, DeviceArray, DeviceBuffer
from .._device.capture import forbid_during_capture, resume_calls, suspend_calls
from .._device.context import DeviceContext
from .._device.raw import RawDevice
from .._errors import (
    BackendClosedError,
    DriverError,
    InvalidArgumentError,
    InvalidBufferError,
    MetraleError,
    cuda_code,
)
from .._interop.dlpack import reap
from .._interop.foreign import foreign_memory
from .._redzones.guard import ZoneGuard
from .._types import ForeignMemory
from .holdings import Holdings
from .records import next_index
from .sites import call_site

__all__ = ["ExportTable"]

_log = logging.getLogger("metrale")

#: CUDA's code for memory the device cannot address, which a refused wrap carries.
_INVALID_DEVICE = cuda_code("CUDA_ERROR_INVALID_DEVICE")


class ExportTable:
    """Exports and wrapped memory of one backend (the ``BufferOwner`` of its buffers)."""

    __slots__ = ("_exported", "_guard", "_holdings", "_raw", "_viewed", "ctx")

    def __init__(self, ctx: DeviceContext, holdings: Holdings, guard: ZoneGuard) -> None:
        self.ctx = ctx
        self._raw = ctx.raw
        self._holdings = holdings
        self._guard = guard
        self._exported: dict[int, int] = {}  # creation index -> DLPack tensors not yet released
        self._viewed: dict[int, weakref.WeakSet[DeviceArray]] = {}  # creation index -> views exported

    # -- BufferOwner ----------------------------------------------------------------------

    def export(self, buf: DeviceBuffer, view: DeviceArray, what: str, *, wait: bool = True) -> ForeignMemory:
        return self._export(buf, view, what, wait, None)

    def export_for_stream(self, buf: DeviceBuffer, view: DeviceArray, what: str, stream: int) -> ForeignMemory:
        return self._export(buf, view, what, True, stream)

    def _export(self, buf: DeviceBuffer, view: DeviceArray, what: str, wait: bool, stream: int | None) -> ForeignMemory:
        ctx = self.ctx
        ctx.enter()
        try:
            self._holdings.require_live(buf, what)
            if wait:
                forbid_during_capture(what)
                if stream is None:
                    self._guard.sync_device()
                elif stream != NO_SYNC:
                    self._guard.order_foreign(stream)
            memory = self._raw.export_memory(buf.ptr, buf.nbytes)
            if wait and buf.kind in ("device", "managed", "pool"):  # exported (not only asked where): free() warns
                with ctx.lock:
                    self._viewed.setdefault(buf.index, weakref.WeakSet()).add(view)
                    self._holdings.releases.watch(self.warn_if_exported, True)
            return memory
        finally:
            ctx.leave()

    # -- PeerSource: another backend of the process copies from this one's buffers ---------------

    @contextlib.contextmanager
    def peer_source(
        self, buf: DeviceBuffer, offset: int, nbytes: int | None, what: str
    ) -> Iterator[tuple[int, int, RawDevice]]:
        ctx = self.ctx
        try:
            ctx.enter()
        except BackendClosedError:
            raise InvalidBufferError(
                f"{what}: the source, allocation #{buf.index} ({buf.nbytes} bytes from {buf.site}), belongs to "
                f"backend {ctx.name}:{ctx.ordinal}, which is closed"
            ) from None
        try:
            ptr, n, _ = self._holdings.span(buf, offset, nbytes, what)
            # a fresh buffer's fills (its zones; a recycled block's zeroing) run on this backend's default
            # stream, which the other backend's stream does not follow: they are done before it reads
            self._guard.settle()
            yield ptr, n, ctx.plugin  # the copy is issued inside: close() waits for it
        finally:
            ctx.leave()

    def peer_is_live(self, buf: DeviceBuffer) -> bool:
        return not self.ctx.closed and self._holdings.is_live(buf)

    def export_held(self, index: int, delta: int) -> None:
        with self.ctx.lock:
            held = self._exported.get(index, 0) + delta
            if held > 0:
                self._exported[index] = held
                self._holdings.releases.watch(self.warn_if_exported, True)
            else:
                self._exported.pop(index, None)

    def warn_if_exported(self, buf: DeviceBuffer) -> None:
        """An allocator release observer, switched on while something is exported: warn when other libraries still
        hold views of ``buf``."""
        if buf.kind not in ("device", "managed", "pool"):
            return
        if not self._exported and not self._viewed:  # nothing exported: switched off, under the lock exports take
            with self.ctx.lock:
                if not self._exported and not self._viewed:
                    self._holdings.releases.watch(self.warn_if_exported, False)
            return
        if self._exported:
            reap()  # tensors whose deleter ran, or whose capsule died unconsumed, are counted off first
        with self.ctx.lock:
            tensors = self._exported.pop(buf.index, 0)
            views = self._viewed.pop(buf.index, None)
            if not self._exported:  # views all gone (their sets empty) leave nothing to watch either
                for index in [i for i, seen in self._viewed.items() if not seen]:
                    del self._viewed[index]
                if not self._viewed:
                    self._holdings.releases.watch(self.warn_if_exported, False)
            arrays = len(views) if views is not None else 0
        if tensors or arrays:
            held = " and ".join(f"{n} {what}" for n, what in ((arrays, "view(s)"), (tensors, "DLPack tensor(s)")) if n)
            _log.warning(
                "free of allocation #%d (%d bytes from %s) while other libraries still hold %s of it: they now "
                "point at freed memory; drop them before freeing",
                buf.index, buf.nbytes, buf.site, held,
            )

    # -- wrapped memory ---------------------------------------------------------------------

    def wrap(self, obj: object) -> DeviceBuffer:
        forbid_during_capture("wrap")  # the capture rule first, as for every barred call
        calls = suspend_calls()  # the producer's code runs outside metrale's calls
        try:
            memory, release = foreign_memory(obj)
        finally:
            resume_calls(calls)
        try:
            forbid_during_capture("wrap")  # a capture may have begun while the producer's code ran
        except BaseException:
            if release is not None:
                release()
            raise
        try:
            self._guard.sync_device()
            ptr = self._import(memory, type(obj).__name__)
        except BaseException:
            if release is not None:
                release()
            raise
        ctx = self.ctx
        buf = DeviceBuffer(ptr, memory.nbytes, "external", next_index(), call_site(ctx.internal), ctx.ref)
        with ctx.lock:
            if not ctx.closed:
                self._holdings.external[buf.index] = (buf, obj, release)
                return buf
        self._forget(ptr, release)
        raise ctx.closed_error()

    def _import(self, memory: ForeignMemory, who: str) -> int:
        """The backend's pointer for ``memory``, checked to lie inside one allocation the device knows.

        Memory the backend cannot address is an ``InvalidArgumentError`` named
        ``CUDA_ERROR_INVALID_DEVICE`` on every backend; so is an extent the producer claims past the
        end of the allocation holding it, which metrale's writes would carry into a neighbour.
        """
        try:
            ptr = self._raw.import_memory(memory)
        except DriverError as exc:
            if exc.name != "CUDA_ERROR_INVALID_DEVICE":
                raise
            raise InvalidArgumentError(f"wrap: {exc}", code=exc.code, name=exc.name) from None
        try:
            base, size = self._raw.address_range(ptr)
        except MetraleError as exc:
            self._forget(ptr, None)
            if exc.name == "CUDA_ERROR_NOT_SUPPORTED":
                raise
            raise InvalidArgumentError(
                f"wrap: {who}'s {memory.nbytes} bytes at {memory.address:#x} lie inside no allocation the "
                f"device knows ({exc.name}); wrap memory its producer allocated on this device",
                code=_INVALID_DEVICE, name="CUDA_ERROR_INVALID_DEVICE",
            ) from None
        if not base <= ptr or ptr + memory.nbytes > base + size:
            self._forget(ptr, None)
            raise InvalidArgumentError(
                f"wrap: {who} claims {memory.nbytes} bytes at {memory.address:#x}, but the allocation holding "
                f"it is {size} bytes at {base:#x}, so {ptr + memory.nbytes - (base + size)} bytes of the claim "
                f"lie outside it; metrale refuses a producer that claims more than it owns (its writes would "
                f"reach a neighbouring allocation)",
                code=_INVALID_DEVICE, name="CUDA_ERROR_INVALID_DEVICE",
            )
        return ptr

    def unwrap(self, buf: object, released: Callable[[DeviceBuffer], None]) -> None:
        forbid_during_capture("unwrap")
        if not isinstance(buf, DeviceBuffer) or buf.kind != "external":
            raise InvalidBufferError(f"unwrap: expected a DeviceBuffer from wrap(), got {buf!r}")
        with self.ctx.lock:
            if not self._holdings.is_live(buf):
                raise InvalidBufferError(f"unwrap: allocation #{buf.index} is not wrapped here; unwrap it once")
            _, _, release = self._holdings.external.pop(buf.index)
        released(buf)
        self._forget(buf.ptr, release)

    def _forget(self, ptr: int, release: Callable[[], None] | None) -> None:
        try:
            self._raw.forget_memory(ptr)
        finally:
            if release is not None:
                release()

    def release(self) -> None:
        """At close: let go of every wrapped object."""
        with self.ctx.lock:
            external, self._holdings.external = self._holdings.external, {}
        for buf, _, release in external.values():
            self.ctx.quietly("unwrap", self._forget, buf.ptr, release)
