"""Chapter 7: a timeline of each rank's step -- what computed when, what was on the wire, and when the
rank sat blocked waiting for the wire. The third is the one that costs time.

    with Timeline() as tl:                  # on every rank; FSDP announces its units' compute (events.py)
        loss = model(x, y); loss.backward(); opt.step()
    tl.spans()                              # [Span(lane, name, start, end)], seconds from the start
    hidden_fraction(tl.spans())             # the share of communication time that cost no waiting

    timelines = launch(work, world_size=2)  # each rank returns tl.spans()
    plot_timeline(timelines, "timeline.svg"); write_chrome_trace(timelines, "trace.json")

Lanes. "compute": one segment per unit and phase ("forward blocks.0"); a unit's segment stops where a
nested unit's starts, so the lane shows who is computing now, not who called whom. "wait": the rank is
blocked in a collective's wait(). "all_gather" / "reduce_scatter" / ...: a collective from when the link
began carrying it (its issue, or, on a throttled link, the end of the one ahead of it) to its completion.

Clocks: wall-clock (time.perf_counter) on the CPU. On a GPU the CPU only queues work, so host times say
when it was queued, not when it ran: there every boundary is a CUDA event -- compute on the compute stream;
a collective's start and end, and the point where a stream stops to wait for one, recorded by the comm
module (comm.py) -- and all are read only when recording ends, as seconds since an origin event (_Clock).
Each rank's zero is the moment it left the barrier that starts recording, so ranks line up to within that
barrier.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import NamedTuple

import torch

from minifsdp import events
from minifsdp.distributed import comm


class Span(NamedTuple):
    lane: str   # "compute", "wait", or a collective's kind
    name: str
    start: float
    end: float


# --8<-- [start:clock]
class _Clock:
    """A timeline's time: seconds since its origin. A stamp is a host time (a float from time.perf_counter)
    or a CUDA event, whose time is its distance from the origin event recorded when the timeline started;
    events are read only at the end, as reading one waits for the GPU to get there."""

    def __init__(self, origin: float, origin_event=None):
        self.origin, self.origin_event = origin, origin_event

    def seconds(self, stamp) -> float:
        if isinstance(stamp, float):
            return stamp - self.origin
        return self.origin_event.elapsed_time(stamp) / 1e3  # milliseconds

    def wait(self, wait) -> tuple[float, float]:
        """When this rank was blocked by a comm.Wait. On a GPU a wait blocks the stream, from the moment it
        reaches the wait until the collective is done -- zero time if it was done already."""
        if wait.cuda is None:
            return self.seconds(wait.start), self.seconds(wait.end)
        arrival, done = map(self.seconds, wait.cuda)
        return arrival, max(arrival, done)

    def collective(self, event) -> tuple[float, float]:
        """When a comm.CommEvent's collective was on the wire."""
        start, done = event.cuda if event.cuda is not None else (event.start, event.done)
        return self.seconds(start), self.seconds(done)
# --8<-- [end:clock]


