"""Chapter 6's diagrams: which submodules become units, one step unit by unit, and FSDP1's sharding
strategies as process groups.

What they show of the code is written here as data (the units each policy makes of the tour GPT and what
each unit's FlatParameter holds; the order of one step's collectives; the groups of each strategy), and
tests/test_diagrams_ch06.py checks it against the package.
"""

from __future__ import annotations

from canvas import *  # noqa: F403  the canvas and the colours

# -- units and wrap policies -----------------------------------------------------------------------------------------
# The tour GPT (4 blocks, n_embd 64, vocabulary 96, lm_head tied to wte), as a tree: (depth, name, parameters
# it holds itself or in its children, its unit under each policy: by class, by size). "" is the root.
SIZE_POLICY_MIN = 16_384
WRAP_TREE = [
    (0, "TinyGPT", 209_536, "", ""),
    (1, "wte", 6_144, "", ""),
    (1, "wpe", 4_096, "", ""),
    (1, "blocks.0", 49_792, "blocks.0", ""),
    (2, "ln_1", 128, "blocks.0", ""),
    (2, "attn", 16_448, "blocks.0", "attn"),
    (2, "ln_2", 128, "blocks.0", ""),
    (2, "fc", 16_640, "blocks.0", "fc"),
    (2, "fc_proj", 16_448, "blocks.0", "fc_proj"),
    (1, "blocks.1-3", 3 * 49_792, "blocks.1, .2, .3", "3 units each"),
    (1, "ln_f", 128, "", ""),
    (1, "lm_head", 0, "", ""),
]
# Each unit's FlatParameter under ModuleWrapPolicy({Block}): (unit, [(parameter, numel)]) in its flat order.
# lm_head.weight is wte.weight, stored once.
FLAT_BY_CLASS = [
    ("(root)", [("wte.weight", 6_144), ("wpe.weight", 4_096), ("ln_f.weight", 64), ("ln_f.bias", 64)]),
    ("blocks.0", [("ln_1.weight", 64), ("ln_1.bias", 64), ("attn.qkv.weight", 12_288),
                  ("attn.proj.weight", 4_096), ("attn.proj.bias", 64), ("ln_2.weight", 64), ("ln_2.bias", 64),
                  ("fc.weight", 16_384), ("fc.bias", 256), ("fc_proj.weight", 16_384), ("fc_proj.bias", 64)]),
]
# The units and their sizes under each policy, as named_units() lists them.
UNITS_BY_CLASS = [("(root)", 10_368)] + [(f"blocks.{k}", 49_792) for k in range(4)]
UNITS_BY_SIZE = [("(root)", 11_392)] + [(f"blocks.{k}.{m}", n) for k in range(4)
                                        for m, n in (("attn", 16_448), ("fc", 16_640), ("fc_proj", 16_448))]
SEGMENT_LABELS = {"wte.weight": "wte", "wpe.weight": "wpe", "attn.qkv.weight": "qkv", "attn.proj.weight": "proj",
                  "fc.weight": "fc", "fc_proj.weight": "fc_proj"}


