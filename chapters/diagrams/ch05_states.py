"""Chapter 5's newer pictures: the FlatParameter's three states, what its storage does, and its flat gradient.

The numbers are those of chapter 5's example unit (make_diagrams.py's flat_parameter): w (4 x 5) and b (5) at
N = 4, each parameter on a 16-element (64-byte) boundary, padded to 48 elements, 12 a rank, fp32.
tests/test_diagrams.py checks them against minifsdp.zero.flat.flat_layout, and the state names against
minifsdp.fsdp.flat_param.ShardState.
"""

from __future__ import annotations

from canvas import *  # noqa: F403  the canvas and the colours

UNIT_N = 4
UNIT_PARAMS = [("w", (4, 5)), ("b", (5,))]
UNIT_OFFSETS, UNIT_PADDED = [0, 32], 48          # flat_layout([20, 5], 4, 16)
UNIT_SHARD = UNIT_PADDED // UNIT_N               # shard_numel: 12
UNIT_BYTES = 4                                   # fp32
# ShardState: (name, value), in the order a unit goes through them
STATES = [("SHARDED", "sharded"), ("UNSHARDING", "all-gather in flight"), ("UNSHARDED", "unsharded")]


def flat_param_states() -> Canvas:
    n, padded, shard = UNIT_N, UNIT_PADDED, UNIT_SHARD
    c = Canvas("flat_param_states", 452, "The FlatParameter's three states, and the calls that move it between them",
               f"Three cards, one per ShardState, for chapter 5's unit at N = {n}: {padded} elements, {shard} a rank. "
               f"SHARDED: the rank holds its shard of {shard} elements, _full has no memory, the parameters' places "
               f"hold empty tensors. unshard(async_op=True) gives _full its {padded} elements back and starts an "
               "all_gather of every rank's shard into it: UNSHARDING, the network writing, the places still empty. "
               "wait_for_unshard() waits, points param at _full and sets each place to its view: UNSHARDED, "
               f"{shard} + {padded} elements held. reshard() frees _full's memory and empties the places, from "
               "either state (from UNSHARDING it waits for the all-gather first). In backward, while UNSHARDED, "
               f"autograd fills param.grad, flat, {padded} elements; reduce_scatter_grad() scales it by 1/N and "
               f"reduce-scatters it in place, leaving this rank's {shard} elements of the average.")
    per = 3.75                                  # units per element: _full is 180 wide
    cols = [10, 240, 470]
    cw = 200
    top = 76

    # the transitions forward, above the cards
    def over(i, label, pill=None):
        a, b = cols[i] + cw / 2 + 30 * i, cols[i + 1] + cw / 2 - 30 + 30 * i
        c.path(f"M{num(a)},{top - 2} V46 H{num(b)} V{top - 2}", points=[(a, 46), (b, top - 2)], arrow=True)
        c.text((a + b) / 2, 30, label, anchor="middle", mono=True, size=MIN_FONT)
        if pill:
            w = text_width(pill, MIN_FONT, mono=True) + 12
            c.box((a + b) / 2 - w / 2, 36, w, 20, pill, BLUE, size=MIN_FONT, mono=True)

    over(0, "unshard(async_op=True)", "all_gather")
    over(1, "wait_for_unshard()")

    held = [  # per state: _full (fill, dashed, label), param, places, elements held
        ((None, True, "_full: 0 bytes"), "param: the shard", "places: empty tensors", f"holds {shard} elements"),
        ((BLUE, True, "_full: being written"), "param: the shard", "places: still empty", f"holds {shard} + {padded} elements"),
        ((BLUE, False, f"_full: {padded} elements"), "param: _full", "places: views of _full",
         f"holds {shard} + {padded} elements")]
    for x, (name, value), ((fill, dash, label), param, places, total) in zip(cols, STATES, held):
        c.rect(x, top, cw, 196, dash=False)
        c.box(x, top, cw, 44, [(name, {"mono": True, "bold": True, "size": 14}), value], GRAY, size=MIN_FONT)
        y = top + 56
        c.box(x + 10, y, shard * per, 24, str(shard), BLUE, size=MIN_FONT)
        c.text(x + 18 + shard * per, y + 17, "its shard", size=MIN_FONT)
        y += 32
        if fill is None:
            c.rect(x + 10, y, padded * per, 24, dash=True)
            c.text(x + 10 + padded * per / 2, y + 17, label, anchor="middle", size=MIN_FONT, mono=True)
        else:
            c.box(x + 10, y, padded * per, 24, label, fill, size=MIN_FONT, mono=True, dash=dash)
        y += 46
        for s in (param, places, total):
            c.text(x + 10, y, s, size=MIN_FONT)
            y += 19

    # back to SHARDED, below the cards
    bottom = top + 196
    a, mid, b = cols[2] + cw / 2, cols[1] + cw / 2, cols[0] + cw / 2
    c.path(f"M{num(a)},{bottom + 2} V{bottom + 24} H{num(b)} V{bottom + 2}",
           points=[(a, bottom + 24), (b, bottom + 2)], arrow=True)
    c.line(mid, bottom + 2, mid, bottom + 24, dash=True)
    for i, s in enumerate(("reshard(), after forward and after backward: _full's memory is",
                           "freed (its storage resized to 0 bytes) and the places emptied. From UNSHARDING",
                           "it first waits for the all-gather: no buffer is freed while the network writes.")):
        c.text(b + 10, bottom + 42 + 18 * i, s, size=MIN_FONT)

    # the gradient, in backward
    y = bottom + 114
    c.text(10, y, "in backward, UNSHARDED: autograd fills param.grad, flat; then reduce_scatter_grad()", bold=True,
           size=MIN_FONT)
    y += 12
    c.box(10, y, padded * per, 26, f"param.grad: {padded}", ORANGE, size=MIN_FONT, mono=True)
    x = 10 + padded * per
    c.text(x + 28, y + 8, "× 1/N", anchor="middle", size=MIN_FONT)
    c.line(x + 4, y + 16, x + 52, y + 16, arrow=True)
    pill = text_width("reduce_scatter", MIN_FONT, mono=True) + 12
    c.box(x + 56, y + 3, pill, 20, "reduce_scatter", ORANGE, size=MIN_FONT, mono=True)
    x += 56 + pill
    c.line(x + 4, y + 13, x + 34, y + 13, arrow=True)
    c.box(x + 38, y, shard * per, 26, str(shard), ORANGE, size=MIN_FONT)
    c.text(x + 46 + shard * per, y + 12, "this rank's shard of", size=MIN_FONT)
    c.text(x + 46 + shard * per, y + 29, "the average: .grad", size=MIN_FONT)
    return c


