"""Chapter 11's diagrams: what each rank holds under the FlatParameter and under fully_shard, FSDP1's wrapper
next to fully_shard's class swap, and when an all-gather can overlap with unshard's async_op.

Drawn on the shared canvas (canvas.py); make_diagrams.py finds this module and draws each function in DIAGRAMS.
"""

from __future__ import annotations

from canvas import *  # noqa: F403  the canvas, the colours, the helpers

# The example module of chapter 5's picture, w (4 x 5) and b (5), at N = 4. The FlatParameter: w at element 0,
# b at the next 16-element boundary (32), the whole padded to 48, 12 a rank. fully_shard: each parameter cut along
# dim 0 as torch.chunk cuts it, ceil(d0 / N) rows a rank, the last ranks fewer or none, every shard padded to
# ceil(d0 / N) rows. tests/test_diagrams_ch11.py checks both against the package (flat_layout, FSDPParam).
PER_PARAM_N = 4
PER_PARAM_PARAMS = [("w", (4, 5)), ("b", (5,))]
PER_PARAM_FLAT_OFFSETS, PER_PARAM_FLAT_PADDED = [0, 32], 48
PER_PARAM_ROWS = {"w": 1, "b": 2}                          # every rank's padded rows
PER_PARAM_LENGTHS = {"w": [1, 1, 1, 1], "b": [2, 2, 1, 0]}  # each rank's real rows


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def per_parameter_shards() -> Canvas:
    n = PER_PARAM_N
    shard = PER_PARAM_FLAT_PADDED // n
    c = Canvas("per_parameter_shards", 468,
               "What each rank holds: one flat padded buffer cut in N, or each parameter cut along dim 0",
               "The module of chapter 5, a weight w of 4 by 5 and a bias b of 5, over 4 ranks. Left, the "
               "FlatParameter: w and b flattened into one buffer of 48 elements (b on the next 16-element "
               "boundary, zeros between and after), cut into 4 shards of 12: rank 0 holds 12 elements of w, rank 1 "
               "the last 8 of w and 4 zeros, rank 2 8 zeros and the first 4 of b, rank 3 the last element of b and 11 "
               "zeros. Right, fully_shard: each parameter is cut along dimension 0 and kept as a DTensor with "
               "placement Shard(0): rank r holds row r of w and rows 2r and 2r + 1 of b, padded to 2 rows, so rank 2 "
               "holds one row of b and rank 3 none. One all-gather of the FlatParameter moves 4 shards of 12 into "
               "one buffer, and w and b are views into it; one all-gather of fully_shard copies each rank's 7 "
               "elements into its slot, gathers 4 slots of 7, and copies the rows out into w and b, tensors of "
               "their own, after which the buffer is freed.")
    fill = {"w": BLUE, "b": TEAL, None: GRAY}
    numel = {name: _numel(shape) for name, shape in PER_PARAM_PARAMS}
    cell = 13

    # the module as built
    c.text(10, 18, "one module, w (4 × 5) and b (5), sharded over N = 4 ranks", bold=True)
    for i in range(4):
        for j in range(5):
            c.rect(20 + j * cell, 30 + i * cell, cell, cell, fill=BLUE)
    c.text(96, 52, "w", size=14, mono=True)
    for j in range(5):
        c.rect(140 + j * cell, 30, cell, cell, fill=TEAL)
    c.text(214, 41, "b", size=14, mono=True)
    swatch(c, 300, 44, BLUE, "w")
    swatch(c, 350, 44, TEAL, "b")
    swatch(c, 400, 44, GRAY, "padding (zeros)")
    c.text(300, 70, "colour: which parameter; a row: one rank", size=MIN_FONT)

    # the two columns: what rank r holds
    lx, rx = 74, 384          # left edges of the FlatParameter strip and of fully_shard's shards
    c.text(10, 108, "FlatParameter (chapters 5–9)", bold=True)
    c.text(10, 126, "flatten, pad to 48, cut into 4 shards of 12", size=MIN_FONT)
    c.text(rx - 10, 108, "fully_shard (this chapter)", bold=True)
    c.text(rx - 10, 126, "each parameter cut along dim 0, Shard(0)", size=MIN_FONT)

    def flat_owner(e):
        return next((p for p, off in zip(numel, PER_PARAM_FLAT_OFFSETS) if off <= e < off + numel[p]), None)

    def flat_note(r):
        parts, e = [], r * shard
        while e < (r + 1) * shard:
            owner, start = flat_owner(e), e
            while e < (r + 1) * shard and flat_owner(e) == owner:
                e += 1
            parts.append(f"{e - start} {owner}" if owner else f"{e - start} pad")
        return ", ".join(parts)

    row_h, y0 = 34, 140
    for r in range(n):
        y = y0 + r * row_h
        c.text(10, y + 17, f"rank {r}", size=MIN_FONT, bold=True)
        for k in range(shard):
            c.rect(lx + k * cell, y + 4, cell, 18, fill=fill[flat_owner(r * shard + k)])
        c.text(lx + shard * cell + 8, y + 17, flat_note(r), size=MIN_FONT)
        # fully_shard: w's row r, then b's two padded rows
        x = rx
        notes = []
        for name, shape in PER_PARAM_PARAMS:
            rows, length = PER_PARAM_ROWS[name], PER_PARAM_LENGTHS[name][r]
            width = _numel(shape[1:]) if len(shape) > 1 else 1
            for k in range(rows * width):
                c.rect(x + k * cell, y + 4, cell, 18, fill=fill[name] if k < length * width else GRAY)
            x += rows * width * cell + 6
            first = sum(PER_PARAM_LENGTHS[name][:r])
            if length:
                notes.append(f"{name}[{first}]" if length == 1 else f"{name}[{first}:{first + length}]")
        pad = sum((PER_PARAM_ROWS[p] - PER_PARAM_LENGTHS[p][r]) * (_numel(s[1:]) if len(s) > 1 else 1)
                  for p, s in PER_PARAM_PARAMS)
        c.text(x + 2, y + 17, ", ".join(notes) + (f" + {pad} pad" if pad else ""), size=MIN_FONT, mono=True)
    y = y0 + n * row_h + 8
    c.line(rx - 22, y0 - 40, rx - 22, y - 4, width=1)

    # what one all-gather moves
    total = sum(PER_PARAM_ROWS[p] * _numel(s) // s[0] for p, s in PER_PARAM_PARAMS)
    c.text(10, y + 14, "one all_gather", bold=True)
    c.text(rx - 10, y + 14, "one all_gather", bold=True)
    c.box(10, y + 24, 200, 24, f"all_gather 4 × {shard} = {PER_PARAM_FLAT_PADDED}", BLUE, size=MIN_FONT, mono=True)
    for i, s in enumerate(["into one buffer, _full: w and b are views",
                           "into it, so the buffer lives until reshard.",
                           "The optimizer steps one flat shard of 12,",
                           "a slice across w, b and the padding."]):
        c.text(10, y + 68 + 18 * i, s, size=MIN_FONT, mono=False)
    c.box(rx - 10, y + 24, 190, 24, f"all_gather 4 × {total} = {total * n}", BLUE, size=MIN_FONT, mono=True)
    for i, s in enumerate([f"copy-in: this rank's {total} elements to its slot;",
                           "copy-out: the rows into w and b, tensors of",
                           "their own; the buffer is freed at once.",
                           "The optimizer steps w's and b's rows."]):
        c.text(rx - 10, y + 68 + 18 * i, s, size=MIN_FONT)
    y += 158
    c.text(10, y, "Both pad. At this size the FlatParameter's 64-byte alignment makes 48 elements of 25; on a",
           size=MIN_FONT)
    c.text(10, y + 18, "model of real size both move the same bytes (the measurements below).", size=MIN_FONT)
    return c



def _tree(c: Canvas, x0: float, y0: float, rows, step: float = 30, indent: float = 22) -> float:
    """A module tree, one box a row: rows of (depth, text, fill); an elbow from each box to its parent's.
    Returns the y below the last row."""
    parents = {}
    for i, (depth, label, fill) in enumerate(rows):
        x, y = x0 + depth * indent, y0 + i * step
        w = text_width(label, MIN_FONT, mono=True) + 12
        c.box(x, y, w, 22, label, fill, size=MIN_FONT, mono=True)
        if depth:
            px, py = parents[depth - 1]
            c.path(f"M{num(px + 8)},{num(py + 22)} V{num(y + 11)} H{num(x)}", points=[(px + 8, py + 22), (x, y + 11)],
                   width=1)
        parents[depth] = (x, y)
    return y0 + len(rows) * step


def class_swap() -> Canvas:
    c = Canvas("class_swap", 488, "FSDP1 wraps each unit in a new module; fully_shard keeps the tree and swaps classes",
               "Left, the FlatParameter FSDP of chapters 5 to 9: FullyShardedDataParallel wraps the model, and the "
               "wrap policy wraps each Block in another FullyShardedDataParallel, so the tree gains a level at each "
               "unit and every name changes, to module.blocks.0.flat_param_0. Right, fully_shard: the tree is the "
               "user's, each Block's class is swapped for FSDPBlock and the model's for FSDPTinyGPT, and the "
               "parameters keep their names, such as blocks.0.fc.weight, now DTensors. Below, the method resolution "
               "order of FSDPBlock: FSDPBlock, then FSDPModule, then Block, then nn.Module. A call to unshard or "
               "reshard finds FSDPModule's method first; a call of the module runs nn.Module's __call__, which "
               "calls forward, found on Block.")
    fsdp, user = YELLOW, GRAY
    c.text(10, 18, "FSDP1: a wrapper around each unit", bold=True)
    c.text(10, 36, "FullyShardedDataParallel(net,", size=MIN_FONT, mono=True)
    c.text(10, 54, "    auto_wrap_policy=policy)  # each Block", size=MIN_FONT, mono=True)
    y = _tree(c, 10, 66, [(0, "FullyShardedDataParallel", fsdp), (1, "module: TinyGPT", user),
                          (2, "wte, wpe, ln_f, lm_head", user), (2, "blocks: ModuleList", user),
                          (3, "0: FullyShardedDataParallel", fsdp), (4, "module: Block", user),
                          (3, "1: FullyShardedDataParallel", fsdp), (4, "module: Block", user)])
    c.text(10, y + 8, "a name: module.blocks.0.flat_param_0", size=MIN_FONT, mono=True)
    rx = 372
    c.line(rx - 16, 6, rx - 16, y + 12, width=1)
    c.text(rx, 18, "fully_shard: the same tree", bold=True)
    c.text(rx, 36, "fully_shard(block); fully_shard(net)", size=MIN_FONT, mono=True)
    _tree(c, rx, 66, [(0, "FSDPTinyGPT", fsdp), (1, "wte, wpe, ln_f, lm_head", user), (1, "blocks: ModuleList", user),
                      (2, "0: FSDPBlock", fsdp), (2, "1: FSDPBlock", fsdp)])
    c.text(rx, 66 + 5 * 30 + 8, "a name: blocks.0.fc.weight", size=MIN_FONT, mono=True)
    c.text(rx, 66 + 5 * 30 + 26, "(a DTensor, Shard(0))", size=MIN_FONT)
    c.text(rx, 66 + 5 * 30 + 52, "no wrap policy: you call", size=MIN_FONT)
    c.text(rx, 66 + 5 * 30 + 70, "fully_shard on each block,", size=MIN_FONT)
    c.text(rx, 66 + 5 * 30 + 88, "then on the root", size=MIN_FONT)

    # the method resolution order of the swapped class
    y += 44
    c.text(10, y, "type(block).__mro__: FSDPModule's methods come before Block's", bold=True)
    c.text(10, y + 18, 'type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})', size=MIN_FONT, mono=True)
    chain = [("FSDPBlock", "(no methods)", fsdp), ("FSDPModule", "unshard, reshard, set_*", fsdp),
             ("Block", "forward", user), ("nn.Module", "__call__, parameters", user)]
    x, top = 10, y + 32
    for i, (name, methods, fill) in enumerate(chain):
        w = max(text_width(name, 14, mono=True), text_width(methods, MIN_FONT)) + 16
        c.box(x, top, w, 44, [(name, {"mono": True, "size": 14}), (methods, {"size": MIN_FONT})], fill)
        if i < len(chain) - 1:
            c.line(x + w + 2, top + 22, x + w + 20, top + 22, arrow=True)
        x += w + 22
    c.text(10, top + 68, "block.unshard() finds FSDPModule.unshard first, whatever Block defines;", size=MIN_FONT)
    c.text(10, top + 86, "block(x) runs nn.Module.__call__, which calls forward: Block's, since FSDPModule has none.",
           size=MIN_FONT)
    return c




# The same module at N = 2: w's rows 0-1 and b's 0-2 on rank 0, w's 2-3 and b's 3-4 (+ one row of padding) on
# rank 1; a slot of 13 elements a rank. tests/test_diagrams_ch11.py checks the rows against FSDPParam.
COPY_N = 2
COPY_ROWS = {"w": 2, "b": 3}
COPY_LENGTHS = {"w": [2, 2], "b": [3, 2]}


def copy_in_out() -> Canvas:
    n, cell = COPY_N, 14
    slot = sum(COPY_ROWS[p] * (_numel(s) // s[0]) for p, s in PER_PARAM_PARAMS)
    c = Canvas("copy_in_out", 418, "One all-gather per module: copy-in, all-gather, copy-out",
               "The module with w of 4 by 5 and b of 5 at N = 2. Rank 0 holds rows 0 and 1 of w and elements 0 to 2 "
               "of b; rank 1 rows 2 and 3 of w, elements 3 and 4 of b, and one element of padding. Copy-in lays each "
               "rank's padded shards end to end, 13 elements, straight into its own slot of the all-gather's output. "
               "The all-gather fills both slots, 26 elements. Copy-out takes rank q's rows of each parameter from "
               "slot q into that parameter's unsharded tensor, w of 4 by 5 and b of 5, each a tensor of its own, and "
               "the output buffer is freed. The gradients go the other way: rank q's rows of every gradient into "
               "slot q, one reduce-scatter that averages, and this rank keeps its slot, in which each parameter's "
               "sharded gradient is a view.")
    fill = {"w": BLUE, "b": TEAL}
    c.text(10, 18, "w (4 × 5) and b (5) at N = 2: one all_gather moves every parameter", bold=True)
    x0 = 104

    def slot_cells(x, y, r, label=True):
        """Rank r's slot: its rows of w, then of b, padded; returns the x after it."""
        for name, shape in PER_PARAM_PARAMS:
            width = _numel(shape) // shape[0]
            for k in range(COPY_ROWS[name] * width):
                real = k < COPY_LENGTHS[name][r] * width
                c.rect(x, y, cell, 20, fill=fill[name] if real else GRAY)
                x += cell
        return x

    # copy-in: each rank's shards into its slot
    c.text(10, 48, "shards", size=MIN_FONT, bold=True)
    ys = 58
    for r in range(n):
        y = ys + r * 30
        c.text(x0 - 10, y + 15, f"rank {r}", anchor="end", size=MIN_FONT)
        x = slot_cells(x0, y, r)
        first_w, first_b = r * COPY_ROWS["w"], r * COPY_ROWS["b"]
        lb = COPY_LENGTHS["b"][r]
        pad = " + 1 pad" if lb < COPY_ROWS["b"] else ""
        c.text(x + 10, y + 15, f"w[{first_w}:{first_w + 2}], b[{first_b}:{first_b + lb}]{pad}", size=MIN_FONT, mono=True)
    y = ys + n * 30 + 6
    c.line(x0 + 6, y, x0 + 6, y + 24, arrow=True)
    c.text(x0 + 18, y + 16, "copy-in: into its own slot of the output, no other input buffer", size=MIN_FONT)

    # the all-gather's output
    y += 34
    c.box(10, y - 1, x0 - 16, 22, "all_gather", BLUE, size=MIN_FONT, mono=True)
    x = x0
    for r in range(n):
        start = x
        x = slot_cells(x, y, r)
        c.path(f"M{num(start + 1)},{num(y + 24)} v5 H{num(x - 1)} v-5", points=[(start, y + 24), (x, y + 29)], width=1)
        c.text((start + x) / 2, y + 44, f"slot {r}: rank {r}'s {slot}", anchor="middle", size=MIN_FONT)
    c.text(x + 10, y + 15, f"{n} × {slot} = {n * slot} elements", size=MIN_FONT)
    y += 56
    c.line(x0 + 6, y, x0 + 6, y + 24, arrow=True)
    c.text(x0 + 18, y + 16, "copy-out: slot q's rows of each parameter into its own tensor; the output is freed",
           size=MIN_FONT)

    # the unsharded parameters
    y += 36
    for i in range(4):
        for j in range(5):
            c.rect(x0 + j * cell, y + i * cell, cell, cell, fill=BLUE)
    c.text(x0 + 5 * cell + 8, y + 16, "w (4 × 5): rows 0-1 from slot 0, 2-3 from slot 1", size=MIN_FONT)
    for j in range(5):
        c.rect(x0 + j * cell, y + 4 * cell + 10, cell, cell, fill=TEAL)
    c.text(x0 + 5 * cell + 8, y + 4 * cell + 22, "b (5): 3 from slot 0, 2 from slot 1 (the padding left behind)",
           size=MIN_FONT)
    c.text(10, y + 30, "unsharded", size=MIN_FONT, bold=True)
    y += 4 * cell + 52
    c.text(10, y, "Backward goes the other way: rank q's rows of every gradient into slot q (copy-in), one", size=MIN_FONT)
    c.text(10, y + 18, "reduce_scatter that averages, and this rank keeps its slot: each parameter's sharded", size=MIN_FONT)
    c.text(10, y + 36, "gradient is a view of it.", size=MIN_FONT)
    return c


# Time units of chapter 11's overlap picture: a block's compute, its all-gather, and the copies either side of it
# (copy-in with the cast to param_dtype, and copy-out). tests/test_diagrams_ch11.py checks the orders the page states.
T_COMPUTE, T_ALL_GATHER, T_COPY_IN, T_COPY_OUT = 4, 3, 1, 1


def _forward_timeline(mode: str, blocks=(1, 2, 3)):
    """The forward of three fully_shard'ed blocks on one GPU, as two in-order streams: the compute stream, and
    the stream the all-gather runs on. The CPU runs far ahead, so only each stream's order and the waits matter.

    side_streams: the default. Each pre-forward issues the copy-in and the all-gather on a side stream, and the
        compute stream waits for the all-gather before its copy-out: the next block's all-gather runs under this
        block's compute (implicit prefetch).
    async_op: _set_unshard_async_op(True). The copy-in runs on the compute stream, behind the block before, and
        the all-gather cannot start before it: nothing overlaps.
    async_op_prefetch: the same, and each block's pre-forward, after its own copy-out, unshards the next block
        (set_modules_to_forward_prefetch): that copy-in is queued before this block's compute, and the all-gather
        runs under it.

    Returns (compute spans, channel spans), each (kind, block, start, end)."""
    compute, channel = [], []
    t = side = 0                  # when each stream is free
    gathered = {}

    def copy_in_and_gather(b):
        nonlocal t, side
        if mode == "side_streams":
            channel.append(("in", b, side, side + T_COPY_IN))
            side += T_COPY_IN
        else:
            compute.append(("in", b, t, t + T_COPY_IN))
            t += T_COPY_IN
            side = max(side, t)
        channel.append(("AG", b, side, side + T_ALL_GATHER))
        side += T_ALL_GATHER
        gathered[b] = side

    for i, b in enumerate(blocks):
        if b not in gathered:
            copy_in_and_gather(b)
        if gathered[b] > t:
            compute.append(("wait", b, t, gathered[b]))
            t = gathered[b]
        compute.append(("out", b, t, t + T_COPY_OUT))
        t += T_COPY_OUT
        if mode == "async_op_prefetch" and i + 1 < len(blocks):
            copy_in_and_gather(blocks[i + 1])
        compute.append(("compute", b, t, t + T_COMPUTE))
        t += T_COMPUTE
    return compute, channel


def unshard_async_op() -> Canvas:
    c = Canvas("unshard_async_op", 420, "async_op moves the copy-in onto the compute stream: overlap then needs prefetch",
               "Three timelines of the forward of blocks 1 to 3 on one GPU, each with the compute stream and the "
               "stream the all-gather runs on. By default the copy-in and the all-gather of each block run on a side "
               "stream, and block 2's all-gather runs while block 1 computes: only the first is waited for, and the "
               "forward takes 19 time units. With _set_unshard_async_op(True) the copy-in (with the cast) runs on "
               "the compute stream, queued behind block 1's compute, and block 2's all-gather cannot start before "
               "it: every all-gather is waited for, 27 units. With async_op and an explicit forward prefetch, "
               "block 1's pre-forward queues block 2's copy-in before block 1's compute, and the all-gather runs "
               "under it again: 21 units, the copy-ins still on the compute stream.")
    x0, unit = 122, 20
    modes = [("side_streams", "default: copy-in and all_gather on a side stream"),
             ("async_op", "_set_unshard_async_op(True)"),
             ("async_op_prefetch", "_set_unshard_async_op(True) + forward prefetch")]
    notes = {"side_streams": "block 2's all_gather runs under block 1's compute",
             "async_op": "block 2's copy-in waits behind block 1's compute: nothing overlaps",
             "async_op_prefetch": "block 2's copy-in is queued before block 1 computes"}
    y = 8
    for mode, title in modes:
        compute, channel = _forward_timeline(mode)
        end = max(e for *_, e in compute)
        waited = sum(e - s for kind, _, s, e in compute if kind == "wait")
        c.text(10, y + 16, title, mono=mode != "side_streams", bold=True, size=14 if mode == "side_streams" else 13.4)
        c.text(WIDTH - 10, y + 16, f"forward: {end} · waiting: {waited}", anchor="end", size=MIN_FONT)
        c.text(10, y + 35, notes[mode], size=MIN_FONT)
        lanes = (("compute", compute, y + 44),
                 ("side stream" if mode == "side_streams" else "NCCL's own", channel, y + 76))
        for lane, spans, top in lanes:
            c.text(x0 - 8, top + 17, lane, anchor="end", size=MIN_FONT)
            for kind, b, a, e in spans:
                label, fill = {"wait": ("wait", RED), "compute": (f"block {b}", GRAY), "AG": (f"AG {b}", BLUE),
                               "in": ("", YELLOW), "out": ("", TEAL)}[kind]
                c.box(x0 + a * unit + 0.5, top, (e - a) * unit - 1, 26, label, fill, size=MIN_FONT)
        y += 124
    y -= 2
    for t in range(0, 28, 4):
        c.text(x0 + t * unit, y, str(t), anchor="middle", size=MIN_FONT)
    c.text(x0 - 8, y, "time", anchor="end", size=MIN_FONT)
    y += 26
    x = swatch(c, 10, y, YELLOW, "cast + copy-in") + 14
    x = swatch(c, x, y, BLUE, "AG: all_gather") + 14
    x = swatch(c, x, y, TEAL, "copy-out") + 14
    swatch(c, x, y, RED, "compute stream waits")
    return c


DIAGRAMS = (per_parameter_shards, class_swap, copy_in_out, unshard_async_op)
