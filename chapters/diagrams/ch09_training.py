"""Chapter 9's diagrams: one optimizer step with the chapter's four additions, gradient accumulation with and
without no_sync(), the gradient norm from the shards, and deferred initialisation (the memory while the units are
built, and what gives the values: an init function run again, or the constructor's ops recorded and replayed).

Drawn on the shared canvas (canvas.py); make_diagrams.py finds this module and draws each function in DIAGRAMS.
"""

from __future__ import annotations

from canvas import *  # noqa: F403  the canvas, the colours, the helpers


def _callout(c: Canvas, x: float, y: float, n: int) -> None:
    """A numbered mark, ① to ④, centred at (x, y): a small filled box with the digit."""
    c.box(x - 9, y - 9, 18, 18, str(n), YELLOW, size=MIN_FONT, bold=True, rx=9)


# -- the key picture ------------------------------------------------------------------------------------------------
def training_step() -> Canvas:
    c = Canvas("training_step", 268, "One optimizer step of three micro-batches, with the chapter's four additions",
               "A timeline of one rank, with a compute lane and a lane for the collectives. First, before the loop, the "
               "model is built unit by unit from the meta device (1). Then three micro-batches, each a forward F and a "
               "backward B; every forward and backward all-gathers the parameters, but only the last backward "
               "reduce-scatters, because the first two run inside no_sync() (2). Each backward starts by recomputing "
               "its block's forward, R, since checkpointing kept only the block's input (3). Before the step, the "
               "gradient's norm is computed from the shards with one all-reduce of one number, and the gradients are "
               "clipped (4). Then the optimizer steps the shards.")
    x0, unit = 104, 16.5
    top, low = 62, 96        # the compute lane, the collectives' lane
    c.text(10, 18, "one optimizer step, 3 micro-batches, one rank", bold=True)
    c.text(x0 - 8, top + 17, "compute", anchor="end", size=MIN_FONT)
    c.text(x0 - 8, low + 17, "collectives", anchor="end", size=MIN_FONT)

    def span(lane, a, b, label, fill, dash=False):
        c.box(x0 + a * unit + 0.5, lane, (b - a) * unit - 1, 26, label, fill, size=MIN_FONT, dash=dash)

    span(top, 0, 3, "build", GRAY, dash=True)
    _callout(c, x0 + 1.5 * unit, top - 14, 1)
    t = 4
    for mb in (1, 2, 3):
        span(top, t, t + 3, f"F{mb}", BLUE)
        span(low, t, t + 2, "AG", BLUE)
        span(top, t + 3, t + 4, "R", TEAL)
        span(top, t + 4, t + 7, f"B{mb}", ORANGE)
        span(low, t + 3, t + 5, "AG", BLUE)
        if mb == 3:
            span(low, t + 7, t + 9, "RS", ORANGE)
        else:
            c.text(x0 + (t + 6) * unit, low + 44, "no RS", anchor="middle", size=MIN_FONT)
        t += 7
    _callout(c, x0 + 9.5 * unit, top - 14, 2)
    _callout(c, x0 + 16.5 * unit, top - 14, 2)
    _callout(c, x0 + 7.5 * unit, top - 14, 3)
    t += 2
    span(top, t, t + 2, "clip", PURPLE)
    span(low, t, t + 2, "AR", PURPLE)
    _callout(c, x0 + (t + 1) * unit, top - 14, 4)
    span(top, t + 2, t + 5, "step", GREEN)
    y = 176
    notes = [(1, "deferred init: the units are built and sharded one at a time"),
             (2, "no_sync(): the first two backwards send no reduce_scatter"),
             (3, "checkpointing: each backward first runs its block's forward again (R)"),
             (4, "clipping: the norm from every rank's shard, one all_reduce (AR) of one number")]
    for i, (n, s) in enumerate(notes):
        _callout(c, 19, y + i * 24 - 5, n)
        c.text(36, y + i * 24, s, size=MIN_FONT)
    return c



