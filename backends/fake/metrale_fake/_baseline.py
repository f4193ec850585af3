"""The fake's baseline for ``metrale bench``: what a program without a GPU would call, numpy."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from metrale_core.plugin import Baseline, CopyDirection

__all__ = ["NumpyBaseline"]


class NumpyBaseline(Baseline):
    """numpy on host memory: ``np.empty``, ``fill``, ``copyto`` and ``add``; nothing is asynchronous."""

    __slots__ = ("_arrays",)

    def __init__(self) -> None:
        self._arrays: list[np.ndarray] = []

    @property
    def label(self) -> str:
        return f"numpy {np.__version__}"

    @property
    def versions(self) -> Mapping[str, str]:
        return {"numpy": np.__version__}

    def _array(self, nbytes: int) -> np.ndarray:
        array = np.zeros(nbytes, np.uint8)
        self._arrays.append(array)
        return array

    def alloc_free(self, nbytes: int) -> Callable[[], None]:
        empty, u8 = np.empty, np.uint8

        def pair() -> None:
            empty(nbytes, u8)

        return pair

    def memset(self, nbytes: int) -> Callable[[], None]:
        array = self._array(nbytes)
        return lambda: array.fill(0)

    def copy(self, direction: CopyDirection, nbytes: int) -> Callable[[], None]:
        dst, src = self._array(nbytes), self._array(nbytes)
        copyto = np.copyto
        return lambda: copyto(dst, src)

    def copy_peer(self, nbytes: int, peer_ordinal: int) -> Callable[[], None]:
        """A numpy copy, as the fake's peer copy is (one host's memory)."""
        return self.copy("dtod", nbytes)

    def vector_add(self, n: int) -> Callable[[], None]:
        a, b, out = (self._array(4 * n).view(np.float32) for _ in range(3))
        add = np.add

        def launch() -> None:
            add(a, b, out=out)

        return launch

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self._arrays.clear()
