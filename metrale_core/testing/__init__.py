"""Conformance testing for any backend: a Hypothesis state machine and a bad-input table.

A backend author runs the same tests metrale runs on its own backends:

    # tests/test_conformance.py of a plugin
    from metrale_core.testing import backend_state_machine

    TestMyBackend = backend_state_machine("mybackend").TestCase

The state machine drives the backend through random programs of
allocations, frees (double frees too), copies, memsets, captures and
replays, capture-rule violations, sweeps, red-zone overruns, an
[`Arena`][metrale_core.Arena] (pieces, a full arena, resets) and, where the
backend has ``inject_fault`` ([`FaultInjecting`][metrale_core.testing.FaultInjecting]),
driver failures and reclaim-and-retry after an out-of-memory error. After
every step it checks the ledger and ``stats()`` against a model and every
read against the bytes the model expects.

The optional primitives (kernels, interop, a baseline, tensor maps) are probed by
[`backend_capabilities`][metrale_core.testing.backend_capabilities]; a test that needs one skips, with the reason,
on a backend that lacks it (``backend_params(needs=...)``), and the machine
leaves out the rules that need it.

Its modules, bottom first: `_faults` (the ``FaultInjecting`` protocol); `_model` (what the
backend should hold), `_bad_inputs` (the bad-input table), `_capabilities` (the probe) and the
rules of the machine, `_memory_rules`, `_pool_rules` and `_tensormap_rules`; `_machine` (the
state machine); `_pytest` (a fixture's params over every backend); this face on top.

This module needs ``hypothesis`` (the ``test`` extra).
"""

from __future__ import annotations

from ._bad_inputs import BAD_INPUTS, BadInput, BadInputFixture, bad_input_fixture, check_bad_input
from ._capabilities import CAPABILITIES, Capabilities, backend_capabilities, probe_capabilities
from ._faults import FaultInjecting
from ._machine import BackendMachine
from ._pytest import backend_params, backend_state_machine

__all__ = [
    "BAD_INPUTS",
    "CAPABILITIES",
    "BackendMachine",
    "BadInput",
    "BadInputFixture",
    "Capabilities",
    "FaultInjecting",
    "backend_capabilities",
    "backend_params",
    "backend_state_machine",
    "bad_input_fixture",
    "check_bad_input",
    "probe_capabilities",
]
