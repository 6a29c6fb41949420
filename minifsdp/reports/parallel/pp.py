"""Chapter 12's report, the pipeline schedules (`python -m minifsdp parallel --parts pp`): GPipe, 1F1B and
interleaved 1F1B (v = 2) on p = 4 ranks, m = 8 micro-batches, every forward made to last 50 ms and every backward
100 ms (halved for the interleaved schedule's half-size stages; compute_time): the bubble each rank measured against
(p - 1) / (v m + p - 1), the micro-batches each held at once, the activation bytes at their peak (MemoryMeter's
"other"), the bytes each sent against the count of boundaries crossed; and the three timelines as a Gantt chart.
"""

from __future__ import annotations

import statistics

from torch import nn

from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.measure.meter import MemoryMeter
from minifsdp.measure.pipeline_timeline import bubble_formula, bubble_fractions, in_flight_peak, pipeline_actions
from minifsdp.measure.timeline import Timeline
from minifsdp.models import GPTConfig, TinyGPT, gpt_batch
from minifsdp.parallel import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, gpt_loss,
                               split_gpt, stages_of_rank)
from minifsdp.reports import style
from minifsdp.reports.format import md_table, md_tabs

# the pipeline tests' model, batch and delays (tests/test_ch12_pipeline.py)
PP_CONFIG = GPTConfig(n_layer=8, n_embd=16, n_head=2, block_size=8, vocab_size=96)
PP_BATCH, PP_RANKS, PP_MICRO = 16, 4, 8
COMPUTE_TIME = (0.050, 0.100)  # seconds a forward, a backward of a whole stage; /v for the interleaved stages
SCHEDULES = {"GPipe": (ScheduleGPipe, 1), "1F1B": (Schedule1F1B, 1), "interleaved 1F1B": (ScheduleInterleaved1F1B, 2)}


def build_pipeline(schedule: str, config: GPTConfig, batch: int, m: int, group=None, compute_time=None, v=None):
    """This rank's stage modules (a ModuleList: a parameter two of them share is listed once) and the schedule."""
    cls, default_v = SCHEDULES[schedule]
    v = default_v if v is None else v
    p, r = comm.world_size(group), comm.rank(group)
    indices = stages_of_rank(r, p, v)
    modules = nn.ModuleList(split_gpt(TinyGPT(config, seed=0), p * v, indices))
    shape = (batch // m, config.block_size, config.n_embd)
    stages = [PipelineStage(mod, s, p * v, group=group, activation_shape=shape) for mod, s in zip(modules, indices)]
    return modules, cls(stages if v > 1 else stages[0], m, loss_fn=gpt_loss, compute_time=compute_time)


def pp_measure(config: GPTConfig = PP_CONFIG, batch: int = PP_BATCH, m: int = PP_MICRO,
               compute_time: tuple[float, float] = COMPUTE_TIME) -> dict:
    """On each rank, per schedule: a timeline of one step under compute_time (after a step that connects the
    ranks), the activation bytes at their peak in a step, the bytes sent in a step."""
    x, y = gpt_batch(config, 0, batch)
    out = {}
    for name, (_, v) in SCHEDULES.items():
        modules, schedule = build_pipeline(name, config, batch, m)
        schedule.step(x, target=y)  # the first messages between two ranks also connect them
        modules.zero_grad()
        schedule.compute_time = (compute_time[0] / v, compute_time[1] / v)
        with Timeline() as tl:
            schedule.step(x, target=y)
        modules.zero_grad()
        schedule.compute_time = None
        meter = MemoryMeter(modules)
        meter.reset_peak()
        with meter:
            schedule.step(x, target=y)
        meter.close()
        modules.zero_grad()
        with comm.counting() as counter:
            schedule.step(x, target=y)
        out[name] = {"spans": tl.spans(), "activation_peak": meter.category_peak["other"],
                     "sent": counter.bytes["send"], "stages": stages_of_rank(comm.rank(), comm.world_size(), v)}
    return out


def predicted_in_flight(schedule: str, r: int, p: int, m: int) -> int:
    """The most micro-batches (pieces of micro-batches through one of its stages, interleaved) rank r holds."""
    v = SCHEDULES[schedule][1]
    if schedule == "GPipe":
        return m
    if v == 1:
        return min(p - r, m)
    return min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)