# -- gradient accumulation ------------------------------------------------------------------------------------------
def accumulation_no_sync() -> Canvas:
    c = Canvas("accumulation_no_sync", 340, "Gradient accumulation under FSDP: reduce every micro-batch, or no_sync()",
               "Two timelines of one optimizer step of three micro-batches on one rank, each with a compute lane and a "
               "lane for the collectives, and under each a bar of the gradients the rank holds between the "
               "micro-batches. Reducing every micro-batch, each backward is followed by a reduce-scatter, and the "
               "rank holds only gradient shards, 4 Psi over N bytes, which add up in .grad. Inside no_sync(), the "
               "first two backwards send nothing and each unit keeps its full flat gradient, 4 Psi bytes in all, "
               "DDP's amount; the last backward adds them in and reduce-scatters once. The all-gathers of every "
               "forward and backward are there in both: no_sync() saves the reduce-scatters only, a third of the "
               "bytes, where under DDP it saves all of them.")
    x0, unit = 112, 18
    rows = [("reduce every micro-batch", (1, 2, 3), "gradient shards, 4Ψ/N, add up in .grad", 0.25),
            ("with model.no_sync(): micro-batches 1 and 2", (3,), "every unit's full gradient, 4Ψ: DDP's amount", 1.0)]
    y = 8
    for title, reduced, held, share in rows:
        c.text(10, y + 16, title, bold=True)
        top, low = y + 28, y + 60
        c.text(x0 - 8, top + 17, "compute", anchor="end", size=MIN_FONT)
        c.text(x0 - 8, low + 17, "collectives", anchor="end", size=MIN_FONT)
        t = 0
        for mb in (1, 2, 3):
            c.box(x0 + t * unit + 0.5, top, 3 * unit - 1, 26, f"F{mb}", BLUE, size=MIN_FONT)
            c.box(x0 + (t + 3) * unit + 0.5, top, 4 * unit - 1, 26, f"B{mb}", ORANGE, size=MIN_FONT)
            c.box(x0 + t * unit + 0.5, low, 2 * unit - 1, 26, "AG", BLUE, size=MIN_FONT)
            c.box(x0 + (t + 3) * unit + 0.5, low, 2 * unit - 1, 26, "AG", BLUE, size=MIN_FONT)
            if mb in reduced:
                c.box(x0 + (t + 7) * unit + 0.5, low, 2 * unit - 1, 26, "RS", ORANGE, size=MIN_FONT)
            t += 9
        c.text(x0 - 8, low + 56, "held", anchor="end", size=MIN_FONT)
        full = 200
        c.rect(x0, low + 42, full, 20, dash=True)
        c.rect(x0, low + 42, full * share, 20, fill=ORANGE)
        c.text(x0 + full + 8, low + 56, held, size=MIN_FONT)
        y += 144
    c.text(10, y + 4, "At N = 4 the bars are 4Ψ/4 and 4Ψ. Both send every all_gather; no_sync() drops the", size=MIN_FONT)
    c.text(10, y + 22, "reduce_scatters only, about a third of a micro-batch's bytes (under DDP, all of them).", size=MIN_FONT)
    return c



