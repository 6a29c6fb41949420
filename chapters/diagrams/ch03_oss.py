"""Chapter 3's diagrams: what each rank holds under OSS and how its step makes the replicas current; when
sharding the optimizer state pays off; and the flat design's step.

What they show of the code is written here as data (the model-state bytes of each optimizer under DDP and
OSS, from the analytic model; the flat layout of the example), and tests/test_diagrams_ch03.py checks it
against the package.
"""

from __future__ import annotations

from canvas import *  # noqa: F403  the canvas and the colours

# -- what each rank holds, and the step -------------------------------------------------------------------------------
STEP_N = 4


def oss_step() -> Canvas:
    n = STEP_N
    c = Canvas("oss_step", 330, "ZeRO-1 (OSS) at N = 4: what each rank keeps, and how its step makes every replica "
               "current",
               "Four ranks. Each keeps all the parameters (4 bytes a parameter) and, after DDP's all-reduce, all the "
               "averaged gradients (4 bytes), but only a quarter of AdamW's optimizer state (8 bytes a parameter): "
               "the state of the parameters it owns. In step(), each rank's local optimizer updates only its own "
               "quarter of the parameters, so the other three quarters are stale on that rank. Then each owner in "
               "turn broadcasts its quarter, and every rank holds every updated parameter. Per rank and step: DDP's "
               "all-reduce, 2 Psi (N - 1)/N, plus the broadcasts, Psi (N - 1)/N.")
    per, top, pitch = 10, 72, 28            # 10 units a byte of every parameter: 16 bytes is 160
    x_state, q = 66, 22                     # the model states; a quarter of a column
    cols = [(252, "after backward:", "every gradient"), (402, "after optim.step():", "its share is new"),
            (552, "after the broadcasts:", "all current")]
    c.text(x_state + 80, 20, "what rank r keeps", anchor="middle", bold=True)
    c.text(x_state + 80, 40, "fp32 AdamW, bytes a parameter", anchor="middle", size=MIN_FONT)
    for x, head, sub in cols:
        c.text(x + 2 * q, 20, head, anchor="middle", bold=True)
        c.text(x + 2 * q, 40, sub, anchor="middle", size=MIN_FONT)
    for r in range(n):
        y = top + r * pitch
        c.text(x_state - 8, y + 15, f"rank {r}", anchor="end", size=MIN_FONT)
        c.rect(x_state, y, 4 * per, 20, fill=BLUE)
        c.rect(x_state + 4 * per, y, 4 * per, 20, fill=ORANGE)
        c.rect(x_state + 8 * per, y, 8 * per, 20, dash=True)
        c.rect(x_state + (8 + 2 * r) * per, y, 2 * per, 20, fill=GREEN)
        for i, (x, _, _) in enumerate(cols):
            for k in range(n):
                fill = ORANGE if i == 0 else BLUE if (i == 2 or k == r) else GRAY
                c.rect(x + k * q, y, q - 2, 20, fill=fill)
    mid = top + 2 * pitch - 4
    c.line(cols[0][0] + n * q + 6, mid, cols[1][0] - 8, mid, arrow=True)
    c.line(cols[1][0] + n * q + 6, mid, cols[2][0] - 8, mid, arrow=True)
    c.text((cols[0][0] + n * q + cols[1][0]) / 2, mid - 8, "step", anchor="middle", size=MIN_FONT)
    c.text((cols[1][0] + n * q + cols[2][0]) / 2 - 2, mid - 8, "send", anchor="middle", size=MIN_FONT)
    for v, label in ((0, "0"), (4, "4"), (8, "8"), (16, "16")):
        c.text(x_state + v * per, top + n * pitch + 12, label, anchor="middle", size=MIN_FONT)
    y = top + n * pitch + 40
    x = swatch(c, 10, y, BLUE, "parameters (current)") + 16
    x = swatch(c, x, y, ORANGE, "gradients") + 16
    x = swatch(c, x, y, GREEN, "optimizer state") + 16
    swatch(c, x, y, GRAY, "stale parameters")
    y += 22
    swatch(c, 10, y, "none", "optimizer state the other ranks keep: each rank keeps 1/N of it", dash=True)
    y += 30
    for s in ("Each rank steps only the parameters it owns, with the state only it keeps; then each",
              "owner broadcasts them. Per rank and step: DDP's all_reduce, 2Ψ(N − 1)/N, plus the",
              "broadcasts, Ψ(N − 1)/N."):
        c.text(10, y, s, size=MIN_FONT)
        y += 18
    return c


