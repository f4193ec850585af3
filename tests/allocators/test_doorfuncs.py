"""The C functions a framework's allocator hook calls (`doorfuncs`), called here as torch calls them: through their
addresses, from C (ctypes). The compiled pair is the process's, so each build runs in a process of its own."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from tests._support import compiled_twin

_SCRIPT = textwrap.dedent("""
    import ctypes, logging, sys
    logging.basicConfig(level=logging.ERROR, format="LOG %(message)s", stream=sys.stdout)
    from metrale_core._twins import pick
    from metrale_core.allocators.doorfuncs import c_functions
    make = pick("doorfuncs", c_functions, sys.argv[1] == "pure")
    ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    calls = []
    import numpy as np
    answers = [None, 0, -1, 2**64, 4096.5, "x", np.uint64(4096), 2**64 - 4096]
    class Door:  # anything with a door's calls (a Door of the pure class is called the same way)
        framework = "probe"
        def alloc(self, size, stream):
            if size >= 100:  # what is no address, and what is
                return answers[size - 100]
            calls.append(("alloc", size, stream))
            if size == 13:
                raise RuntimeError("a bug in the door")
            return 0x7F0000001000 if size else 0
        def free(self, ptr):
            calls.append(("free", ptr))
        def record(self, ptr, stream):
            calls.append(("record", ptr, stream))
        def refuse(self, what, why):
            calls.append(("refuse", what))
            logging.getLogger("metrale").error("refused: %s", why)
        def end_pool(self, pool_id):
            calls.append(("end", pool_id))
    door = Door()
    a, f, r, c = make(door, 0)[:4]
    RECORD = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
    CAPTURED = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64)
    print("alloc", hex(ALLOC(a)(64, 0, 0x77)), ALLOC(a)(0, 0, None))
    print("other device", ALLOC(a)(64, 1, None))
    print("raising", ALLOC(a)(13, 0, None))
    FREE(f)(0x7F0000001000, 64, 0, 0x77)
    RECORD(r)(0x7F0000001000, 0x99)
    CAPTURED(c)(0, 1, 2**64 - 1)
    print("calls", calls)
    print("second", make(door, 0) is None)
    print("odd", [ALLOC(a)(100 + i, 0, None) for i in range(len(answers))])
    class Loud(logging.Handler):
        def emit(self, record):
            raise KeyboardInterrupt
    logging.getLogger("metrale").addHandler(Loud())
    print("loud", ALLOC(a)(13, 0, None))
""")

#: A door of the build's own class (`_twins.pick("door")`) on the fake backend, through the C functions.
_DOOR_SCRIPT = textwrap.dedent("""
    import ctypes, logging, sys
    logging.basicConfig(level=logging.ERROR, format="LOG %(message)s", stream=sys.stdout)
    from metrale_core import MetraleSettings, open_backend
    from metrale_core._twins import pick
    from metrale_core.allocators.door import Door
    from metrale_core.allocators.doorfuncs import c_functions
    pure = sys.argv[1] == "pure"
    gpu = open_backend("fake", settings=MetraleSettings(pure=pure, redzone=0))
    door = pick("door", Door, pure)(gpu, "probe")
    print("class", type(door).__module__, isinstance(door, Door))
    ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    made = pick("doorfuncs", c_functions, pure)(door, 0)
    a, f = made.alloc, made.free
    RECORD = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
    def made_here():
        return ALLOC(a)(1000, 0, 0x77)
    ptr = made_here()
    piece = door.piece(ptr)
    print("piece", piece.nbytes, piece.kind, piece.site.endswith(":" + str(made_here.__code__.co_firstlineno + 1)))
    print("other device", ALLOC(a)(64, 1, None), door.failures)
    FREE(f)(ptr, 1000, 0, 0x77)
    print("freed", door.out(), gpu.live_alloc_len(), ALLOC(a)(1000, 0, 0x77) == ptr)
    RECORD(made.record_stream)(ptr, 0x99)  # used on another stream too: not reused before a wait for the device
    FREE(f)(ptr, 1000, 0, 0x77)
    print("recorded", ALLOC(a)(1000, 0, 0x77) != ptr, door.failures)
    FREE(f)(0x1234, 8, 0, None)
    print("stranger", door.failures, type(door.last_error).__name__)
    print("zero", ALLOC(a)(0, 0, None))
    door.close()
    gpu.close()