# -- clipping -------------------------------------------------------------------------------------------------------
def clip_from_shards() -> Canvas:
    c = Canvas("clip_from_shards", 302, "The norm of the whole gradient from N shards: add the partial sums, not the norms",
               "Four ranks, each holding a disjoint shard of the gradient. Each computes the sum of the squares of its "
               "own elements, s_r. One all-reduce with SUM adds the four partial sums, so every rank holds the same "
               "total, and the 2-norm of the whole gradient is its square root. Each rank computes the same "
               "coefficient, max_norm over the norm plus 1e-6, capped at 1, and scales its own shard by it. For the "
               "infinity norm each rank takes its largest absolute value and the all-reduce takes the maximum. "
               "Adding the ranks' norms instead would overstate the norm: norms do not add.")
    y0, row = 40, 40
    c.text(10, 18, "clip_grad_norm_(max_norm) at N = 4: one all_reduce of one number", bold=True)
    sx, px, ax, rx = 70, 204, 362, 492   # shard, partial sum, all_reduce, result columns
    for r in range(4):
        y = y0 + r * row
        c.text(10, y + 18, f"rank {r}", size=MIN_FONT, bold=True)
        c.rect(sx - 16, y + 6, 10, 16, fill=RANKS[r])
        c.box(sx, y + 2, 110, 26, f"grad shard {r}", ORANGE, size=MIN_FONT)
        c.line(sx + 114, y + 15, px - 4, y + 15, arrow=True)
        c.box(px, y + 2, 132, 26, f"s{r} = Σ |gᵢ|²", GRAY, size=MIN_FONT)
        c.line(px + 136, y + 15, ax - 4, y + 15, arrow=True)
        c.line(ax + 104, y + 15, rx - 4, y + 15, arrow=True)
        c.box(rx, y + 2, 178, 26, f"grad shard {r} × coef", ORANGE, size=MIN_FONT)
    h = 4 * row - 12
    c.box(ax, y0 + 2, 100, h, [("all_reduce", {"mono": True}), ("SUM", {"bold": True})],
          PURPLE, size=MIN_FONT)
    y = y0 + 4 * row + 14
    c.text(10, y, "every rank then holds the same total = s0 + s1 + s2 + s3, and computes the same", size=MIN_FONT)
    c.text(10, y + 20, "norm = total^(1/2),   coef = min(1, max_norm / (norm + 1e-6))", size=MIN_FONT, mono=True)
    c.text(10, y + 44, "inf-norm: each rank's max |gᵢ|, and an all_reduce with MAX.", size=MIN_FONT)
    c.text(10, y + 62, "Not the ranks' norms added: ‖g‖ < ‖g₀‖ + ‖g₁‖ + … whenever two shards are non-zero.",
           size=MIN_FONT)
    return c



# -- deferred initialisation ----------------------------------------------------------------------------------------
# The memory of one rank while FSDP builds a model of 4 equal units of U bytes at N = 4, in units of U: what the
# page's measurement shows (tests/test_ch09_training.py holds the real peak to the same model, to the byte).
INIT_UNITS, INIT_N = 4, 4


def _init_profile(deferred: bool) -> list[tuple[str, list[float]]]:
    """(phase, the memory after each of its steps): eager builds everything first; deferred materialises each
    unit just before it is flattened. Flattening adds the flat copy and the shard; then the parameters and the
    flat copy go, and the shard stays."""
    shard = 1 / INIT_N
    phases, held = [], 0.0
    if not deferred:
        held = float(INIT_UNITS)
        phases.append(("build", [held]))
    for k in range(1, INIT_UNITS + 1):
        steps = []
        if deferred:
            held += 1
            steps.append(held)             # the unit's parameters, initialised
        held += 1 + shard
        steps.append(held)                 # + its flat copy and its shard
        held -= 2
        steps.append(held)                 # the parameters and the flat copy go
        phases.append((f"unit {k}", steps))
    return phases


def deferred_init_memory() -> Canvas:
    c = Canvas("deferred_init_memory", 372, "Deferred init holds one unit in full at a time; an eager model holds all of it",
               "Two step plots of the memory of one rank while FSDP builds a model of four equal units at N = 4, in "
               "units of one unit's parameters. Eager: the whole model exists first, 4 units, and flattening the "
               "first unit puts its flat copy and its shard on top: the peak is 5.25 units. On the meta device: "
               "each unit gets memory and values just before it is flattened, its flat copy and shard come on top, "
               "and then only the shard stays: the peak, at the last unit, is the three shards already built plus "
               "one unit twice and its shard, 3 units. At the end both hold the four shards, one unit's worth.")
    x0, step_w, level = 130, 38, 16
    panels = [("eager: TinyGPT(), then FSDP", False), ("meta device: FSDP builds each unit", True)]
    y = 20
    for title, deferred in panels:
        c.text(10, y, title, bold=True)
        phases = _init_profile(deferred)
        base = y + 12 + 6 * level
        x, points, prev = x0, [(x0, base)], 0.0
        for label, steps in phases:
            start = x
            for v in steps:
                points += [(x, base - prev * level), (x, base - v * level)]
                x += step_w
                prev = v
            c.text((start + x) / 2, base + 16, label, anchor="middle", size=MIN_FONT)
        points += [(x, base - prev * level), (x, base)]
        d = "M" + " L".join(f"{num(a)},{num(b)}" for a, b in points) + " Z"
        c.path(d, points=points, fill=BLUE, colour=MUTED, width=1)
        c.line(x0, base, WIDTH - 10, base, width=1)
        peak = max(v for _, steps in phases for v in steps)
        c.line(x0, base - peak * level, WIDTH - 10, base - peak * level, dash=True, width=1)
        note = ("peak: the model + a unit's flat copy and shard" if not deferred
                else "peak: the shards built + one unit twice")
        c.text(WIDTH - 10, base - peak * level - 5, note, anchor="end", size=MIN_FONT)
        if deferred:
            model = base - INIT_UNITS * level
            c.line(x0, model, WIDTH - 10, model, dash=True, width=1)
            c.text(WIDTH - 10, model - 5, "the whole model", anchor="end", size=MIN_FONT)
        c.text(x0 - 10, base - 20, "memory of", anchor="end", size=MIN_FONT)
        c.text(x0 - 10, base - 4, "one rank", anchor="end", size=MIN_FONT)
        y = base + 48
    y -= 14
    swatch(c, 10, y, BLUE, "parameters: a unit's, its flat copy, the shards (N = 4: a shard is a quarter unit)")
    c.text(10, y + 24, "Each unit is built, flattened and sharded before the next one gets memory: a rank never", size=MIN_FONT)
    c.text(10, y + 42, "holds more than one unit in full, so a model larger than its memory can be built.", size=MIN_FONT)
    return c