STORAGE_BYTES = UNIT_PADDED * UNIT_BYTES          # _full's storage: 192 bytes


def flat_param_storage() -> Canvas:
    full = STORAGE_BYTES
    c = Canvas("flat_param_storage", 300, "reshard() frees the storage under the views, not the views",
               f"Three panels. Unsharded, once forward has run: the tensor _full and the weight view autograd saved for "
               f"backward both point at one storage of {full} bytes. Dropping _full instead of resizing: the saved "
               f"view still points at the storage, so its {full} bytes stay allocated until backward. reshard(): the "
               "storage is resized to 0 bytes; _full and the saved view remain valid objects with no bytes behind "
               f"them. Below: before backward, unshard() resizes the same storage back to {full} bytes and the "
               "all-gather writes into it, so the saved view reads the right values again.")
    panels = [("forward has run, unsharded", "unsharded", True, full, f"{full} bytes held"),
              ("drop _full instead", "dropped", False, full, f"{full} bytes still held, by the view"),
              ("reshard(): resize_(0)", "reshard", True, 0, "0 bytes: the memory is back")]
    pw, gap = 210, 15
    for i, (title, kind, has_full, size, verdict) in enumerate(panels):
        x = 10 + i * (pw + gap)
        c.text(x, 20, title, bold=True, mono=title.startswith("reshard"), size=MIN_FONT if i == 2 else 14)
        rows = [(34, "_full", True), (80, "saved by autograd", False)]
        sx, sy, sw, sh = x + 150, 34, 58, 72
        if size:
            c.box(sx, sy, sw, sh, [f"{size}", "bytes"], BLUE, size=MIN_FONT)
        else:
            c.rect(sx, sy, sw, sh, dash=True)
            c.text(sx + sw / 2, sy + 32, "0", anchor="middle", size=MIN_FONT)
            c.text(sx + sw / 2, sy + 50, "bytes", anchor="middle", size=MIN_FONT)
        c.text(sx + sw / 2, sy + sh + 18, "storage", anchor="middle", size=MIN_FONT)
        for y, label, mono in rows:
            if label == "_full" and not has_full:
                c.rect(x, y, 124, 26, dash=True)
                c.text(x + 62, y + 18, "_full: dropped", anchor="middle", size=MIN_FONT)
                continue
            c.rect(x, y, 124, 26)
            c.text(x + 62, y + 18, label, anchor="middle", size=MIN_FONT, mono=mono)
            c.line(x + 126, y + 13, sx - 2, y + 13, arrow=True)
        c.text(x, 150, verdict, size=MIN_FONT)
    y = 176
    c.line(10, y, WIDTH - 10, y, dash=True)
    c.text(10, y + 24, "before backward, unshard() again", bold=True, size=MIN_FONT)
    x, top = 10, y + 36
    for row, label, mono in ((top, "_full", True), (top + 46, "saved by autograd", False)):
        c.rect(x, row, 124, 26)
        c.text(x + 62, row + 18, label, anchor="middle", size=MIN_FONT, mono=mono)
        c.line(x + 126, row + 13, x + 148, row + 13, arrow=True)
    c.box(x + 150, top, 58, 72, [f"{full}", "bytes"], BLUE, size=MIN_FONT)
    pill = text_width("all_gather", MIN_FONT, mono=True) + 12
    c.line(x + 240, top + 36, x + 210, top + 36, arrow=True)
    c.box(x + 242, top + 26, pill, 20, "all_gather", BLUE, size=MIN_FONT, mono=True)
    tx = x + 242 + pill + 16
    for i, line in enumerate(("_alloc_storage gives the same storage its",
                              f"{full} bytes back; the all_gather writes into",
                              "it. The view autograd saved reads the values",
                              "backward needs, as if never freed.")):
        c.text(tx, top + 12 + 19 * i, line, size=MIN_FONT)
    return c


