"""Per-call cost of DLPack exports on the H200 (timeit, best of 5)."""
import gc, timeit, ctypes
from metrale_core import open_backend
import torch, cupy

def best(fn, n=2000):
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6

with open_backend("cuda") as gpu:
    buf = gpu.alloc(1 << 20)
    view = buf.view("float32")
    s = torch.cuda.Stream()
    print(f"legacy __dlpack__()                     {best(lambda: view.__dlpack__(stream=-1)):7.2f} us")
    print(f"versioned __dlpack__(max_version=(1,0)) {best(lambda: view.__dlpack__(stream=-1, max_version=(1, 0))):7.2f} us")
    print(f"host-waiting __dlpack__(stream=None)    {best(lambda: view.__dlpack__(max_version=(1, 0))):7.2f} us")
    print(f"stream-ordered __dlpack__(stream=s)     {best(lambda: view.__dlpack__(stream=s.cuda_stream, max_version=(1, 0))):7.2f} us")
    with torch.cuda.stream(s):
        print(f"torch.from_dlpack(view)                 {best(lambda: torch.from_dlpack(view)):7.2f} us")
    cs = cupy.cuda.Stream(non_blocking=True)
    with cs:
        print(f"cupy.from_dlpack(view)                  {best(lambda: cupy.from_dlpack(view)):7.2f} us")
    t = torch.empty(1 << 18, device="cuda")
    print(f"torch tensor.__dlpack__() (for scale)   {best(lambda: t.__dlpack__(stream=-1)):7.2f} us")
    print(f"torch.from_dlpack(torch tensor)         {best(lambda: torch.from_dlpack(t)):7.2f} us")
    gc.collect()
    torch.cuda.synchronize()
    gpu.free(buf)
print("versions: torch", torch.__version__, "cupy", cupy.__version__)
