"""Finalizers that call metrale while a garbage collection interrupts a metrale call of the same backend.

The collection may start inside any call, at any object it makes, while the call holds a lock of its backend that
is not re-entrant. A ``free`` made there is deferred to the thread's next call (or ``close()``); any other call is
refused with a `MetraleError` (an "exception ignored" of the finalizer) instead of waiting forever. Each case runs in
a subprocess, so that a hang fails the test instead of the run; on both builds where the twins are built.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from metrale_core._twins import built

_SCRIPT = r"""
import gc, logging, sys
from metrale_core import MetraleError, MetraleSettings, open_backend
logging.disable(logging.CRITICAL)
pure = sys.argv[1] == "pure"
gpu = open_backend("fake", settings=MetraleSettings(redzone=64, pure=pure, redzone_quarantine_bytes=1 << 20))
freed, refused, hold = [], [], []
class Owner:  # in a cycle: only a collection frees it; its finalizer frees its buffer and tries to allocate
    def __init__(self, buf, left):
        self.buf, self.me, self.left = buf, self, left
    def __del__(self):
        if self.left:  # a second cycle, for a later collection (an allocation: refused if interrupted)
            try:
                Owner(gpu.alloc(100), self.left - 1)
            except MetraleError as exc:
                refused.append(str(exc))
        gpu.free(self.buf)
        freed.append(self.buf.index)
        hold.append([(i, i, i) for i in range(3000)])  # no free list: the next tuple anywhere is a collection
keep = [gpu.alloc(100) for _ in range(4)]
probe = gpu.ledger_probe()  # (its reads take the ledger's lock outside any call of the backend's own)
calls = (gpu.scan_redzones, lambda: gpu.alloc(100), gpu.ledger_report, gpu.stats, gpu.memory_summary,
         lambda: gpu.free(gpu.alloc(300)), probe.records, probe.live_bytes)
for call in calls:
    gc.collect(); gc.disable()
    Owner(gpu.alloc(100), 3)
    gc.set_threshold(1); gc.enable()
    call()
    gc.set_threshold(700)
gc.collect()
gpu.live_alloc_len()  # a call: the frees deferred so far are done
report = gpu.ledger_report()
left = {r.index for r in report.live + report.swept}
assert not left & set(freed), (sorted(left & set(freed)), sorted(freed))
gpu.close()
print("done", len(freed), len(refused) > 0)
"""


def _builds() -> list[str]:
    twins = built()
    return ["pure", *(["compiled"] if twins.get("lane") and twins.get("gate") else [])]


def _run(script: str, build: str) -> list[str]:
    """``script`` in a subprocess on ``build`` (a hang fails the test at its timeout); the words it printed."""
    done = subprocess.run(
        [sys.executable, "-c", script, build], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


@pytest.mark.parametrize("build", _builds())
def test_finalizer_frees_in_an_interrupted_call_are_deferred(build: str) -> None:
    words = _run(_SCRIPT, build)
    assert words[0] == "done" and int(words[1]) > 0, words


_IN_A_CAPTURE = r"""
import gc, logging, sys
from metrale_core import MetraleSettings, open_backend
logging.disable(logging.CRITICAL)
gpu = open_backend("fake", settings=MetraleSettings(pure=sys.argv[1] == "pure"))
stream = gpu.create_stream()
work = gpu.alloc(4096)
ran = []
class Owner:  # in a cycle: only a collection frees it; its finalizer frees its buffer
    def __init__(self, buf):
        self.buf, self.me = buf, self
    def __del__(self):
        ran.append(1)
        gpu.free(self.buf)
doomed = gpu.alloc(100)
index = doomed.index
gpu.begin_capture(stream)
for j in range(40):  # a collection inside a capturable call on the capturing stream
    gc.collect(); gc.disable()
    if j == 0:
        Owner(doomed)
        del doomed
    gc.set_threshold(gc.get_count()[0] + j); gc.enable()
    gpu.memset(work, 0, stream=stream)
    gc.set_threshold(700)
    if ran:
        break
gpu.memset(work, 1, stream=stream)  # a call during the capture: the deferred free waits
gpu.end_capture(stream).close()  # not invalidated
gpu.live_alloc_len()  # the next call outside the capture runs it
assert index not in [r.index for r in gpu.ledger_probe().records()]
gpu.free(work)
gpu.close()
print("done", len(ran))
"""


@pytest.mark.parametrize("build", _builds())
def test_a_deferred_free_waits_while_a_capture_runs(build: str) -> None:
    assert _run(_IN_A_CAPTURE, build) == ["done", "1"]


_POOL_PIECE = r"""
import gc, logging, sys
from metrale_core import MetraleSettings, open_backend
logging.disable(logging.CRITICAL)
gpu = open_backend("fake", settings=MetraleSettings(pure=sys.argv[1] == "pure"))
pool = gpu.create_pool()
freed, hold = [], []
class Owner:  # in a cycle: its finalizer frees its piece with MemoryPool.free
    def __init__(self, buf):
        self.buf, self.me = buf, self
    def __del__(self):
        pool.free(self.buf)
        freed.append(self.buf.index)
        hold.append([(i, i, i) for i in range(3000)])
for call in (lambda: pool.alloc(100), gpu.scan_redzones, lambda: gpu.free(gpu.alloc(300))):
    gc.collect(); gc.disable()
    Owner(pool.alloc(64))
    gc.set_threshold(1); gc.enable()
    call()
    gc.set_threshold(700)
gc.collect()
gpu.live_alloc_len()
left = {r.index for r in gpu.ledger_probe().records()}
assert not left & set(freed), (left, freed)
gpu.close()
print("done", len(freed))
"""


@pytest.mark.parametrize("build", _builds())
def test_a_finalizer_may_free_a_pool_piece_too(build: str) -> None:
    words = _run(_POOL_PIECE, build)
    assert words[0] == "done" and int(words[1]) > 0, words
