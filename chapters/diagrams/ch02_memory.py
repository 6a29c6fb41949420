"""Chapter 2's pictures (chapters/02_memory.md): what one rank's memory is made of; and the sum the memory
calculator adds up from it (chapters/13_calculator.md).

Drawn by make_diagrams.py, which finds this module; `from canvas import *` gives the canvas and the colours.
"""

from __future__ import annotations

from canvas import *  # noqa: F403  Canvas, the colours, bracket, MIN_FONT, text_width, num

# Bytes per parameter of each model state, with AdamW: (label, bytes, the state it belongs to). The states
# sum to minifsdp.measure.analytic's FP32_ADAM and mixed_precision_adam(12), which tests/test_diagrams_ch02.py
# checks.
MODEL_STATES = {
    "fp32": [("parameters 4", 4, "params"), ("gradients 4", 4, "grads"), ("exp_avg 4", 4, "optim"),
             ("exp_avg_sq 4", 4, "optim")],
    "mixed": [("params 2", 2, "params"), ("grads 2", 2, "grads"), ("fp32 master 4", 4, "optim"),
              ("exp_avg 4", 4, "optim"), ("exp_avg_sq 4", 4, "optim")],
}
STATE_FILL = {"params": BLUE, "grads": ORANGE, "optim": GREEN}


def rank_memory() -> Canvas:
    c = Canvas("rank_memory", 204, "One rank's memory: 16 bytes of model states a parameter, then the residual states",
               "Two bars of the model states one data-parallel rank keeps per parameter, with AdamW. In fp32: "
               "parameters 4 bytes, gradients 4, and AdamW's exp_avg and exp_avg_sq, 4 each: 16 bytes. With mixed "
               "precision as in the ZeRO paper: bf16 parameters 2 bytes and gradients 2, then 12 bytes of fp32 "
               "optimizer state (a master copy of the weights, exp_avg and exp_avg_sq): 16 bytes again. Under "
               "them, a grey box: the residual states, activations, temporaries and buffers, with an arrow: they grow "
               "with the batch, the sequence, the width and the depth, not with the parameters.")
    x0, per = 10, 40  # 40 units per byte: 16 bytes are 640 units
    rows = [("model states, fp32 AdamW", "fp32"),
            ("model states, mixed precision as in the ZeRO paper (bf16, K = 12)", "mixed")]
    y = 20
    for title, key in rows:
        c.text(x0, y, title, size=MIN_FONT, bold=True)
        x = x0
        for label, nbytes, state in MODEL_STATES[key]:
            c.box(x, y + 8, nbytes * per, 26, label, STATE_FILL[state], size=MIN_FONT)
            x += nbytes * per
        y += 62
    c.text(x0 + 16 * per, 20, "16 bytes a parameter, either way", size=MIN_FONT, anchor="end")
    c.text(x0, y, "residual states: not per parameter", size=MIN_FONT, bold=True)
    w = 420
    c.box(x0, y + 8, w, 44, ["activations, saved in forward for backward;", "temporaries; buffers"], GRAY,
          size=MIN_FONT)
    c.line(x0 + w + 8, y + 30, x0 + w + 48, y + 30, arrow=True)
    c.text(x0 + w + 56, y + 26, "grow with batch ×", size=MIN_FONT)
    c.text(x0 + w + 56, y + 44, "sequence × width × depth", size=MIN_FONT)
    return c


# A DDP step of a 3-layer model, drawn to scale in made-up units (a schematic: the sizes say which is bigger,
# as the tour GPT's measured peak does in the page's chart, not how big): (row, label, fill, born, freed, size).
# The running total under them is the sum of the bars alive at each moment, as the meter keeps it.
STEP_LANE = (150, 666)
STEP_PHASES = [("forward", 150, 330), ("backward", 330, 560), ("step", 560, 666)]
STEP_STORAGES = [
    ("parameters", "", BLUE, 150, 666, 3),
    ("optimizer state", "", GREEN, 150, 666, 6),
    ("activations", "layer 1", GRAY, 170, 530, 3), ("activations", "layer 2", GRAY, 215, 470, 3),
    ("activations", "layer 3", GRAY, 260, 410, 3),
    ("logits, their gradient", "", GRAY, 300, 355, 2),
    ("gradients", "layer 3", ORANGE, 400, 666, 1), ("gradients", "layer 2", ORANGE, 460, 666, 1),
    ("gradients", "layer 1", ORANGE, 520, 666, 1),
]