def fsdp_wrap_units() -> Canvas:
    c = Canvas("fsdp_wrap_units", 500, "Units of the tour GPT under two wrap policies, and what each unit's "
               "FlatParameter holds",
               "The model tree of the tour GPT: wte, wpe, four blocks of ln_1, attn, ln_2, fc and fc_proj, ln_f and "
               "lm_head, which is tied to wte. Under ModuleWrapPolicy({Block}) each block is a unit of 49,792 "
               "parameters and the root keeps wte, wpe and ln_f, 10,368: five units. Under "
               f"SizeBasedWrapPolicy(min_num_params={SIZE_POLICY_MIN:_}) the walk wraps attn, fc and fc_proj of each "
               "block, and the blocks' LayerNorms are left to the root, 11,392: thirteen units. Below, the "
               "FlatParameters under ModuleWrapPolicy: the root's holds wte, wpe and ln_f (the tied lm_head once), "
               "a block's holds its LayerNorms, qkv, proj, fc and fc_proj, one after another.")
    name_x, numel_x, col_a, col_b, col_w = 10, 262, 276, 478, 192
    c.text(name_x, 20, "the module tree", bold=True)
    c.text(numel_x, 20, "params", anchor="end", bold=True)
    c.text(col_a + col_w / 2, 20, "ModuleWrapPolicy", anchor="middle", bold=True)
    c.text(col_a + col_w / 2, 38, "({Block})", anchor="middle", mono=True, size=MIN_FONT)
    c.text(col_b + col_w / 2, 20, "SizeBasedWrapPolicy", anchor="middle", bold=True)
    c.text(col_b + col_w / 2, 38, f"min_num_params={SIZE_POLICY_MIN:_}", anchor="middle", mono=True, size=MIN_FONT)
    y, row = 48, 22
    for depth, name, numel, by_class, by_size in WRAP_TREE:
        label = name if name != "lm_head" else "lm_head = wte"
        c.text(name_x + 18 * depth, y + 17, label, mono=True, size=MIN_FONT, bold=depth == 0)
        c.text(numel_x, y + 17, f"{numel:,}" if numel else "tied", anchor="end", size=MIN_FONT)
        for x, unit in ((col_a, by_class), (col_b, by_size)):
            if depth == 0:
                continue
            if name == "blocks.0" and x == col_b:  # the block itself is no unit: its pieces are
                c.text(x + col_w / 2, y + 17, "(not a unit)", anchor="middle", size=MIN_FONT)
                continue
            if depth == 2 and x == col_a:
                continue  # inside blocks.0's unit, drawn once over its rows
            fill = GRAY if unit == "" else BLUE
            c.box(x, y + 2, col_w, row - 4, "root" if unit == "" else unit, fill, size=MIN_FONT,
                  mono=unit in ("attn", "fc", "fc_proj", "blocks.0"))
        if name == "blocks.0":
            c.box(col_a, y + 2 + row, col_w, 5 * row - 4, ["inside blocks.0's unit:", "its LayerNorms, attn,",
                                                          "fc and fc_proj"], BLUE, size=MIN_FONT)
        y += row
    y += 6
    c.text(col_a + col_w / 2, y + 14, "5 units, largest 49,792", anchor="middle", size=MIN_FONT, bold=True)
    c.text(col_b + col_w / 2, y + 14, "13 units, largest 16,640", anchor="middle", size=MIN_FONT, bold=True)
    c.text(col_b + col_w / 2, y + 32, "the root gets every LayerNorm", anchor="middle", size=MIN_FONT)
    y += 52
    c.text(name_x, y, "Each unit's FlatParameter under ModuleWrapPolicy({Block}): one flat tensor,", size=MIN_FONT,
           bold=True)
    c.text(name_x, y + 18, "one all_gather and one reduce_scatter per use", size=MIN_FONT, bold=True)
    y += 30
    scale = 500 / 49_792
    for unit, params in FLAT_BY_CLASS:
        total = sum(n for _, n in params)
        c.text(name_x, y + 19, unit if unit != "(root)" else "root", mono=True, size=MIN_FONT)
        c.text(numel_x - 102, y + 19, f"{total:,}", anchor="end", size=MIN_FONT)
        x = 170
        for pname, n in params:
            w = n * scale
            label = SEGMENT_LABELS.get(pname, "")
            c.box(x, y + 4, w, 22, label if text_width(label, MIN_FONT) < w - 4 else "", BLUE, size=MIN_FONT,
                  width=0.5)
            x += w
        y += 32
    c.text(name_x, y + 12, "Thin slices: LayerNorm weights and biases. lm_head shares wte's slice: a tied "
           "parameter", size=MIN_FONT)
    c.text(name_x, y + 30, "is stored once, so it must stay inside one unit.", size=MIN_FONT)
    return c


# -- one step, unit by unit ------------------------------------------------------------------------------------------
# One step of chapter 6's runtime (FULL_SHARD, no prefetching) on a GPT of three blocks, in issue order:
# (unit, what, start, end) in time slots. AG: its all-gather; RS: its reduce-scatter; the rest is compute.
STEP_UNITS = ["(root)", "blocks.0", "blocks.1", "blocks.2"]
STEP_FORWARD = [("(root)", "AG", 0, 1), ("(root)", "embed", 1, 3),
                ("blocks.0", "AG", 3, 4), ("blocks.0", "fwd", 4, 6),
                ("blocks.1", "AG", 6, 7), ("blocks.1", "fwd", 7, 9),
                ("blocks.2", "AG", 9, 10), ("blocks.2", "fwd", 10, 12),
                ("(root)", "head", 12, 14)]