def flat_param_grad() -> Canvas:
    n, padded, shard = UNIT_N, UNIT_PADDED, UNIT_SHARD
    sizes = {name: (shape[0] * shape[1] if len(shape) == 2 else shape[0]) for name, shape in UNIT_PARAMS}
    # the flat layout as spans: (start, end, parameter or None for zeros)
    spans, end = [], 0
    for (name, _), offset in zip(UNIT_PARAMS, UNIT_OFFSETS):
        if offset > end:
            spans.append((end, offset, None))
        spans.append((offset, offset + sizes[name], name))
        end = offset + sizes[name]
    spans.append((end, padded, None))
    c = Canvas("flat_param_grad", 356, "The flat gradient: built once by the split's backward, averaged in place",
               f"Top: in backward, autograd gives the split's backward one gradient per piece of the buffer: w's "
               f"{sizes['w']} elements, zeros for the gap, b's {sizes['b']}, zeros for the padding. It "
               f"concatenates them into param.grad, one flat tensor of {padded} elements, so for a moment two flat "
               f"gradients are alive. Below, at N = {n}: every rank scales its own param.grad by 1/N and calls one "
               f"reduce_scatter whose output is its own chunk of {shard} elements of that same tensor. Afterwards "
               f"rank q's chunk q holds the sum over the {n} ranks of their chunk q, the average; the other chunks "
               f"are no longer needed. grad_for_optimizer copies the chunk out as .grad, and the flat gradient is "
               f"released.")
    x0 = 120
    per = 9.0                                   # the top strips: 48 elements are 432 units

    c.text(10, 18, "on each rank, the split's backward: one gradient per piece, then one flat tensor", bold=True,
           size=MIN_FONT)
    y = 32
    c.text(x0 - 10, y + 17, "the pieces", anchor="end", size=MIN_FONT)
    x = x0
    for a, b, name in spans:
        label = (f"{name}.grad" if (b - a) * per > 60 else name) if name else "zeros"
        c.box(x, y, (b - a) * per - 6, 24, label, ORANGE if name else GRAY, size=MIN_FONT, mono=name is not None)
        x += (b - a) * per
    c.line(x0 + 20, y + 28, x0 + 20, y + 50, arrow=True)
    c.text(x0 + 30, y + 44, "cat: the split's backward", size=MIN_FONT)
    y += 56
    c.text(x0 - 10, y + 17, "param.grad", anchor="end", size=MIN_FONT, mono=True)
    for a, b, name in spans:
        label = (f"{name}.grad" if (b - a) * per > 60 else name) if name else "zeros"
        c.box(x0 + a * per, y, (b - a) * per, 24, label, ORANGE if name else GRAY, size=MIN_FONT,
              mono=name is not None)
    for v in (0, padded):
        c.text(x0 + v * per, y + 42, str(v), anchor="middle", size=MIN_FONT)
    bracket(c, x0 + padded * per + 8, 32, y + 24, ["two flat", "sizes alive"])

    y += 76
    c.text(10, y, f"reduce_scatter_grad() at N = {n}: × 1/N, then a reduce_scatter into chunk q, in place",
           bold=True, size=MIN_FONT)
    y += 14
    small = 4.0                                 # the ranks' strips: 48 elements are 192 units
    left, right = 78, 440
    pill = text_width("reduce_scatter", MIN_FONT, mono=True) + 12
    for q in range(n):
        top = y + q * 32
        c.text(left - 8, top + 17, f"rank {q}", anchor="end", size=MIN_FONT)
        for k in range(n):
            c.rect(left + k * shard * small, top, shard * small, 24, fill=ORANGE)
            if k == q:
                c.rect(right + k * shard * small, top, shard * small, 24, fill=ORANGE, width=2)
                c.text(right + (k + 0.5) * shard * small, top + 17, "mean", anchor="middle", size=MIN_FONT,
                       colour=INK)
            else:
                c.rect(right + k * shard * small, top, shard * small, 24, dash=True)
    mid = y + 2 * 32 - 4
    c.line(left + padded * small + 8, mid, right - 8, mid, arrow=True)
    c.box((left + padded * small + right) / 2 - pill / 2, mid - 10, pill, 20, "reduce_scatter", ORANGE,
          size=MIN_FONT, mono=True)
    y += n * 32 + 4
    c.text(left, y + 12, "each rank's own param.grad", size=MIN_FONT)
    c.text(right, y + 12, f"chunk q: {shard} elements, the average", size=MIN_FONT)
    y += 40
    c.text(10, y, f"grad_for_optimizer() copies chunk q out as .grad ({shard} elements), and the flat gradient goes.",
           size=MIN_FONT)
    return c


