"""Where the TMA puts a box in shared memory when its rows are narrower than the swizzle's span.

Each case runs in its own process (a fault is sticky): the shipped tma_copy_2d loads a 16-row float32 box
through a swizzled map into plenty of shared memory, then stores that shared memory, read row-major, through an
unswizzled map tall enough to show every byte the load could have written. Prints, per case, which model of
the layout the positions match: "linear" (rows of the box's width, 16-byte chunks XORed in place, the fake's
model today) or "padded" (each row takes the swizzle's whole span, then the same XOR), else the positions.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

BITS = {"32b": 0x10, "64b": 0x30, "128b": 0x70}
SPAN = {"32b": 32, "64b": 64, "128b": 128}
CASES = [("32b", 16), ("64b", 16), ("64b", 32), ("128b", 16), ("128b", 32), ("128b", 64), ("128b", 128)]
ROWS = 16


def model(swizzle: str, inner: int, row_bytes: int) -> list[int]:
    out = []
    for r in range(ROWS):
        for c in range(inner // 4):
            off = r * row_bytes + c * 4
            out.append((off ^ ((off >> 3) & BITS[swizzle])) // 4)
    return out


def one(swizzle: str, inner: int) -> None:
    from metrale_core import TensorMapSpec, open_backend
    from metrale_core.kernels import shipped_modules

    cols = inner // 4
    rows_out = ROWS * SPAN[swizzle] // inner * 2  # twice the padded footprint, read back
    with open_backend(os.environ.get("PROBE_BACKEND", "cuda")) as gpu:
        tma = gpu.load_modules(shipped_modules("tma")).kernel("tma", "tma_copy_2d")
        a = (np.arange(ROWS * cols, dtype=np.float32) + 1000).reshape(ROWS, cols)
        src, dst = gpu.alloc(a.nbytes), gpu.alloc(rows_out * inner)
        gpu.copy_to_device(src, a)
        gpu.memset(dst, 0)
        tsrc = gpu.tensor_map(src, TensorMapSpec("float32", (ROWS, cols), (inner, 4), (ROWS, cols), swizzle=swizzle))
        tdst = gpu.tensor_map(dst, TensorMapSpec("float32", (rows_out, cols), (inner, 4), (rows_out, cols)))
        gpu.launch(tma, 1, 32, [tsrc, tdst, np.uint32(cols), np.uint32(ROWS), np.uint32(a.nbytes)],
                   shared_mem=rows_out * inner)
        out = np.empty(rows_out * cols, dtype=np.float32)
        gpu.copy_to_host(out, dst)
        del tsrc, tdst
        gpu.free(src)
        gpu.free(dst)
    where = {float(v): i for i, v in enumerate(out) if 1000 <= v < 1000 + a.size}
    pos = [where.get(float(1000 + i), -1) for i in range(a.size)]
    names = [n for n, rb in (("linear", inner), ("padded", SPAN[swizzle])) if pos == model(swizzle, inner, rb)]
    print(f"{swizzle} inner {inner} B: {' '.join(names) or 'neither'}"
          + ("" if names else f"; positions {pos}"), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        one(sys.argv[1], int(sys.argv[2]))
    else:
        for swizzle, inner in CASES:
            run = subprocess.run([sys.executable, __file__, swizzle, str(inner)], check=False, capture_output=True,
                                 text=True, timeout=40)
            said = run.stdout.strip().splitlines()
            tail = run.stderr.strip().splitlines()
            print(said[-1] if run.returncode == 0 and said else f"{swizzle} inner {inner} B: rc={run.returncode} "
                  f"{tail[-1][:300] if tail else ''}", flush=True)