STEP_BACKWARD = [("(root)", "head", 0, 2),
                 ("blocks.2", "AG", 2, 3), ("blocks.2", "bwd", 3, 5), ("blocks.2", "RS", 5, 6),
                 ("blocks.1", "AG", 5, 6), ("blocks.1", "bwd", 6, 8), ("blocks.1", "RS", 8, 9),
                 ("blocks.0", "AG", 8, 9), ("blocks.0", "bwd", 9, 11), ("blocks.0", "RS", 11, 12),
                 ("(root)", "embed", 11, 13), ("(root)", "RS", 13, 14)]
STEP_END, STEP_OPTIMIZER = (14, 16.5), (16.5, 19)


def step_unsharded(events, unit: str, end_of_phase: float, kept: bool) -> tuple[float, float] | None:
    """When `unit` holds its full parameters in one phase: from its all-gather to the end of its last compute
    there (to `end_of_phase` if it is `kept`, as the root is)."""
    mine = [(what, a, b) for u, what, a, b in events if u == unit]
    gathered = [a for what, a, _ in mine if what == "AG"]
    computed = [b for what, _, b in mine if what not in ("AG", "RS")]
    start = gathered[0] if gathered else 0
    return (start, end_of_phase if kept else max(computed))


def fsdp_step() -> Canvas:
    c = Canvas("fsdp_step", 376, "One FSDP step, unit by unit: forward, then backward in reverse order",
               "Two panels, forward and backward, with a row for the root and for blocks.0, blocks.1 and blocks.2. "
               "In forward the root all-gathers its parameters and computes the embeddings; each block in turn "
               "all-gathers, computes its forward and reshards; the root computes the head and the loss and keeps "
               "its parameters. In backward the root computes first, with no all-gather; then each block, last "
               "first, all-gathers again, computes its backward, reshards, and starts the reduce-scatter of its "
               "flat gradient, which travels while the next block starts. The root's backward ends with the "
               "embeddings and its own reduce-scatter. At the end of backward the root waits for every "
               "reduce-scatter and leaves each rank's gradient shard in .grad; optimizer.step() then reads only "
               "the shards. A teal band marks the time each unit holds its full parameters.")
    x0, slot, row = 96, 30, 30
    fills = {"AG": BLUE, "RS": ORANGE}

    def panel(y, title, note, events, root_kept_to=None):
        c.text(10, y + 16, title, bold=True)
        c.text(x0 + 140, y + 16, note, size=MIN_FONT)
        top = y + 26
        for i, unit in enumerate(STEP_UNITS):
            ry = top + i * row
            c.text(10, ry + 19, "root" if unit == "(root)" else unit, mono=True, size=MIN_FONT)
            span = step_unsharded(events, unit, root_kept_to, kept=unit == "(root)" and root_kept_to is not None)
            a, b = span
            c.rect(x0 + a * slot, ry + 2, (b - a) * slot, row - 4, fill=TEAL, width=0.5)
            for u, what, a, b in events:
                if u == unit:
                    c.box(x0 + a * slot + 2, ry + 6, (b - a) * slot - 4, row - 12, what, fills.get(what, GRAY),
                          size=MIN_FONT, mono=what in ("AG", "RS"))
        return top + len(STEP_UNITS) * row

    end = panel(8, "forward", "each unit: unshard → compute → reshard", STEP_FORWARD, 14)
    c.text(x0 + 14 * slot + 8, 8 + 26 + 13, "the root keeps", size=MIN_FONT)
    c.text(x0 + 14 * slot + 8, 8 + 26 + 29, "its parameters", size=MIN_FONT)
    c.text(x0 + 14 * slot + 8, 8 + 26 + 45, "for backward", size=MIN_FONT)
    y = end + 16
    bottom = panel(y, "backward", "reverse order: unshard → compute → reshard → RS", STEP_BACKWARD)
    top = y + 26
    a, b = STEP_END
    c.box(x0 + a * slot + 2, top + 2, (b - a) * slot - 4, bottom - top - 4,
          ["wait for", "every RS;", ".grad is", "the rank's", "shard"], YELLOW, size=MIN_FONT)
    a, b = STEP_OPTIMIZER
    c.box(x0 + a * slot + 2, top + 2, (b - a) * slot - 4, bottom - top - 4,
          ["optimizer", ".step():", "reads", "only the", "shards"], GREEN, size=MIN_FONT)
    y = bottom + 26
    x = swatch(c, 10, y, BLUE, "AG: all_gather") + 14
    x = swatch(c, x, y, ORANGE, "RS: reduce_scatter (async)") + 14
    swatch(c, x, y, GRAY, "compute")
    y += 22
    x = swatch(c, 10, y, TEAL, "full parameters held") + 14
    x = swatch(c, x, y, YELLOW, "gradient shards") + 14
    swatch(c, x, y, GREEN, "optimizer on the shards")
    return c


