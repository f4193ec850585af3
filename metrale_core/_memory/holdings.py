"""What one backend holds now, and the rules that follow from it: liveness and bounds.

`Holdings` is the table of everything a backend has handed out and not
taken back: the ledger (``device`` and ``managed`` memory), arena blocks
(``alloc_arena``), the open [`Arena`][metrale_core.Arena] objects, wrapped
memory (``wrap``) and pinned host buffers. The allocator and the export table
fill and empty it; everyone asks it whether a handle is live and where an
operation's bytes lie.

Liveness is by the handle's owner, its creation index and the size recorded
when it was made, never by the address or the size the caller's copy of the
handle carries: a handle of another backend, one whose address the driver has
handed out again, or a copy with a larger ``nbytes`` is not live here.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from .._device.args import integer, invalid_argument
from .._device.buffer import DeviceBuffer
from .._device.context import DeviceContext
from .._device.handles import HostBuffer
from .._errors import InvalidArgumentError, InvalidBufferError
from .._twins import pick
from .._types import as_index
from .ledger import Ledger
from .sites import user_stack
from .watch import ReleaseWatch

if TYPE_CHECKING:
    from .arena import Arena
    from .pool import MemoryPool

__all__ = ["Holdings", "Wrapped"]

#: The kinds of memory on the ledger.
_LEDGERED: Final = frozenset({"device", "managed", "pool"})

#: Memory of another library that ``wrap`` took in: the buffer, the object kept alive, and its release.
Wrapped = tuple[DeviceBuffer, object, "Callable[[], None] | None"]


class Holdings:
    """The live handles of one backend. Thread-safe; its own state only (the allocator and the
    export table mutate it through these methods)."""

    __slots__ = (
        "_ctx", "_lock", "arena_blocks", "arenas", "external", "host", "judging", "ledger", "pool_of", "pools",
        "raw_base", "releases",
    )

    def __init__(self, ctx: DeviceContext) -> None:
        self._ctx = ctx
        self._lock = threading.Lock()
        #: ``device`` and ``managed`` allocations, with their call sites (the compiled twin where built).
        settings = ctx.settings
        frames = settings.memory_history_frames if settings.memory_history else 0
        # with memory_history_frames, each allocation's history event keeps its stack (a walk of Python frames)
        stack = functools.partial(user_stack, ctx.internal, frames) if frames else None
        self.ledger = pick("ledger", Ledger, settings.pure)(settings.memory_history, stack)
        #: ``alloc_arena`` blocks (``create_arena``'s too), by creation index.
        self.arena_blocks: dict[int, DeviceBuffer] = {}
        #: The open arenas.
        self.arenas: list[Arena] = []
        #: Wrapped memory, by creation index.
        self.external: dict[int, Wrapped] = {}
        #: Pinned host buffers, by identity.
        self.host: dict[int, HostBuffer] = {}
        #: Zoned allocations: creation index -> the raw pointer (the user's pointer is past the leading zone).
        self.raw_base: dict[int, int] = {}
        #: The open memory pools, and the pool of each piece out (by creation index).
        self.pools: list[MemoryPool] = []
        self.pool_of: dict[int, MemoryPool] = {}
        #: Zoned pieces freed and waiting in the quarantine for their zones' check: creation index -> their pool.
        self.judging: dict[int, MemoryPool] = {}
        #: The release observers with something to watch (the fronts switch theirs; the allocator calls them).
        self.releases = ReleaseWatch()

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    # -- liveness ------------------------------------------------------------------------

    def is_live(self, buf: DeviceBuffer) -> bool:
        """Whether ``buf`` is live here: this backend's, not freed, with the size it was made with."""
        if buf._owner is not self._ctx.ref:
            return False
        kind = buf.kind
        if kind in _LEDGERED:
            return self.ledger.holds(buf.index, buf.ptr, buf.nbytes)
        if kind == "arena":
            block = self.arena_blocks.get(buf.index)
            if block is not None:
                return block.ptr == buf.ptr and block.nbytes == buf.nbytes
            return any(arena.holds(buf) for arena in list(self.arenas))
        if kind == "external":
            held = self.external.get(buf.index)
            return held is not None and held[0].ptr == buf.ptr and held[0].nbytes == buf.nbytes
        return False

    def require_live(self, buf: DeviceBuffer, what: str) -> None:
        if not self.is_live(buf):
            raise InvalidBufferError(
                f"{what}: allocation #{buf.index} ({buf.nbytes} bytes at {buf.ptr:#x}, from "
                f"{buf.site}) is not live on backend {self._ctx.name}: it was freed, swept, or "
                f"belongs to another backend. Use a live buffer"
            )

    def host_is_live(self, hb: HostBuffer) -> bool:
        """Whether ``hb`` is a live host buffer of this backend (by identity: the driver reuses addresses)."""
        return self.host.get(id(hb)) is hb

    # -- bounds --------------------------------------------------------------------------

    def span(
        self, target: object, offset: object, nbytes: int | None, what: str
    ) -> tuple[int, int, DeviceBuffer | None]:
        """``(pointer, nbytes, buffer)`` for a device-side operand, bounds checked against the live buffer."""
        off = integer(offset, what, "offset")
        if isinstance(target, DeviceBuffer):
            self.require_live(target, what)
            size = target.nbytes  # what was recorded: require_live compared it
            count = size - off if nbytes is None else nbytes
            if off > size or count < 0 or off + count > size:
                raise InvalidBufferError(
                    f"{what}: bytes [{off}, {off + max(count, 0)}) run past allocation "
                    f"#{target.index} of {size} bytes; stay within the buffer"
                )
            return target.ptr + off, count, target
        ptr = as_index(target)
        if ptr is None:
            raise invalid_argument(what, "a DeviceBuffer or an int device pointer", target)
        if ptr <= 0:
            raise InvalidArgumentError(f"{what}: a device pointer must be positive, got {ptr}")
        if nbytes is None:
            raise InvalidArgumentError(f"{what}: a raw device pointer needs an explicit nbytes")
        return ptr + off, nbytes, None

    def host_view(self, obj: object, what: str, *, writable: bool) -> tuple[memoryview, HostBuffer | None]:
        """The bytes of a host operand (a live ``HostBuffer`` of this backend, or a buffer-protocol object)."""
        if isinstance(obj, HostBuffer):
            if not self.host_is_live(obj):
                raise InvalidBufferError(f"{what}: {obj!r} is not a live host buffer of this backend")
            return obj.view(), obj
        try:
            view = memoryview(obj)  # type: ignore[arg-type]
        except TypeError:
            raise invalid_argument(what, "a buffer-protocol object or a HostBuffer", obj) from None
        if not view.c_contiguous:
            raise InvalidArgumentError(f"{what}: host memory must be C-contiguous; pass a contiguous copy")
        if writable and view.readonly:
            raise InvalidArgumentError(f"{what}: the host destination is read-only; pass a bytearray or array")
        return view.cast("B") if view.format != "B" or view.ndim != 1 else view, None
