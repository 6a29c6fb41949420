"""Chapter 12: a pipeline's timeline -- which stage computed which micro-batch when, the bubble, and how many
micro-batches each stage held at once.

The schedules (parallel/pipeline.py) announce every action as a compute event named like "F3 s1" (forward of
micro-batch 3 through stage 1), so chapter 7's Timeline records them unchanged:

    with Timeline() as tl:                  # on every rank
        schedule.step(x, target=y)
    timelines = launch(work, world_size=p)  # each rank returns tl.spans()

    bubble_fractions(timelines)             # per rank: the share of the pipeline's step it sat idle
    bubble_formula(p, m, v)                 # (p - 1) / (v*m + p - 1)
    in_flight_peaks(timelines[r])           # per stage: most micro-batches forward and not yet backward
    plot_pipeline(timelines, "pipeline.svg")

`simulate(orders, t_forward, t_backward)` runs the schedules' orders on an ideal machine -- every forward takes
t_forward, every backward t_backward, messages arrive at once -- and gives spans the same functions read: the
world of the formulas, to hold a measurement against. It also finds an order that cannot finish.
"""

from __future__ import annotations

import re

from minifsdp.measure.timeline import Span
from minifsdp.parallel.pipeline_orders import BACKWARD, FORWARD, Action

_ACTION = re.compile(r"([FB])(\d+) s(\d+)")


def pipeline_actions(spans: list[Span]) -> list[tuple[Action, float, float]]:
    """The pipeline's actions among a rank's spans, as (action, start, end), in the order they ran. An action the
    timeline split (a wait inside it) is one action, from its first piece's start to its last piece's end."""
    found: dict[Action, list[float]] = {}
    for s in spans:
        match = _ACTION.fullmatch(s.name) if s.lane == "compute" else None
        if match:
            action = Action(match[1], int(match[3]), int(match[2]))
            start, end = found.get(action, (s.start, s.end))
            found[action] = [min(start, s.start), max(end, s.end)]
    return sorted(((a, s, e) for a, (s, e) in found.items()), key=lambda t: t[1])


# --8<-- [start:bubble]
def bubble_fractions(timelines: list[list[Span]]) -> list[float]:
    """Per rank, 1 - (its compute time) / (the pipeline's step: from the first
    action anywhere to the last action anywhere). The ranks' clocks must share
    an origin (Timeline starts them at a barrier)."""
    per_rank = [pipeline_actions(spans) for spans in timelines]
    start = min(s for actions in per_rank for _, s, _ in actions)
    end = max(e for actions in per_rank for _, _, e in actions)
    return [1 - sum(e - s for _, s, e in actions) / (end - start)
            for actions in per_rank]


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """The idle share of a step, for p ranks, m micro-batches and v stages per
    rank, each action of a stage taking the same time: the fill and the drain
    take (p - 1) slots of a 1/v-stage action, against v*m of work:
    (p - 1) / (v*m + p - 1). (Megatron's (p - 1) / (v*m) is the same bubble over
    the ideal time.)"""
    return (p - 1) / (v * m + p - 1)
# --8<-- [end:bubble]


def in_flight_peaks(spans: list[Span]) -> dict[int, int]:
    """Per stage: the most micro-batches whose forward had run and whose backward had not, at any moment."""
    now: dict[int, int] = {}
    peak: dict[int, int] = {}
    for action, _, _ in pipeline_actions(spans):
        now[action.stage] = now.get(action.stage, 0) + (1 if action.kind == FORWARD else -1)
        peak[action.stage] = max(peak.get(action.stage, 0), now[action.stage])
    return peak


def in_flight_peak(spans: list[Span]) -> int:
    """The rank's stages together: the most (stage, micro-batch) pairs whose activations it held at once."""
    now = peak = 0
    for action, _, _ in pipeline_actions(spans):
        now += 1 if action.kind == FORWARD else -1
        peak = max(peak, now)
    return peak


