"""The chapters' conceptual diagrams, drawn as SVG by plain Python (no plotting library, no network).

    python chapters/diagrams/make_diagrams.py          # every diagram, into chapters/figures/diagrams/
    python chapters/diagrams/make_diagrams.py chapters/figures/diagrams/ring_allreduce.svg ...   # only these

`make diagrams` (which `make figures` runs first) names every file. Each diagram is one function, named
after its file: below, or in a module of its own beside this script (chNN_*.py, a chapter's newer
pictures) that draws on the same canvas (canvas.py: sizes, colours, measured text, the SVG). The SVG files are committed; tests/test_diagrams.py draws them again into a temporary
folder and checks that nothing changed, and that each file is well-formed and accessible.

Where a diagram shows what the code computes (OSS's partition, the boxes of a flat shard, the 1F1B order,
the FlatParameter's layout), the numbers are written here as data, and the tests check them against the
package's own functions. The script imports nothing from the package, so it runs anywhere Python does.

Size. Every diagram is 680 units wide, for the content column of the docs site (about 690 px on a desktop).
The file's width and height equal its viewBox, so on a desktop it shows at 1:1 and MIN_FONT units of text
are MIN_FONT px, just over 10 pt (13.33 px); on a phone the site lets a diagram keep that size and pan
(hooks/narrow.py). No text is smaller than MIN_FONT units. `Canvas` refuses text that would stick out of the picture or out of its box, measuring it
with the advance widths of DejaVu Sans (and 0.61 em per character for monospace), wider than the other
fonts a reader's system is likely to use (Helvetica, Arial, Segoe UI, Roboto), so the real text is no wider.

Dark mode. The pages show the diagrams with `<img>`, and an image does not inherit the page's colours:
`currentColor` would stay black on material's dark scheme (`slate`), and a `prefers-color-scheme` media
query inside the SVG follows the operating system, not material's palette toggle (which sets a
`data-md-color-scheme` attribute on the page). So the diagrams use colours that read on both backgrounds,
white and slate (#1e2129), and no media query:

- text and lines on the page's background are one mid grey, MUTED, about 4:1 against both backgrounds;
- boxes are filled with mid-tone colours that stand out from both backgrounds, and the text inside them is
  near-black, INK, at least 7:1 against every fill, and appears nowhere else.

tests/test_diagrams.py checks those contrasts. The colours mean what they mean in the figures that
`make figures` plots: all_gather blue, reduce_scatter orange, all_reduce purple; parameters blue, gradients
orange, optimizer state green; a forward blue and a backward orange; ranks 0, 1, 2, 3 blue, orange, green,
purple.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "figures" / "diagrams"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # run with -I (as the tests do), the script's folder is not on the path

from canvas import *  # noqa: E402,F403  the canvas and the colours, shared with the chapters' modules


# -- chapter 1 ----------------------------------------------------------------------------------------------------
def ring_allreduce() -> Canvas:
    """All-reduce on a ring of 4 ranks: reduce-scatter in N - 1 steps, then all-gather in N - 1 more."""
    n = 4
    c = Canvas("ring_allreduce", 392, "Ring all-reduce on 4 ranks: a reduce-scatter, then an all-gather",
               "Four ranks in a ring, each sending only to its right-hand neighbour, rank 3 to rank 0. Each rank's "
               "tensor is cut into 4 chunks. A table shows, after each step, how many ranks' chunks are summed in "
               "each chunk of each rank. In the 3 reduce-scatter steps every rank sends one chunk to its "
               "neighbour, which adds it to its own, until rank r holds chunk r summed over all 4 ranks. In the 3 "
               "all-gather steps the finished chunks travel on round the ring until every rank has all of them: "
               "2(N - 1) = 6 steps, each sending S/N bytes per rank.")
    left, col_w, cell, gap = 76, 116, 22, 4
    centre = [left + col_w * (r + 0.5) for r in range(n)]
    cell_x = [[centre[r] - (n * cell + (n - 1) * gap) / 2 + k * (cell + gap) for k in range(n)] for r in range(n)]
    # the ring: rank r sends to rank r + 1, and rank 3 to rank 0
    for r in range(n):
        c.text(centre[r], 34, f"rank {r}", anchor="middle", bold=True)
    for r in range(n - 1):
        c.line(centre[r] + 30, 29, centre[r + 1] - 32, 29, arrow=True)
    c.path(f"M{num(centre[3] + 30)},29 h16 V10 H{num(centre[0] - 46)} V29 h12",
           points=[(centre[3] + 46, 10), (centre[0] - 46, 29)], arrow=True)
    c.text(left - 10, 56, "chunk", anchor="end", size=MIN_FONT)
    for r in range(n):
        for k in range(n):
            c.text(cell_x[r][k] + cell / 2, 56, str(k), anchor="middle", size=MIN_FONT)

    # who has been summed into each chunk of each rank, step by step
    have = [[{r} for _ in range(n)] for r in range(n)]
    rows = [("start", have, set())]
    for step in range(n - 1):  # reduce-scatter: rank r sends chunk (r - step - 1) mod n, the receiver adds it
        new = [[set(s) for s in row] for row in have]
        got = set()
        for r in range(n):
            k, dst = (r - step - 1) % n, (r + 1) % n
            new[dst][k] |= have[r][k]
            got.add((dst, k))
        have = new
        rows.append((f"step {step + 1}", have, got))
    for step in range(n - 1):  # all-gather: rank r passes on the finished chunk (r - step) mod n
        new = [[set(s) for s in row] for row in have]
        got = set()
        for r in range(n):
            k, dst = (r - step) % n, (r + 1) % n
            new[dst][k] = set(have[r][k])
            got.add((dst, k))
        have = new
        rows.append((f"step {n + step}", have, got))
    assert all(have[r][k] == set(range(n)) for r in range(n) for k in range(n))

    top, pitch = 66, 32
    for i, (label, state, got) in enumerate(rows):
        y = top + i * pitch
        c.text(left - 10, y + 16, label, anchor="end", size=MIN_FONT)
        for r in range(n):
            for k in range(n):
                count = len(state[r][k])
                fill = GRAY if count == 1 else PURPLE if count == n else ORANGE
                if (r, k) in got:  # a ring around what arrived in this step
                    c.rect(cell_x[r][k] - 3, y - 3, cell + 6, cell + 6, width=2, rx=4)
                c.box(cell_x[r][k], y, cell, cell, str(count), fill, size=MIN_FONT, bold=count == n)
    x_br = left + n * col_w + 6
    bracket(c, x_br, top - 2, top + 3 * pitch + cell + 2, ["reduce_scatter:", "N − 1 = 3 steps"])
    bracket(c, x_br, top + 4 * pitch - 2, top + 6 * pitch + cell + 2, ["all_gather:", "N − 1 = 3 steps"])

    y = top + 7 * pitch + 14
    x = swatch(c, 10, y, GRAY, "1: its own chunk only") + 18
    x = swatch(c, x, y, ORANGE, "2, 3: a partial sum of that many ranks") + 18
    y += 22
    x = swatch(c, 10, y, PURPLE, "4: the sum over all 4 ranks") + 18
    c.rect(x - 3, y - 14, 22, 20, width=2, rx=4)
    c.rect(x, y - 11, 16, 14, fill=GRAY)
    c.text(x + 22, y, "arrived in this step, from the left-hand neighbour", size=MIN_FONT)
    c.text(10, y + 28, "Each step, every rank sends one chunk, S/N bytes, to its right-hand neighbour.", size=MIN_FONT)
    c.text(10, y + 46, "2(N − 1) = 6 steps cost 2·S·(N − 1)/N bytes per rank: one all_reduce.", size=MIN_FONT)
    return c


def ddp_buckets() -> Canvas:
    """DDP's backward: gradients land last layer first, fill buckets, and each full bucket is all-reduced at once."""
    c = Canvas("ddp_buckets", 306, "DDP: buckets all-reduced during backward",
               "A timeline of one backward pass. The backward of layer 4, then 3, 2 and 1 runs on the compute lane. "
               "As each parameter's gradient is accumulated, its hook (_on_grad_ready) fires. The gradients fill "
               "three buckets, packed in reverse order: bucket 0 holds layers 4 and 3, bucket 1 layer 2, bucket 2 "
               "layer 1. When a bucket's last gradient arrives, _launch flattens it, multiplies it by 1/N and starts "
               "an asynchronous all_reduce, which travels while backward computes the earlier layers. At the end, "
               "_finish waits for the last bucket and copies the averages into each .grad before backward() "
               "returns.")
    x0, unit = 128, 22.5

    def x(t):
        return x0 + t * unit

    c.text(x0, 18, "one backward pass, time →  (gradients arrive last layer first)", size=MIN_FONT)
    lanes = {"backward": 28, "_on_grad_ready": 70, "buckets": 96, "all_reduce": 150}
    for name, y in lanes.items():
        c.text(x0 - 10, y + 17, name, anchor="end", size=MIN_FONT, mono=name.startswith("_") or name == "all_reduce")
    for i, layer in enumerate((4, 3, 2, 1)):
        c.box(x(5 * i), lanes["backward"], 5 * unit, 26, f"layer {layer}", ORANGE, size=MIN_FONT)
        for t in (5 * i + 3.2, 5 * i + 4.6):  # the layer's weight, then its bias: each hook fires
            c.line(x(t), lanes["_on_grad_ready"] + 4, x(t), lanes["_on_grad_ready"] + 22, colour=MUTED, width=2)
    c.box(x(20), lanes["backward"], 4 * unit, 26, "_finish", GRAY, size=MIN_FONT, mono=True)
    # each bucket: its label, the time span of the layers whose gradients fill it, and its all_reduce's
    # duration (the last bucket is the smallest); full at the end of its span, it is launched at once
    buckets = [("bucket 0: layers 4, 3", 0, 10, 5), ("bucket 1", 10, 15, 4), ("bucket 2", 15, 20, 3)]
    for i, (label, a, b, duration) in enumerate(buckets):
        c.box(x(a) + 1, lanes["buckets"], (b - a) * unit - 2, 24, label, GRAY, size=MIN_FONT, dash=True)
        c.line(x(b), lanes["buckets"] + 24, x(b), lanes["all_reduce"] - 1, arrow=True)
        c.box(x(b) + 1, lanes["all_reduce"], duration * unit - 2, 26, f"bucket {i}", PURPLE, size=MIN_FONT)
    c.text(x(10) + 6, lanes["all_reduce"] - 11, "_launch", size=MIN_FONT, mono=True)
    y = 204
    for s in ("_launch, once a bucket's last gradient is ready: flatten it, × 1/N, start an",
              "async all_reduce, strictly in bucket order. It travels while backward computes.",
              "_finish, queued on the autograd engine: wait for every bucket, copy the averages",
              "into each .grad. Then backward() returns."):
        c.text(10, y, s, size=MIN_FONT)
        y += 20
    c.text(10, y + 6, "Buckets are packed in reverse registration order, then rebuilt in arrival order.", size=MIN_FONT)
    return c


