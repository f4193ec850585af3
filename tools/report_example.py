"""Write the hand-written memory snapshot behind ``docs/memory-report-example.png``.

A simulated LLM inference server, in the format ``backend.save_snapshot(path)``
writes: the weights loaded once, a KV cache that grows in blocks as requests
decode and shrinks as they finish, per-step scratch that comes and goes, and a
leak (a log-probability buffer kept every 20 steps and never freed). Nothing
runs on a device; the numbers are made up to look like a real run.

    python tools/report_example.py /tmp/inference-snapshot.json
    metrale report /tmp/inference-snapshot.json --png docs/memory-report-example.png
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

MIB = 1 << 20
ROOT = "/srv/llm"


class Log:
    """Allocations, frees and the live set, as the ledger would record them."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.live: dict[int, dict[str, Any]] = {}
        self.index = 0
        self.ptr = 0x7F3A_0000_0000

    def alloc(self, t: float, nbytes: int, site: str) -> int:
        record = {"ptr": self.ptr, "nbytes": nbytes, "kind": "device", "index": self.index, "site": f"{ROOT}/{site}"}
        self.ptr += (nbytes + 0xFFFF) // 0x10000 * 0x10000
        self.index += 1
        self.live[record["index"]] = record
        self.events.append({"t": round(t, 6), "op": "alloc", **record})
        return int(record["index"])

    def free(self, t: float, index: int) -> None:
        record = self.live.pop(index)
        self.events.append({"t": round(t, 6), "op": "free", **record})


def snapshot(events: list[dict[str, Any]], live: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """A snapshot of one fake device, as ``backend.save_snapshot(path)`` writes one, holding ``events`` and ``live``;
    ``fields`` add to its header or replace a field (``elapsed``, ``stats``, ``dropped``...).
    ``tests/reports/test_report.py`` writes its snapshots with it too."""
    header = {
        "format": "metrale-memory-snapshot",
        "version": 1,
        "backend": "fake",
        "device": "metrale fake device 0 (16.0 GiB, discrete)",
        "ordinal": 0,
        "total": 16 << 30,
        "created": "2026-12-02T15:10:00+00:00",
        "history_limit": 10000,
        "dropped": 0,
    }
    return {**header, "events": events, "live": live, "stats": {}, **fields}


def simulate() -> dict[str, Any]:
    rng = random.Random(7)
    log = Log()
    t = 0.35
    for _ in range(32):  # the weights, one tensor group per layer, then the embeddings
        log.alloc(t, 208 * MIB, "model/loader.py:88")
        t += rng.uniform(0.025, 0.04)
    log.alloc(t, 500 * MIB, "model/loader.py:97")
    t += 0.3
    log.alloc(t, 64 * MIB, "model/rope.py:40")  # rotary tables
    t += 0.2
    requests: list[list[int]] = []
    for step in range(240):
        t += rng.uniform(0.018, 0.026)
        if step % 40 == 0:  # a new wave of requests: prefill
            requests = [[] for _ in range(rng.randint(3, 5))]
            for blocks in requests:
                for _ in range(rng.randint(3, 6)):
                    blocks.append(log.alloc(t, 32 * MIB, "engine/kv_cache.py:141"))
        act = log.alloc(t + 0.0005, 384 * MIB, "engine/forward.py:57")
        attn = log.alloc(t + 0.001, 128 * MIB, "kernels/attention.py:203")
        meta = log.alloc(t + 0.0012, 6 * MIB, "engine/utils.py:40")
        pos = log.alloc(t + 0.0013, 3 * MIB, "model/utils.py:40")
        log.free(t + 0.009, attn)
        logits = log.alloc(t + 0.010, 96 * MIB, "engine/sampler.py:34")
        log.free(t + 0.012, act)
        if step % 20 == 19:
            log.alloc(t + 0.013, 64 * MIB, "engine/sampler.py:61")  # kept "for later", never freed: the leak
        log.free(t + 0.014, logits)
        log.free(t + 0.0145, meta)
        log.free(t + 0.015, pos)
        for blocks in requests:  # decode: a request takes another block every few steps
            if rng.random() < 0.3:
                blocks.append(log.alloc(t + 0.016, 32 * MIB, "engine/kv_cache.py:141"))
        if step % 40 == 39:  # the wave finishes: its KV cache blocks go back
            for blocks in requests:
                for i, index in enumerate(blocks):
                    log.free(t + 0.017 + i * 1e-5, index)
            requests = []
    return snapshot(
        log.events,
        sorted(log.live.values(), key=lambda r: r["index"]),
        elapsed=round(t + 0.05, 6),
        stats={"alloc_count": log.index, "free_count": log.index - len(log.live)},
    )


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    Path(argv[0]).write_text(json.dumps(simulate(), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
