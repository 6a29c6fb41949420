"""Chapter 12's pictures: the tensor-parallel block, the vocabulary split, sequence parallelism, how the split
weights start equal, and, for the pipeline, the stages, the messages between them, the mesh they compose on and
what an interleaved order must do (exercise 12.4's contract).

Drawn on the shared canvas (canvas.py); make_diagrams.py finds this module. What a picture shows of the code
(the qkv pieces a rank keeps, the stages' blocks) is written here as data, and tests/test_diagrams_ch1213.py checks
it against the package; tests/test_diagrams_ch12_exercise.py checks the contract's stages, budgets and bubbles.
"""

from __future__ import annotations

from canvas import *  # noqa: F403

# The qkv weight of TinyGPT at t = 2 (minifsdp.parallel.mappings.shard_of with stride 3): its rows are
# q, then k, then v, cut into 3t pieces; rank r keeps pieces r, r + t, r + 2t.
QKV_T = 2
QKV_PIECES = ["q0", "q1", "k0", "k1", "v0", "v1"]       # the 3t pieces, in the weight's order
QKV_KEPT = {0: ["q0", "k0", "v0"], 1: ["q1", "k1", "v1"]}  # what shard_of gives each rank

# The pipeline GPT of the chapter's tests, 8 blocks, cut into 4 stages by split_gpt.
STAGE_MODULES = [["wte", "wpe", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3"], ["blocks.4", "blocks.5"],
                 ["blocks.6", "blocks.7", "ln_f", "lm_head"]]

# Exercise 12.4's contract at p = 2 ranks, v = 2 stages each, m = 4 micro-batches: the stages each rank holds
# (stages_of_rank), each rank's budget of (stage, micro-batch) pieces in flight, min(2(p - r - 1) + (v - 1)p + 1,
# v*m), and the bubble on the ideal machine (forward 1/v, backward 2/v) a right order leaves, against 1F1B's.
# Two wrong orders: every forward of the rank's stages, then every backward (the pieces it holds after each of
# its actions, and its peak); one micro-batch at a time through the rank's stages and back.
IL_P, IL_V, IL_M = 2, 2, 4
IL_STAGES = {0: [0, 2], 1: [1, 3]}
IL_BUDGET = {0: 5, 1: 3}
IL_BUBBLE, IL_BUBBLE_1F1B = (1, 9), (1, 5)
IL_ALL_FORWARDS_HELD = [1, 2, 3, 4, 5, 6, 7, 8, 7, 6, 5, 4, 3, 2, 1, 0]  # on either rank
IL_WRONG = {"every forward, then every backward": ((8, 8), (1, 9)),  # (peak held on rank 0, 1), bubble
            "one micro-batch at a time": ((2, 2), (1, 2))}


def _arrow_label(c: Canvas, x1, x2, y, label, colour=MUTED, above=True):
    c.line(x1, y, x2, y, colour=colour, arrow=True)
    if label:
        c.text((x1 + x2) / 2, y - 6 if above else y + 17, label, anchor="middle", size=MIN_FONT)


# -- tensor parallel ------------------------------------------------------------------------------------------------
def tp_block() -> Canvas:
    c = Canvas("tp_block", 352, "A transformer block under tensor parallelism, and the qkv weight cut with stride 3",
               "Top: one block on rank r of t. The attention half is LayerNorm ln_1 (replicated), f, the qkv "
               "ColumnParallelLinear, attention on this rank's n_head/t heads, the proj RowParallelLinear and g; the "
               "MLP half is ln_2, f, the fc column layer, gelu, the fc_proj row layer and g. Two all-reduces forward "
               "(the two g) and two backward (the two f), each of one whole activation. Bottom: TinyGPT's qkv "
               "weight stacks all the q rows, then k, then v. At t = 2 it is cut into six pieces q0 q1 k0 k1 v0 v1, "
               "and rank 0 keeps q0, k0 and v0, rank 1 q1, k1 and v1: each rank its own heads' rows of q, k and v. "
               "A contiguous cut would give rank 0 all of q and half of k.")
    c.text(10, 20, "One block on rank r of t: two column-then-row pairs", bold=True)
    rows = [("attention", "ln_1", "qkv", "n_head/t heads", "proj"),
            ("MLP", "ln_2", "fc", "gelu", "fc_proj")]
    for i, (half, ln, col, mid, row) in enumerate(rows):
        y = 40 + i * 62
        c.text(10, y + 24, half, size=MIN_FONT, bold=True)
        parts = [(84, 76, GRAY, [ln, ("replicated", {"size": MIN_FONT})]),
                 (170, 22, PURPLE, [("f", {"mono": True, "bold": True})]),
                 (202, 104, GRAY, [(col, {"mono": True}), "column"]),
                 (316, 112, GRAY, [mid, ("no traffic", {"size": MIN_FONT})]),
                 (438, 104, GRAY, [(row, {"mono": True}), "row"]),
                 (552, 22, PURPLE, [("g", {"mono": True, "bold": True})])]
        for x, w, fill, lines in parts:
            c.box(x, y, w, 40, lines, fill, size=MIN_FONT)
        for (xa, wa, *_), (xb, *_) in zip(parts, parts[1:]):
            c.line(xa + wa + 1, y + 20, xb - 1, y + 20, arrow=True)
        c.line(571, y + 20, 600, y + 20, arrow=True)
        c.text(606, y + 25, "+ x", size=MIN_FONT)
    c.text(10, 180, "g: all_reduce forward, identity backward · f: the reverse · per block 2 + 2 all-reduces",
           size=MIN_FONT)
    # the qkv cut
    y = 214
    c.text(10, y, "qkv's weight, t = 2: cut into 3t pieces, rank r keeps r, r + t, r + 2t (stride 3)", bold=True)
    x0, w = 84, 76
    c.text(x0 - 8, y + 36, "rows", anchor="end", size=MIN_FONT)
    for k, piece in enumerate(QKV_PIECES):
        owner = next(r for r, kept in QKV_KEPT.items() if piece in kept)
        c.box(x0 + k * w, y + 14, w - 2, 32, [(piece, {"mono": True})], RANKS[owner], size=MIN_FONT)
    for r, kept in QKV_KEPT.items():
        yy = y + 78 + r * 26
        c.text(x0 - 8, yy, f"rank {r}", anchor="end", size=MIN_FONT, bold=True)
        c.text(x0, yy, f"keeps {' '.join(kept)}: its heads' q, k and v rows", size=MIN_FONT)
    c.text(x0 + 6 * w + 4, y + 26, "a contiguous", size=MIN_FONT)
    c.text(x0 + 6 * w + 4, y + 43, "cut: q0 q1 k0", size=MIN_FONT)
    return c


def tp_vocab_loss() -> Canvas:
    c = Canvas("tp_vocab_loss", 300, "The vocab-parallel loss: three numbers per token instead of the logits",
               "One token's logits over a vocabulary of 8, split over two ranks: rank 0 holds entries 0 to 3, rank 1 "
               "entries 4 to 7, and the target is entry 5, on rank 1. The loss log of the sum of exp(z) minus "
               "z_target is computed from three all-reduces of one number per token: the maximum of each rank's "
               "logits (an all-reduce with MAX, so that no exponential overflows), the target's shifted logit (rank 1 "
               "holds it, rank 0 adds zero), and the sum of each rank's exponentials. Gathering the logits instead "
               "would move (t - 1)/t of V numbers per token to every rank.")
    c.text(10, 20, "One token, V = 8, t = 2: each rank holds V/t of its logits", bold=True)
    x0, w = 120, 52
    for v in range(8):
        c.box(x0 + v * w, 34, w - 2, 30, [(f"z{v}", {"mono": True, "bold": v == 5})], RANKS[v // 4],
              size=MIN_FONT, width=2.5 if v == 5 else 1.0)
    c.text(x0 - 8, 54, "logits", anchor="end", size=MIN_FONT)
    c.text(x0 + 2 * w, 82, "rank 0: z0 … z3", anchor="middle", size=MIN_FONT)
    c.text(x0 + 6 * w, 82, "rank 1: z4 … z7 (target 5)", anchor="middle", size=MIN_FONT)
    steps = [("1", "m = max z", "max of z0…z3", "max of z4…z7", "all_reduce MAX"),
             ("2", "z_target − m", "0", "z5 − m", "all_reduce SUM"),
             ("3", "Σ exp(z − m)", "Σ over z0…z3", "Σ over z4…z7", "all_reduce SUM")]
    c.text(202, 112, "rank 0 gives", anchor="middle", size=MIN_FONT)
    c.text(327, 112, "rank 1 gives", anchor="middle", size=MIN_FONT)
    for i, (k, what, r0, r1, op) in enumerate(steps):
        y = 122 + i * 40
        c.text(10, y + 21, f"{k}. {what}", size=MIN_FONT, bold=True)
        c.box(150, y, 104, 30, r0, BLUE, size=MIN_FONT)
        c.box(262, y, 130, 30, r1, ORANGE, size=MIN_FONT)
        c.line(394, y + 15, 414, y + 15, arrow=True)
        c.box(416, y, 132, 30, op, PURPLE, size=MIN_FONT)
        c.text(556, y + 20, "1 number/token", size=MIN_FONT)
    c.text(10, 262, "loss = log Σ exp(z − m) − (z_target − m); backward: softmax − one-hot, no traffic.",
           size=MIN_FONT)
    c.text(10, 286, "Gathering the logits instead: (t − 1)/t · V numbers per token to every rank.", size=MIN_FONT)
    return c


def _tensor(c: Canvas, x, y, w, h, stripes: str, t: int = 2, label: str = ""):
    """A [tokens, features] activation on one rank: `stripes` 'tokens' (this rank's s/t rows, in its colour),
    'features' (all tokens, this rank's h/t columns) or 'whole' (every rank the same)."""
    if stripes == "whole":
        c.rect(x, y, w, h, fill=GRAY)
    elif stripes == "tokens":
        for r in range(t):
            c.rect(x, y + r * h / t, w, h / t, fill=RANKS[r])
    else:
        for r in range(t):
            c.rect(x + r * w / t, y, w / t, h, fill=RANKS[r])
    if label:
        c.text(x + w / 2, y + h + 16, label, anchor="middle", size=MIN_FONT)


def tp_sequence_parallel() -> Canvas:
    c = Canvas("tp_sequence_parallel", 330, "Sequence parallelism: the all-reduce split into its two halves",
               "Two rows, t = 2. Above, tensor parallelism alone: between two layers every rank holds the whole "
               "activation of s tokens, runs the LayerNorm and the residual add on it and keeps it for backward, t "
               "copies of the same bytes; g all-reduces the row layer's partial sums. Below, sequence parallelism: "
               "the LayerNorm region holds only this rank's s/t tokens; an all-gather puts the tokens back together "
               "before the column layer, and a reduce-scatter after the row layer sums the partial outputs and "
               "leaves each rank its s/t tokens. A reduce-scatter and an all-gather move the bytes of one "
               "all-reduce, and the LayerNorm region's activations are divided by t.")
    c.text(10, 20, "Between the matmuls, each rank keeps…", bold=True)
    for i, (title, region, into, out) in enumerate((
            ("tensor parallel", "whole", ("f", TEAL, "identity"), ("g", PURPLE, "all_reduce")),
            ("+ sequence parallel", "tokens", ("all_gather", BLUE, "s/t → s"), ("reduce_scatter", ORANGE,
                                                                               "sum, s → s/t")))):
        y = 42 + i * 130
        c.text(10, y + 12, title, size=MIN_FONT, bold=True)
        _tensor(c, 24, y + 24, 70, 56, region, label="LN, + x: all s" if region == "whole" else "LN, + x: s/t")
        c.line(96, y + 52, 114, y + 52, arrow=True)
        c.box(116, y + 34, 104, 36, [(into[0], {"mono": True}), into[2]], into[1], size=MIN_FONT)
        c.line(222, y + 52, 240, y + 52, arrow=True)
        _tensor(c, 242, y + 24, 64, 56, "features", label="h/t features")
        c.line(308, y + 52, 330, y + 52, arrow=True)
        c.box(332, y + 34, 114, 36, ["column · attn", "or MLP · row"], GRAY, size=MIN_FONT)
        c.line(448, y + 52, 466, y + 52, arrow=True)
        c.box(468, y + 34, 124, 36, [(out[0], {"mono": True}), out[2]], out[1], size=MIN_FONT)
        c.line(594, y + 52, 610, y + 52, arrow=True)
        _tensor(c, 612, y + 24, 58, 56, region)
    swatch(c, 24, 306, BLUE, "rank 0's part")
    swatch(c, 150, 306, ORANGE, "rank 1's part")
    c.text(278, 306, "grey: the same whole tensor on every rank", size=MIN_FONT)
    return c


def tp_init() -> Canvas:
    c = Canvas("tp_init", 300, "Every rank's slice of a weight, from one seed",
               "Left, what minifsdp does (and Megatron-LM with use_cpu_initialization): every rank of the group "
               "seeds its generator alike and draws the whole weight, out by in, then keeps its slice, rows for a "
               "column layer, columns for a row layer. The slices are exactly the single model's weight, cut, which "
               "is what lets the tests compare with one process; the price is the whole weight in memory for a "
               "moment. Right, Megatron-LM's initialisation on the GPU: each rank draws only its own slice, from a "
               "seed of its own (seed + 2718 + its tensor-parallel rank, kept by the model-parallel RNG tracker). "
               "No whole weight is ever made, and no single process ever had these weights.")
    for x, title in ((10, "one seed, the whole weight, a slice"), (352, "a seed per rank, only the slice")):
        c.text(x, 20, title, bold=True)
    # left
    c.box(10, 34, 318, 34, [("torch.manual_seed(s) on every rank", {"mono": True})], GRAY, size=MIN_FONT)
    c.line(169, 70, 169, 86, arrow=True)
    c.rect(104, 88, 130, 80, fill=GRAY)
    c.rect(104, 88, 130, 40, fill=BLUE)
    c.rect(104, 128, 130, 40, fill=ORANGE)
    c.text(96, 112, "whole weight,", anchor="end", size=MIN_FONT)
    c.text(96, 129, "drawn on", anchor="end", size=MIN_FONT)
    c.text(96, 146, "every rank", anchor="end", size=MIN_FONT)
    c.text(242, 112, "rank 0 keeps", size=MIN_FONT)
    c.text(242, 152, "rank 1 keeps", size=MIN_FONT)
    c.text(10, 196, "= the single model's weight, cut:", size=MIN_FONT)
    c.text(10, 214, "the tests compare with TinyGPT", size=MIN_FONT)
    c.text(10, 232, "cost: the whole weight, for a moment", size=MIN_FONT)
    # right
    for r in range(2):
        x = 352 + r * 164
        c.box(x, 34, 154, 34, [(f"seed + 2718 + {r}", {"mono": True})], GRAY, size=MIN_FONT)
        c.line(x + 77, 70, x + 77, 86, arrow=True)
        c.rect(x + 12, 88, 130, 40, fill=RANKS[r])
        c.text(x + 77, 146, f"rank {r} draws its slice", anchor="middle", size=MIN_FONT)
    c.text(352, 196, "model-parallel RNG tracker (Megatron, GPU)", size=MIN_FONT)
    c.text(352, 214, "no whole weight; no single process", size=MIN_FONT)
    c.text(352, 232, "ever had these weights", size=MIN_FONT)
    c.line(340, 30, 340, 240, dash=True)
    c.text(10, 272, "minifsdp: the left, in ColumnParallelLinear, RowParallelLinear and VocabParallelEmbedding;",
           size=MIN_FONT)
    c.text(10, 290, "from_full(layer) starts every rank from one given layer's weights instead.", size=MIN_FONT)
    return c


# -- pipeline parallel ----------------------------------------------------------------------------------------------
def pp_stages() -> Canvas:
    c = Canvas("pp_stages", 236, "A GPT cut into four pipeline stages, and what crosses between them",
               "TinyGPT of 8 blocks cut by split_gpt into 4 stages, stage r on rank r: stage 0 holds the embeddings "
               "wte and wpe and blocks 0 and 1, stage 1 blocks 2 and 3, stage 2 blocks 4 and 5, stage 3 blocks 6 and "
               "7, ln_f and lm_head. Between neighbours, each micro-batch's activation (micro-batch by sequence by "
               "hidden) goes forward and its gradient, of the same shape, comes back. lm_head is tied to wte: the "
               "last stage holds a copy, and after backward the first and last rank exchange the two gradients.")
    c.text(10, 20, "split_gpt: 8 blocks, p = 4 stages, stage r on rank r", bold=True)
    w, gap = 136, 28
    for r, modules in enumerate(STAGE_MODULES):
        x = 10 + r * (w + gap)
        c.text(x + w / 2, 48, f"rank {r}", anchor="middle", size=MIN_FONT, bold=True)
        blocks = [m.split(".")[1] for m in modules if m.startswith("blocks.")]
        others = [m for m in modules if not m.startswith("blocks.")]
        lines = [", ".join(others[:2]), "blocks " + ", ".join(blocks), ", ".join(others[2:])]
        c.box(x, 56, w, 56, [(s, {"mono": True}) for s in lines if s], RANKS[r], size=MIN_FONT)
        if r < len(STAGE_MODULES) - 1:
            c.line(x + w + 2, 74, x + w + gap - 2, 74, colour=BLUE, arrow=True, width=2)
            c.line(x + w + gap - 2, 96, x + w + 2, 96, colour=ORANGE, arrow=True, width=2)
    c.path("M78,114 v26 H590 v-26", points=[(78, 114), (590, 140)], dash=True)
    c.text(334, 158, "tied: lm_head is a copy of wte; after backward ranks 0 and 3 add each other's gradient",
           anchor="middle", size=MIN_FONT)
    y = 192
    x = swatch(c, 10, y, BLUE, "activation forward: [micro-batch, sequence, hidden]") + 16
    swatch(c, x, y, ORANGE, "its gradient back: the same shape")
    c.text(10, y + 26, "Only these cross a boundary, point to point: no collective over the pipeline.",
           size=MIN_FONT)
    return c


def pipeline_p2p() -> Canvas:
    c = Canvas("pipeline_p2p", 388, "Messages between neighbouring stages: pairing, ordering, and freeing the output",
               "Top: in 1F1B's steady state, rank r sends micro-batch i+1's activation to rank r+1 and waits for "
               "micro-batch i's gradient from it, while rank r+1 sends that gradient and waits for the activation. "
               "If both post a blocking send first, each waits for the other to receive: a deadlock. Megatron-LM "
               "posts the sends and receives of a step together with batch_isend_irecv, or orders them by rank "
               "parity (even ranks send first, odd ranks receive first); minifsdp never blocks in a send (isend) and "
               "posts each rank's receives in the order its peer sends, one ahead. Bottom: once an output is sent, "
               "backward needs only its grad_fn. Megatron's deallocate_output_tensor replaces its data by one "
               "element; minifsdp keeps the whole output until the micro-batch's backward.")
    c.text(10, 20, "1F1B's steady state between rank r and rank r + 1", bold=True)
    # two lanes, both sending first
    for i, (rank, send, recv) in enumerate((("rank r", "send act i+1 →", "recv grad i ←"),
                                            ("rank r+1", "send grad i →", "recv act i+1 ←"))):
        y = 34 + i * 40
        c.text(76, y + 21, rank, anchor="end", size=MIN_FONT, bold=True)
        c.box(84, y, 130, 30, send, BLUE if i == 0 else ORANGE, size=MIN_FONT)
        c.box(218, y, 130, 30, recv, GRAY, size=MIN_FONT, dash=True)
    c.box(360, 44, 300, 50, ["both block in send, waiting for", "a receive the other never posts"], RED,
          size=MIN_FONT)
    c.text(10, 136, "blocking sends first: deadlock", size=MIN_FONT, bold=True)
    fixes = [("Megatron", "batch_isend_irecv: the step's sends and receives posted together"),
             ("", "or by parity: even ranks send first, odd ranks receive first"),
             ("", "shapes vary (variable_seq_lengths)? send the shape first, then the tensor"),
             ("minifsdp", "isend never blocks a rank; receives posted in the sender's order,"),
             ("", "one ahead; one activation_shape, no shape sent")]
    for k, (who, what) in enumerate(fixes):
        y = 162 + k * 20
        if who:
            c.text(10, y, who, size=MIN_FONT, bold=True)
        c.text(84, y, what, size=MIN_FONT)
    # the output after the send
    y = 278
    c.text(10, y, "After micro-batch i's output is sent, backward needs its grad_fn, not its data", bold=True)
    c.text(10, y + 34, "Megatron", size=MIN_FONT, bold=True)
    c.box(84, y + 14, 210, 30, [("deallocate_output_tensor", {"mono": True})], GREEN, size=MIN_FONT)
    c.text(302, y + 34, "data → 1 element; grad_fn kept (custom_backward)", size=MIN_FONT)
    c.text(10, y + 76, "minifsdp", size=MIN_FONT, bold=True)
    c.box(84, y + 56, 210, 30, "output kept whole", GRAY, size=MIN_FONT)
    c.text(302, y + 76, "until its backward: p − r outputs on rank r", size=MIN_FONT)
    return c


def parallel_mesh() -> Canvas:
    c = Canvas("parallel_mesh", 250, "DP x TP on a 2 x 2 mesh of four ranks",
               "Four ranks as a 2 by 2 mesh with dimensions dp and tp. Each row, ranks 0 and 1 or ranks 2 and 3, is "
               "a tensor-parallel group holding one replica of the model split in two slices; each column, ranks 0 "
               "and 2 or ranks 1 and 3, is a data-parallel group holding the same slice in the two replicas. The tp "
               "groups carry activations at every layer, on the critical path, so they go inside a node on NVLink; "
               "the dp groups carry one gradient reduction per step, overlapped with backward, so they can cross "
               "nodes.")
    c.text(10, 20, 'init_mesh((2, 2), ("dp", "tp"))', bold=True, mono=True)
    x0, y0, w, h = 120, 56, 150, 52
    for d in range(2):
        c.text(x0 - 10, y0 + d * (h + 22) + 31, f"replica {d}", anchor="end", size=MIN_FONT, bold=True)
        for t in range(2):
            rank = 2 * d + t
            c.box(x0 + t * (w + 20), y0 + d * (h + 22), w, h, [f"rank {rank}", f"slice {t} of the model"],
                  RANKS[rank], size=MIN_FONT)
    for t in range(2):
        c.text(x0 + t * (w + 20) + w / 2, 46, f"dp group: ranks {t}, {t + 2}", anchor="middle", size=MIN_FONT)
    xr = x0 + 2 * w + 20 + 22
    c.text(xr, 64, "tp group (a row): activations,", size=MIN_FONT)
    c.text(xr, 82, "4 collectives a block, on the", size=MIN_FONT)
    c.text(xr, 100, "critical path: inside a node", size=MIN_FONT)
    c.text(xr, 138, "dp group (a column): the same", size=MIN_FONT)
    c.text(xr, 156, "slice's gradients, once a step,", size=MIN_FONT)
    c.text(xr, 174, "overlapped: across nodes", size=MIN_FONT)
    c.text(10, 228, "No byte of one group crosses into the other; ZeRO and FSDP shard over dp only.", size=MIN_FONT)
    return c


def pipeline_interleaved_contract() -> Canvas:
    p, v, m = IL_P, IL_V, IL_M
    n = p * v
    rank_of = {s: r for r, stages in IL_STAGES.items() for s in stages}
    wrong = list(IL_WRONG.items())
    c = Canvas("pipeline_interleaved_contract", 452,
               f"What an interleaved order must do at p = {p}, v = {v}, m = {m}",
               f"Top: {n} stages, s0 to s{n - 1}; rank r holds stages r and r + p, so rank 0 holds s0 and s2 and "
               f"rank 1 s1 and s3. Micro-batch 0 goes forward s0 on rank 0, s1 on rank 1, s2 on rank 0, s3 on rank "
               f"1, and its backward comes back the same way, s3 to s0: a forward needs the previous stage's forward, "
               f"a backward the next stage's backward. Middle: each rank has v times m = {v * m} (stage, "
               f"micro-batch) pieces. Its budget, min(2(p - r - 1) + (v - 1)p + 1, v m), is {IL_BUDGET[0]} on "
               f"rank 0 and {IL_BUDGET[1]} on rank 1. An order that runs every forward and then every backward "
               f"holds 1, 2, up to all {v * m} pieces and back to 0, over both budgets. Bottom: a right order holds "
               f"at most {IL_BUDGET[0]} and {IL_BUDGET[1]} pieces and leaves a bubble of at most "
               f"{IL_BUBBLE[0]}/{IL_BUBBLE[1]} of the step on the ideal machine (1F1B: "
               f"{IL_BUBBLE_1F1B[0]}/{IL_BUBBLE_1F1B[1]}). Every forward then every backward: "
               f"{wrong[0][1][0][0]} and {wrong[0][1][0][1]} held, bubble {wrong[0][1][1][0]}/{wrong[0][1][1][1]}, "
               f"on time but over the budget. One micro-batch at a time: {wrong[1][1][0][0]} held, bubble "
               f"{wrong[1][1][1][0]}/{wrong[1][1][1][1]}, within the budget but slow.")
    c.text(10, 20, f"p = {p} ranks, v = {v} stages each, m = {m}: rank r holds stages r, r + p", bold=True)
    # the stages, and micro-batch 0's way through them
    w, gap, x0, y = 120, 60, 10, 38
    for s in range(n):
        x = x0 + s * (w + gap)
        c.box(x, y, w, 44, [(f"stage {s}", {"bold": True}), f"on rank {rank_of[s]}"], RANKS[rank_of[s]],
              size=MIN_FONT)
        if s < n - 1:
            c.line(x + w + 2, y + 14, x + w + gap - 2, y + 14, colour=BLUE, arrow=True, width=2)
            c.line(x + w + gap - 2, y + 32, x + w + 2, y + 32, colour=ORANGE, arrow=True, width=2)
    y += 70
    x = swatch(c, 10, y, BLUE, "micro-batch 0 forward: s0 → s1 → s2 → s3") + 16
    swatch(c, x, y, ORANGE, "its backward: s3 → s2 → s1 → s0")
    c.text(10, y + 22, "a forward needs the previous stage's forward, a backward the next stage's backward",
           size=MIN_FONT)
    # the pieces every forward, then every backward holds, against each rank's budget
    y += 56
    c.text(10, y, f"Pieces held after each of a rank's {2 * v * m} actions: every forward, then every backward",
           bold=True)
    unit, pitch, base = 10, 17, y + 18 + v * m * 10
    for r in range(p):
        left = 54 + r * 330
        budget = IL_BUDGET[r]
        for k, held in enumerate(IL_ALL_FORWARDS_HELD):
            bx = left + k * pitch
            inside = min(held, budget)
            if inside:
                c.rect(bx, base - inside * unit, pitch - 3, inside * unit, fill=GRAY, rx=0)
            if held > budget:
                c.rect(bx, base - held * unit, pitch - 3, (held - budget) * unit, fill=RED, rx=0)
        right = left + len(IL_ALL_FORWARDS_HELD) * pitch
        c.line(left - 4, base, right, base, width=1)
        c.line(left - 4, base - budget * unit, right + 4, base - budget * unit, dash=True)
        c.text(left - 8, base - budget * unit + 5, str(budget), anchor="end", size=MIN_FONT, bold=True)
        c.text(left - 8, base - v * m * unit + 10, str(v * m), anchor="end", size=MIN_FONT)
        c.text(left, base + 20, f"rank {r}, stages {IL_STAGES[r][0]} and {IL_STAGES[r][1]}: budget {budget}",
               size=MIN_FONT)
    c.text(10, base + 42, "budget of rank r: min(2(p − r − 1) + (v − 1)p + 1, v·m) pieces; red: held over it",
           size=MIN_FONT)
    # the contract, and the two wrong orders
    y = base + 70
    cols = [(10, 254, "order"), (268, 166, "most held: rank 0, 1"), (438, 232, "bubble, ideal machine")]
    for cx, cw, head in cols:
        c.text(cx + 4, y, head, size=MIN_FONT, bold=True)
    rows = [("a right order", f"≤ {IL_BUDGET[0]}, ≤ {IL_BUDGET[1]}", GREEN,
             f"≤ {IL_BUBBLE[0]}/{IL_BUBBLE[1]} (1F1B: {IL_BUBBLE_1F1B[0]}/{IL_BUBBLE_1F1B[1]})", GREEN)]
    for name, ((h0, h1), (a, b)) in wrong:
        over = h0 > IL_BUDGET[0] or h1 > IL_BUDGET[1]
        slow = a * IL_BUBBLE[1] > b * IL_BUBBLE[0]
        rows.append((name, f"{h0}, {h1}" + (": over" if over else ""), RED if over else GREEN,
                     f"{a}/{b}" + (": too slow" if slow else ""), RED if slow else GREEN))
    for i, (name, held, held_fill, bubble, bubble_fill) in enumerate(rows):
        ry = y + 10 + i * 32
        c.box(cols[0][0], ry, cols[0][1], 28, name, GRAY, size=MIN_FONT)
        c.box(cols[1][0], ry, cols[1][1], 28, held, held_fill, size=MIN_FONT)
        c.box(cols[2][0], ry, cols[2][1], 28, bubble, bubble_fill, size=MIN_FONT)
    return c


DIAGRAMS = (tp_block, tp_vocab_loss, tp_sequence_parallel, tp_init, pp_stages, pipeline_p2p, parallel_mesh,
            pipeline_interleaved_contract)