class Timeline:
    """Records one rank's compute segments and (through a comm counter) its collectives and waits."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self._stack: list[str] = []   # units computing, innermost last
        self._open: tuple[str, object] | None = None
        self._segments: list[tuple[str, object, object]] = []
        self._counter_cm = None

    def __enter__(self) -> "Timeline":
        if comm.world_size() > 1:
            comm.barrier()  # every rank starts its clock together
        if self.cuda:
            torch.cuda.synchronize()  # the GPU idle: its origin event and the host's origin are one moment
        self.origin = time.perf_counter()
        self.clock = _Clock(self.origin, self._stamp() if self.cuda else None)
        self._counter_cm = comm.counting(record=True)
        self.counter = self._counter_cm.__enter__()
        # a unit's compute starts (FSDP announces it): it interrupts the one running, which resumes at its end
        events.subscribe(events.COMPUTE_BEGIN, self._begin)
        events.subscribe(events.COMPUTE_END, self._end)
        return self

    def __exit__(self, *exc) -> None:
        events.unsubscribe(events.COMPUTE_BEGIN, self._begin)
        events.unsubscribe(events.COMPUTE_END, self._end)
        self._close(self._stamp())
        self._stack.clear()
        self._counter_cm.__exit__(*exc)
        if self.cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def span(self, name: str):
        """Mark compute outside FSDP's units, e.g. `with tl.span("optimizer"): opt.step()`."""
        self._begin(name)
        try:
            yield
        finally:
            self._end(name)

    # -- compute segments ------------------------------------------------------------------------------------
    def _stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _close(self, now) -> None:
        if self._open is not None:
            name, start = self._open
            self._segments.append((name, start, now))
            self._open = None

    def _begin(self, name: str) -> None:
        now = self._stamp()
        self._close(now)
        self._stack.append(name)
        self._open = (name, now)

    def _end(self, name: str) -> None:
        if name not in self._stack:
            return
        now = self._stamp()
        self._close(now)
        del self._stack[len(self._stack) - 1 - self._stack[::-1].index(name)]
        if self._stack:
            self._open = (self._stack[-1], now)

    # -- the result ------------------------------------------------------------------------------------------
    def spans(self) -> list[Span]:
        """Every span, in seconds from the start of recording; compute segments exclude the waits."""
        return _spans(self.clock, self._segments, self.counter)


def _spans(clock: _Clock, segments, counter) -> list[Span]:
    """A recording's spans: compute segments [(name, start stamp, end stamp)] and a comm counter's
    collectives and waits, through `clock`."""
    waits = [(*clock.wait(w), w.tag) for w in counter.waits]
    waits = [(s, e, tag) for s, e, tag in waits if e > s]  # on a GPU, a wait for what was done already
    out = [Span("wait", tag, s, e) for s, e, tag in waits]
    for name, s, e in segments:
        for s2, e2 in _subtract((clock.seconds(s), clock.seconds(e)), [(ws, we) for ws, we, _ in waits]):
            if e2 > s2:
                out.append(Span("compute", name, s2, e2))
    for ev in counter.events:
        out.append(Span(ev.kind, ev.tag, *clock.collective(ev)))
    return sorted(out, key=lambda sp: sp.start)


def _subtract(interval, holes):
    """`interval` minus every hole in `holes`, as a list of intervals."""
    pieces = [interval]
    for hs, he in holes:
        pieces = [p for s, e in pieces for p in ((s, min(e, hs)), (max(s, he), e)) if p[1] > p[0]]
    return pieces


