"""The home page's picture, the road through the chapters (chapters/index.md), and the set-up page's, how
launch starts the ranks (chapters/setup.md).

Drawn by make_diagrams.py, which finds this module; `from canvas import *` gives the canvas and the colours.
"""

from __future__ import annotations

from canvas import *  # noqa: F403  Canvas, the colours, swatch, MIN_FONT, text_width, num

# The stops of the road: (name, chapters, fill, the ZeRO stage whose model states it keeps, or the two lines
# said under it). A stop's colour is the model state it shards: ZeRO-1 the optimizer state (green), ZeRO-2
# the gradients (orange), ZeRO-3 the parameters (blue); the stops that shard nothing are grey.
ROAD = [("DDP", "ch 1–2", GRAY, 0), ("ZeRO-1", "ch 3", GREEN, 1), ("ZeRO-2", "ch 4", ORANGE, 2),
        ("FSDP", "ch 5–10", BLUE, 3), ("FSDP2", "ch 11", BLUE, 3),
        ("TP / PP", "ch 12", GRAY, ("layers split", "over ranks")), ("scaling", "ch 13", GRAY, ("1,024 ranks", "on paper"))]
# Bytes per parameter of each model state on one rank of N = 4, fp32 AdamW, at ZeRO stages 0 to 3:
# (parameters, gradients, optimizer state). tests/test_diagrams_ch00.py checks them against
# minifsdp.measure.analytic.model_state_bytes.
ROAD_N = 4
ROAD_STATES = {0: (4, 4, 8), 1: (4, 4, 2), 2: (4, 1, 2), 3: (1, 1, 2)}


def road() -> Canvas:
    c = Canvas("road", 150, "The road through the chapters: DDP, ZeRO-1, ZeRO-2, FSDP, FSDP2, TP and PP, scaling",
               "Seven stops in a row, each an arrow pointing to the next: DDP (chapters 1 and 2), ZeRO-1 (chapter 3), "
               "ZeRO-2 (chapter 4), FSDP (chapters 5 to 10), FSDP2 (chapter 11), tensor and pipeline parallelism "
               "(chapter 12) and scaling (chapter 13). Under each data-parallel stop, a bar of the model states one "
               "rank keeps at N = 4 with fp32 AdamW: 16 Psi bytes under DDP, 10 Psi under ZeRO-1, 7 Psi under "
               "ZeRO-2, 4 Psi under FSDP and FSDP2. Tensor and pipeline parallelism split the layers over the "
               "ranks; the last chapter runs the wrappers as rank 0 of up to 1,024 ranks, on paper.")
    w, tip, gap, top, h = 84, 10, 3, 8, 46
    per = w / 16  # units per byte of every parameter: DDP's 16 fill the stop's width
    for i, (name, chapters, fill, below) in enumerate(ROAD):
        x = 4 + i * (w + tip + gap)
        c.rect(x, top, w, h, fill=fill, stroke="none", rx=0)
        outline = f"M{num(x)},{top} h{w} l{tip},{num(h / 2)} l-{tip},{num(h / 2)} h-{w} z"
        c.path(outline, [(x, top), (x + w + tip, top + h / 2), (x, top + h)], fill=fill, width=1.0)
        c.box(x, top, w, h, [(name, {"bold": True, "size": 15}), chapters], "none", size=MIN_FONT, stroke="none")
        if isinstance(below, int):
            left = x
            for (n, fill_state) in zip(ROAD_STATES[below], (BLUE, ORANGE, GREEN)):
                c.rect(left, 70, n * per, 14, fill=fill_state, rx=0)
                left += n * per
            c.text(x, 102, f"{sum(ROAD_STATES[below])}Ψ a rank", size=MIN_FONT)
        else:
            for k, line in enumerate(below):
                c.text(x, 82 + 18 * k, line, size=MIN_FONT)
    y = 136
    x = swatch(c, 4, y, BLUE, "parameters") + 16
    x = swatch(c, x, y, ORANGE, "gradients") + 16
    x = swatch(c, x, y, GREEN, "optimizer state") + 16
    c.text(x, y, f"kept by one rank of N = {ROAD_N}, fp32 AdamW", size=MIN_FONT)
    return c


def launch_ranks() -> Canvas:
    n = 4
    c = Canvas("launch_ranks", 232, "launch(work, world_size=4): four ranks, one process group, the results in rank order",
               "On the left, your process calls launch(work, world_size=4). Arrows lead to four ranks, rank 0 to "
               "rank 3, each a process of its own that joins one process group (gloo on CPUs, NCCL with one GPU "
               "per rank) and runs work(). Arrows lead from each rank to the right, where launch returns what each "
               "rank returned, as a list in rank order. Under torchrun the four processes already exist, and "
               "launch joins the group and runs work in place on each.")
    top, h, step = 26, 30, 40
    group_x, group_w = 226, 220
    c.rect(group_x - 12, top - 18, group_w + 24, n * step + 26, dash=True)
    c.text(group_x + group_w / 2, top - 4, "one process group: gloo, or NCCL", size=MIN_FONT, anchor="middle")
    mid = top + 8 + (n * step - 10) / 2
    c.box(10, mid - 28, 170, 56, [("launch(work, 4)", {"mono": True}), "in your process"], GRAY, size=MIN_FONT)
    c.box(490, mid - 28, 180, 56, [("[r0, r1, r2, r3]", {"mono": True}), "returned in rank order"], GRAY,
          size=MIN_FONT)
    for r in range(n):
        y = top + 8 + r * step
        c.box(group_x, y, group_w, h, f"rank {r}: a process, runs work()", RANKS[r], size=MIN_FONT)
        c.path(f"M180,{num(mid)} C200,{num(mid)} 200,{num(y + h / 2)} {group_x - 2},{num(y + h / 2)}",
               [(180, mid), (group_x - 2, y + h / 2)], arrow=True, width=1.2)
        c.path(f"M{group_x + group_w},{num(y + h / 2)} C470,{num(y + h / 2)} 470,{num(mid)} 488,{num(mid)}",
               [(group_x + group_w, y + h / 2), (488, mid)], arrow=True, width=1.2)
    c.text(10, 222, "Under torchrun the ranks already exist: launch joins the group and runs work in place on each.",
           size=MIN_FONT)
    return c


DIAGRAMS = (road, launch_ranks)