""")


@pytest.mark.parametrize("build", ["pure", "compiled"])
def test_the_c_functions_call_the_door_as_torch_would(build: str) -> None:
    if build == "compiled":
        compiled_twin("doorfuncs")  # (skips where it was not built)
    done = subprocess.run([sys.executable, "-c", _SCRIPT, build], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "alloc 0x7f0000001000 None" in out
    assert "other device None" in out
    assert "refused: probe asked for memory on device 1; this door serves device 0" in out
    assert "raising None" in out
    # the end of a pool: refused by the ctypes callbacks (they never saw its beginning), the door's in the compiled
    ended = "('refuse', 'graph capture')" if build == "pure" else f"('end', (1, {2**64 - 1}))"
    assert ("calls [('alloc', 64, 119), ('alloc', 0, 0), ('refuse', 'alloc'), ('alloc', 13, 0), "
            f"('free', 139637976731648), ('record', 139637976731648, 153), {ended}]") in out
    if build == "pure":
        assert ("refused: probe captured a CUDA graph (or allocated to a private pool of its own) on device 0, its "
                f"pool (1, {2**64 - 1}), through metrale's ctypes callbacks") in out
    # the compiled pair serves one door; ctypes callbacks, any number
    assert f"second {build == 'compiled'}" in out
    assert "LOG allocator door: alloc of 13 bytes failed" in out and "a bug in the door" in out
    # what is no address gives no memory; a log handler that raises crosses nothing either
    assert f"odd [None, None, None, None, None, None, 4096, {2**64 - 4096}]" in out
    assert "loud None" in out


@pytest.mark.parametrize("build", ["pure", "compiled"])
def test_a_door_of_each_build_through_the_c_functions(build: str) -> None:
    """A real door (the compiled twin is called at C level by the compiled pair) on the fake backend: a piece with
    the site of the line that called the C function, a refusal for another device, a free that caches the piece."""
    if build == "compiled":
        compiled_twin("doorfuncs")
        compiled_twin("door")
    done = subprocess.run([sys.executable, "-c", _DOOR_SCRIPT, build], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    module = "metrale_core.allocators._door" if build == "compiled" else "metrale_core.allocators.door"
    assert f"class {module} True" in out
    assert "piece 1000 pool True" in out
    assert "other device None 1" in out
    assert "freed 0 0 True" in out
    assert "recorded True 1" in out
    assert "stranger 2 DoorError" in out
    assert "zero None" in out


#: A C++ caller of the exported alloc, as torch's ``CUDAPluggableAllocator::malloc`` calls it: what it throws is
#: caught here (a C++ exception must never reach ctypes), and its ``what()`` handed back.
_CALLER = """
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <utility>
struct CUstream_st;
typedef std::pair<unsigned long long, unsigned long long> pool_id;
typedef void (*begin_fn)(int, pool_id, std::function<bool(CUstream_st *)>);
typedef void (*pool_fn)(int, pool_id);
/* torch's beginAllocateToPool: which streams allocate to the pool, a test given by value (the callee keeps a copy) */
extern "C" void call_begin(void *fn, int device, unsigned long long a, unsigned long long b, void *captured,
                           int fails) {
    std::function<bool(CUstream_st *)> test = [captured, fails](CUstream_st *stream) -> bool {
        if (fails) throw std::runtime_error("no capture info");
        return stream == static_cast<CUstream_st *>(captured);
    };
    reinterpret_cast<begin_fn>(fn)(device, pool_id(a, b), test);
}
extern "C" void call_pool(void *fn, int device, unsigned long long a, unsigned long long b) {
    reinterpret_cast<pool_fn>(fn)(device, pool_id(a, b));
}
typedef void *(*alloc_fn)(size_t, int, void *);
extern "C" int call_alloc(void *fn, size_t size, int device, void *stream, void **out, char *why, size_t room) {
    try {
        *out = reinterpret_cast<alloc_fn>(fn)(size, device, stream);
        return 0;
    } catch (const std::exception &e) {
        std::strncpy(why, e.what(), room - 1);
        why[room - 1] = 0;
        return 1;
    } catch (...) {
        return 2;
    }
}
"""

_BY_NAME_SCRIPT = textwrap.dedent("""
    import ctypes, importlib.util, logging, sys
    logging.basicConfig(level=logging.ERROR, format="LOG %(message)s", stream=sys.stdout)
    caller = ctypes.CDLL(sys.argv[1]).call_alloc
    caller.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t]
    lib = ctypes.CDLL(importlib.util.find_spec("metrale_core.allocators._doorfuncs").origin)  # as torch loads it
    from metrale_core.allocators.doorfuncs import EXPORTED
    alloc, free = (getattr(lib, name) for name in EXPORTED)
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    def call(size, device=0, stream=0x77):
        out, why = ctypes.c_void_p(), ctypes.create_string_buffer(8192)
        thrown = caller(ctypes.cast(alloc, ctypes.c_void_p), size, device, stream, ctypes.byref(out), why, 8192)
        return (thrown, out.value or 0, why.value.decode().replace("\\n", " ")[:400])
    print("unimported", call(64))  # loaded by name before Python imported it: thrown, no crash
    free(0x1000, 64, 0, None)  # (a free changes nothing)
    import metrale_core.allocators._doorfuncs
    print("before", call(64))  # no door took the pair yet: thrown, logged
    from metrale_core import MetraleSettings, open_backend
    from metrale_core._twins import pick
    from metrale_core.allocators.door import Door
    from metrale_core.allocators.doorfuncs import c_functions
    gpu = open_backend("fake", settings=MetraleSettings(pure=False, redzone=0))
    door = pick("door", Door, False)(gpu, "probe")
    made = pick("doorfuncs", c_functions, False)(door, 0)
    thrown, ptr, _ = call(1000)
    print("served", thrown, made is not None, door.piece(ptr).nbytes)
    print("empty", call(0))
    print("too much", call(1 << 50), door.failures)
    print("other device", call(64, device=1), door.failures)
    thrown, again, _ = call(1000)
    print("next", thrown, door.out())
    free(ptr, 1000, 0, 0x77)
    free(again, 1000, 0, 0x77)
    print("freed", door.out())
    hooks = ctypes.CDLL(sys.argv[1])
    hooks.call_begin.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p,
                                 ctypes.c_int]
    hooks.call_pool.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]
    hooks.call_begin(made.begin_pool, 0, 5, 2**64 - 1, 0x77, 0)  # (torch: a graph's capture begins)
    thrown, captured, _ = call(1000, stream=0x77)
    thrown, elsewhere, _ = call(1000, stream=0x99)
    print("begun", door.graphs(), door.piece(captured) is not None, captured != elsewhere)
    hooks.call_pool(made.end_pool, 0, 5, 2**64 - 1)
    free(captured, 1000, 0, 0x77)
    free(elsewhere, 1000, 0, 0x99)
    hooks.call_pool(made.release_pool, 0, 5, 2**64 - 1)  # (torch: the graph's reset)
    print("released", door.graphs(), door.out())
    hooks.call_begin(made.begin_pool, 0, 6, 0, 0x77, 1)  # a test that throws
    print("failing test", call(1000, stream=0x77)[:2], "could not be told" in call(64, stream=0x77)[2])
    hooks.call_pool(made.end_pool, 0, 6, 0)
    hooks.call_pool(made.release_pool, 0, 6, 0)
    hooks.call_begin(made.begin_pool, 1, 7, 0, 0x77, 0)  # another device's pool: not this door's
    print("other device's pool", door.graphs())
    door.close()
    gpu.close()
