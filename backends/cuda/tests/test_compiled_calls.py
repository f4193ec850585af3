"""The compiled driver calls (``_cdriver``, issue 38) against the pure ones, on the CPU: the module and its stub, the
choice of the two, the return convention turned into the same errors, and the same packed arguments.

No test here calls the driver: the driver calls are stood in for (``drv`` of the pure device, ``_c`` of the compiled
one), so the Python around them is held to the same errors on any machine, with the module built or not. Where
``_cdriver`` was not built (no cuda.h, no C++ compiler, no Cython at install), the tests of the module itself skip,
saying so. ``test_compiled_gpu.py`` runs both on a GPU.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_core import (
    BackendUnavailableError,
    InvalidArgumentError,
    LaunchArg,
    MetraleError,
    MetraleSettings,
    OutOfMemoryError,
    Param,
)
from metrale_cuda import _compiled, _device, _driver, _launch, _plugin
from metrale_cuda._compiled import CompiledCudaDevice, describe, device_class
from metrale_cuda._device import CudaDevice
from metrale_cuda._launch import ArgSlots, CuFunction, CuGraphExec, CuStream
from tests._support import DeviceCallsTable, device_calls_table

PACKAGE = Path(_compiled.__file__).parent
KEY = 0x7F00_1000  # the context handle the stand-ins report current


def _have_bindings() -> bool:
    try:
        return importlib.util.find_spec("cuda.bindings.driver") is not None
    except ImportError:
        return False


pytestmark = pytest.mark.skipif(not _have_bindings(), reason="cuda-bindings is not installed")


def _module() -> types.ModuleType:
    module = _compiled.load()
    if module is None:
        pytest.skip(f"no compiled driver calls here: {describe(False)}")
    return module


# -- the module, its stub and the choice ------------------------------------------------------------------------------


def _stub() -> dict[str, list[str]]:
    """Each function and method of ``_cdriver.pyi`` (``ArgSlots.fill``) with its parameters' names."""
    tree = ast.parse((PACKAGE / "_cdriver.pyi").read_text(encoding="utf-8"))
    found: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = [a.arg for a in node.args.args]
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not any(
                    isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list
                ):
                    found[f"{node.name}.{item.name}"] = [a.arg for a in item.args.args]
    return found


def test_the_module_exposes_its_stub() -> None:
    module, stub = _module(), _stub()
    assert {"launch", "graph_launch", "mem_alloc", "mem_free", "memset_d8", "copy_htod", "copy_dtoh", "copy_dtod",
            "ctx_current", "ctx_set", "ArgSlots.fill", "ArgSlots.image", "DeviceCalls.capsule"} <= set(stub)
    # (a compiled class's __init__ is a slot that takes *args at runtime; Cython writes its signature in the docstring)
    assert module.ArgSlots.__doc__.startswith("ArgSlots(tuple sizes)")
    assert module.DeviceCalls.__doc__.startswith(
        "DeviceCalls(uintptr_t ctx, alloc_failed, free_failed, memset_failed, graph_launch_failed, launch_failed)"
    )
    stub.pop("ArgSlots.__init__")
    stub.pop("DeviceCalls.__init__")
    for name, params in stub.items():
        owner, _, attr = name.rpartition(".")
        function = getattr(getattr(module, owner) if owner else module, attr)
        assert list(inspect.signature(function).parameters) == params, name
    assert module.REPACK == -1
    slots = module.ArgSlots((4, 8))
    assert (slots.sizes, len(slots.offsets), isinstance(slots.address, int)) == ((4, 8), 2, True)


def test_the_compiled_slots_twin_the_pure_ones() -> None:
    module = _module()
    pure = {n for n in dir(ArgSlots) if not n.startswith("_")}
    twin = {n for n in dir(module.ArgSlots) if not n.startswith("_")}
    assert {"address", "fill", "image", "offsets", "sizes"} <= pure & twin


@pytest.mark.parametrize("pure", [False, True])
def test_the_device_class_honours_the_pure_setting(pure: bool) -> None:
    chosen = device_class(pure)
    assert chosen is (CudaDevice if pure or _compiled.load() is None else CompiledCudaDevice)
    assert ("METRALE_PURE=1" in describe(pure)) is pure


