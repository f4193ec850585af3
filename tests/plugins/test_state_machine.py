"""The conformance state machine, against every available backend, in several configurations."""

from __future__ import annotations

import pytest

from metrale_core.testing import backend_state_machine
from tests._support import SETTINGS, backend_params

CONFIGS = {
    "env": SETTINGS,
    # two fake devices: the peer rules copy between ordinals 0 and 1
    "zones": SETTINGS.updated(redzone=128, redzone_lead=True, redzone_min_idx=0, fake_device_count=2),
    "scale": SETTINGS.updated(target_hw="strix-halo", redzone=256),
    "raise": SETTINGS.updated(redzone=64, redzone_action="raise", redzone_scan_graphs=True),
    "queued": SETTINGS.updated(redzone=64, redzone_action="raise", redzone_scan_graphs=True, redzone_scan_queued=True),
    # a bound small enough that frees drain the quarantine; checks judged at the wait after each launch
    "quarantine": SETTINGS.updated(
        redzone=64, redzone_lead=True, redzone_action="raise", redzone_quarantine_bytes=4096,
        redzone_scan_graphs=True, redzone_scan_queued=True,
    ),
    # no quarantine: each free judged at once, a judged pool piece back with its zones in place (issue 54)
    "judged": SETTINGS.updated(redzone=64, redzone_lead=True, redzone_action="raise", redzone_quarantine_bytes=0),
    # one allocation in three zoned (the machine aligns the process's creation indexes at its start, so a
    # replay zones the same ones); checks waited for at each launch
    "sampled": SETTINGS.updated(
        redzone=128, redzone_lead=True, redzone_sample=3, redzone_action="raise", redzone_quarantine_bytes=4096,
        redzone_scan_graphs=True,
    ),
}


def _make(param: object, config: str) -> type:
    name = param.values[0]  # type: ignore[attr-defined]
    case = backend_state_machine(name, CONFIGS[config]).TestCase
    for mark in param.marks:  # type: ignore[attr-defined]
        case = mark(case)
    case.__name__ = f"TestMachine_{name}_{config}"
    return case


for _param in backend_params():
    for _config in CONFIGS:
        _case = _make(_param, _config)
        globals()[_case.__name__] = _case
del _case, _param, _config  # else pytest collects the last class a second time under this name

_defer = backend_state_machine("fake", SETTINGS.updated(fake_defer=True, redzone=64)).TestCase
TestMachine_fake_defer = _defer

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestCollectionWarning")