# -- when it pays off -------------------------------------------------------------------------------------------------
# Model-state bytes a parameter, per rank at N = 4, fp32, under DDP (ZeRO stage 0) and OSS (stage 1), for three
# optimizers: (optimizer, its state in bytes a parameter, DDP's total, OSS's total). tests/test_diagrams_ch03.py
# checks them against minifsdp.measure.analytic.model_state_bytes, and each optimizer's state against torch's.
PAYS_N = 4
PAYS_ROWS = [("SGD(lr)", 0, 8, 8.0), ("SGD(lr, momentum=0.9)", 4, 12, 9.0), ("AdamW(lr)", 8, 16, 10.0)]


def oss_when_it_pays() -> Canvas:
    c = Canvas("oss_when_it_pays", 318, "OSS pays off only with an optimizer that keeps state",
               "Model-state bytes a parameter on each of 4 ranks, fp32, under DDP and under OSS, for three "
               "optimizers. Plain SGD keeps no state: 8 bytes under both, so OSS saves nothing. SGD with momentum "
               "keeps 4 bytes: 12 under DDP, 9 under OSS. AdamW keeps 8: 16 under DDP, 10 under OSS. Under every "
               "optimizer OSS on DDP sends 1.5 times DDP's bytes: the owners' broadcasts after the step.")
    x0, per = 176, 20
    y = 20
    c.text(10, y, f"model-state bytes a parameter, per rank, N = {PAYS_N}", bold=True)
    y += 14
    for name, state, ddp, oss in PAYS_ROWS:
        y += 16
        c.text(10, y, name, mono=True, size=MIN_FONT)
        y += 4
        for label, total, sharded in (("DDP", ddp, False), ("OSS", oss, True)):
            y += 4
            c.text(x0 - 8, y + 14, label, anchor="end", size=MIN_FONT)
            c.rect(x0, y, 4 * per, 18, fill=BLUE)
            c.rect(x0 + 4 * per, y, 4 * per, 18, fill=ORANGE)
            if state:
                if sharded:
                    c.rect(x0 + 8 * per, y, state * per, 18, dash=True)
                    c.rect(x0 + 8 * per, y, state / PAYS_N * per, 18, fill=GREEN)
                else:
                    c.rect(x0 + 8 * per, y, state * per, 18, fill=GREEN)
            c.text(x0 + 16 * per + 12, y + 14, f"{num(total)} bytes", size=MIN_FONT)
            y += 18
        saved = ddp - oss
        c.text(WIDTH - 10, y - 10, f"saves {num(saved)} bytes" if saved else "saves nothing", anchor="end",
               size=MIN_FONT, bold=True)
        y += 6
    y += 20
    x = swatch(c, 10, y, BLUE, "parameters 4") + 16
    x = swatch(c, x, y, ORANGE, "gradients 4") + 16
    x = swatch(c, x, y, GREEN, "optimizer state, this rank's") + 16
    swatch(c, x, y, "none", "the others'", dash=True)
    y += 28
    c.text(10, y, "Under every optimizer, OSS on DDP sends 1.5 times DDP's bytes: the broadcasts.", size=MIN_FONT)
    return c


