"""Memory reports: a loaded memory snapshot as live bytes per call site over time.

``backend.save_snapshot(path)`` writes a JSON snapshot: the allocations on the
ledger when it was saved and, when history recording is on, a bounded log of
every ``alloc``, ``free`` and ``sweep`` before that. `metrale_core._memory.snapshot`
holds that format, both ways: `load_snapshot` reads one back, checks it and
refuses a damaged file with a [`SnapshotError`][metrale_core.SnapshotError]. This module
builds the report from what it read: it replays the snapshot into live bytes per
call site over time (`live_by_site`), and renders that as a Chrome
trace-event timeline (`chrome_trace`, for https://ui.perfetto.dev and
``chrome://tracing``), as a stacked area plot (`plot_png`, which needs
matplotlib) or as an interactive HTML timeline (`plot_html`, which needs
plotly; both: ``pip install "metrale[report]"``). ``metrale report`` is the
command line over these.

The replay starts from the live set before the first event
(`initial_live`): an allocation whose ``alloc`` fell off the front of the
bounded log, or came before recording began, counts as live from the start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final, NamedTuple

from .._errors import InvalidArgumentError, MissingPackageError
from .._install import install_command
from .._memory.snapshot import (  # the format, read and written in one module; re-exported for report's callers
    FORMAT,
    VERSION,
    MemorySnapshot,
    SnapshotEvent,
    initial_live,
    load_snapshot,
)
from .._types import format_bytes

__all__ = [
    "FORMAT",
    "OTHER_SITES",
    "VERSION",
    "MemorySnapshot",
    "SiteTimeline",
    "SnapshotEvent",
    "chrome_trace",
    "format_time",
    "initial_live",
    "live_by_site",
    "load_snapshot",
    "plot_html",
    "plot_png",
    "site_labels",
]

#: The label of the series that sums every call site outside the top ones.
OTHER_SITES: Final = "other sites"


@dataclasses.dataclass(frozen=True, slots=True)
class SiteTimeline:
    """Live bytes per call site over time, as `live_by_site` replays a snapshot.

    Step 0 is the live set before the first event, placed at the first event's
    time; step ``i + 1`` is the live set just after event ``i``; each step holds
    until the next, the last one until the snapshot was saved (``end``). Without
    events there is one step: the live set when the snapshot was saved, at
    ``end`` (0 where the snapshot does not say when that was).

    :param times: per step, seconds since the backend opened; never decreasing.
    :param labels: the series: the ``top`` call sites by peak live bytes, largest first, in
        short form (see `site_labels`), then ``"other sites"`` when more sites remain.
    :param sites: per series, the full ``file:line`` call sites it sums.
    :param series: per series, its live bytes at each step.
    :param totals: the live bytes of every site at each step.
    :param end: when the snapshot was saved (`MemorySnapshot.elapsed`), if the snapshot
        says and it is not before the last step; else ``None``.
    """

    times: tuple[float, ...]
    labels: tuple[str, ...]
    sites: tuple[tuple[str, ...], ...]
    series: tuple[tuple[int, ...], ...]
    totals: tuple[int, ...]
    end: float | None = None

    @property
    def peaks(self) -> tuple[int, ...]:
        """Each series' largest live bytes."""
        return tuple(max(values) for values in self.series)

    @property
    def peak_step(self) -> int:
        """The first step at which the total live bytes are largest."""
        return max(range(len(self.totals)), key=lambda i: (self.totals[i], -i))



def _split_site(site: str) -> tuple[str, str]:
    path, colon, line = site.rpartition(":")
    return (path, colon + line) if colon and path and line.isdigit() else (site, "")


def site_labels(sites: Sequence[str]) -> dict[str, str]:
    """Short, distinct labels for ``file:line`` call sites: ``app.py:12``.

    Each label is the file's name and line; where two sites would share a
    label, each of them takes one more directory from its path until they
    differ (or the whole site is used).
    """
    split = {site: _split_site(site) for site in sites}
    seps = {site: [i for i, c in enumerate(path) if c in "/\\"] for site, (path, _) in split.items()}
    depth = dict.fromkeys(split, 1)

    def label(site: str) -> str:
        path, line = split[site]
        cuts = seps[site]
        return (path[cuts[-depth[site]] + 1 :] if depth[site] <= len(cuts) else path) + line

    while True:
        by_label: dict[str, list[str]] = {}
        for site in split:
            by_label.setdefault(label(site), []).append(site)
        grow = [s for group in by_label.values() if len(group) > 1 for s in group if depth[s] <= len(seps[s])]
        if not grow:
            return {site: label(site) for site in split}
        for site in grow:
            depth[site] += 1