# -- chapters 2 to 5 ----------------------------------------------------------------------------------------------
def zero_stages() -> Canvas:
    """The model states each of 4 ranks keeps at ZeRO stages 0 to 3, fp32 AdamW: 4 + 4 + 8 bytes a parameter."""
    n = 4
    c = Canvas("zero_stages", 444, "ZeRO stages 0 to 3: the model states each of 4 ranks keeps",
               "Four groups of four bars, one bar per rank, for DDP, ZeRO-1, ZeRO-2 and ZeRO-3 at N = 4, with fp32 "
               "AdamW. Each bar is parameters (4 bytes per parameter), gradients (4) and optimizer state (8). A "
               "sharded state is drawn as a dashed outline of its full size with only this rank's quarter filled. "
               "Per rank: 16 Psi bytes under DDP, 10 Psi under ZeRO-1 (optimizer state sharded), 7 Psi under "
               "ZeRO-2 (gradients too), 4 Psi under ZeRO-3 (parameters too).")
    x0, per = 80, 27.5  # 27.5 units per byte of every parameter: 16 Psi is 440 units
    stages = [("0 · DDP", "nothing sharded", (False, False, False), "16Ψ"),
              ("1 · ZeRO-1 (OSS)", "optimizer state sharded", (False, False, True), "8Ψ + 8Ψ/N = 10Ψ"),
              ("2 · ZeRO-2 (SDP)", "+ gradients", (False, True, True), "4Ψ + 12Ψ/N = 7Ψ"),
              ("3 · ZeRO-3 (FSDP)", "+ parameters", (True, True, True), "16Ψ/N = 4Ψ")]
    states = [(0, 4, BLUE), (4, 8, ORANGE), (8, 16, GREEN)]
    y = 20
    for name, what, sharded, total in stages:
        w = c.text(10, y, name, bold=True)
        c.text(20 + w, y, what, size=MIN_FONT)
        c.text(WIDTH - 10, y, f"{total} bytes per rank", anchor="end", size=MIN_FONT)
        for r in range(n):
            top = y + 10 + r * 17
            c.text(x0 - 8, top + 12, f"rank {r}", anchor="end", size=MIN_FONT)
            for (a, b, fill), shard in zip(states, sharded):
                if shard:
                    part = (b - a) / n
                    c.rect(x0 + a * per, top, (b - a) * per, 14, dash=True)
                    c.rect(x0 + (a + r * part) * per, top, part * per, 14, fill=fill)
                else:
                    c.rect(x0 + a * per, top, (b - a) * per, 14, fill=fill)
        y += 10 + 4 * 17 + 16
    y -= 8
    for v in (0, 4, 8, 16):
        c.text(x0 + v * per, y, f"{v}Ψ" if v else "0", anchor="middle", size=MIN_FONT)
    y += 24
    x = swatch(c, 10, y, BLUE, "parameters, fp32: 4Ψ") + 18
    x = swatch(c, x, y, ORANGE, "gradients: 4Ψ") + 18
    swatch(c, x, y, GREEN, "AdamW exp_avg, exp_avg_sq: 8Ψ")
    y += 22
    swatch(c, 10, y, "none", "held by the other ranks: each of the N = 4 keeps 1/N of a sharded state", dash=True)
    return c


# OSS's greedy partition of TinyGPT() (the default config) over 4 ranks: the parameters largest first (a stable
# sort: equal sizes keep their registration order), each to the rank with the fewest elements so far. The ten
# matrices are drawn one by one; the 16 vectors after them (biases, LayerNorms) only as their sum per rank.
# tests/test_diagrams.py checks all of it against minifsdp.zero.oss.partition_parameters.
PARTITION_N = 4
PARTITION_MATRICES = [("blocks.0.fc.weight", 4096, 0), ("blocks.0.fc_proj.weight", 4096, 1),
                      ("blocks.1.fc.weight", 4096, 2), ("blocks.1.fc_proj.weight", 4096, 3),
                      ("wte.weight", 3072, 0), ("blocks.0.attn.qkv.weight", 3072, 1),
                      ("blocks.1.attn.qkv.weight", 3072, 2), ("wpe.weight", 1024, 3),
                      ("blocks.0.attn.proj.weight", 1024, 3), ("blocks.1.attn.proj.weight", 1024, 3)]