# -- the flat design ----------------------------------------------------------------------------------------------------
# Three parameters of 5, 2 and 4 elements, laid end to end at N = 4 (no alignment, for the picture): their
# offsets and the padded size, as minifsdp.zero.flat.flat_layout gives them (tests/test_diagrams_ch03.py).
FLAT_N = 4
FLAT_PARAMS = [("a", 5), ("b", 2), ("c", 4)]
FLAT_OFFSETS, FLAT_PADDED = [0, 5, 7], 12


def flat_oss_step() -> Canvas:
    n, chunk = FLAT_N, FLAT_PADDED // FLAT_N
    c = Canvas("flat_oss_step", 372, "The flat ZeRO-1 (FlatOSS): reduce-scatter, step one slice, all-gather",
               "Three parameters, a of 5 elements, b of 2 and c of 4, laid end to end in one flat buffer and padded "
               "to 12, cut into four slices of 3: slices cut through tensors. In step(), every rank's flat "
               "gradient is reduce-scattered, so rank r receives the summed gradient of slice r only; its local "
               "optimizer, which keeps state for that slice only, steps it; and an all-gather puts the four updated "
               "slices back into every rank's buffer. The parameters are views of the buffer, so they are current "
               "as soon as it lands. This is the all-reduce of chapter 1 cut in two, with the step in the middle.")
    x0, cell = 150, 32
    owner_of = [i // chunk for i in range(FLAT_PADDED)]
    name_of = {}
    for (name, numel), off in zip(FLAT_PARAMS, FLAT_OFFSETS):
        for i in range(off, off + numel):
            name_of[i] = name

    def strip(y, fill_of, label):
        c.text(x0 - 10, y + 18, label, anchor="end", size=MIN_FONT)
        for i in range(FLAT_PADDED):
            fill = fill_of(i)
            c.box(x0 + i * cell, y, cell - 2, 26, name_of.get(i, "pad") if fill != "none" else "", fill,
                  size=MIN_FONT, dash=fill == "none")

    y = 22
    c.text(x0, y - 6, "one bucket: a, b, c end to end, padded to a multiple of N = 4", size=MIN_FONT)
    strip(y + 4, lambda i: ORANGE, "flat gradient")
    for r in range(n):  # the slices
        x = x0 + r * chunk * cell
        c.text(x + chunk * cell / 2 - 1, y + 50, f"slice {r}", anchor="middle", size=MIN_FONT)
    y += 72
    c.text(x0 - 10, y + 4, "reduce_scatter", anchor="end", size=MIN_FONT, mono=True)
    c.line(x0 - 4, y - 10, x0 - 4, y + 20, colour=MUTED, arrow=True)
    y += 26
    for r in range(n):
        top = y + r * 30
        c.text(x0 - 10, top + 18, f"rank {r}", anchor="end", size=MIN_FONT)
        for i in range(FLAT_PADDED):
            if owner_of[i] == r:
                c.box(x0 + i * cell, top, cell - 2, 26, name_of.get(i, "pad"), ORANGE, size=MIN_FONT)
        c.text(x0 + FLAT_PADDED * cell + 8, top + 18, f"→ step slice {r}", size=MIN_FONT)
    y += n * 30 + 12
    c.text(x0 - 10, y + 12, "all_gather", anchor="end", size=MIN_FONT, mono=True)
    c.line(x0 - 4, y - 4, x0 - 4, y + 24, colour=MUTED, arrow=True)
    y += 26
    strip(y, lambda i: BLUE, "every rank")
    y += 46
    x = swatch(c, 10, y, ORANGE, "gradient: summed slice") + 16
    x = swatch(c, x, y, BLUE, "parameters, updated") + 16
    c.text(x, y, "pad: zeros", size=MIN_FONT)
    y += 26
    c.text(10, y, "Rank r's optimizer keeps state for slice r only. The parameters are views into the buffer:",
           size=MIN_FONT)
    c.text(10, y + 18, "current as soon as the all_gather lands.", size=MIN_FONT)
    return c


DIAGRAMS = (oss_step, oss_when_it_pays, flat_oss_step)