def live_by_site(snapshot: MemorySnapshot, top: int = 8) -> SiteTimeline:
    """Replay the snapshot into live bytes per call site at each step.

    The ``top`` call sites by peak live bytes (their own peak, at any step) get
    a series each, largest first; every other site is summed into one
    ``"other sites"`` series. Times that go backwards in the log (it is ordered
    by when each change was recorded) are held at the previous time.

    :raises InvalidArgumentError: ``top`` is less than 1.
    :raises SnapshotError: the log contradicts itself (see `initial_live`).
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidArgumentError(f"top must be a whole number of call sites, at least 1, not {top!r}")
    start = initial_live(snapshot)
    ops: list[tuple[str, int]] = []  # (site, change in bytes) per event
    for event in snapshot.events:
        a = event.allocation
        ops.append((a.site, a.nbytes if event.op == "alloc" else -a.nbytes))
    # first pass: each site's peak
    current: dict[str, int] = {}
    for a in start:
        current[a.site] = current.get(a.site, 0) + a.nbytes
    peak = dict(current)
    for site, delta in ops:
        current[site] = current.get(site, 0) + delta
        peak[site] = max(peak.get(site, 0), current[site])
    ranked = sorted(peak, key=lambda s: (-peak[s], s))
    chosen, rest = ranked[:top], ranked[top:]
    labels = site_labels(chosen)
    slot = {site: i for i, site in enumerate(chosen)}
    other = len(chosen)
    for site in rest:
        slot[site] = other
    width = len(chosen) + (1 if rest else 0)
    # second pass: the series
    level = [0] * width
    for a in start:
        level[slot[a.site]] += a.nbytes
    columns = [tuple(level)]
    times = [snapshot.events[0].t if snapshot.events else snapshot.elapsed or 0.0]
    for event, (site, delta) in zip(snapshot.events, ops, strict=True):
        level[slot[site]] += delta
        columns.append(tuple(level))
        times.append(max(event.t, times[-1]))
    series = tuple(tuple(column[j] for column in columns) for j in range(width))
    return SiteTimeline(
        times=tuple(times),
        labels=tuple([labels[s] for s in chosen] + ([OTHER_SITES] if rest else [])),
        sites=tuple([(s,) for s in chosen] + ([tuple(rest)] if rest else [])),
        series=series,
        totals=tuple(sum(column) for column in columns),
        end=snapshot.elapsed if snapshot.elapsed is not None and snapshot.elapsed >= times[-1] else None,
    )


def chrome_trace(snapshot: MemorySnapshot, top: int = 8) -> dict[str, Any]:
    """The snapshot as a Chrome trace-event JSON object, for https://ui.perfetto.dev or ``chrome://tracing``.

    One counter event (``"ph": "C"``) named ``"live bytes"`` per step of
    `live_by_site`, with one argument per series (its live bytes), so
    ``chrome://tracing`` draws them as one stacked counter track and Perfetto
    as one track per call site (``live bytes app.py:12``); and one counter
    ``"total"`` with the argument ``"live bytes"`` (Perfetto: ``total live
    bytes``). ``ts`` is in microseconds since the backend opened. Where the
    snapshot says when it was saved, each counter has a last sample then, with
    the last step's values. A metadata event names the process after the
    backend and device; the top-level ``"metadata"`` holds the snapshot's
    header, the full call site behind each label, and the backend's counters.
    """
    timeline = live_by_site(snapshot, top)
    pid = tid = 1
    times = list(timeline.times)
    steps = list(range(len(times)))
    if timeline.end is not None and timeline.end > times[-1]:
        times.append(timeline.end)
        steps.append(steps[-1])
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": tid,
         "args": {"name": f"metrale {snapshot.backend}: {snapshot.device}"}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": "allocation ledger"}},
    ]
    for step, t in zip(steps, times, strict=True):
        ts = round(t * 1e6, 3)
        values = {label: series[step] for label, series in zip(timeline.labels, timeline.series, strict=True)}
        events.append({"name": "live bytes", "cat": "metrale.memory", "ph": "C", "ts": ts, "pid": pid, "tid": tid,
                       "args": values})
        events.append({"name": "total", "cat": "metrale.memory", "ph": "C", "ts": ts, "pid": pid, "tid": tid,
                       "args": {"live bytes": timeline.totals[step]}})
    sites: dict[str, Any] = {}
    for label, group in zip(timeline.labels, timeline.sites, strict=True):
        sites[label] = group[0] if label != OTHER_SITES else list(group)
    metadata = {
        "format": "metrale-memory-report",
        "source": str(snapshot.source) if snapshot.source is not None else None,
        "backend": snapshot.backend,
        "device": snapshot.device,
        "ordinal": snapshot.ordinal,
        "total_bytes": snapshot.total,
        "created": snapshot.created,
        "history_limit": snapshot.history_limit,
        "dropped": snapshot.dropped,
        "events": len(snapshot.events),
        "elapsed": snapshot.elapsed,
        "sites": sites,
        "stats": dict(snapshot.stats),
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata}


def _byte_unit(n: int) -> tuple[str, int]:
    if n >= 1 << 30:
        return "GiB", 1 << 30
    if n >= 1 << 20:
        return "MiB", 1 << 20
    return "KiB", 1 << 10


def format_time(seconds: float, span: float | None = None) -> str:
    """``50.0 ms``, ``4496 ms``; ``12.40 s`` where the time or ``span`` (one unit for a column) is 10 s or more."""
    if max(seconds, span or 0.0) >= 10:
        return f"{seconds:.2f} s"
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"


class _TimeAxis(NamedTuple):
    """The x axis both plots share: the event times and the end of the last step, in one unit."""

    xs: list[float]  #: each step's time, then the end of the last step (seconds or milliseconds)
    in_seconds: bool  #: the axis is in seconds (it runs to 10 s or more), else in milliseconds
    suffix: str  #: "s" or "ms"

    def at(self, x: float) -> str:
        """A point of the axis as the plots write it: ``12.40 s``, ``50.0 ms``, ``4496 ms``."""
        if self.in_seconds:
            return f"{x:.2f} s"
        return f"{x:.1f} ms" if x < 100 else f"{x:.0f} ms"


def _time_axis(timeline: SiteTimeline) -> _TimeAxis:
    """The last step lasts until the snapshot was saved: until then, or for a little while (3% of the span)."""
    times = list(timeline.times)
    last = times[-1]
    span = last - times[0]
    end = timeline.end if timeline.end is not None and timeline.end > last else last + max(span * 0.03, 1e-6)
    in_seconds = end >= 10
    factor = 1.0 if in_seconds else 1e3
    return _TimeAxis([t * factor for t in times] + [end * factor], in_seconds, "s" if in_seconds else "ms")


def _history_note(snapshot: MemorySnapshot) -> str:
    if not snapshot.events:
        if snapshot.history_limit == 0:
            return (
                "history recording was off (METRALE_MEMORY_HISTORY=0): only the live set when the snapshot was saved"
            )
        return "no events were recorded: only the live set when the snapshot was saved"
    note = f"{len(snapshot.events)} events replayed"
    if snapshot.dropped:
        note += f" ({snapshot.dropped} older ones were dropped from the log)"
    return note


@contextlib.contextmanager
def _needs(package: str, what: str, instead: str, snapshot: MemorySnapshot) -> Iterator[None]:
    """Optional imports, inside it: a missing ``package`` is a `MissingPackageError` naming the extra that brings
    it and ``instead``, a report that needs no package."""
    try:
        yield
    except ImportError as exc:
        raise MissingPackageError(
            f"{what} needs {package}, which is not installed: {install_command('report')} "
            f"(or write {instead} instead: metrale report {snapshot.name} --trace OUT.json)"
        ) from exc


class _Plotted(NamedTuple):
    """What both plots draw: the timeline, the step and bytes of its peak, and the unit of the memory axis."""

    timeline: SiteTimeline
    peak_step: int
    peak: int
    unit: str
    scale: int


def _plotted(snapshot: MemorySnapshot, top: int) -> _Plotted:
    timeline = live_by_site(snapshot, top)
    step = timeline.peak_step
    peak = timeline.totals[step]
    return _Plotted(timeline, step, peak, *_byte_unit(peak))


def plot_png(snapshot: MemorySnapshot, path: str | os.PathLike[str], top: int = 8) -> None:
    """Plot live memory over time, stacked by the ``top`` call sites, to a PNG file.

    A stacked step plot of `live_by_site`, 10 x 5.5 inches at 120 dpi:
    time since the backend opened on x (milliseconds; seconds past 10 s), live
    memory on y (KiB, MiB or GiB, by the peak), the peak of the total marked.
    The bands are stacked with the sites still holding memory when the
    snapshot was saved at the bottom, then those that had given it all back,
    each group in the order the sites first held memory; so resident memory
    (weights, and a leak growing over it) lies under what comes and goes, and
    ``"other sites"`` is always on top. The legend lists the bands top to
    bottom with each site's peak and, where it is not 0, its live bytes when
    the snapshot was saved. Without events the plot is one stacked bar: the
    live set when the snapshot was saved. Renders off screen on matplotlib's
    Agg canvas; pyplot and its global state are not touched.

    :raises MissingPackageError: matplotlib is not installed.
    :raises OSError: the file cannot be written.
    """
    with _needs("matplotlib", "plotting a memory report", "the timeline", snapshot):
        import matplotlib
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    timeline, peak_step, peak, unit, scale = _plotted(snapshot, top)
    # tab10 (tab20 for more sites) without its greys, which belong to "other sites"
    many = len([label for label in timeline.labels if label != OTHER_SITES]) > 9
    cmap = matplotlib.colormaps["tab20" if many else "tab10"]
    palette = [cmap(i) for i in range(cmap.N) if i not in ((14, 15) if many else (7,))]
    bands = []  # (is "other sites", freed by the end, first step with memory, rank, label text, color, values)
    for rank, (label, values) in enumerate(zip(timeline.labels, timeline.series, strict=True)):
        first = next((i for i, v in enumerate(values) if v), len(values))
        if not snapshot.events:
            text = f"{label}  ({format_bytes(values[-1])})"
        else:
            text = f"{label}  (peak {format_bytes(max(values))}"
            text += f", {format_bytes(values[-1])} at save)" if values[-1] else ")"
        color = "#b8b8b8" if label == OTHER_SITES else palette[rank % len(palette)]
        bands.append((label == OTHER_SITES, values[-1] == 0, first, rank, text, color, [v / scale for v in values]))
    bands.sort(key=lambda band: band[:4])
    with matplotlib.rc_context({
        "font.size": 11, "axes.titlesize": 10, "axes.labelsize": 11, "legend.fontsize": 10,
        "legend.title_fontsize": 10, "xtick.labelsize": 10, "ytick.labelsize": 10,
        "axes.spines.top": False, "axes.spines.right": False,
    }):
        fig = Figure(figsize=(10, 5.5), dpi=120, layout="constrained")
        ax = fig.add_subplot()
        texts = [band[4] for band in bands]
        colors = [band[5] for band in bands]
        if snapshot.events:
            axis = _time_axis(timeline)
            xs = axis.xs
            if bands:
                ys = [band[6] + band[6][-1:] for band in bands]
                ax.stackplot(xs, ys, labels=texts, colors=colors, step="post", linewidth=0)
            px, py = xs[peak_step], peak / scale
            at = axis.at(px)
            ax.plot([px], [py], marker="v", color="#222222", markersize=7, linestyle="none")
            where = (px - xs[0]) / ((xs[-1] - xs[0]) or 1.0)  # keep the label inside the axes at either edge
            ha, dx = ("right", 6) if where > 0.85 else ("left", -6) if where < 0.15 else ("center", 0)
            ax.annotate(
                f"peak {format_bytes(peak)} at {at}", xy=(px, py), xytext=(dx, 8), textcoords="offset points",
                ha=ha, va="bottom", fontsize=10,
            )
            ax.set_xlim(xs[0], xs[-1])
            ax.set_xlabel(f"time since the backend opened ({axis.suffix})")
            when = f" at {at}"
        else:
            bottom = 0.0
            for band in bands:
                ax.bar([0], [band[6][0]], bottom=[bottom], width=0.5, color=band[5], label=band[4])
                bottom += band[6][0]
            ax.set_xlim(-1, 1)
            ax.set_xticks([0], ["when the snapshot was saved"])
            when = " when saved"
        ax.set_ylim(0, max(peak / scale, 1e-9) * 1.15)
        ax.set_ylabel(f"live memory ({unit})")
        ax.grid(axis="y", color="#dddddd", linewidth=0.8)
        ax.set_axisbelow(True)
        if not bands:
            ax.text(0.5, 0.5, "nothing was allocated", transform=ax.transAxes, ha="center", va="center")
        else:
            # Handles made here, not collected from the axes: matplotlib leaves out of a legend every label
            # that starts with "_", as a call site in a module such as "_selftest.py" does.
            handles = [Patch(facecolor=band[5], label=band[4]) for band in bands]
            ax.legend(  # top to bottom, as the bands are stacked
                handles=handles[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), title="call site",
                alignment="left", frameon=False,
            )
        fig.suptitle(f"Live memory by call site: peak {format_bytes(peak)}{when}", fontsize=13)
        ax.set_title(
            f"{snapshot.backend}: {snapshot.device}, saved {snapshot.created}\n{_history_note(snapshot)}",
            color="#555555",
        )
        fig.savefig(Path(path), format="png")


def plot_html(snapshot: MemorySnapshot, path: str | os.PathLike[str], top: int = 8) -> None:
    """Write an interactive timeline of live memory by call site to one HTML file, opened in a browser with no
    network (plotly's JavaScript is inside the file).

    The stacked step areas of `live_by_site`, one per call site (the ``top`` ones, the rest summed as
    ``"other sites"``): hover over a band for its call site (in full), its live bytes then, and the total; drag
    to zoom, double-click to zoom back out; click a site in the legend to hide it. Time since the backend
    opened on x, in milliseconds (seconds past 10 s); live memory on y in the unit of the peak; the peak of
    the total is marked. Needs plotly: ``pip install "metrale[report]"``.

    :raises MissingPackageError: plotly is not installed.
    :raises OSError: the file cannot be written.
    """
    with _needs("plotly", "an HTML timeline", "a Perfetto timeline", snapshot):
        import plotly.graph_objects as go  # type: ignore[import-untyped, unused-ignore]
    timeline, peak_step, peak, unit, scale = _plotted(snapshot, top)
    axis = _time_axis(timeline)
    xs, suffix = axis.xs, axis.suffix
    totals = [*timeline.totals, timeline.totals[-1]]
    fig = go.Figure()
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf"]
    for rank, (label, group, values) in enumerate(zip(timeline.labels, timeline.sites, timeline.series, strict=True)):
        ys = [v / scale for v in (*values, values[-1])]
        site = group[0] if label != OTHER_SITES else f"{len(group)} other call sites"
        text = [f"{format_bytes(v)} of {format_bytes(t)} live" for v, t in zip((*values, values[-1]), totals,
                                                                                strict=True)]
        fig.add_trace(go.Scatter(
            x=xs, y=ys, name=f"{label} (peak {format_bytes(max(values))})", mode="lines", stackgroup="live",
            line={"shape": "hv", "width": 0.5},
            fillcolor="#b8b8b8" if label == OTHER_SITES else palette[rank % len(palette)],
            line_color="#888888" if label == OTHER_SITES else palette[rank % len(palette)],
            text=text, customdata=[site] * len(xs),
            hovertemplate=f"<b>%{{customdata}}</b><br>%{{text}}<br>at %{{x:.3f}} {suffix}<extra></extra>",
        ))
    px, py = xs[peak_step], peak / scale
    fig.add_trace(go.Scatter(
        x=[px], y=[py], mode="markers+text", marker={"symbol": "triangle-down", "size": 11, "color": "#222222"},
        text=[f"peak {format_bytes(peak)}"], textposition="top center", name="peak", showlegend=False,
        hovertemplate=f"peak of the total: {format_bytes(peak)} at %{{x:.3f}} {suffix}<extra></extra>",
    ))
    fig.update_layout(
        title={"text": f"Live memory by call site: peak {format_bytes(peak)}<br><sup>{snapshot.backend}: "
                       f"{snapshot.device}, saved {snapshot.created}; {_history_note(snapshot)}</sup>"},
        xaxis_title=f"time since the backend opened ({suffix})", yaxis_title=f"live memory ({unit})",
        legend_title_text="call site (click to hide)", hovermode="closest", template="plotly_white",
        width=None, height=560, margin={"t": 90},
    )
    fig.update_yaxes(rangemode="tozero")
    Path(path).write_text(
        fig.to_html(include_plotlyjs=True, full_html=True, config={"displaylogo": False, "responsive": True}),
        encoding="utf-8",
    )