PARTITION_VECTORS = 16                          # how many smaller tensors follow, of 32 or 128 elements
PARTITION_TOTALS = [7360, 7360, 7328, 7328]     # elements per rank, vectors included


def oss_partition() -> Canvas:
    n = PARTITION_N
    c = Canvas("oss_partition", 404, "OSS: the greedy partition, largest parameter first, to the least-loaded rank",
               "The ten weight matrices of the tiny GPT, sorted largest first: four MLP weights of 4,096 elements, "
               "wte and two qkv weights of 3,072, wpe and two attention projections of 1,024. Each goes to the rank "
               "that owns the fewest elements so far: the MLP weights to ranks 0 to 3, the 3,072-element ones to "
               "ranks 0, 1 and 2, the three 1,024-element ones to rank 3. The 16 small vectors that follow fill the "
               "gaps, and the four ranks end with 7,360, 7,360, 7,328 and 7,328 elements. In step(), each rank "
               "steps only its own share, then each owner in turn broadcasts its updated parameters.")
    c.text(10, 18, "largest first, each to the least-loaded rank", bold=True)
    c.text(86, 42, "elements", anchor="end", size=MIN_FONT)
    c.text(96, 42, "tensor", size=MIN_FONT)
    c.text(341, 42, "rank", anchor="middle", size=MIN_FONT)
    y = 64
    for i, (name, size, rank) in enumerate(PARTITION_MATRICES):
        c.text(30, y, f"{i + 1}", anchor="end", size=MIN_FONT)
        c.text(86, y, f"{size:,}", anchor="end", size=MIN_FONT, mono=True)
        c.text(96, y, name, size=MIN_FONT, mono=True)
        c.text(312, y, "→", size=MIN_FONT)
        c.box(332, y - 13, 18, 17, str(rank), RANKS[rank], size=MIN_FONT)
        y += 21
    c.text(10, y + 2, f"then {PARTITION_VECTORS} vectors of 32 or 128 elements,", size=MIN_FONT)
    c.text(10, y + 20, "the same way: they fill the gaps", size=MIN_FONT)

    # each rank's share, stacked bottom up in the order placed
    bottom, scale, col_w, x_cols = 282, 0.031, 50, 398
    for r in range(n):
        xr = x_cols + r * (col_w + 18)
        level = bottom
        for i, (name, size, rank) in enumerate(PARTITION_MATRICES):
            if rank == r:
                h = size * scale
                c.box(xr, level - h, col_w, h, str(i + 1), RANKS[r], size=MIN_FONT)
                level -= h
        rest = PARTITION_TOTALS[r] - sum(s for _, s, rank in PARTITION_MATRICES if rank == r)
        c.rect(xr, level - rest * scale - 1, col_w, rest * scale + 1, fill=RANKS[r])
        c.text(xr + col_w / 2, bottom + 18, f"rank {r}", anchor="middle", size=MIN_FONT)
        c.text(xr + col_w / 2, bottom + 35, f"{PARTITION_TOTALS[r]:,}", anchor="middle", size=MIN_FONT, mono=True)
    c.text(x_cols - 8, bottom + 35, "elements", anchor="end", size=MIN_FONT)

    y = 346
    c.text(10, y, "step(): each rank steps only its share, then each owner broadcasts it, in rank order", size=MIN_FONT)
    w, gap = 152, 20
    for r in range(n):
        xb = 10 + r * (w + gap)
        c.box(xb, y + 14, w, 30, f"broadcast, src={r}", RANKS[r], size=MIN_FONT)
        if r < n - 1:
            c.line(xb + w + 2, y + 29, xb + w + gap - 2, y + 29, arrow=True)
    return c


# The FlatParameter of chapter 5's example, at N = 4: w (4 x 5) and b (5), each starting on a 16-element (64-byte)
# boundary, padded to a multiple of N and 16. tests/test_diagrams.py checks it against minifsdp.zero.flat.flat_layout.
FLAT_N = 4
FLAT_PARAMS = [("w", (4, 5)), ("b", (5,))]
FLAT_OFFSETS, FLAT_PADDED = [0, 32], 48


def flat_parameter() -> Canvas:
    n, shard = FLAT_N, FLAT_PADDED // FLAT_N
    c = Canvas("flat_parameter", 448, "The FlatParameter: flatten, pad, shard, and views into the all-gathered buffer",
               "A unit with a 4 by 5 weight w and a bias b of 5 elements, at N = 4. Flattened, w takes elements 0 "
               "to 19 and b, on the next 16-element boundary, elements 32 to 36; zeros fill the gaps and pad the "
               "whole to 48. Each of the 4 ranks keeps 12 contiguous elements, its shard: rank 0 the first 12 of "
               "w, rank 1 the rest of w and 4 zeros, rank 2 8 zeros and 4 of b, rank 3 the last of b and 11 zeros. "
               "unshard() all-gathers the 4 shards into the full buffer _full, and module.weight and module.bias "
               "become views into it. reshard() frees the buffer's memory and keeps the views as objects.")
    numel = {name: (shape[0] * shape[1] if len(shape) == 2 else shape[0]) for name, shape in FLAT_PARAMS}
    fill = {"w": BLUE, "b": GREEN}
    cell = 14
    # the unit as built: module.weight and module.bias
    c.text(10, 18, "a unit with w (4 × 5) and b (5), at N = 4", bold=True)
    for i in range(4):
        for j in range(5):
            c.rect(20 + j * cell, 30 + i * cell, cell, cell, fill=BLUE)
    c.text(100, 50, "module.weight", size=MIN_FONT, mono=True)
    c.text(100, 68, "w: 20 elements", size=MIN_FONT)
    for j in range(5):
        c.rect(330 + j * cell, 30, cell, cell, fill=GREEN)
    c.text(410, 42, "module.bias", size=MIN_FONT, mono=True)
    c.text(410, 60, "b: 5 elements", size=MIN_FONT)

    x0, cw = 64, 12  # the flat strips: 48 cells of 12

    def strip(y, ranks=False):
        spans = [(0, 20, "w", "w"), (20, 32, "12 zeros", None), (32, 37, "b", "b"), (37, 48, "11 zeros", None)]
        for a, b, label, name in spans:
            c.box(x0 + a * cw, y, (b - a) * cw, 24, label, fill[name] if name else GRAY, size=MIN_FONT, mono=name is not None)
        for k in range(1, 48):
            c.line(x0 + k * cw, y + 1, x0 + k * cw, y + 4, colour=INK, width=1)
        if ranks:  # where each rank's shard landed
            for r in range(n):
                a, b = x0 + r * shard * cw, x0 + (r + 1) * shard * cw
                c.path(f"M{num(a + 1)},{y - 3} v-5 H{num(b - 1)} v5", points=[(a, y - 8), (b, y - 3)], width=1)
                c.text((a + b) / 2, y - 12, f"from rank {r}", anchor="middle", size=MIN_FONT)

    c.line(40, 92, 40, 124, arrow=True)
    c.text(52, 106, "flatten: each parameter on a 64-byte boundary (16 fp32 elements),", size=MIN_FONT)
    c.text(52, 122, "then zeros up to a multiple of N and 16", size=MIN_FONT)
    for v in (0, 20, 32, 37, 48):
        c.text(x0 + v * cw, 146, str(v), anchor="middle", size=MIN_FONT)
    strip(152)
    c.text(10, 169, "flat", size=MIN_FONT)

    c.line(40, 184, 40, 212, arrow=True)
    c.text(52, 200, f"shard: rank r keeps flat[{shard}r : {shard}r + {shard}], its param (shard_numel = {shard})",
           size=MIN_FONT)
    gap = 16
    sx = (WIDTH - n * shard * cw - (n - 1) * gap) / 2
    for r in range(n):
        for k in range(shard):
            e = r * shard + k
            name = next((p for p, off in zip(numel, FLAT_OFFSETS) if off <= e < off + numel[p]), None)
            c.rect(sx + r * (shard * cw + gap) + k * cw, 218, cw, 24, fill=fill[name] if name else GRAY)
        c.text(sx + r * (shard * cw + gap) + shard * cw / 2, 260, f"rank {r}", anchor="middle", size=MIN_FONT)

    c.line(40, 272, 40, 300, arrow=True)
    c.text(52, 288, "unshard(): all_gather the 4 shards into _full; the parameters become views of it", size=MIN_FONT)
    strip(326, ranks=True)
    c.text(10, 343, "_full", size=MIN_FONT, mono=True)
    for a, b, s in ((0, 20, "module.weight = _full[0:20].view(4, 5)"), (32, 37, "module.bias = _full[32:37]")):
        xa, xb = x0 + a * cw, x0 + b * cw
        c.path(f"M{num(xa)},358 v6 H{num(xb)} v-6", points=[(xa, 358), (xb, 364)])
        c.line((xa + xb) / 2, 364, (xa + xb) / 2, 372)
        c.text((xa + xb) / 2 if a == 0 else xa - 40, 388, s, anchor="middle" if a == 0 else "start", size=MIN_FONT,
               mono=True)
    c.text(10, 418, "reshard(): _full's storage is resized to 0. The memory goes back; the views stay,", size=MIN_FONT)
    c.text(10, 436, "as objects with no bytes behind them, until the next unshard() fills the same storage.", size=MIN_FONT)
    return c