def deferred_init_replay() -> Canvas:
    c = Canvas("deferred_init_replay", 372, "Where a deferred model's values come from: an init function, or the constructor replayed",
               "Three rows, each from the model's constructor to a sharded unit. Eager: TinyGPT() runs its init ops "
               "on real tensors, the whole model, and FSDP then flattens and shards each unit. On the meta device, "
               "as minifsdp and FSDP1's param_init_fn do it: the constructor builds meta tensors, shapes without "
               "memory, on which its init ops did nothing; FSDP gives each unit memory and runs an init function on "
               "it, param_init_fn(module) or reset_parameters(), then flattens and shards it. Record and replay, as "
               "torchdistx's deferred_init does it: the constructor builds fake tensors and every op on them is "
               "recorded; materialize_module replays a unit's recorded ops on the real device, so the values are "
               "the constructor's own, and nothing has to be written again.")
    widths, gap = (146, 170, 170, 124), 18
    lefts = [10 + sum(widths[:i]) + i * gap for i in range(4)]
    rows = [("eager", [["TinyGPT(): init", "ops on real data"], ["real tensors:", "the whole model"],
                       ["(already there)"], ["flatten, shard", "each unit"]],
             "the values: the constructor's; the memory: the whole model first"),
            ("meta device: minifsdp, FSDP1's param_init_fn",
             [["on the meta device:", "TinyGPT()"], ["meta tensors: shapes,", "the init ops did nothing"],
              ["per unit: memory,", "param_init_fn(m)"], ["flatten, shard", "the unit"]],
             "the values: the init function's, eager's only if it is order-free (a generator per tensor)"),
            ("record and replay: torchdistx's deferred_init",
             [["deferred_init(", "TinyGPT)"], ["fake tensors + a", "record of the init ops"],
              ["per unit: replay,", "materialize_module(m)"], ["flatten, shard", "the unit"]],
             "the values: the constructor's own ops, run again; no init function to write")]
    y = 8
    for title, boxes, note in rows:
        c.text(10, y + 16, title, bold=True)
        top = y + 26
        for i, lines in enumerate(boxes):
            x, w = lefts[i], widths[i]
            fill = BLUE if i == 2 and lines != ["(already there)"] else GRAY
            if lines == ["(already there)"]:
                c.rect(x, top, w, 44, dash=True)
                c.text(x + w / 2, top + 27, "(initialised already)", anchor="middle", size=MIN_FONT)
            else:
                c.box(x, top, w, 44, lines, fill, size=MIN_FONT)
            if i:
                c.line(x - gap + 2, top + 22, x - 3, top + 22, arrow=True)
        c.text(10, top + 66, note, size=MIN_FONT)
        y += 112
    swatch(c, 10, y + 14, BLUE, "where the values are made, unit by unit, after the sharding is known")
    return c


DIAGRAMS = (training_step, accumulation_no_sync, clip_from_shards, deferred_init_memory, deferred_init_replay)