def flat_param_tied() -> Canvas:
    c = Canvas("flat_param_tied", 304, "A tied weight is stored once; frozen parameters get a FlatParameter of their own",
               "Left, a unit's places: wte.weight, fc.weight and lm_head.weight, where lm_head.weight is the same "
               "parameter as wte.weight, and a frozen norm.weight. The trainable FlatParameter lays out wte's weight "
               "once and fc's weight after it: both wte.weight and lm_head.weight become views of the same slice, "
               "and in backward both uses add their gradients into it. The frozen parameter, which needs no "
               "gradient, goes into a second FlatParameter of the unit, gathered and freed with it, never "
               "reduce-scattered.")
    places = [("fc.weight", 1, 28), ("wte.weight", 0, 64), ("lm_head.weight", 0, 136)]  # (name, slice, y)
    px, pw = 10, 150
    fx, sy = 300, 100
    slices = [(fx, 180, "wte.weight"), (fx + 180, 120, "fc.weight")]
    c.text(px, 18, "places", bold=True, size=MIN_FONT)
    c.text(fx, 18, "the trainable FlatParameter", bold=True, size=MIN_FONT)
    for x, w, label in slices:
        c.box(x, sy, w, 26, label, BLUE, size=MIN_FONT, mono=True)
    c.box(fx + 300, sy, 60, 26, "zeros", GRAY, size=MIN_FONT)
    for name, k, y in places:
        c.rect(px, y, pw, 26)
        c.text(px + pw / 2, y + 18, name, anchor="middle", mono=True, size=MIN_FONT)
        x, w, _ = slices[k]
        tx = x + w / 2 + (-30 if name == "wte.weight" else 30 if name == "lm_head.weight" else 0)
        end = sy - 2 if y < sy else sy + 28
        c.path(f"M{num(px + pw + 2)},{y + 13} H{num(tx)} V{num(end)}", points=[(px + pw + 2, y + 13), (tx, end)],
               arrow=True)
    c.text(fx, sy + 80, "lm_head.weight is wte.weight: one slice, two views;", size=MIN_FONT)
    c.text(fx, sy + 98, "in backward both uses add into the same gradient", size=MIN_FONT)
    y = 228
    c.line(10, y - 14, WIDTH - 10, y - 14, dash=True)
    c.rect(px, y, pw, 26)
    c.text(px + pw / 2, y + 18, "norm.weight", anchor="middle", mono=True, size=MIN_FONT)
    c.text(px, y + 46, "requires_grad=False", size=MIN_FONT, mono=True)
    c.line(px + pw + 2, y + 13, fx - 4, y + 13, arrow=True)
    c.box(fx, y, 120, 26, "norm.weight", BLUE, size=MIN_FONT, mono=True)
    c.text(fx + 130, y + 18, "a second FlatParameter", bold=True, size=MIN_FONT)
    c.text(fx, y + 46, "gathered and freed with the unit, no gradient,", size=MIN_FONT)
    c.text(fx, y + 64, "never reduce-scattered", size=MIN_FONT)
    return c