# -- FSDP1's sharding strategies as process groups ------------------------------------------------------------------
# At 4 ranks: the shard groups (a unit's FlatParameter is split over each), the replicate groups (its gradient
# shard is all-reduced across each), and whether the full parameters are freed after forward.
STRATEGIES = [
    ("FULL_SHARD", [[0, 1, 2, 3]], None, True),
    ("SHARD_GRAD_OP", [[0, 1, 2, 3]], None, False),
    ("NO_SHARD", [[0], [1], [2], [3]], [[0, 1, 2, 3]], False),
    ("HYBRID_SHARD", [[0, 1], [2, 3]], [[0, 2], [1, 3]], True),
]
STRATEGY_NOTES = {
    "FULL_SHARD": ("one shard group: each rank holds 1/4", "freed after forward (ZeRO-3)"),
    "SHARD_GRAD_OP": ("one shard group: each rank holds 1/4", "kept from forward to backward"),
    "NO_SHARD": ("a shard group per rank: each holds all", "nothing to gather: DDP"),
    "HYBRID_SHARD": ("shard in {0, 1} and {2, 3}: 1/2 each", "replicate across {0, 2}, {1, 3}"),
}


def strategy_collectives(shard, replicate) -> list[str]:
    """The collectives a unit's gradient goes through under one strategy."""
    out = ["reduce_scatter"] if max(len(g) for g in shard) > 1 else []
    return out + (["all_reduce"] if replicate else [])


def fsdp1_strategies() -> Canvas:
    c = Canvas("fsdp1_strategies", 440, "FSDP1's sharding strategies at four ranks, as process groups",
               "Four rows, one per strategy, each showing ranks 0 to 3 and the part of one unit's FlatParameter "
               "each holds between steps, in four quarters. FULL_SHARD and SHARD_GRAD_OP shard the unit over one "
               "group of four ranks: each rank holds one quarter, and the gradient is reduce-scattered; "
               "FULL_SHARD frees the full parameters after forward, SHARD_GRAD_OP keeps them until backward. "
               "NO_SHARD makes a shard group of each rank alone: each holds the whole unit, and the gradient is "
               "all-reduced across the four ranks, as under DDP. HYBRID_SHARD shards within ranks 0 and 1 and "
               "within ranks 2 and 3, each rank holding one half, and replicates across ranks 0 and 2 and ranks 1 "
               "and 3: the gradient is reduce-scattered within the shard group, then all-reduced across the "
               "replicate group.")
    rank_x, rank_w, gap = 10, 116, 10
    y = 8
    for name, shard, replicate, raf in STRATEGIES:
        first, second = STRATEGY_NOTES[name]
        c.text(10, y + 16, name, mono=True, bold=True)
        c.text(180, y + 16, first + " · " + second, size=MIN_FONT)
        top = y + 26
        for group in shard:  # a dashed outline around each shard group
            x_a = rank_x + group[0] * (rank_w + gap) - 3
            x_b = rank_x + group[-1] * (rank_w + gap) + rank_w + 3
            c.rect(x_a, top - 3, x_b - x_a, 56, dash=True, rx=6)
        for r in range(4):
            x = rank_x + r * (rank_w + gap)
            c.box(x, top, rank_w, 22, f"rank {r}", RANKS[r], size=MIN_FONT, bold=True)
            group = next(g for g in shard if r in g)
            k, quarters = group.index(r), 4 // len(group)
            for q in range(4):
                held = k * quarters <= q < (k + 1) * quarters
                c.rect(x + 4 + q * (rank_w - 8) / 4, top + 27, (rank_w - 8) / 4, 20, fill=BLUE if held else "none",
                       dash=not held, width=0.8)
        cx = rank_x + 4 * (rank_w + gap) + 2
        for i, kind in enumerate(strategy_collectives(shard, replicate)):
            c.box(cx, top + i * 26, 670 - cx, 22, kind, ORANGE if kind == "reduce_scatter" else PURPLE,
                  size=MIN_FONT, mono=True)
        y += 98
    y += 4
    x = swatch(c, 10, y, BLUE, "the quarters of one unit this rank holds") + 14
    swatch(c, x, y, "none", "held elsewhere", dash=True)
    c.text(10, y + 22, "Dashed outlines: the shard groups. Right: what the unit's gradient goes through.",
           size=MIN_FONT)
    return c


