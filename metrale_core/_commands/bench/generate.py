"""One process of the ``frameworks`` measurement: a transformers Llama's ``generate`` under one allocator.

``python -m metrale_core._commands.bench.generate MODE STEPS`` prints one JSON line. Each mode is a process of its
own: torch's allocator can be changed only before torch first uses CUDA.

- ``torch``: torch's own caching allocator (the baseline).
- ``metrale``: every tensor from a metrale pool through `metrale_core.allocators.torch`; the red zones are the
  settings' (the parent sets ``METRALE_REDZONE`` and ``METRALE_REDZONE_SAMPLE`` per configuration).
- ``plant``: as ``metrale``, then a kernel that is not torch's (metrale's ``fault.write_u8``) writes one byte past
  the end of a 1,000-float tensor; the line says whether a scan reported it, with the tensor's site.
- ``graph-torch``, ``graph-metrale``: the model's forward of the prompts captured once with ``torch.cuda.graph``
  and replayed (the decode step a server replays), under torch's allocator and under metrale's door (its red zones
  the settings'): the median time of a replay.
- ``graph-plant``: as ``graph-metrale``, with a memset node in the captured graph writing one byte past a tensor
  the capture made; after a replay, whether a scan reported it with that tensor's site.
- ``oom``: under metrale's door, a tensor larger than the card: whether torch raised (its error's type and first
  words), and whether the next allocation was served.

The model: vocabulary 32,000, hidden 1,024, intermediate 2,816, 8 layers, 16 heads, 8 KV heads, random weights,
bfloat16; ``generate`` of 4 x 32 prompt tokens and 32 new tokens, greedy (the allocators issue's table).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["main"]


def _model(torch: Any) -> tuple[Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found, unused-ignore]

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 32000, (4, 32), device="cuda")
    return model, ids


def _workload(torch: Any) -> Callable[[], Any]:
    """The measured call: the model's greedy ``generate`` of 32 new tokens for its prompts."""
    model, ids = _model(torch)

    def generate() -> Any:
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)

    return generate


def _door(mode: str) -> tuple[Any, Any]:
    """The backend and torch door of a mode under metrale (``(None, None)`` under torch's allocator: ``torch``,
    ``graph-torch``), made before torch first uses CUDA."""
    if mode in ("torch", "graph-torch"):
        return None, None
    from metrale_core import MetraleSettings, open_backend
    from metrale_core.allocators import torch as torch_door

    gpu = open_backend("cuda", settings=MetraleSettings())
    return gpu, torch_door.install(gpu)


def main(argv: list[str]) -> int:
    mode, steps = argv[0], int(argv[1])
    gpu, door = _door(mode)
    import torch  # type: ignore[import-not-found, import-untyped, unused-ignore]

    generate = _workload(torch)
    generate()
    torch.cuda.synchronize()
    made = gpu.stats().alloc_count if gpu is not None else 0
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    result: dict[str, Any] = {
        "mode": mode, "median_s": statistics.median(times), "min_s": min(times), "torch": torch.__version__,
        "allocs_per_generate": (gpu.stats().alloc_count - made) / steps if gpu is not None else None,
    }
    if mode == "plant":
        assert gpu is not None and door is not None
        result.update(_plant(torch, gpu, door))
    print(json.dumps(result), flush=True)
    return 0


def _replays(argv: list[str]) -> int:
    """The ``graph-*`` and ``oom`` modes: one JSON line."""
    mode, steps = argv[0], int(argv[1])
    gpu, door = _door(mode)
    import torch  # type: ignore[import-not-found, import-untyped, unused-ignore]

    result: dict[str, Any] = {"mode": mode, "torch": torch.__version__}
    if mode == "oom":
        result.update(_out_of_memory(torch))
        print(json.dumps(result), flush=True)
        return 0
    model, ids = _model(torch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():  # the warm-up torch's documentation asks for
        for _ in range(3):
            model(ids, use_cache=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        logits = model(ids, use_cache=False).logits
        if mode == "graph-plant":
            planted = _plant_in_capture(torch, logits)
    times = []
    for _ in range(max(steps, 1) * 20):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    result.update({"median_s": statistics.median(times), "min_s": min(times)})
    if mode == "graph-plant":
        assert gpu is not None and door is not None
        piece = door.piece(planted)
        found = [v for v in gpu.scan_redzones() if piece is not None and v.index == piece.index]
        result.update({"planted_site": piece.site if piece is not None else None, "found": bool(found),
                       "reported_site": found[0].site if found else None})
    if door is not None:
        result["door_failures"] = door.failures
    del graph
    print(json.dumps(result), flush=True)
    return 0


def _plant_in_capture(torch: Any, tensor: Any) -> int:
    """A memset node in the graph being captured, on its stream: one byte past ``tensor``'s end (the overrun a
    replay makes). Returns the tensor's address."""
    from cuda.bindings import driver as drv  # type: ignore[import-not-found, unused-ignore]

    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    stream = drv.CUstream(torch.cuda.current_stream().cuda_stream)
    (err,) = drv.cuMemsetD8Async(end, 0x3C, 1, stream)
    if int(err) != 0:
        raise RuntimeError(f"cuMemsetD8Async in the capture: {err}")
    return int(tensor.data_ptr())


def _out_of_memory(torch: Any) -> dict[str, Any]:
    """A tensor larger than the card under the door: what torch raised, and whether the next one is served."""
    said = None
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    except Exception as exc:  # (torch raises RuntimeError, or its subclass torch.OutOfMemoryError)
        said = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    served = float(torch.ones(1 << 20, device="cuda").sum()) == float(1 << 20)
    torch.cuda.synchronize()
    return {"raised": said, "next_served": served}


def _plant(torch: Any, gpu: Any, door: Any) -> dict[str, Any]:
    """A one-byte overrun past a 1,000-float tensor by a kernel that is not torch's; found by a scan?"""
    import numpy as np

    from metrale_core.kernels import shipped_modules

    write = gpu.load_modules(shipped_modules("fault")).kernel("fault", "write_u8")
    victim = torch.zeros(1000, device="cuda")
    piece = door.piece(victim.data_ptr())
    torch.cuda.synchronize()
    gpu.launch(write, 1, 1, [victim.data_ptr() + victim.numel() * victim.element_size(), np.uint32(0x3C)])
    gpu.synchronize()
    found = [v for v in gpu.scan_redzones() if piece is not None and v.index == piece.index]
    return {"planted_site": piece.site if piece is not None else None, "found": bool(found),
            "reported_site": found[0].site if found else None}


if __name__ == "__main__":
    sys.exit((_replays if sys.argv[1].startswith(("graph", "oom")) else main)(sys.argv[1:]))