# One block of TinyGPT() (the default config): its tensors in registration order, (name, elements).
# tests/test_diagrams.py checks them against the model.
BLOCK = [("ln_1.weight", 32), ("ln_1.bias", 32), ("attn.qkv.weight", 3072), ("attn.proj.weight", 1024),
         ("attn.proj.bias", 32), ("ln_2.weight", 32), ("ln_2.bias", 32), ("fc.weight", 4096), ("fc.bias", 128),
         ("fc_proj.weight", 4096), ("fc_proj.bias", 32)]


def flat_param_why() -> Canvas:
    total = sum(numel for _, numel in BLOCK)
    small = sum(1 for _, numel in BLOCK if numel <= 128)
    calls = len(BLOCK)
    c = Canvas("flat_param_why", 250, "Why flatten: one all-gather per unit instead of one per tensor",
               f"A block of the default TinyGPT holds {calls} tensors, {total:,} parameters, {small} of the tensors "
               f"128 elements or fewer. Gathered tensor by tensor, it takes {calls} all_gather calls, each paying the "
               "fixed cost of a call (drawn grey, the same for every call) before its bytes (blue, in proportion to "
               "the tensor's size); most calls are nearly all fixed cost. Flattened, the block is one tensor and "
               "takes one all_gather: one fixed cost, and the same bytes.")
    x0, fixed, gap = 160, 24, 3
    per = (WIDTH - 10 - x0 - calls * (fixed + gap)) / total
    c.text(10, 18, f"one block of TinyGPT: {calls} tensors, {total:,} parameters; each box is one all_gather",
           bold=True, size=MIN_FONT)
    rows = [("tensor by tensor", [numel for _, numel in BLOCK], 36),
            ("flattened", [total], 106)]
    for label, sizes, y in rows:
        c.text(10, y + 18, label, size=MIN_FONT, bold=True)
        x = x0
        for numel in sizes:
            c.rect(x, y, fixed, 26, fill=GRAY)
            c.rect(x + fixed, y, max(numel * per, 1), 26, fill=BLUE)
            x += fixed + numel * per + gap
        n = len(sizes)
        c.text(x0, y + 44, f"{n} all_gather{'s' if n > 1 else ''}: {n} fixed cost{'s' if n > 1 else ''}, "
               f"{total:,} elements", size=MIN_FONT)
    y = 196
    x = swatch(c, 10, y, GRAY, "the fixed cost of a call, whatever its size") + 18
    swatch(c, x, y, BLUE, "the parameters it carries")
    c.text(10, y + 26, f"{small} of the {calls} tensors hold 128 elements or fewer: their calls are almost all fixed cost.",
           size=MIN_FONT)
    return c