def step_memory() -> Canvas:
    c = Canvas("step_memory", 350, "What the meter sees in one DDP step: storages born and freed, and their running "
               "total", "A schematic of one training step of a three-layer model, forward, backward and the "
               "optimizer step, time running to the right. Parameters and optimizer state live through the whole "
               "step. Each layer's activations are created in forward and freed in backward, last layer first. "
               "The logits and their gradient live from the end of forward into the start of backward. Each "
               "layer's gradient is created in backward and lives on through the step. Under the bars, the "
               "running total of the bytes alive, which the meter keeps by adding a storage when an operation "
               "creates it and subtracting it when it is freed: it peaks at the start of backward, before any "
               "gradient exists.")
    lane0, lane1 = STEP_LANE
    for name, a, b in STEP_PHASES:
        c.text((a + b) / 2, 16, name, size=MIN_FONT, anchor="middle", bold=True)
    y = 28
    bottom = y + 21 * len(STEP_STORAGES) + 124  # the running total's axis
    for _, a, b in STEP_PHASES[1:]:
        c.line(a, 24, a, bottom, dash=True, width=1.0)
    rows = {}
    for row, sub, fill, born, freed, size in STEP_STORAGES:
        key = (row, sub)
        if row not in [r for r, _ in rows]:
            c.text(lane0 - 8, y + 13, row, size=MIN_FONT, anchor="end")
        rows[key] = y
        c.box(born, y, freed - born, 17, sub if freed - born > text_width(sub, MIN_FONT) + 6 else "", fill,
              size=MIN_FONT)
        y += 21
    # the running total, as the meter keeps it: + a storage's bytes when it is born, - when it is freed
    base, unit = bottom, 4.0
    times = sorted({t for *_, born, freed, _ in STEP_STORAGES for t in (born, freed)})
    alive = lambda t: sum(size for *_, born, freed, size in STEP_STORAGES if born <= t < freed)
    points, d = [], f"M{num(lane0)},{num(base)}"
    for t in times[:-1]:
        h = base - unit * alive(t)
        d += f" V{num(h)} H{num(next(u for u in times if u > t))}"
        points.append((t, h))
    c.path(d, [(lane0, base)] + points, colour=MUTED, width=2.0)
    c.line(lane0, base, lane1, base, width=1.0)
    c.text(lane0 - 8, base - 30, "bytes alive", size=MIN_FONT, anchor="end")
    c.text(lane0 - 8, base - 12, "(the meter)", size=MIN_FONT, anchor="end")
    peak_t = max(times[:-1], key=alive)
    c.text(STEP_PHASES[1][1] - 6, base - unit * alive(peak_t) - 10, "peak: before any gradient exists",
           size=MIN_FONT, anchor="end")
    return c


def memory_terms() -> Canvas:
    """What the memory calculator of chapter 13 adds up for one rank (analytic.estimate), term by term."""
    c = Canvas("memory_terms", 110, "What one rank needs for a training step: model states, FSDP's unsharded units, "
               "activations", "Three groups of boxes joined by plus signs. First the model states: parameters, "
               "gradients and optimizer state, 4 + 4 + 8 bytes a parameter in fp32 or 2 + 2 + 12 in bf16 mixed "
               "precision, each divided by N from the ZeRO stage that shards it. Plus, under ZeRO-3 only, FSDP's "
               "unsharded units: one block's parameters, two with prefetch. Plus the activations: per block "
               "s times b times h times (34 + 5 a s / h) bytes in 16 bits, times the L blocks, and the fp32 logits, "
               "4 s b V: an estimate.")
    y, h = 8, 30
    x = 10
    for label, w, fill in (("params", 56, BLUE), ("grads", 56, ORANGE), ("optim", 112, GREEN)):
        c.box(x, y, w, h, label, fill, size=MIN_FONT)
        x += w
    under = [(10, ["bytes a parameter: 4 + 4 + 8", "(fp32) or 2 + 2 + 12 (bf16),", "÷ N from the stage sharding it"]),
             (270, ["ZeRO-3 only: one", "block unsharded,", "two with prefetch"]),
             (456, ["per block s·b·h·(34 + 5as/h)", "in 16 bits, × L blocks; + the", "fp32 logits 4·s·b·V: an estimate"])]
    c.text(247, y + 21, "+", size=18, anchor="middle", bold=True)
    c.box(270, y, 76, h, "block", BLUE, size=MIN_FONT, dash=True)
    c.box(346, y, 76, h, "next one", BLUE, size=MIN_FONT, dash=True)
    c.text(439, y + 21, "+", size=18, anchor="middle", bold=True)
    c.box(456, y, 214, h, "activations", GRAY, size=MIN_FONT)
    for left, lines in under:
        for k, line in enumerate(lines):
            c.text(left, y + h + 22 + 18 * k, line, size=MIN_FONT)
    return c


DIAGRAMS = (rank_memory, step_memory, memory_terms)
