"""Progress of long commands (``metrale bench``, ``metrale conformance``) on standard error.

On a terminal, a tqdm bar with the time left (tqdm is a dependency of metrale-core; where it is missing, the
lines below). Elsewhere (a pipe, a CI log), plain lines, one per step, as before: a bar's carriage returns
would fill a log with redrawn lines.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    """``step(done, total, line)`` as work advances; ``note(line)`` for a line between steps; ``close()``."""

    __slots__ = ("_bar", "_stream", "_unit")

    def __init__(self, unit: str, stream: TextIO | None = None, *, bar: bool | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._unit = unit
        self._bar: Any = None
        if bar is None:
            bar = bool(getattr(self._stream, "isatty", lambda: False)())
        if bar:
            try:
                import tqdm  # type: ignore[import-untyped, unused-ignore]
            except ImportError:  # plain lines
                return
            self._bar = tqdm.tqdm(total=None, unit=unit, file=self._stream, dynamic_ncols=True, leave=False,
                                  bar_format="{desc} {bar} {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}]")

    @property
    def plain(self) -> bool:
        """Whether it prints plain lines (no terminal, or no tqdm)."""
        return self._bar is None

    def step(self, done: int, total: int, line: str) -> None:
        """``done`` of ``total`` units are done; ``line`` says what runs now."""
        if self._bar is None:
            print(line, file=self._stream, flush=True)
            return
        self._bar.total = total
        self._bar.n = done
        self._bar.set_description_str(line[:60], refresh=False)
        self._bar.refresh()

    def note(self, line: str) -> None:
        """A line of its own (a bar keeps drawing under it)."""
        if self._bar is None:
            print(line, file=self._stream, flush=True)
        else:
            self._bar.write(line, file=self._stream)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
