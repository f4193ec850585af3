"""What a DLPack export costs on the host, against torch's own (a measurement, not a test).

- Needs a CUDA GPU, torch and CuPy: ``python3 dev.py gpu --only probes`` runs it on the GPU machine.
- Each row: a float32 view of a 1 MiB buffer, per call, the best of 5 rounds of 2,000 calls.
- ``stream=-1`` where no wait is asked for; the consumers import on side streams.
"""

import gc
import timeit
from collections.abc import Callable

import cupy
import torch

from metrale_core import open_backend


def best(fn: Callable[[], object], n: int = 2000) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def row(label: str, fn: Callable[[], object]) -> None:
    print(f"{label:<40} {best(fn):7.2f} us")


with open_backend("cuda") as gpu:
    buf = gpu.alloc(1 << 20)
    view = buf.view("float32")
    s = torch.cuda.Stream()
    row("legacy __dlpack__()", lambda: view.__dlpack__(stream=-1))
    row("versioned __dlpack__(max_version=(1,0))", lambda: view.__dlpack__(stream=-1, max_version=(1, 0)))
    row("host-waiting __dlpack__(stream=None)", lambda: view.__dlpack__(max_version=(1, 0)))
    row("stream-ordered __dlpack__(stream=s)", lambda: view.__dlpack__(stream=s.cuda_stream, max_version=(1, 0)))
    with torch.cuda.stream(s):
        row("torch.from_dlpack(view)", lambda: torch.from_dlpack(view))
    cs = cupy.cuda.Stream(non_blocking=True)
    with cs:
        row("cupy.from_dlpack(view)", lambda: cupy.from_dlpack(view))
    t = torch.empty(1 << 18, device="cuda")
    row("torch tensor.__dlpack__() (for scale)", lambda: t.__dlpack__(stream=-1))
    row("torch.from_dlpack(torch tensor)", lambda: torch.from_dlpack(t))
    gc.collect()
    torch.cuda.synchronize()
    gpu.free(buf)
print("versions: torch", torch.__version__, "cupy", cupy.__version__)
