"""``FakeBackend``: a [`GpuBackend`][metrale_core.GpuBackend] with the fake's own extras."""

from __future__ import annotations

from metrale_core import GpuBackend, InvalidArgumentError
from metrale_core.plugin import as_index, cuda_code

from ._device import FAULT_OPS, FakeDevice

__all__ = ["FakeBackend"]


class FakeBackend(GpuBackend):
    """The fake backend: the core's semantics over an in-memory device, plus fault injection."""

    def inject_fault(self, op: str, *, nth: int = 1, code: str = "CUDA_ERROR_UNKNOWN") -> None:
        """Make the ``nth`` next raw call of ``op`` fail once with CUDA result ``code``.

        The failure lands after the core has done its part, where a driver
        failure would. ``op`` is one of ``alloc`` (device, managed, arena and
        host), ``free``, ``memcpy`` (a red-zone read counts), ``memset`` (a
        red-zone fill counts), ``graph_instantiate``, ``graph_launch``,
        ``synchronize`` (stream, event and device), ``is_capturing`` and
        ``launch`` (a kernel launch).
        """
        self._check_open()
        if op not in FAULT_OPS:
            raise InvalidArgumentError(f"inject_fault: op must be one of {sorted(FAULT_OPS)}, got {op!r}")
        count = as_index(nth)
        if count is None or count < 1:
            raise InvalidArgumentError(f"inject_fault: nth must be a positive integer, got {nth!r}")
        if not isinstance(code, str) or cuda_code(code) is None or code == "CUDA_SUCCESS":
            raise InvalidArgumentError(
                f"inject_fault: code must be the name of a CUDA error result, such as "
                f"'CUDA_ERROR_UNKNOWN', got {code!r}"
            )
        raw = self.raw
        assert isinstance(raw, FakeDevice)
        raw.inject_fault(op, count, code)