""")


@pytest.fixture(scope="module")
def cxx_caller(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The path of `_CALLER` built as a shared library (skipped where no C++ compiler is)."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler here (c++, g++, clang++) to build a C++ caller")
    folder = tmp_path_factory.mktemp("cxx")
    (folder / "caller.cpp").write_text(_CALLER)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", "caller.so", "caller.cpp"], cwd=folder, check=True,
                   timeout=120)
    return str(folder / "caller.so")




def test_the_compiled_pair_is_exported_under_fixed_names(cxx_caller: str) -> None:
    """``metrale_door_alloc`` and ``metrale_door_free`` are the compiled pair, found by name in its shared library
    (torch's public ``CUDAPluggableAllocator(path, alloc_fn_name, free_fn_name)`` finds them so), called from C++ as
    torch calls them: a door's pieces; and where it gives none (no door yet, out of memory, another device), a
    ``std::runtime_error`` saying why, which torch makes a ``RuntimeError`` of; the door serves on after it."""
    compiled_twin("doorfuncs")
    compiled_twin("door")
    done = subprocess.run([sys.executable, "-c", _BY_NAME_SCRIPT, cxx_caller], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "unimported (1, 0, 'metrale: its allocator functions are loaded, but Python did not import" in out
    assert "before (1, 0, \"metrale: no door took metrale's allocator functions yet" in out
    assert "LOG allocator door: alloc of 64 bytes by name before any door" in out
    assert "served 0 True 1000" in out
    assert "empty (0, 0, '')" in out
    too_much = next(line for line in out.splitlines() if line.startswith("too much"))
    assert "(1, 0, 'CUDA out of memory. metrale: OutOfMemoryError: " in too_much, too_much
    assert "largest call sites: <string>:" in too_much and too_much.endswith(" 1"), too_much
    other = next(line for line in out.splitlines() if line.startswith("other device"))
    assert "(1, 0, 'metrale: DoorError: probe asked for memory on device 1" in other and other.endswith(" 2")
    assert "next 0 2" in out
    assert "freed 0" in out
    # torch's pool hooks, as torch calls them: a private pool for the capture's stream, let go of at release
    assert "begun 1 True True" in out
    assert "released 0 0" in out
    assert "failing test (1, 0) True" in out
    assert "other device's pool 0" in out