# -- the runtime's hooks, in one unit's step -----------------------------------------------------------------------
# (method, when it runs, what it does, the unit's TrainingState after it). A method of None is compute.
HOOKS = [
    ("pre_forward", "the unit's forward is called", ["AG", "all_gather its FlatParameter, wait"], "FORWARD"),
    (None, "forward: the module computes; nested units run their own hooks inside it", [], None),
    ("post_forward", "its forward returns", ["reshard (not the root); hook each output", "and the split of its views"],
     "IDLE"),
    ("pre_backward", "the gradient of an output arrives", ["first unit: queue finish_backward;",
                                                           "AG", "all_gather again, wait"], "PRE_BACKWARD"),
    (None, "backward: autograd computes the gradients of the unit's views", [], None),
    ("_before_concat", "before the flat gradient is made",
     ["free the full parameters;", "wait for the earlier units' RS"], None),
    ("post_backward", "the flat gradient is complete", ["RS", "reduce_scatter, async; reshard"], "POST_BACKWARD"),
    ("finish_backward", "the end of backward (the root, once)", ["wait for every RS: .grad = shard;",
                                                                 "reshard every unit"], "IDLE"),
]


def fsdp_hooks() -> Canvas:
    c = Canvas("fsdp_hooks", 434, "The runtime's hooks, in the order they run for one unit, and its state after each",
               "Eight rows, top to bottom in time. pre_forward runs when the unit's forward is called: it all-gathers "
               "the FlatParameter and waits (state FORWARD). The module computes. post_forward runs when the forward "
               "returns: it reshards, except at the root, and hooks each output and the split of the views (IDLE). "
               "pre_backward runs when the gradient of an output arrives: the first unit queues finish_backward, and "
               "the unit all-gathers again (PRE_BACKWARD). Autograd computes the views' gradients. _before_concat "
               "runs before they are concatenated: it frees the full parameters and waits for the earlier units' "
               "reduce-scatters, before autograd concatenates the views' gradients into the flat one. post_backward runs when the flat gradient is complete: it starts the reduce-scatter "
               "and reshards (POST_BACKWARD). finish_backward, queued on the autograd engine, runs at the end of "
               "backward: it waits for every reduce-scatter, leaves each gradient shard in .grad and reshards every "
               "unit (IDLE).")
    act_x, state_x, state_w = 300, 546, 124
    c.text(10, 18, "FSDPUnit's method", bold=True)
    c.text(act_x, 18, "what it does", bold=True)
    c.text(state_x + state_w / 2, 18, "state after", anchor="middle", bold=True)
    y = 28
    for method, when, actions, state in HOOKS:
        if method is None:
            c.box(10, y + 3, 660, 24, when, GRAY, size=MIN_FONT)
            y += 32
            continue
        c.text(10, y + 16, method, mono=True, bold=True)
        if text_width(when, MIN_FONT) > act_x - 20:
            raise ValueError(f"fsdp_hooks: {when!r} runs into the next column")
        c.text(10, y + 35, when, size=MIN_FONT)
        line_y, x = y + 16, act_x
        for part in actions:
            if part in ("AG", "RS"):
                c.box(x, line_y - 14, 30, 19, part, BLUE if part == "AG" else ORANGE, size=MIN_FONT, mono=True)
                x += 36
                continue
            c.text(x, line_y, part, size=MIN_FONT)
            line_y, x = line_y + 19, act_x
        if state:
            c.box(state_x, y + 6, state_w, 26, state, "none", size=MIN_FONT, mono=True, colour=MUTED,
                  bold=state != "IDLE")
        y += 50
    y += 10
    c.text(10, y, "The hooks are registered by the unit: pre_forward and post_forward around its forward, "
           "the", size=MIN_FONT)
    c.text(10, y + 18, "others on tensors and autograd nodes, so backward calls them where each moment comes.",
           size=MIN_FONT)
    return c