def _merge(intervals) -> list[tuple[float, float]]:
    """The union of intervals, as sorted disjoint intervals."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _union_length(intervals) -> float:
    return sum(e - s for s, e in _merge(intervals))


# --8<-- [start:hidden_fraction]
def hidden_fraction(spans: list[Span]) -> float:
    """The share of the time something was on the wire during which this rank
    was NOT blocked waiting.

    1.0: every collective overlapped with other work; 0.0: the rank waited
    through all of them.
    """
    # BEGIN EXERCISE 7.3: union of collectives' time, and the part spent waiting
    comm_spans = [(s.start, s.end) for s in spans
                  if s.lane not in ("compute", "wait")]
    waits = [(s.start, s.end) for s in spans if s.lane == "wait"]
    busy = _union_length(comm_spans)
    if busy == 0:
        return 1.0
    exposed = sum(_union_length([(max(s, ws), min(e, we)) for ws, we in waits
                                 if min(e, we) > max(s, ws)])
                  for s, e in _merge(comm_spans))
    return 1.0 - exposed / busy
    # END EXERCISE
# --8<-- [end:hidden_fraction]


def lane_time(spans: list[Span], *lanes: str) -> float:
    """Time covered by the given lanes together ("compute", "wait", collectives' kinds), overlaps once."""
    return _union_length([(s.start, s.end) for s in spans if s.lane in lanes])


# -- pictures and traces ---------------------------------------------------------------------------------------
def _unit_colors(timelines) -> dict:
    """One colour per unit, in order of first appearance (so the root, which starts first, is grey). Blue,
    orange and purple are left to the collectives (reports/style.py's COLLECTIVE)."""
    from minifsdp.reports import style

    palette = [style.FILLS[c] for c in ("grey", "green", "red", "yellow", "teal")] + \
              [style.LINES[c] for c in ("green", "red", "yellow", "teal")]
    units = []
    for spans in timelines:
        for s in spans:
            unit = s.name.split(" ", 1)[-1]
            if s.lane == "compute" and unit not in units:
                units.append(unit)
    return {u: palette[i % len(palette)] for i, u in enumerate(units)}


def timeline_legend(timelines) -> list:
    """The legend's handles for plot_timeline: the units' colours, the collectives', and the hatching of a wait."""
    from matplotlib.patches import Patch

    from minifsdp.reports import style

    kinds = sorted({s.lane for spans in timelines for s in spans} - {"compute", "wait"})
    handles = [Patch(facecolor=c, label=u) for u, c in _unit_colors(timelines).items()]
    handles += [Patch(facecolor=style.COLLECTIVE.get(k, style.FILLS["grey"]), label=k.replace("_", "-"))
                for k in kinds]
    handles.append(Patch(facecolor="none", edgecolor=style.MUTED, hatch="////", label="blocked waiting"))
    return handles


def plot_timeline(timelines: list[list[Span]], path: str | None = None, title: str = "", ax=None,
                  legend: bool = True):
    """Gantt chart, per rank: a compute lane (colour = unit, pale = forward, hatched = blocked waiting)
    and a communication lane (colour = collective). With `path`, a figure of its own in the charts' style
    (reports/style.py), saved there; with `ax`, drawn into it (legend=False leaves the legend to the caller,
    e.g. one for several panels: timeline_legend)."""
    from minifsdp.reports import style

    if ax is None:
        return style.charts(_own_timeline)(timelines, path, title)
    colors = _unit_colors(timelines)
    labels = []
    for rank, spans in enumerate(timelines):
        y_comp, y_comm = 2 * rank + 1, 2 * rank
        for s in spans:
            bar = [(s.start * 1e3, (s.end - s.start) * 1e3)]
            if s.lane == "compute":  # forward pale, backward solid
                phase, unit = s.name.split(" ", 1)
                colour = style.pale(colors[unit], 0.55) if phase == "forward" else colors[unit]
                ax.broken_barh(bar, (y_comp + 0.1, 0.8), facecolors=colour, edgecolor="none")
            elif s.lane == "wait":
                ax.broken_barh(bar, (y_comp + 0.1, 0.8), facecolors="none", edgecolor=style.MUTED, hatch="////",
                               linewidth=0.5)
            else:
                ax.broken_barh(bar, (y_comm + 0.1, 0.8), facecolors=style.COLLECTIVE.get(s.lane, style.FILLS["grey"]),
                               edgecolor="white", linewidth=0.5)
        labels += [(y_comm + 0.5, f"rank {rank} comm"), (y_comp + 0.5, f"rank {rank} compute")]
    ax.set_yticks([y for y, _ in labels], [t for _, t in labels])
    ax.set_ylim(-0.1, 2 * len(timelines) + 0.1)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel("ms since the start of the step")
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    if legend:
        ax.legend(handles=timeline_legend(timelines), loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def _own_timeline(timelines, path, title):
    from minifsdp.reports import style

    fig, ax = style.figure(1.6 + 0.45 * 2 * len(timelines))
    plot_timeline(timelines, title=title, ax=ax, legend=False)
    fig.legend(handles=timeline_legend(timelines), loc="outside lower center", ncol=4)
    if path:
        style.save(fig, path)
    return ax


def write_chrome_trace(timelines: list[list[Span]], path: str) -> None:
    """A trace for chrome://tracing or ui.perfetto.dev: one process per rank, one thread per lane."""
    lanes = sorted({s.lane for spans in timelines for s in spans}, key=lambda lane: (lane != "compute", lane))
    events = []
    for rank, spans in enumerate(timelines):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for tid, lane in enumerate(lanes):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}})
        for s in spans:
            lane = "compute" if s.lane == "wait" else s.lane  # a wait interrupts compute: same track
            events.append({"ph": "X", "name": s.name if s.lane != "wait" else f"wait {s.name}",
                           "cat": s.lane, "pid": rank, "tid": lanes.index(lane),
                           "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