def pp_sent_formula(config: GPTConfig, batch: int, m: int, p: int, v: int, r: int) -> int:
    """Bytes rank r sends in a step: each micro-batch's activation across each boundary after one of its stages,
    its gradient across each boundary before one; and at either end of the pipeline, the tied embedding's
    gradient to the other end."""
    stages = stages_of_rank(r, p, v)
    message = 4 * (batch // m) * config.block_size * config.n_embd
    crossings = sum((s < p * v - 1) + (s > 0) for s in stages)
    ends = (r == 0) + (r == p - 1) if p > 1 else 0
    return crossings * m * message + ends * config.vocab_size * config.n_embd * 4


def pp_results(p: int = PP_RANKS, config: GPTConfig = PP_CONFIG, batch: int = PP_BATCH, m: int = PP_MICRO,
               compute_time: tuple[float, float] = COMPUTE_TIME) -> dict:
    res = launch(pp_measure, world_size=p, kwargs=dict(config=config, batch=batch, m=m, compute_time=compute_time),
                 device="cpu")
    out = {}
    for name, (_, v) in SCHEDULES.items():
        timelines = [r[name]["spans"] for r in res]
        out[name] = {"v": v, "timelines": timelines, "bubbles": bubble_fractions(timelines),
                     "formula": bubble_formula(p, m, v),
                     "in_flight": [in_flight_peak(s) for s in timelines],
                     "in_flight_predicted": [predicted_in_flight(name, r, p, m) for r in range(p)],
                     "activation_peak": [r[name]["activation_peak"] for r in res],
                     "sent": [r[name]["sent"] for r in res],
                     "sent_formula": [pp_sent_formula(config, batch, m, p, v, r) for r in range(p)]}
    return out


def _extent(timelines) -> tuple[float, float]:
    """When the pipeline's first action began and its last ended, on any rank."""
    actions = [a for spans in timelines for a in pipeline_actions(spans)]
    return min(s for _, s, _ in actions), max(e for _, _, e in actions)


def pp_table(results: dict, p: int = PP_RANKS, m: int = PP_MICRO, config: GPTConfig = PP_CONFIG,
             batch: int = PP_BATCH, compute_time: tuple[float, float] = COMPUTE_TIME) -> str:
    head = (f"**Pipeline schedules**, p = {p} ranks, m = {m} micro-batches of {batch // m} sequences, TinyGPT of "
            f"{config.n_layer} blocks (h = {config.n_embd}); every forward of a stage made to last "
            f"{compute_time[0] * 1e3:.0f} ms and every backward {compute_time[1] * 1e3:.0f} ms (÷ v for the "
            f"interleaved schedule's v stages per rank); the bubble: each rank's idle share of the step")
    rows = []
    for name, r in results.items():
        b, v = r["bubbles"], r["v"]
        start, end = _extent(r["timelines"])
        ideal = (v * m + p - 1) * sum(compute_time) / v
        rows.append([name, v, f"{statistics.mean(b):.3f} ({min(b):.3f} – {max(b):.3f})", f"{r['formula']:.3f}",
                     f"{(end - start) * 1e3:.0f} ms", f"{ideal * 1e3:.0f} ms"])
    per_rank = {name: [[k, r["in_flight"][k], r["in_flight_predicted"][k], f"{r['activation_peak'][k]:,}",
                        f"{r['sent'][k]:,.0f}", f"{r['sent_formula'][k]:,}"] for k in range(p)]
                for name, r in results.items()}
    return pp_layout(head, rows, per_rank)


def pp_layout(head: str, rows: list[list], per_rank: dict[str, list[list]]) -> str:
    """The schedules side by side, then a tab per schedule with a row per rank (seven columns in one table
    would scroll sideways in the docs' column, md_table)."""
    schedules = md_table(["schedule", "v", "bubble: mean over ranks (min – max)", "formula (p−1)/(v·m+p−1)", "step",
                          "ideal step (v·m+p−1)(t_f+t_b)/v"], rows)
    text = ("**Per rank**, a tab per schedule: micro-batches in flight at the peak (measured on the timeline; "
            "predicted by the order: GPipe m, 1F1B p − r, interleaved 2(p−r−1) + (v−1)p + 1 pieces of 1/v "
            "stage), activation bytes at their peak (MemoryMeter, one step), bytes sent in a step (counted; "
            "formula: an activation per micro-batch across each boundary after the rank's stages, a gradient "
            "across each before, the tied embedding's gradient at either end)")
    tabs = md_tabs([(name, md_table(["rank", "in flight", "predicted", "activation peak", "bytes sent", "formula"],
                                    cells)) for name, cells in per_rank.items()])
    return "\n\n".join([head, schedules, text, tabs]) + "\n"


FORWARD_COLORS = (style.FILLS["blue"], style.LINES["blue"])       # forward through a rank's first stage, its second
BACKWARD_COLORS = (style.FILLS["orange"], style.LINES["orange"])  # the same, backward (interleaved 1F1B)


@style.charts
def plot_gantt(results: dict, path: str, p: int = PP_RANKS, m: int = PP_MICRO) -> None:
    """The schedules' timelines stacked, one panel each, on one time axis: a row per rank, a box per action,
    forwards blue and backwards orange (darker: the rank's second stage), each labelled with its micro-batch
    where the number fits in the box; empty space is the bubble."""
    from matplotlib.patches import Patch

    fig, axes = style.figure(1.0 + 1.9 * len(results), len(results), 1, sharex=True, squeeze=False)
    axes = axes[:, 0]
    longest = max(end - start for start, end in (_extent(r["timelines"]) for r in results.values()))
    labels = []  # (ax, x, y, width in ms, micro-batch): written once the layout says how wide a millisecond is
    for ax, (name, r) in zip(axes, results.items()):
        timelines = r["timelines"]
        origin, _ = _extent(timelines)
        for rank, spans in enumerate(timelines):
            y = p - 1 - rank
            for action, start, end in pipeline_actions(spans):
                chunk = action.stage // p
                color = (FORWARD_COLORS if action.kind == "F" else BACKWARD_COLORS)[chunk]
                left, width = (start - origin) * 1e3, (end - start) * 1e3
                ax.broken_barh([(left, width)], (y + 0.08, 0.84), facecolors=color, edgecolor="white", linewidth=0.6)
                labels.append((ax, left + width / 2, y + 0.5, width, str(action.microbatch)))
        ax.set_yticks([p - 1 - k + 0.5 for k in range(p)], [f"rank {k}" for k in range(p)])
        ax.tick_params(axis="y", length=0)
        ax.set_ylim(0, p)
        ax.set_xlim(0, longest * 1e3 * 1.01)
        ax.set_title(f"{name} (v = {r['v']}): bubble {statistics.mean(r['bubbles']):.3f} measured, "
                     f"{r['formula']:.3f} by the formula", fontsize=10, loc="left")
    axes[-1].set_xlabel(f"ms since the step began (p = {p}, m = {m}; in a box: its micro-batch)")
    handles = [Patch(color=FORWARD_COLORS[0], label="forward"), Patch(color=BACKWARD_COLORS[0], label="backward"),
               Patch(color=FORWARD_COLORS[1], label="forward, 2nd stage (v = 2)"),
               Patch(color=BACKWARD_COLORS[1], label="backward, 2nd stage")]
    fig.legend(handles=handles, loc="outside lower center", ncol=2)
    fig.canvas.draw()
    fig.set_layout_engine("none")  # the layout is final: the labels inside the boxes must not move it
    points_per_ms = axes[0].get_window_extent().width * 72 / fig.dpi / (longest * 1e3 * 1.01)
    for ax, x, y, width, label in labels:
        if width * points_per_ms >= 0.65 * style.MIN_FONT_PT * len(label) + 2:  # only where the number fits
            ax.text(x, y, label, ha="center", va="center", fontsize=10, color=style.INK)
    style.save(fig, path)