@pytest.mark.parametrize("value", ["1", "0"])
def test_the_plugin_opens_the_class_the_pure_setting_chooses(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """``METRALE_PURE`` (the setting ``pure``, read by the settings, never here) chooses the class at open."""
    opened: list[type] = []

    def stand_in(cls: type[CudaDevice], ordinal: int) -> Any:
        opened.append(cls)
        return None

    monkeypatch.setattr(CudaDevice, "open", classmethod(stand_in))
    monkeypatch.setenv("METRALE_PURE", value)
    _plugin.open_device(MetraleSettings(), 0)
    compiled = value == "0" and _compiled.load() is not None
    assert opened == [CompiledCudaDevice if compiled else CudaDevice]


def test_versions_say_which_driver_calls_run() -> None:
    compiled = _plugin.versions(MetraleSettings(pure=False))["driver calls"]
    assert compiled == describe(False)
    assert compiled.startswith("compiled: cuda.bindings.cydriver" if _compiled.load() else "pure Python:")
    assert "METRALE_PURE=1" in _plugin.versions(MetraleSettings(pure=True))["driver calls"]
    assert set(_plugin.metrale_backend(MetraleSettings())  # (the hook's settings: their pure)
               .versions()) == {"cuda-bindings", "driver", "driver calls"}


# -- the return convention, turned into the same errors as the pure calls' -------------------------------------------


class _Driver:
    """Both stand-ins at once: ``cuda.bindings.driver``'s calls (tuples, for the pure device) and ``_cdriver``'s (ints,
    for the compiled one), each answering ``code`` (``0``: success) or raising ``raises``."""

    REPACK = -1
    ArgSlots = ArgSlots  # the pure slots stand in for the compiled ones (their layout is tested below)

    def __init__(self, code: int = 0, raises: BaseException | None = None, value: int = 0xD000) -> None:
        self.code, self.raises, self.value = code, raises, value
        self.calls: list[str] = []

    def _answer(self, name: str) -> int:
        self.calls.append(name)
        if self.raises is not None:
            raise self.raises
        return self.code

    # cuda.bindings.driver
    def cuCtxGetCurrent(self) -> tuple[int, int]:
        return (self._answer("cuCtxGetCurrent"), KEY)

    def cuCtxSetCurrent(self, ctx: object) -> tuple[int]:
        return (self._answer("cuCtxSetCurrent"),)

    def cuMemAlloc(self, nbytes: int) -> tuple[int, int]:
        return (self._answer("cuMemAlloc"), self.value)

    def cuMemAllocManaged(self, nbytes: int, flags: object) -> tuple[int, int]:
        return (self._answer("cuMemAllocManaged"), self.value)

    def cuMemFree(self, ptr: int) -> tuple[int]:
        return (self._answer("cuMemFree"),)

    def cuMemsetD8Async(self, *args: object) -> tuple[int]:
        return (self._answer("cuMemsetD8Async"),)

    def cuMemcpyHtoDAsync(self, *args: object) -> tuple[int]:
        return (self._answer("cuMemcpyHtoDAsync"),)

    def cuMemcpyDtoHAsync(self, *args: object) -> tuple[int]:
        return (self._answer("cuMemcpyDtoHAsync"),)

    def cuMemcpyDtoDAsync(self, *args: object) -> tuple[int]:
        return (self._answer("cuMemcpyDtoDAsync"),)

    def cuGraphLaunch(self, *args: object) -> tuple[int]:
        return (self._answer("cuGraphLaunch"),)

    def cuLaunchKernel(self, *args: object) -> tuple[int]:
        return (self._answer("cuLaunchKernel"),)

    def cuStreamSynchronize(self, *args: object) -> tuple[int]:
        return (0,)

    # _cdriver: a value >= 0, or -CUresult
    def ctx_current(self) -> int:
        code = self._answer("cuCtxGetCurrent")
        return -code if code else KEY

    def ctx_set(self, ctx: int) -> int:
        return self._answer("cuCtxSetCurrent")

    def mem_alloc(self, nbytes: int) -> int:
        code = self._answer("cuMemAlloc")
        return -code if code else self.value

    def mem_alloc_managed(self, nbytes: int, flags: int) -> int:
        code = self._answer("cuMemAllocManaged")
        return -code if code else self.value

    def mem_free(self, ptr: int) -> int:
        return self._answer("cuMemFree")

    def memset_d8(self, *args: object) -> int:
        return self._answer("cuMemsetD8Async")

    def copy_htod(self, *args: object) -> int:
        return self._answer("cuMemcpyHtoDAsync")

    def copy_dtoh(self, *args: object) -> int:
        return self._answer("cuMemcpyDtoHAsync")

    def copy_dtod(self, *args: object) -> int:
        return self._answer("cuMemcpyDtoDAsync")

    def graph_launch(self, *args: object) -> int:
        return self._answer("cuGraphLaunch")

    def launch(self, slots: Any, args: Any, *rest: object) -> int:
        if not slots.fill(args):
            return self.REPACK
        return self._answer("cuLaunchKernel")


@pytest.fixture
def bound_thread() -> Iterator[None]:
    """The stand-in context counts as current on this thread (as a device's first call leaves it), until the end."""
    before = _driver.THREAD.ctx
    _driver.THREAD.ctx = KEY
    yield
    _driver.THREAD.ctx = before


def _devices(monkeypatch: pytest.MonkeyPatch, driver: _Driver) -> tuple[CudaDevice, CompiledCudaDevice]:
    """A pure device over the stand-in ``drv``, a compiled one over the stand-in ``_c``; neither opened."""
    monkeypatch.setattr(_device, "drv", driver)
    monkeypatch.setattr(_launch, "drv", driver)
    pure, compiled = CudaDevice(0, None, KEY), CompiledCudaDevice(0, None, KEY)
    compiled._c = driver
    return pure, compiled


_ARGS = [LaunchArg(Param("a", "u", 8), (0xD000).to_bytes(8, "little"), 0xD000),
         LaunchArg(Param("n", "u", 4), (3).to_bytes(4, "little"))]

#: Each primitive over the stand-ins, called as the core calls it.
OPS: dict[str, Callable[[CudaDevice], object]] = {
    "alloc": lambda d: d.alloc(1 << 20, "device"),
    "alloc_arena": lambda d: d.alloc(4096, "arena"),
    "alloc_managed": lambda d: d.alloc(4096, "managed"),
    "free": lambda d: d.free(0xD000, "device"),
    "memset": lambda d: d.memset(0xD000, 7, 64, CuStream(0x51)),
    "copy_htod": lambda d: d.copy_htod(0xD000, memoryview(bytearray(16)), CuStream(0x51), pinned=True),
    "copy_dtoh": lambda d: d.copy_dtoh(memoryview(bytearray(16)), 0xD000, CuStream(0x51), pinned=True),
    "copy_dtod": lambda d: d.copy_dtod(0xD000, 0xE000, 64, CuStream(0x51)),
    "graph_launch": lambda d: d.graph_launch(CuGraphExec(0x61, ()), CuStream(0x51)),
    "launch": lambda d: d.launch(CuFunction(0x71), (1, 1, 1), (32, 1, 1), 0, CuStream(0x51), _ARGS),
}


def _outcome(op: Callable[[CudaDevice], object], device: CudaDevice) -> tuple[object, ...]:
    try:
        return ("returned", op(device))
    except MetraleError as exc:
        return (type(exc), str(exc), exc.code, exc.name, getattr(exc, "requested", None))


#: Codes of the error table (and some it does not know): out of memory, invalid value, a sticky fault, the teardown
#: no-ops (a free that meets one is no failure), not found (the code cydriver's functions raise under), unknown ones.
CODES = st.sampled_from([1, 2, 4, 101, 201, 500, 600, 700, 709, 719, 999, 4242]) | st.integers(1, 1000)


@settings(max_examples=60, deadline=None)
@given(op=st.sampled_from(sorted(OPS)), code=CODES)
def test_a_nonzero_code_raises_as_the_pure_call_s_does(op: str, code: int) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        before = _driver.THREAD.ctx
        _driver.THREAD.ctx = KEY
        try:
            driver = _Driver(code)
            pure, compiled = _devices(monkeypatch, driver)
            pure_outcome = _outcome(OPS[op], pure)
            pure_calls, driver.calls = driver.calls, []
            compiled_outcome = _outcome(OPS[op], compiled)
        finally:
            _driver.THREAD.ctx = before
    assert compiled_outcome == pure_outcome
    assert driver.calls == pure_calls, "the same driver calls, in the same order"
    if op != "free" or code not in _driver.TEARDOWN_NOOPS:
        assert pure_outcome[0] != "returned"


@pytest.mark.parametrize("op", sorted(OPS))
def test_success_answers_as_the_pure_call_does(monkeypatch: pytest.MonkeyPatch, bound_thread: None, op: str) -> None:
    driver = _Driver(0)
    pure, compiled = _devices(monkeypatch, driver)
    assert _outcome(OPS[op], compiled) == _outcome(OPS[op], pure)


def test_an_allocation_s_pointer_or_negative_code_is_decoded(
    monkeypatch: pytest.MonkeyPatch, bound_thread: None
) -> None:
    _, compiled = _devices(monkeypatch, _Driver(0, value=0x7F12_3456_0000))
    assert compiled.alloc(64, "device") == 0x7F12_3456_0000
    driver = _Driver(0)
    driver.mem_alloc = lambda nbytes: -2  # type: ignore[method-assign]  # CUDA_ERROR_OUT_OF_MEMORY, negated
    _, compiled = _devices(monkeypatch, driver)
    with pytest.raises(OutOfMemoryError) as info:
        compiled.alloc(1 << 60, "device")
    assert (info.value.code, info.value.name, info.value.requested) == (2, "CUDA_ERROR_OUT_OF_MEMORY", 1 << 60)
    assert str(info.value).startswith(f"cuMemAlloc of {1 << 60} bytes")


def test_a_context_that_is_not_current_is_made_current(monkeypatch: pytest.MonkeyPatch, bound_thread: None) -> None:
    """``ctx_current`` answers another context: the compiled alloc binds, as the pure one does."""
    driver = _Driver(0)
    _, compiled = _devices(monkeypatch, driver)
    driver.ctx_current = lambda: 0x5555  # type: ignore[method-assign]
    compiled.alloc(64, "device")
    assert driver.calls == ["cuCtxSetCurrent", "cuMemAlloc"]
    assert _driver.THREAD.ctx == KEY


@pytest.mark.parametrize(
    ("raised", "expected"),
    [(RuntimeError("Failed to dlopen libcuda.so.1"), BackendUnavailableError),
     (OverflowError("can't convert negative value to size_t"), InvalidArgumentError)],
)
@pytest.mark.parametrize("op", sorted(OPS))
def test_a_foreign_exception_maps_as_the_pure_call_s(
    monkeypatch: pytest.MonkeyPatch, bound_thread: None, op: str, raised: Exception, expected: type
) -> None:
    pure, compiled = _devices(monkeypatch, _Driver(raises=raised))
    outcome = _outcome(OPS[op], compiled)
    assert outcome == _outcome(OPS[op], pure)
    assert outcome[0] is expected


_REASON = _plugin.probe(MetraleSettings())


@pytest.mark.skipif(_REASON is None, reason="a CUDA driver answers here: test_compiled_gpu.py covers this machine")
def test_without_a_driver_library_the_compiled_calls_raise_as_the_pure_ones() -> None:
    """cydriver's functions raise (``except ?CUDA_ERROR_NOT_FOUND``) where libcuda cannot be loaded: the compiled
    calls let that through to ``foreign_error``, as the pure calls' bindings raise it."""
    module = _module()
    with pytest.raises(Exception) as raised:
        module.mem_alloc(64)
    assert _driver.foreign_error(raised.value, "cuMemAlloc").__class__ is BackendUnavailableError
    pure, compiled = CudaDevice(0, None, KEY), CompiledCudaDevice(0, None, KEY)
    for op in ("alloc", "free", "memset", "launch"):
        outcome = _outcome(OPS[op], compiled)
        assert outcome[0] is BackendUnavailableError, (op, outcome)
        if op == "alloc":
            assert outcome == _outcome(OPS[op], pure)


def test_a_launch_whose_sizes_differ_repacks_without_a_driver_call() -> None:
    module = _module()
    slots = module.ArgSlots((8, 8))
    assert module.launch(slots, _ARGS, 0, (1, 1, 1), (1, 1, 1), 0, 0) == module.REPACK


# -- the packed arguments -------------------------------------------------------------------------------------------


def _args(sizes: list[int], data: st.DataObject) -> list[LaunchArg]:
    return [LaunchArg(Param(f"p{i}", "b", max(size, 1)), data.draw(st.binary(min_size=size, max_size=size)))
            for i, size in enumerate(sizes)]


SIZES = st.lists(st.one_of(st.sampled_from([1, 2, 4, 8, 16, 64, 128]), st.integers(0, 300)), max_size=12)


@settings(max_examples=100, deadline=None)
@given(sizes=SIZES, other=SIZES, data=st.data())
def test_the_compiled_slots_pack_the_bytes_the_pure_ones_pack(sizes: list[int], other: list[int],
                                                            data: st.DataObject) -> None:
    module = _module()
    pure, twin = ArgSlots(tuple(sizes)), module.ArgSlots(tuple(sizes))
    assert twin.sizes == pure.sizes
    assert [o - twin.offsets[0] for o in twin.offsets] == [o - pure.offsets[0] for o in pure.offsets]
    assert (twin.address is None) == (pure.address is None) == (not sizes)
    assert twin.image() == pure.image() == bytes(len(pure.image()))
    for batch in (sizes, other, sizes):  # a fit, perhaps a misfit (nothing to trust), a fit again
        args = _args(batch, data)
        fits = pure.fill(args)
        assert twin.fill(args) is fits
        assert fits == ([len(a.data) for a in args] == sizes)
        if fits:
            assert twin.image() == pure.image()


def test_the_compiled_slots_start_aligned_and_point_at_each_slot() -> None:
    import ctypes

    module = _module()
    slots = module.ArgSlots((4, 128, 8))
    assert slots.fill([LaunchArg(Param("a", "u", 4), b"\x01\x02\x03\x04"),
                       LaunchArg(Param("m", "b", 1, 128), bytes(range(128))),
                       LaunchArg(Param("b", "u", 8), b"abcdefgh")])
    pointers = (ctypes.c_void_p * 3).from_address(slots.address)
    assert pointers[0] % 128 == 0 and pointers[1] % 128 == 0
    assert ctypes.string_at(pointers[0], 4) == b"\x01\x02\x03\x04"
    assert ctypes.string_at(pointers[1], 128) == bytes(range(128))
    assert ctypes.string_at(pointers[2], 8) == b"abcdefgh"
    assert module.ArgSlots(()).address is None
    with pytest.raises(ValueError, match="negative"):
        module.ArgSlots((-1,))



def test_the_device_calls_decline_where_the_driver_cannot_answer() -> None:
    """``DeviceCalls``'s C functions, called as the core calls them (the GIL held), on a machine whose driver does
    not load or whose context is not current: each declines (``1``), writes nothing and raises nothing. A call
    that answered ``0`` there would hand the core an address it never got (the review's finding)."""
    import ctypes

    module = _module()
    seen: list[object] = []
    calls = module.DeviceCalls(
        0x1234, lambda err, n: seen.append((err, n)), seen.append, seen.append, seen.append, seen.append
    )
    capsule = calls.capsule()
    table = device_calls_table(capsule)
    out = ctypes.c_uint64(77)
    assert (table.alloc(table.state, 4096, ctypes.byref(out)), out.value) == (1, 77)
    assert table.free(table.state, 4096) == 1
    assert table.memset(table.state, 4096, 7, 256, object()) == 1  # (declined before the stream is read)
    assert table.graph_launch(table.state, object(), object()) == 1  # (declined before the handles are read)
    shape = (ctypes.c_uint * 6)(1, 1, 1, 32, 1, 1)
    assert table.launch(table.state, object(), shape, 0, object(), []) == 1  # (likewise)
    calls.close()
    assert calls.closed and table.alloc(table.state, 4096, ctypes.byref(out)) == 1
    assert seen == []


def test_the_device_calls_are_the_struct_of_the_core_s_header() -> None:
    """``_cdriver`` compiles against metrale-core's ``metrale/device_calls.h``: its struct is the header's size (the
    ctypes mirror's, which ``tests/plugins/test_device_calls_header.py`` checks against the header) and its capsule
    the name the core reads."""
    import ctypes

    from metrale_core.plugin import DEVICE_CALLS

    module = _module()
    calls = module.DeviceCalls(0x1234, *[lambda *_: None] * 5)
    table = device_calls_table(calls.capsule())
    assert table.size == ctypes.sizeof(DeviceCallsTable) and module.DEVICE_CALLS == DEVICE_CALLS
    calls.close()