# -- chapter 6 ----------------------------------------------------------------------------------------------------
def fsdp_unit_lifecycle() -> Canvas:
    c = Canvas("fsdp_unit_lifecycle", 502, "One FSDP unit through one training step, and the memory it holds",
               "Nine rows, top to bottom in time, for one unit of P parameters at N = 4. unshard() all-gathers the "
               "shards into _full; forward computes with views of it and saves activations; reshard() frees _full. "
               "After the other units, the pre-backward hook unshards again with a second all_gather; backward "
               "computes and frees the activations; the post-accumulate-grad hook starts the reduce_scatter of the "
               "flat gradient and reshards; at the end of backward .grad holds this rank's shard of the average, "
               "and the optimizer steps the shard. Beside each row, a bar of what this rank holds for the unit: the "
               "shard always (P/N), the full parameters (P) while it computes, the activations from forward to "
               "backward, the flat gradient (P) until it has been sent, then the gradient shard (P/N).")
    x0, p = 322, 130  # the bars: P is 130 units, so P/N is 32.5
    parts = {"shard": (p / 4, BLUE, ""), "full": (p, TEAL, "_full: P"), "act": (140, GRAY, "activations"),
             "flat": (p, ORANGE, "flat gradient: P"), "gshard": (p / 4, YELLOW, "")}
    rows = [("unshard()", "all_gather", "every rank's shard into _full", ["shard", "full"]),
            ("forward", None, "computes with views of _full", ["shard", "full", "act"]),
            ("reshard()", None, "_full's storage resized to 0", ["shard", "act"]),
            ("…", None, "the other units, forward and backward", ["shard", "act"]),
            ("unshard()", "all_gather", "again, in the pre-backward hook", ["shard", "full", "act"]),
            ("backward", None, "frees the activations as it goes", ["shard", "full", "act"]),
            ("flat gradient", "reduce_scatter", "async, then reshard()", ["shard", "flat"]),
            ("end of backward", None, "waited: .grad = its shard of the mean", ["shard", "gshard"]),
            ("optimizer.step()", None, "on the shard: 1/N of the work", ["shard", "gshard"])]
    c.text(10, 18, "one unit of P parameters, N = 4", bold=True)
    c.text(x0, 18, "what this rank holds for the unit", bold=True)
    y = 32
    for name, collective, note, held in rows:
        mono = name.endswith(")")
        w = c.text(10, y + 15, name, size=14, mono=mono, bold=True)
        if collective:
            cw = text_width(collective, MIN_FONT, mono=True) + 10
            c.box(20 + w, y + 1, cw, 19, collective, BLUE if collective == "all_gather" else ORANGE, size=MIN_FONT, mono=True)
        c.text(10, y + 33, note, size=MIN_FONT)
        x = x0
        for part in held:
            width, fill, label = parts[part]
            c.box(x, y + 6, width, 26, label, fill, size=MIN_FONT, mono=label.startswith("_"))
            x += width
        y += 44
    y += 14
    x = swatch(c, 10, y, BLUE, "param: its shard, P/N") + 16
    x = swatch(c, x, y, TEAL, "_full: the unit's parameters") + 16
    swatch(c, x, y, GRAY, "activations")
    y += 22
    x = swatch(c, 10, y, ORANGE, "param.grad: the flat gradient, held until sent") + 16
    swatch(c, x, y, YELLOW, ".grad: its shard, P/N")
    c.text(10, y + 24, "Not drawn: the optimizer state of the shard (2·P/N for AdamW), there throughout.", size=MIN_FONT)
    return c


# -- chapter 7 ----------------------------------------------------------------------------------------------------
def _backward_timeline(mode: str, units=(3, 2, 1), t_compute=4, t_all_gather=2, t_reduce_scatter=2):
    """Three units' backward on one rank, with one FIFO channel for the collectives (chapter 7's model):
    (compute spans, channel spans), each (kind, unit, start, end)."""
    compute, channel, arrived = [], [], {}
    free = 0

    def issue(kind, unit, t):
        nonlocal free
        start = max(t, free)
        free = start + (t_all_gather if kind == "AG" else t_reduce_scatter)
        channel.append((kind, unit, start, free))
        return free

    t = 0
    for i, unit in enumerate(units):
        following = units[i + 1] if i + 1 < len(units) else None
        if unit not in arrived:                               # pre_backward: its own unshard(async_op=True)
            arrived[unit] = issue("AG", unit, t)
        if mode == "BACKWARD_PRE" and following is not None:  # ... then the prefetch, before waiting for its own
            arrived[following] = issue("AG", following, t)
        if arrived[unit] > t:
            compute.append(("wait", unit, t, arrived[unit]))
            t = arrived[unit]
        compute.append(("compute", unit, t, t + t_compute))
        t += t_compute
        if mode == "BACKWARD_POST" and following is not None:  # post_backward: ahead of its reduce_scatter
            arrived[following] = issue("AG", following, t)
        issue("RS", unit, t)
    return compute, channel


