"""One process of the ``frameworks`` measurement: a transformers Llama's ``generate`` under one allocator.

``python -m metrale_core._commands.bench.generate MODE STEPS`` prints one JSON line. Each mode is a process of its
own: torch's allocator can be changed only before torch first uses CUDA.

- ``torch``: torch's own caching allocator (the baseline).
- ``metrale``: every tensor from a metrale pool through `metrale_core.allocators.torch`; the red zones are the
  settings' (the parent sets ``METRALE_REDZONE`` and ``METRALE_REDZONE_SAMPLE`` per configuration).
- ``plant``: as ``metrale``, then a kernel that is not torch's (metrale's ``fault.write_u8``) writes one byte past
  the end of a 1,000-float tensor; the line says whether a scan reported it, with the tensor's site.

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


def main(argv: list[str]) -> int:
    mode, steps = argv[0], int(argv[1])
    gpu = door = None
    if mode != "torch":
        from metrale_core import MetraleSettings, open_backend
        from metrale_core.allocators import torch as torch_door

        gpu = open_backend("cuda", settings=MetraleSettings())
        door = torch_door.install(gpu)
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
    sys.exit(main(sys.argv[1:]))