# -- RAF or NRAF -------------------------------------------------------------------------------------------------
# The same step under reshard_after_forward=False: every unit keeps its parameters from its forward to its
# backward, so backward issues no all-gather (the slots where RAF's were are left empty).
STEP_BACKWARD_NRAF = [e for e in STEP_BACKWARD if not (e[1] == "AG" and e[0] != "(root)")]


def raf_bands(forward, backward, keep: bool) -> dict[str, list[tuple[float, float]]]:
    """When each unit holds its full parameters over the whole step, backward shifted by the forward's
    length: under RAF the root from its all-gather to its last backward compute and every block twice,
    for its forward and its backward; kept (NRAF), every unit from its forward's all-gather to the end of
    its backward."""
    shift = max(b for _, _, _, b in forward)
    out = {}
    for unit in STEP_UNITS:
        fwd = step_unsharded(forward, unit, None, kept=False)
        bwd = step_unsharded(backward, unit, None, kept=False)
        if unit == "(root)" or keep:
            out[unit] = [(fwd[0], shift + bwd[1])]
        else:
            out[unit] = [fwd, (shift + bwd[0], shift + bwd[1])]
    return out


def fsdp_raf_nraf() -> Canvas:
    c = Canvas("fsdp_raf_nraf", 334, "RAF or NRAF: when each unit holds its full parameters over one step",
               "Two timelines of the same step, forward then backward, with a row for the root and blocks.0 to "
               "blocks.2. With reshard_after_forward=True (RAF, FULL_SHARD) each block holds its full parameters "
               "twice, while its forward and while its backward computes, and is all-gathered twice; after "
               "forward only the root is unsharded; 7 all-gathers. With reshard_after_forward=False (NRAF, "
               "SHARD_GRAD_OP) each block keeps its parameters from its forward to the end of its backward, so "
               "after forward every unit is unsharded, and backward issues no all-gather: 4 all-gathers.")
    x0, slot, row = 96, 20, 24
    shift = max(b for _, _, _, b in STEP_FORWARD)
    fills = {"AG": BLUE, "RS": ORANGE}
    y = 8
    for keep, title, schedule in ((False, "reshard_after_forward=True: RAF, ZeRO-3", STEP_BACKWARD),
                                  (True, "reshard_after_forward=False: NRAF, ZeRO-2-like", STEP_BACKWARD_NRAF)):
        gathers = sum(1 for _, what, _, _ in STEP_FORWARD + schedule if what == "AG")
        c.text(10, y + 16, title, bold=True, mono=True, size=MIN_FONT)
        c.text(670, y + 16, f"{gathers} all-gathers", anchor="end", size=MIN_FONT)
        top = y + 24
        c.text(x0 + shift * slot / 2, top + 14, "forward", anchor="middle", size=MIN_FONT)
        c.text(x0 + shift * slot * 1.5, top + 14, "backward", anchor="middle", size=MIN_FONT)
        top += 20
        bands = raf_bands(STEP_FORWARD, schedule, keep)
        for i, unit in enumerate(STEP_UNITS):
            ry = top + i * row
            c.text(10, ry + 16, "root" if unit == "(root)" else unit, mono=True, size=MIN_FONT)
            for a, b in bands[unit]:
                c.rect(x0 + a * slot, ry + 2, (b - a) * slot, row - 4, fill=TEAL, width=0.5)
            for events, offset in ((STEP_FORWARD, 0), (schedule, shift)):
                for u, what, a, b in events:
                    if u == unit:
                        c.rect(x0 + (offset + a) * slot + 2, ry + 5, (b - a) * slot - 4, row - 10,
                               fill=fills.get(what, GRAY), width=0.8)
        bottom = top + len(STEP_UNITS) * row
        c.line(x0 + shift * slot, top - 22, x0 + shift * slot, bottom, dash=True)
        y = bottom + 12
    y += 8
    x = swatch(c, 10, y, BLUE, "all_gather") + 14
    x = swatch(c, x, y, ORANGE, "reduce_scatter") + 14
    x = swatch(c, x, y, GRAY, "compute") + 14
    swatch(c, x, y, TEAL, "full parameters held")
    return c


DIAGRAMS = (fsdp_wrap_units, fsdp_step, fsdp_hooks, fsdp_raf_nraf, fsdp1_strategies)