def flat_param_views() -> Canvas:
    padded = UNIT_PADDED
    sizes = {name: (shape[0] * shape[1] if len(shape) == 2 else shape[0]) for name, shape in UNIT_PARAMS}
    params = sum(sizes.values())
    c = Canvas("flat_param_views", 258, "Views into the all-gather buffer: the values land in place, nothing is copied",
               f"Two ways to unshard chapter 5's unit. Left, gather then copy: the all_gather fills a buffer of "
               f"{padded} elements, then w ({sizes['w']}) and b ({sizes['b']}) are copied out into tensors of their "
               f"own; during the copy {padded} + {params} elements are alive, and the copy takes time. Right, views: "
               f"the all_gather fills _full, {padded} elements, and module.weight and module.bias are views of its "
               f"slices [0:20] and [32:37]: nothing is copied, {padded} elements at the peak.")
    per = 5.0
    panels = [(10, "gather, then copy out", False), (350, "gather into _full, then views", True)]
    pill = text_width("all_gather", MIN_FONT, mono=True) + 12
    for x, title, views in panels:
        c.text(x, 18, title, bold=True, size=MIN_FONT)
        c.box(x, 30, pill, 20, "all_gather", BLUE, size=MIN_FONT, mono=True)
        c.line(x + pill / 2, 52, x + pill / 2, 68, arrow=True)
        c.box(x, 70, padded * per, 24, "_full" if views else "a buffer", BLUE, size=MIN_FONT, mono=views)
        for (name, _), offset in zip(UNIT_PARAMS, UNIT_OFFSETS):
            a, b = x + offset * per, x + (offset + sizes[name]) * per
            if views:
                label, ty = ("module.weight", 140) if name == "w" else ("module.bias", 164)
                c.path(f"M{num(a)},97 v6 H{num(b)} v-6", points=[(a, 97), (b, 103)])
                c.line((a + b) / 2, 103, (a + b) / 2, ty - 14, arrow=True)
                c.text((a + b) / 2, ty, f"{label}: a view", anchor="middle" if name == "w" else "start",
                       size=MIN_FONT, mono=False)
            else:
                c.line((a + b) / 2, 96, (a + b) / 2, 124, arrow=True)
                c.box(a, 128, b - a, 24, name, BLUE, size=MIN_FONT, mono=True)
        if not views:
            c.text(x, 172, "copied out: module.weight and", size=MIN_FONT)
            c.text(x, 190, "module.bias are tensors of their own", size=MIN_FONT)
        verdict = (f"peak: {padded} elements, nothing copied" if views
                   else f"peak: {padded} + {params} elements, and a copy's time")
        c.text(x, 222, verdict, size=MIN_FONT, bold=True)
    c.text(10, 248, "The price of views: _full lives as long as anything computes with one of them.", size=MIN_FONT)
    return c


DIAGRAMS = (flat_param_states, flat_param_storage, flat_param_grad, flat_param_tied, flat_param_why,
            flat_param_views)
