"""The C functions a framework's allocator hook calls (`doorfuncs`), called here as torch calls them: through their
addresses, from C (ctypes). The compiled pair is the process's, so each build runs in a process of its own."""

from __future__ import annotations

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
    def alloc(size, device, stream):
        if size >= 100:  # what is no address, and what is
            return answers[size - 100]
        calls.append(("alloc", size, device, stream))
        if size == 13:
            raise RuntimeError("a bug in the door")
        return 0x7F0000001000 if size else 0
    def free(ptr, size, device, stream):
        calls.append(("free", ptr, size, device, stream))
    a, f = make(alloc, free)
    print("alloc", hex(ALLOC(a)(64, 0, 0x77)), ALLOC(a)(0, 1, None))
    print("raising", ALLOC(a)(13, 0, None))
    FREE(f)(0x7F0000001000, 64, 0, 0x77)
    print("calls", calls)
    print("second", make(alloc, free) is None)
    print("odd", [ALLOC(a)(100 + i, 0, None) for i in range(len(answers))])
    class Loud(logging.Handler):
        def emit(self, record):
            raise KeyboardInterrupt
    logging.getLogger("metrale").addHandler(Loud())
    print("loud", ALLOC(a)(13, 0, None))
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
    assert "raising None" in out
    assert ("calls [('alloc', 64, 0, 119), ('alloc', 0, 1, 0), ('alloc', 13, 0, 0), "
            "('free', 139637976731648, 64, 0, 119)]") in out
    # the compiled pair serves one door; ctypes callbacks, any number
    assert f"second {build == 'compiled'}" in out
    assert "LOG allocator door: alloc of 13 bytes failed" in out and "a bug in the door" in out
    # what is no address gives no memory; a log handler that raises crosses nothing either
    assert f"odd [None, None, None, None, None, None, 4096, {2**64 - 4096}]" in out
    assert "loud None" in out