def backward_prefetch() -> Canvas:
    c = Canvas("backward_prefetch", 424, "Backward prefetch: when the next all-gather is issued on the one channel",
               "Three timelines of the backward of blocks.3, blocks.2 and blocks.1, each with a compute lane and "
               "a communication channel that carries one collective at a time, in issue order. With "
               "backward_prefetch=None, each unit's all_gather is issued when its backward starts, queues behind the "
               "previous unit's reduce_scatter, and the rank waits through both: 10 time units of waiting. With "
               "BACKWARD_POST it is issued when the previous unit's gradient is ready, ahead of that unit's "
               "reduce_scatter: 6 units of waiting. With BACKWARD_PRE it is issued when the previous unit's "
               "backward starts and travels while that unit computes: only the first all_gather is waited for, "
               "2 units, at the price of a second full buffer while a unit computes.")
    x0, unit = 118, 22.5
    modes = [("backward_prefetch=None", None, "blocks.2's AG is issued when its backward starts: behind RS 3"),
             ("backward_prefetch=BACKWARD_POST", "BACKWARD_POST",
              "blocks.2's AG is issued once blocks.3's gradient is ready: ahead of RS 3"),
             ("backward_prefetch=BACKWARD_PRE", "BACKWARD_PRE",
              "blocks.2's AG is issued as blocks.3's backward starts: it travels under it")]
    y = 8
    for title, mode, note in modes:
        compute, channel = _backward_timeline(mode)
        waited = sum(end - start for kind, _, start, end in compute if kind == "wait")
        buffers = "two full buffers" if mode == "BACKWARD_PRE" else "one full buffer"
        c.text(10, y + 16, title, mono=True, bold=True)
        c.text(WIDTH - 10, y + 16, f"waiting: {waited} · {buffers}", anchor="end", size=MIN_FONT)
        c.text(10, y + 35, note, size=MIN_FONT)
        for lane, spans, top in (("compute", compute, y + 44), ("channel", channel, y + 76)):
            c.text(x0 - 8, top + 17, lane, anchor="end", size=MIN_FONT)
            for kind, u, a, b in spans:
                label, fill = {"wait": ("wait", RED), "compute": (f"blocks.{u}", GRAY),
                               "AG": (f"AG {u}", BLUE), "RS": (f"RS {u}", ORANGE)}[kind]
                c.box(x0 + a * unit + 0.5, top, (b - a) * unit - 1, 26, label, fill, size=MIN_FONT)
        y += 126
    y -= 2
    for t in range(0, 25, 4):
        c.text(x0 + t * unit, y, str(t), anchor="middle", size=MIN_FONT)
    c.text(x0 - 8, y, "time", anchor="end", size=MIN_FONT)
    y += 26
    x = swatch(c, 10, y, BLUE, "AG i: all_gather of blocks.i") + 16
    x = swatch(c, x, y, ORANGE, "RS i: its reduce_scatter") + 16
    swatch(c, x, y, RED, "blocked waiting")
    return c


# -- chapter 8 ----------------------------------------------------------------------------------------------------
def mixed_precision() -> Canvas:
    c = Canvas("mixed_precision", 420,
               "Mixed precision under FSDP: where each cast happens, and where offload puts the shard",
               "A loop of boxes. Top row, left to right: the fp32 master shard param (P/N elements); _cast_shard() "
               "casts it to param_dtype, bf16; all_gather sends bf16; _full holds the unit's P parameters in bf16. "
               "Forward and backward compute in bf16 on views of _full. Bottom row, right to left: the flat "
               "gradient param.grad, bf16; reduce_scatter, after a cast to reduce_dtype and the 1/N; "
               "grad_for_optimizer() casts this rank's shard to fp32; .grad, fp32, P/N. optimizer.step() updates "
               "the master shard in fp32 with AdamW's fp32 state. A dashed outline around the master shard, the "
               "optimizer and the gradient shard marks what CPU offload keeps in host memory.")
    xs, w, h = (6, 178, 350, 522), 152, 56
    rows = (40, 150, 260)
    top = [("master shard", "param: fp32, P/N", BLUE), ("_cast_shard()", "to param_dtype: bf16", GRAY),
           ("all_gather", "bf16 on the wire", BLUE), ("_full", "bf16, P: the views", TEAL)]
    bottom = [(".grad", "its shard: fp32, P/N", YELLOW), ("grad_for_optimizer", "to fp32", GRAY),
              ("reduce_scatter", "reduce_dtype, × 1/N", ORANGE), ("param.grad", "flat gradient: bf16", ORANGE)]
    for row, boxes in ((rows[0], top), (rows[2], bottom)):
        for x, (name, note, fill) in zip(xs, boxes):
            code = name.startswith(("_", ".", "param", "grad", "all_", "reduce_"))
            c.box(x, row, w, h, [(name, {"mono": code, "bold": not code, "size": MIN_FONT if code else 14}),
                                 (note, {"size": MIN_FONT})], fill)
    c.box(xs[3], rows[1], w, h, [("forward, backward", {}), ("compute in bf16", {"size": MIN_FONT})], GRAY)
    c.box(xs[0], rows[1], w, h, [("optimizer.step()", {"mono": True, "size": MIN_FONT}),
                                 ("fp32, AdamW state", {"size": MIN_FONT})], GREEN)
    for i in range(3):  # along the top, then back along the bottom
        c.line(xs[i] + w + 2, rows[0] + h / 2, xs[i + 1] - 2, rows[0] + h / 2, arrow=True)
        c.line(xs[i + 1] - 2, rows[2] + h / 2, xs[i] + w + 2, rows[2] + h / 2, arrow=True)
    mid_r, mid_l = xs[3] + w / 2, xs[0] + w / 2
    c.line(mid_r, rows[0] + h + 2, mid_r, rows[1] - 2, arrow=True)
    c.line(mid_r, rows[1] + h + 2, mid_r, rows[2] - 2, arrow=True)
    c.line(mid_l, rows[2] - 2, mid_l, rows[1] + h + 2, arrow=True)
    c.line(mid_l, rows[1] - 2, mid_l, rows[0] + h + 2, arrow=True)
    c.text(xs[1] - 8, rows[1] + 24, "mixed_precision=MixedPrecision(", size=MIN_FONT, mono=True)
    c.text(xs[1] + 8, rows[1] + 42, "param_dtype=torch.bfloat16)", size=MIN_FONT, mono=True)
    c.rect(2, rows[0] - 8, w + 12, rows[2] + h - rows[0] + 16, dash=True, width=1.5, rx=6)
    y = rows[2] + h + 28
    c.text(10, y, "Dashed: in host memory under CPUOffload(offload_params=True), and the step runs on", size=MIN_FONT)
    c.text(10, y + 18, "the CPU. The fp32 shard then crosses host_to_device at every unshard, and the", size=MIN_FONT)
    c.text(10, y + 36, "gradient shard device_to_host in reduce_dtype, cast to fp32 on the host.", size=MIN_FONT)
    c.text(10, y + 58, "reduce_dtype=None sends bf16 (2 bytes an element); torch.float32 sends 4.", size=MIN_FONT)
    return c


