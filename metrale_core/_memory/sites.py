"""The call site: ``"file:line"`` of the first frame outside metrale (and ``site_skip``), for every allocation.

Written once, compiled as well as run as Python (``_sites``, with ``_sites.pxd``: docs/building.md):

- `call_site`: the hot path's walk, from the caller's frame outward; compiled, it has no frame of its own and
  reads the frames through the C API (its ``if cython.compiled:`` branches), where Python reads their attributes;
- `call_site_at` and `user_stack`: the walks of ``stacklevel`` and of ``memory_history_frames`` (Python only);
- `call_site_for`: the `call_site` a backend with a ``pure`` setting runs.

Both builds keep their own caches (which module is internal, the formatted sites): the same answers, each
computed once per process and build.
"""

from __future__ import annotations

import collections
import itertools
import sys
from collections.abc import Iterator
from types import CodeType, FrameType
from typing import Final, Protocol

from .._twins import pick

try:
    import cython
except ImportError:  # (no Cython here: this module runs as Python)
    from .. import _nocython as cython

__all__ = ["CallSite", "call_site", "call_site_at", "call_site_for", "user_stack"]

#: Modules (and packages) of metrale's own that call the API as a user does: their frames are call sites.
_USER_MODULES = ("metrale_core._commands.selftest", "metrale_core.testing", "metrale_core._commands.bench")


#: Per set of internal packages: per module name, whether its frames are internal (not call sites).
#: The maps grow with the modules a program runs, once. Keyed by the module's name (a string whose
#: hash is cached), not by the code object, whose hash is computed from its contents at every lookup.
_INTERNAL_MODULES: dict[frozenset[str], dict[str, bool]] = {}


#: Per call (code object and instruction): its ``"file:line"`` (compiled: a C table of as many). ``f_lineno``
#: decodes the line table at each read (a quarter of a microsecond), so a site is formatted once.
_SITES: dict[tuple[int, int], tuple[object, str]] = {}
_SITES_MAX: Final = 4096  # (compiled: at most half of the C table's 8192 slots, _frames.pxd)

#: (one lookup of ``sys``'s attribute, not one per call)
_getframe: Final = sys._getframe

if not cython.compiled:  # (compiled: the frame API and a table of sites in C, below)

    def _frame_back(frame: FrameType) -> FrameType | None:
        return frame.f_back

    def _frame_module(frame: FrameType) -> object:
        return frame.f_globals.get("__name__", "")

    def _frame_code(frame: FrameType) -> CodeType:
        return frame.f_code

    def _frame_lasti(frame: FrameType) -> int:
        return frame.f_lasti

    def _cached_site(code: CodeType, lasti: int) -> str | None:
        """The site kept for (``code``, ``lasti``), or ``None`` (compiled: a C table, no key object made)."""
        hit = _SITES.get((id(code), lasti))
        return None if hit is None else hit[1]

    def _cache_site(code: CodeType, lasti: int, site: str, most: int) -> None:
        """Keep ``site`` for (``code``, ``lasti``); at ``most`` entries, start again (code made at run time: exec,
        generated tests). The entry keeps its code alive: the id stays its own."""
        if len(_SITES) >= most:
            _SITES.clear()
        _SITES[(id(code), lasti)] = (code, site)
else:  # the frame API and a table of sites in C: ``_frames.pxd``, cimported by this module alone
    from cython.cimports.metrale_core._memory._frames import (  # type: ignore[import-not-found,no-redef]
        _cache_site,
        _cached_site,
        _frame_back,
        _frame_code,
        _frame_lasti,
        _frame_module,
        frames_init,
    )

    frames_init()


def _is_internal(module: str, internal: frozenset[str]) -> bool:
    """Whether frames of ``module`` are passed over: its top-level package is in ``internal``, or a dotted entry
    of ``internal`` (``site_skip``'s module prefixes, ``myapp.gpu``) is it or a package above it."""
    if module.startswith(_USER_MODULES):
        return False
    if module.partition(".")[0] in internal:
        return True
    return any(module == entry or module.startswith(entry + ".") for entry in internal if "." in entry)


