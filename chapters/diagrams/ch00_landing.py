"""The home page's picture: the road through the chapters (chapters/index.md).

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
# (parameters, gradients, optimizer state). tests/test_ch00_landing.py checks them against
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


DIAGRAMS = (road,)