# -- chapter 9 ----------------------------------------------------------------------------------------------------
def activation_checkpointing() -> Canvas:
    c = Canvas("activation_checkpointing", 396,
               "Activation checkpointing: forward without saving, recompute in backward",
               "Two timelines of four blocks. Without checkpointing, forward F0 to F3 saves each block's activations, "
               "so four blocks' worth are alive when backward starts, and backward B3 to B0 frees them. With "
               "checkpoint_module on each block, forward keeps only each block's input; in backward each block "
               "first runs its forward again (R3, then B3, R2, B2 and so on), so at most one block's activations "
               "are alive besides the inputs, at the price of a second forward per block. Under each timeline, the "
               "activations alive.")
    x0, unit, level = 112, 34.5, 19  # 19 units of height per block's activations
    panels = [("without checkpointing", [("F", i, 1) for i in range(4)] + [("B", i, 2) for i in (3, 2, 1, 0)]),
              ("checkpoint_module(block)", [("F", i, 1) for i in range(4)] +
               [a for i in (3, 2, 1, 0) for a in (("R", i, 1), ("B", i, 2))])]
    kept_input = 0.15  # a block's input, as a share of its activations
    y = 18
    for p, (title, actions) in enumerate(panels):
        w = c.text(10, y, title, bold=True, mono=p == 1)
        if p == 1:
            c.text(18 + w, y, "on every block", bold=True)
        lane = y + 10
        t, alive, points = 0, 0.0, [(0, 0.0)]
        for kind, i, d in actions:
            fill = {"F": BLUE, "R": TEAL, "B": ORANGE}[kind]
            c.box(x0 + t * unit + 0.5, lane, d * unit - 1, 26, f"{kind}{i}", fill, size=MIN_FONT)
            if kind == "F":
                alive += kept_input if p == 1 else 1
            elif kind == "R":
                alive += 1
            else:
                alive -= 1 + kept_input if p == 1 else 1
            t += d
            points.append((t, max(alive, 0.0)))
        base = lane + 26 + 24 + 4 * level
        d = f"M{num(x0)},{num(base)} " + " ".join(f"L{num(x0 + a * unit)},{num(base - v * level)}" for a, v in points)
        c.path(d + f" L{num(x0 + t * unit)},{num(base)} Z", points=[(x0, base), (x0 + t * unit, base - 4 * level)],
               fill=GRAY, colour=MUTED, width=1)
        c.line(x0, base, x0 + 16 * unit, base, width=1)
        peak = max(v for _, v in points)
        c.line(x0, base - peak * level, x0 + 16 * unit, base - peak * level, dash=True, width=1)
        label = "peak: 4 blocks' activations" if p == 0 else "peak: the inputs + 1 block's activations"
        c.text(x0 + 16 * unit, base - peak * level - 5, label, anchor="end", size=MIN_FONT)
        c.text(x0 - 8, base - 20, "alive", anchor="end", size=MIN_FONT)
        c.text(x0 - 8, base - 4, "activations", anchor="end", size=MIN_FONT)
        y = base + 32
    y -= 4
    x = swatch(c, 10, y, BLUE, "F: forward") + 14
    x = swatch(c, x, y, TEAL, "R: the forward again, saving") + 14
    swatch(c, x, y, ORANGE, "B: backward")
    c.text(10, y + 24, "Under FSDP(checkpoint(block)), R runs inside the unit's backward, after its", size=MIN_FONT)
    c.text(10, y + 42, "pre-backward all_gather: the recompute sends nothing more.", size=MIN_FONT)
    return c


# -- chapter 10 ---------------------------------------------------------------------------------------------------
# Chapter 10's example: three tensors laid end to end in one flat buffer (unaligned, as in the page's figure),
# saved by 2 ranks and loaded by 3. Each box is (offsets, sizes) of one tensor, as boxes() gives them, and its
# place in the flat buffer; tests/test_diagrams.py checks them against minifsdp.checkpoint.flat_chunks.boxes.
RESHARD_SHAPES = [("t0", (6, 10)), ("t1", (10,)), ("t2", (4, 10))]
RESHARD_SAVED, RESHARD_LOADED = 2, 3
RESHARD_BOXES = {  # ranks -> [(rank, tensor, offsets, sizes, flat start, flat end)]
    2: [(0, "t0", (0, 0), (5, 10), 0, 50), (0, "t0", (5, 0), (1, 5), 50, 55), (1, "t0", (5, 5), (1, 5), 55, 60),
        (1, "t1", (0,), (10,), 60, 70), (1, "t2", (0, 0), (4, 10), 70, 110)],
    3: [(0, "t0", (0, 0), (3, 10), 0, 30), (0, "t0", (3, 0), (1, 7), 30, 37), (1, "t0", (3, 7), (1, 3), 37, 40),
        (1, "t0", (4, 0), (2, 10), 40, 60), (1, "t1", (0,), (10,), 60, 70), (1, "t2", (0, 0), (1, 4), 70, 74),
        (2, "t2", (0, 4), (1, 6), 74, 80), (2, "t2", (1, 0), (3, 10), 80, 110)],
}


