"""The bad-input table: every bad call raises its typed error and changes nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from metrale_core import GpuBackend
from metrale_core.testing import BAD_INPUTS, BadInput, BadInputFixture, bad_input_fixture, check_bad_input


@pytest.fixture
def fixture(gpu: GpuBackend) -> Iterator[BadInputFixture]:
    with bad_input_fixture(gpu) as handles:
        yield handles


def test_the_table_is_large_enough() -> None:
    assert len(BAD_INPUTS) >= 20
    assert len({case.name for case in BAD_INPUTS}) == len(BAD_INPUTS)


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.name for c in BAD_INPUTS])
def test_bad_input(fixture: BadInputFixture, case: BadInput) -> None:
    error = check_bad_input(fixture, case)
    # Errors only metrale raises carry no CUDA code; driver-side ones carry CUDA's.
    if error.name is not None:
        assert error.name.startswith("CUDA_ERROR_")