# --8<-- [start:simulate]
def simulate(orders: list[list[Action]], t_forward: float,
             t_backward: float) -> list[list[Span]]:
    """Each rank's spans if `orders[r]` ran on rank r of an ideal machine: an
    action starts when its rank is free and its input is there -- a forward
    needs the previous stage's forward of the micro-batch, a backward the next
    stage's backward (or, on the last stage, its own forward) -- and lasts
    t_forward or t_backward."""
    num_stages = 1 + max(a.stage for order in orders for a in order)
    done: dict[Action, float] = {}
    free = [0.0] * len(orders)
    position = [0] * len(orders)
    spans: list[list[Span]] = [[] for _ in orders]
    while any(position[r] < len(order) for r, order in enumerate(orders)):
        progressed = False
        for r, order in enumerate(orders):
            while position[r] < len(order):
                a = order[position[r]]
                if a.kind == FORWARD:
                    needs = ([Action(FORWARD, a.stage - 1, a.microbatch)]
                             if a.stage > 0 else [])
                else:
                    needs = [Action(FORWARD, a.stage, a.microbatch)]
                    if a.stage < num_stages - 1:
                        needs.append(
                            Action(BACKWARD, a.stage + 1, a.microbatch))
                if any(n not in done for n in needs):
                    break
                start = max([free[r]] + [done[n] for n in needs])
                took = t_forward if a.kind == FORWARD else t_backward
                free[r] = done[a] = start + took
                spans[r].append(Span("compute", str(a), start, free[r]))
                position[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(order[position[r]])
                     for r, order in enumerate(orders)
                     if position[r] < len(order)}
            raise RuntimeError(
                f"these orders cannot finish: every rank waits for an action "
                f"that never comes (rank: next action) {stuck}")
    return spans
# --8<-- [end:simulate]


def plot_pipeline(timelines: list[list[Span]], path: str | None = None, title: str = "", ax=None):
    """A Gantt chart of the pipeline: a row per rank, an action per box (pale: forward, solid: backward),
    coloured by micro-batch and labelled with it where the label fits (' marks a rank's later stage); empty
    space is the bubble. With `path`, a figure of its own in the charts' style (reports/style.py), saved
    there; with `ax`, drawn into it."""
    from minifsdp.reports import style

    if ax is None:
        return style.charts(_own_pipeline)(timelines, path, title)
    colors = [style.FILLS[c] for c in ("blue", "orange", "green", "purple", "red", "teal", "yellow", "grey")]
    p = len(timelines)
    labels = []
    for rank, spans in enumerate(timelines):
        y = p - 1 - rank
        for action, start, end in pipeline_actions(spans):
            color = colors[action.microbatch % len(colors)]
            ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (y, 0.85), edgecolor="white", linewidth=0.5,
                           facecolors=style.pale(color, 0.55) if action.kind == FORWARD else color)
            label = str(action.microbatch) if action.stage < p else f"{action.microbatch}'"  # ' a later stage
            labels.append(((start + end) / 2 * 1e3, y + 0.42, (end - start) * 1e3, label))
    ax.set_yticks([p - 1 - r + 0.42 for r in range(p)], [f"rank {r}" for r in range(p)])
    ax.set_xlabel("ms since the start of the step (pale: forward, solid: backward; the number: micro-batch)")
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    fig = ax.figure
    fig.canvas.draw()  # the layout, to write only the labels that fit in their box
    lo, hi = ax.get_xlim()
    points_per_ms = ax.get_window_extent().width * 72 / fig.dpi / (hi - lo)
    for x, y, width, label in labels:
        if width * points_per_ms >= 0.65 * style.MIN_FONT_PT * len(label) + 2:
            ax.text(x, y, label, ha="center", va="center", fontsize=10, color=style.INK)
    return ax


def _own_pipeline(timelines, path, title):
    from minifsdp.reports import style

    fig, ax = style.figure(1.3 + 0.45 * len(timelines))
    plot_pipeline(timelines, title=title, ax=ax)
    if path:
        fig.set_layout_engine("none")  # keep the layout the labels were fitted to
        style.save(fig, path)
    return ax