def checkpoint_reshard() -> Canvas:
    c = Canvas("checkpoint_reshard", 470, "A flat-sharded checkpoint written by 2 ranks and read by 3",
               "Three tensors, t0 (6 by 10), t1 (10) and t2 (4 by 10), laid end to end in one flat buffer of 110 "
               "elements. Saved at N = 2, rank 0 holds elements 0 to 54 and writes them as two boxes of t0: rows 0 "
               "to 4, and the first half of row 5; rank 1 writes the rest of row 5, all of t1 and all of t2. On "
               "disk each tensor is the list of these chunks, each an offset and a size. Loaded at N = 3, each rank "
               "describes its range of 37 elements as boxes the same way, and DCP copies every overlap with the "
               "chunks on disk: rank 1's rows 4 and 5 of t0 are read from three chunks.")
    x0, cw = 40, 5.5  # the flat strips: one element is 5.5 units
    total = sum(s[0] * s[1] if len(s) == 2 else s[0] for _, s in RESHARD_SHAPES)
    chunk_ends = sorted({b for *_, b in RESHARD_BOXES[RESHARD_SAVED]} - {total})

    def strip(y, found, padded_to=None, lines=()):
        for rank, tensor, offsets, sizes, a, b in found:
            c.rect(x0 + a * cw + 0.5, y, (b - a) * cw - 1, 24, fill=RANKS[rank])
            cuts = [a] + [e for e in lines if a < e < b] + [b]  # the name goes in the widest part between lines
            left, right = max(zip(cuts, cuts[1:]), key=lambda ab: ab[1] - ab[0])
            if (right - left) * cw > 40:
                c.text(x0 + (left + right) / 2 * cw, y + 16, tensor, anchor="middle", size=MIN_FONT, mono=True, colour=INK)
        if padded_to:
            c.box(x0 + total * cw + 0.5, y, (padded_to - total) * cw - 1, 24, "", GRAY)

    c.text(10, 18, "saved at N = 2: each rank's range of the flat buffer, written as boxes of each tensor", size=MIN_FONT)
    strip(28, RESHARD_BOXES[RESHARD_SAVED])
    offset = 0
    for name, shape in RESHARD_SHAPES:
        n = shape[0] * shape[1] if len(shape) == 2 else shape[0]
        a, b = x0 + offset * cw, x0 + (offset + n) * cw
        c.path(f"M{num(a + 1)},58 v5 H{num(b - 1)} v-5", points=[(a, 58), (b, 63)], width=1)
        c.text((a + b) / 2, 80, f"{name} {shape}", anchor="middle", size=MIN_FONT, mono=True)
        offset += n
    for v in (0, 55, 110):
        c.text(x0 + v * cw, 98, str(v), anchor="middle", size=MIN_FONT)

    c.text(10, 128, "on disk: each tensor as a list of chunks, each written by one rank", size=MIN_FONT)
    gx, cell = (14, 240, 466), 13
    for (name, shape), x in zip(RESHARD_SHAPES, gx):
        c.text(x, 152, f"{name} {shape}", size=MIN_FONT, mono=True)
        chunks = [bx for bx in RESHARD_BOXES[RESHARD_SAVED] if bx[1] == name]
        for rank, _, off, size, *_ in chunks:
            (r0, c0), (nr, nc) = (off, size) if len(off) == 2 else ((0, off[0]), (1, size[0]))
            c.rect(x + c0 * cell, 162 + r0 * cell, nc * cell, nr * cell, fill=RANKS[rank], stroke=INK, width=1.5)
        for i, (rank, _, off, size, *_) in enumerate(chunks):
            tup = [f"({', '.join(map(str, t))}{',' if len(t) == 1 else ''})" for t in (off, size)]
            c.rect(x, 262 + i * 20 - 11, 14, 14, fill=RANKS[rank])
            c.text(x + 20, 262 + i * 20, f"at {tup[0]}, size {tup[1]}", size=MIN_FONT, mono=True)

    c.text(10, 338, "loaded at N = 3: each rank's range as boxes; DCP copies each overlap with a chunk", size=MIN_FONT)
    y = 348
    strip(y, RESHARD_BOXES[RESHARD_LOADED], padded_to=-(-total // RESHARD_LOADED) * RESHARD_LOADED,
          lines=chunk_ends)
    for b in chunk_ends:  # where the chunks on disk meet: ink over the boxes, grey beyond them
        xb = x0 + b * cw
        c.line(xb, y + 1, xb, y + 23, colour=INK, width=1.5, dash=True)
        c.line(xb, y - 6, xb, y - 1, colour=MUTED, width=1.5)
        c.line(xb, y + 25, xb, y + 30, colour=MUTED, width=1.5)
    for v in (0, 37, 74, 111):
        c.text(x0 + v * cw, y + 46, str(v), anchor="middle", size=MIN_FONT)
    y += 76
    x = swatch(c, 10, y, RANKS[0], "rank 0") + 14
    x = swatch(c, x, y, RANKS[1], "rank 1") + 14
    x = swatch(c, x, y, RANKS[2], "rank 2") + 14
    swatch(c, x, y, GRAY, "padding")
    y += 24
    c.rect(10, y - 12, 16, 16, fill=GRAY)
    c.line(18, y - 11, 18, y + 3, colour=INK, width=1.5, dash=True)
    c.text(32, y, "where two chunks on disk meet: a box across one is read from both", size=MIN_FONT)
    return c


# -- chapter 11 ---------------------------------------------------------------------------------------------------
def hsdp_mesh() -> Canvas:
    c = Canvas("hsdp_mesh", 330, "HSDP on a (2, 2) mesh: shard within a node, replicate across nodes",
               "Two nodes, each a row of the mesh with two ranks: ranks 0 and 1 on node 0, ranks 2 and 3 on node 1. "
               "Within a node, the shard group, the ranks all-gather the parameters and reduce-scatter the "
               "gradients: rank 0 and rank 2 hold shard 0 of each unit, rank 1 and rank 3 shard 1. Across the nodes, "
               "the replicate group, ranks 0 and 2, and ranks 1 and 3, all-reduce their gradient shard. Per unit a "
               "rank sends F/2 into the reduce-scatter and F/2 into the all-reduce, and only the all-reduce "
               "crosses the link between nodes.")
    c.text(10, 20, 'init_mesh((2, 2), ("replicate", "shard")): rank r in row r // 2, column r % 2', size=MIN_FONT, mono=True)
    node_x, node_w, node_h = 10, 470, 92
    rank_w, step = 140, 290
    shard_fill = (YELLOW, TEAL)
    for col in range(2):  # the replicate groups: a rank and the one holding the same shard on the other node
        x = node_x + 20 + col * step + rank_w / 2
        c.line(x, 40 + 80 + 2, x, 190 + 28 - 2, colour=MUTED, width=2)
        c.box(x - 55, 142, 110, 24, "all_reduce", PURPLE, size=MIN_FONT, mono=True)
    for node in range(2):
        y = 40 + node * 150
        c.rect(node_x, y, node_w, node_h, dash=True, width=1.5, rx=8)
        c.text(node_x + 10, y + 20, f"node {node}", size=MIN_FONT, bold=True)
        xa, xb = node_x + 20 + rank_w, node_x + 20 + step
        c.line(xa, y + 54, xb, y + 54, width=2)  # the shard group: the ranks of a node
        for col in range(2):
            r = node * 2 + col
            c.box(node_x + 20 + col * step, y + 28, rank_w, 52,
                  [(f"rank {r}", {"bold": True}), (f"shard {col} of each unit", {"size": MIN_FONT})], shard_fill[col])
        c.box(xa + 12, y + 30, xb - xa - 24, 22, "all_gather", BLUE, size=MIN_FONT, mono=True)
        c.box(xa + 12, y + 56, xb - xa - 24, 22, "reduce_scatter", ORANGE, size=MIN_FONT, mono=True)
    gx = node_x + node_w + 12
    c.text(gx, 70, '"shard" group:', size=MIN_FONT, mono=True)
    c.text(gx, 88, "within a node,", size=MIN_FONT)
    c.text(gx, 106, "fast links", size=MIN_FONT)
    c.text(gx, 148, '"replicate" group:', size=MIN_FONT, mono=True)
    c.text(gx, 166, "across nodes,", size=MIN_FONT)
    c.text(gx, 184, "the slow link", size=MIN_FONT)
    c.text(10, 306, "Per unit of F elements a rank sends F/2 into its node's reduce_scatter, then F/2 into", size=MIN_FONT)
    c.text(10, 324, "the all_reduce of its shard across nodes, 2 · (F/2) · 1/2: only that part crosses.", size=MIN_FONT)
    return c


# -- chapter 12 ---------------------------------------------------------------------------------------------------
def tp_f_g() -> Canvas:
    c = Canvas("tp_f_g", 334, "Tensor parallel: a column layer, then a row layer, between f and g",
               "Two ranks of a tensor-parallel group, t = 2. Forward: the input x enters f, which is the identity, "
               "goes through ColumnParallelLinear with this rank's rows A_r of the first weight, giving Y_r, then "
               "gelu, then RowParallelLinear with this rank's columns B_r of the second weight, giving a partial sum "
               "Z_r, and g all-reduces the partial sums into z, the same on both ranks. Backward runs the other "
               "way: g is the identity, and f all-reduces the two ranks' parts of the gradient of x.")
    xs = {"f": 106, "col": 142, "gelu": 324, "row": 372, "g": 554}
    ws = {"f": 24, "col": 170, "gelu": 36, "row": 170, "g": 26}

    def panel(y, backward):
        c.text(10, y, "backward: dL/dz in, dL/dx out" if backward else "forward: x in, z out", bold=True)
        for r in range(2):
            ry = y + 14 + r * 50
            c.text(50, ry + 25, f"rank {r}", anchor="end", size=MIN_FONT, bold=True)
            c.text(56, ry + 25, "dL/dx" if backward else "x", size=MIN_FONT)
            col = f"dL/dY_{r} → part of dL/dx" if backward else f"Y_{r} = x A_{r}ᵀ"
            row = f"dL/dz → dL/dY_{r}" if backward else f"Z_{r} = Y_{r} B_{r}ᵀ"
            c.box(xs["col"], ry, ws["col"], 40, [("ColumnParallelLinear", {"mono": True}), col], GRAY, size=MIN_FONT)
            c.box(xs["gelu"], ry + 8, ws["gelu"], 24, "gelu", GRAY, size=MIN_FONT)
            c.box(xs["row"], ry, ws["row"], 40, [("RowParallelLinear", {"mono": True}), row], GRAY, size=MIN_FONT)
            chain = [(94, xs["f"]), (xs["f"] + ws["f"], xs["col"]), (xs["col"] + ws["col"], xs["gelu"]),
                     (xs["gelu"] + ws["gelu"], xs["row"]), (xs["row"] + ws["row"], xs["g"]),
                     (xs["g"] + ws["g"], 604)]
            for a, b in chain:
                if backward:
                    c.line(b - 2, ry + 20, a + 2, ry + 20, arrow=True)
                else:
                    c.line(a + 2, ry + 20, b - 2, ry + 20, arrow=True)
            c.text(608, ry + 25, "dL/dz" if backward else "z", size=MIN_FONT)
        for name in ("f", "g"):
            reduces = (name == "g") != backward
            c.box(xs[name], y + 8, ws[name], 102, [(name, {"mono": True, "bold": True})],
                  PURPLE if reduces else TEAL)
        notes = "f: all_reduce · g: identity" if backward else "f: identity · g: all_reduce"
        c.text(10, y + 134, notes, size=MIN_FONT, mono=True)

    panel(20, backward=False)
    panel(176, backward=True)
    swatch(c, 340, 20 + 134, PURPLE, "all_reduce over the group")
    swatch(c, 340, 176 + 134, TEAL, "identity")
    return c


# The 1F1B order of chapter 12's example, p = 4 stages, m = 8 micro-batches: each rank's actions, as
# minifsdp.parallel.pipeline_orders.one_f_one_b_order gives them (tests/test_diagrams.py checks it).
PIPELINE_P, PIPELINE_M = 4, 8
PIPELINE_1F1B = ["F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
                 "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
                 "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
                 "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"]


def pipeline_spans(orders: list[str], t_forward=1, t_backward=2) -> list[list[tuple[str, int, int]]]:
    """Each rank's (action, start, end) on an ideal machine: an action starts when its rank is free and its input
    has arrived (a forward needs the previous stage's forward, a backward the next stage's backward, or on the last
    stage its own forward). Stage r runs on rank r."""
    p = len(orders)
    actions = [o.split() for o in orders]
    done, free, position = {}, [0] * p, [0] * p
    spans = [[] for _ in range(p)]
    while any(position[r] < len(actions[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(actions[r]):
                a = actions[r][position[r]]
                kind, i = a[0], int(a[1:])
                needs = ([(r - 1, f"F{i}")] if r > 0 else []) if kind == "F" else \
                    [(r, f"F{i}")] + ([(r + 1, f"B{i}")] if r < p - 1 else [])
                if any(need not in done for need in needs):
                    break
                start = max([free[r]] + [done[need] for need in needs])
                free[r] = done[(r, a)] = start + (t_forward if kind == "F" else t_backward)
                spans[r].append((a, start, free[r]))
                position[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("these orders cannot finish")
    return spans


def pipeline_1f1b() -> Canvas:
    p, m = PIPELINE_P, PIPELINE_M
    c = Canvas("pipeline_1f1b", 300, "The 1F1B pipeline schedule at p = 4 stages and m = 8 micro-batches",
               "A chart with a row per rank, rank r running stage r, and time across, a forward taking one unit and "
               "a backward two. Rank 0 runs three forwards (the warm-up, p - r - 1), then alternates one forward and "
               "one backward, then drains three backwards (the cool-down); rank 3 alternates from the start. The "
               "empty slots are the bubble, (p - 1)/(m + p - 1) = 3/11 of the step. At most p - r micro-batches are "
               "in flight on rank r: 4, 3, 2, 1.")
    spans = pipeline_spans(PIPELINE_1F1B)
    end = max(b for row in spans for _, _, b in row)
    x0, unit, top, pitch = 74, 18, 64, 42
    c.text(10, 20, "1F1B, p = 4, m = 8: a forward takes 1, a backward 2", bold=True)
    for r, row in enumerate(spans):
        y = top + r * pitch
        c.text(x0 - 8, y + 14, f"rank {r}", anchor="end", size=14, bold=True)
        c.text(x0 - 8, y + 31, f"holds ≤ {min(p - r, m)}", anchor="end", size=MIN_FONT)
        for a, s, e in row:
            c.box(x0 + s * unit + 0.5, y, (e - s) * unit - 1, 34, a[1:], BLUE if a[0] == "F" else ORANGE,
                  size=16, bold=True)
    # rank 0's three phases
    warm = [e for a, _, e in spans[0] if a.startswith("F")][p - 2]
    drain = [s for a, s, _ in spans[0] if a.startswith("B")][m - (p - 1)]
    for a, b, label in ((0, warm, "warm-up: 3 F"), (warm, drain, "one F, one B"), (drain, end, "cool-down: 3 B")):
        xa, xb = x0 + a * unit, x0 + b * unit
        c.path(f"M{num(xa + 1)},{top - 6} v-5 H{num(xb - 1)} v5", points=[(xa, top - 11), (xb, top - 6)], width=1)
        c.text((xa + xb) / 2 if a else xa, top - 16, label, anchor="middle" if a else "start", size=MIN_FONT)
    y = top + p * pitch + 8
    for t in range(0, end + 1, 3):
        c.text(x0 + t * unit, y, str(t), anchor="middle", size=MIN_FONT)
    c.text(x0 - 8, y, "time", anchor="end", size=MIN_FONT)
    y += 26
    x = swatch(c, 10, y, BLUE, "forward of micro-batch i") + 16
    x = swatch(c, x, y, ORANGE, "its backward") + 16
    c.text(x, y, "empty: the bubble, (p − 1)/(m + p − 1) = 3/11", size=MIN_FONT)
    c.text(10, y + 24, "Rank r starts with p − r − 1 forwards, then frees a micro-batch for each one it admits.",
           size=MIN_FONT)
    return c


DIAGRAMS = {f.__name__: f for f in (ring_allreduce, ddp_buckets, zero_stages, oss_partition, flat_parameter,
                                      fsdp_unit_lifecycle, backward_prefetch, mixed_precision,
                                      activation_checkpointing, checkpoint_reshard, hsdp_mesh, tp_f_g,
                                      pipeline_1f1b)}


def _chapter_modules() -> dict:
    """The diagrams drawn in modules of their own beside this script (chNN_*.py, a chapter's newer pictures):
    each draws with `from canvas import *` and lists its drawing functions in a tuple named DIAGRAMS."""
    found = {}
    for path in sorted(HERE.glob("ch[0-9][0-9]_*.py")):
        for f in importlib.import_module(path.stem).DIAGRAMS:
            assert f.__name__ not in DIAGRAMS and f.__name__ not in found, f"two diagrams named {f.__name__}"
            found[f.__name__] = f
    return found


DIAGRAMS.update(_chapter_modules())


def draw(name: str) -> str:
    """The SVG text of one diagram."""
    canvas = DIAGRAMS[name]()
    assert canvas.name == name, (canvas.name, name)
    return canvas.svg()


def main(argv: list[str]) -> None:
    paths = [Path(a) for a in argv] or [OUT / f"{name}.svg" for name in DIAGRAMS]
    for path in paths:
        if path.suffix != ".svg" or path.stem not in DIAGRAMS:
            raise SystemExit(f"{path}: not a diagram this script draws ({', '.join(DIAGRAMS)})")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(draw(path.stem), encoding="utf-8")
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