def call_site(internal: frozenset[str], skip: int = 0) -> str:
    """``"file:line"`` of the first frame whose top-level package is not in ``internal``.

    Whether a module's frames are internal is decided once per module name (a dict lookup
    afterwards); a plain dict read and write is atomic under the GIL, and on a free-threaded build
    two threads that race compute the same answer. The walk starts at the caller's frame (never this
    function's own, where it is Python): compiled modules (the one-source modules' ``_`` aliases) have no
    frames, so no fixed depth of frames is known to be metrale's: a caller that runs as Python says so
    with ``skip`` (1: its own frame is metrale's; never more than the frames it knows to be there; a
    negative one counts as 0), and the walk starts past it, making fewer frame objects; where there are
    fewer frames than that, at the caller's own. A frame is judged by its globals' module
    name (``sys._getframemodulename``, which would need no frame object, names the function's
    ``__module__`` instead, which ``functools.wraps`` copies: a user's wrapper of a metrale method
    would pass for metrale's).
    """
    own = 0 if cython.compiled else 1  # (compiled, this function has no frame of its own)
    known = _INTERNAL_MODULES.get(internal)
    if known is None:
        known = _INTERNAL_MODULES.setdefault(internal, {})
    frame: FrameType | None
    try:  # sys._getframe makes a frame object of the one it returns only (the walk out: of each on the way)
        frame = _getframe(own + skip if skip > 0 else own)
    except ValueError:  # fewer frames than that (not from a caller that told the truth): from the caller's own
        try:
            frame = _getframe(own)
        except ValueError:  # (no Python frame called it: from C)
            frame = None
    while frame is not None:
        module = _frame_module(frame)  # (compiled: the frame API, PyFrame_GetGlobals)
        if type(module) is not str:  # (globals can hold anything)
            module = ""
        inside = known.get(module)
        if inside is None:
            inside = known[module] = _is_internal(module, internal)
        if not inside:
            return _site(frame)
        frame = _frame_back(frame)
    return "<unknown>:0"


def _frames_outside(internal: frozenset[str], frame: FrameType | None) -> Iterator[FrameType]:
    """``frame`` and its callers outward, those of ``internal`` passed over (judged as `call_site` judges them)."""
    known = _INTERNAL_MODULES.get(internal)
    if known is None:
        known = _INTERNAL_MODULES.setdefault(internal, {})
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if type(module) is not str:
            module = ""
        inside = known.get(module)
        if inside is None:
            inside = known[module] = _is_internal(module, internal)
        if not inside:
            yield frame
        frame = frame.f_back


def call_site_at(internal: frozenset[str], stacklevel: int) -> str:
    """``"file:line"`` of the ``stacklevel``-th frame outside ``internal``, counted from the caller outward, as
    ``warnings.warn``'s ``stacklevel`` counts (1: `call_site`'s answer; 2: the frame outside ``internal`` that
    called it). Where there are fewer such frames, the outermost one. For the allocating calls' ``stacklevel``:
    not a hot path (a walk of Python frames)."""
    caller = _getframe(0 if cython.compiled else 1)  # (compiled, this function has no frame of its own)
    last = collections.deque(itertools.islice(_frames_outside(internal, caller), stacklevel), maxlen=1)
    return _site(last[0]) if last else "<unknown>:0"


def user_stack(internal: frozenset[str], limit: int) -> tuple[str, ...]:
    """The caller's stack, ``"file:line"`` per frame: the call site (`call_site`'s answer) first, then its callers
    outward, frames of ``internal`` passed over, ``limit`` frames at most (``memory_history_frames``; a walk of
    Python frames, made only where that setting is on)."""
    caller = _getframe(0 if cython.compiled else 1)  # (compiled, this function has no frame of its own)
    return tuple(_site(frame) for frame in itertools.islice(_frames_outside(internal, caller), limit))


class CallSite(Protocol):
    """What `call_site` and its compiled twin are (`call_site_for`)."""

    def __call__(self, internal: frozenset[str], skip: int = 0) -> str: ...


def call_site_for(pure: bool) -> CallSite:
    """The `call_site` a backend with this ``pure`` setting runs: this function compiled (``_sites``: the same
    answers, a C walk of the frames) where it was built and ``pure`` is off, else as Python. An owner
    picks it once, as its backend opens; both take the same ``skip``."""
    return pick("site", call_site, pure)


def _site(frame: FrameType) -> str:
    """``"file:line"`` of ``frame``, formatted once per call (code object and instruction)."""
    code = _frame_code(frame)  # (compiled: the frame API, PyFrame_GetCode, PyFrame_GetLasti)
    lasti = _frame_lasti(frame)
    site = _cached_site(code, lasti)
    if site is None:
        site = f"{code.co_filename}:{frame.f_lineno}"
        _cache_site(code, lasti, site, _SITES_MAX)
    return site
