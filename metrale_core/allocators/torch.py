"""PyTorch's CUDA tensors from a metrale pool: every tensor a ledger record with the application's call site.

- `allocator(gpu)` is a ``torch.cuda.memory.CUDAPluggableAllocator`` whose two C functions (`doorfuncs`: the
  compiled pair for the process's first door, found by torch's public constructor under its exported names, as RMM's
  are; else ctypes callbacks, by address through torch's private route) call a `Door` of ``gpu``; `install(gpu)`
  makes it torch's current allocator (torch allows that only before it first uses CUDA) and returns the door.
- Each tensor's site is the first frame outside metrale and the packages of the ``site_skip`` setting (torch,
  transformers and the like by default): the application's line that made it.
- An allocation metrale refuses (out of memory, another device) raises in the Python code that asked for the
  tensor: the compiled pair throws a C++ ``std::runtime_error`` that torch turns into a ``RuntimeError`` (as it
  does RMM's ``rmm::out_of_memory``; torch's own ``torch.OutOfMemoryError`` is a C++ class of torch's, which only
  code built against torch's headers can throw). Its message is metrale's: "CUDA out of memory." (the words
  applications test for), then the error with the sites holding memory. The CUDA context is untouched, and the next
  allocation is served. The ctypes fallback (the pure build) cannot throw: there torch gets no memory, the tensor's
  data pointer is 0, and its first kernel faults (``CUDA_ERROR_ILLEGAL_ADDRESS``, which ends the CUDA context).
- Streams: a tensor's piece is cached for the stream torch allocated it on and reused there (torch frees it with
  that stream). ``Tensor.record_stream(s)`` reaches the door (torch's ``set_record_stream_fn`` hook): the piece is
  then cached for no stream at its free, and taken again only after the pool's next wait for the device
  (`MemoryPool.record_stream`).
- CUDA graphs (``torch.cuda.graph``): torch's three pool hooks reach the door (``set_begin_allocate_to_pool``,
  ``set_end_allocate_to_pool_fn``, ``set_release_pool``), which keeps a private metrale pool per torch pool
  (`Door.begin_pool`): a capture's tensors come from it, grown during the capture with the thread's capture mode
  relaxed (as torch's allocator grows its own), zoned as any (a replay's overrun is found by a scan, and when the
  graph goes), and its memory is never handed out outside the graph's pool until torch lets go of it. Only the
  compiled pair takes the beginning of a pool (a C++ ``std::function``); under the ctypes fallback the end of each
  capture is refused, logged at ERROR and counted (``door.failures``, ``door.last_error``).
- ``torch.compile(mode="reduce-overhead")``: its CUDA graph trees read and set torch's own allocator's state
  (``_cuda_getCheckpointState``), which no pluggable allocator has. `graph_trees_off` turns them off
  (``torch._inductor.config.triton.cudagraph_trees = False``, set where inductor's config is imported, now or later),
  and each compiled graph is then a plain capture; ``metrale run --torch`` calls it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .._errors import DoorError
from .._twins import pick
from .door import Door, framework, require_cuda
from .doorfuncs import EXPORTED, c_functions

if TYPE_CHECKING:
    from .. import GpuBackend

__all__ = ["allocator", "door_of", "graph_trees_off", "install"]

_log = logging.getLogger("metrale")


def _torch() -> Any:
    return framework("torch", "PyTorch", "pip install torch (a CUDA build)")


def allocator(gpu: GpuBackend, *, release_threshold: int = 0) -> Any:
    """A ``torch.cuda.memory.CUDAPluggableAllocator`` serving torch's tensors on ``gpu``'s device from a new
    pool of ``gpu`` (its door: `door_of`).

    :raises MissingPackageError: torch is not installed.
    :raises DoorError: ``gpu`` is no CUDA device.
    """
    torch = _torch()
    require_cuda(gpu, "torch")
    door = pick("door", Door, gpu.settings.pure)(gpu, "torch", release_threshold=release_threshold)
    # the compiled pair of C functions where it is built and free (a compiled door called at C level), else ctypes
    # callbacks (slower); either lives for the process: torch keeps only the C++ allocator, which calls them until
    # it exits
    made_by = pick("doorfuncs", c_functions, gpu.settings.pure)
    addresses = made_by(door, gpu.ordinal)
    pluggable = torch.cuda.memory.CUDAPluggableAllocator
    if addresses is not None and made_by is not c_functions:  # the compiled pair: torch's public constructor, by name
        made = pluggable(importlib.util.find_spec(f"{__package__}._doorfuncs").origin, *EXPORTED)  # type: ignore[union-attr]
    else:  # the ctypes callbacks' fallback: torch's private route, by address (its __init__ loads a library by name)
        addresses = addresses or c_functions(door, gpu.ordinal)
        assert addresses is not None
        made = pluggable.__new__(pluggable)
        torch.cuda.memory._CUDAAllocator.__init__(made, torch._C._cuda_customAllocator(addresses.alloc, addresses.free))
    inner = made.allocator()  # (torch's _CUDAPluggableAllocator: its hooks take C functions' addresses)
    for setter, at in (("set_record_stream_fn", addresses.record_stream),
                       ("set_begin_allocate_to_pool", addresses.begin_pool),
                       ("set_end_allocate_to_pool_fn", addresses.end_pool),
                       ("set_release_pool", addresses.release_pool)):
        hook = getattr(inner, setter, None)
        if not at:  # (the ctypes callbacks: no beginning of a pool, no release; their end refuses the capture)
            continue
        if hook is None:
            _log.warning("torch allocator: this torch (%s) has no %s: its %s is not seen by metrale", torch.__version__,
                         setter, "Tensor.record_stream" if "record" in setter else "graph captures")
        else:
            hook(at)
    made._metrale = door
    return made


def door_of(torch_allocator: Any) -> Door:
    """The `Door` of an allocator made by `allocator`."""
    door = getattr(torch_allocator, "_metrale", None)
    if not isinstance(door, Door):
        raise DoorError(f"{torch_allocator!r} is no allocator made by metrale_core.allocators.torch.allocator")
    return door


def install(gpu: GpuBackend, *, release_threshold: int = 0) -> Door:
    """Make torch allocate every CUDA tensor from a pool of ``gpu``; returns its `Door`.

    :raises DoorError: torch already used CUDA (its allocator can be changed only before), or ``gpu`` is no CUDA
        device.
    :raises MissingPackageError: torch is not installed.
    """
    torch = _torch()
    if torch.cuda.is_initialized():
        raise DoorError(
            "torch allocator: torch already initialized CUDA, and its allocator can only be changed before that; "
            "install it before the first CUDA tensor, or run the script under `metrale run --torch`")
    made = allocator(gpu, release_threshold=release_threshold)
    try:
        torch.cuda.memory.change_current_allocator(made)
    except RuntimeError as exc:
        door_of(made).close()
        raise DoorError(f"torch allocator: torch refused it: {exc}") from None
    return door_of(made)


#: The module whose ``triton.cudagraph_trees`` `graph_trees_off` sets.
INDUCTOR_CONFIG = "torch._inductor.config"


def graph_trees_off(module: str = INDUCTOR_CONFIG) -> None:
    """Turn torch.compile's CUDA graph trees off (``triton.cudagraph_trees = False`` in ``module``, inductor's
    config), now where it is imported, else as soon as it is (an import hook, used once): they need torch's
    own allocator, and with them off ``torch.compile(mode="reduce-overhead")`` captures plain CUDA graphs, which the
    door serves. Logged once at INFO."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        _trees_off(loaded)
    elif not any(isinstance(finder, _TreesOff) and not finder.used for finder in sys.meta_path):
        # (a new list, never one changed in place: another thread's import may be walking the old one)
        sys.meta_path = [_TreesOff(module), *(f for f in sys.meta_path if not isinstance(f, _TreesOff))]


def _trees_off(config: ModuleType) -> None:
    triton = getattr(config, "triton", None)
    if triton is not None and getattr(triton, "cudagraph_trees", False):
        triton.cudagraph_trees = False
        _log.info("torch allocator: torch.compile's CUDA graph trees are off (they need torch's own allocator); "
                  "mode='reduce-overhead' captures plain CUDA graphs, which metrale's door serves")


class _TreesOff(importlib.abc.MetaPathFinder):
    """Serves nothing itself: where ``module`` is imported, it asks the finders after it for the module's spec and
    wraps its loader, which runs as ever, then `_trees_off`. Used once (inert after: ``sys.meta_path`` is not changed
    while the import system walks it)."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.used = False

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != self.module or self.used:
            return None
        self.used = True
        spec = None
        for finder in [f for f in sys.meta_path if f is not self]:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            try:
                _trees_off(module)
            except Exception:  # (inductor's config as torch made it: never fail its import)
                _log.exception("torch allocator: torch.compile's CUDA graph trees could not be turned off")

        loader.exec_module = exec_module
        return spec
