"""The compiled lanes read the handles' fields in place (``_device/_fields.pxd``): a lane whose fields are not where
it reads them refuses to load, and its pure module runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests._support import compiled_twin

#: A handle class whose slots moved (another class under its name, of the same size), then each lane asked for.
_MOVED = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.WARNING, format="LOG %(message)s", stream=sys.stdout)
    from metrale_core._device import handles

    class Stream(handles._Handle):  # (the same size, its capture where _owner was)
        __slots__ = ("capture", "default", "moved")

    handles.Stream = Stream
    from metrale_core._twins import pick
    from metrale_core._streams.lane import StreamLane
    from metrale_core._streams.graph_lane import GraphLane
    print("picked", pick("stream_lane", StreamLane, False) is StreamLane,
          pick("graph_lane", GraphLane, False) is GraphLane)
""")


def test_a_lane_whose_fields_moved_refuses_to_load() -> None:
    for twin in ("stream_lane", "graph_lane"):
        compiled_twin(twin)
    done = subprocess.run([sys.executable, "-c", _MOVED], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "picked True True" in done.stdout
    assert "no longer lays them out as metrale_core/_device/_fields.pxd says" in done.stdout
