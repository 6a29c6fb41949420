"""Chapter 1's diagrams: the four collectives on three ranks, and the naive DDP next to PyTorch's.

What they show of the code is written here as data: the collectives' results (tests/test_diagrams_ch01.py
runs the same collectives through minifsdp.distributed.comm on three ranks), and a small model of one
backward pass whose buckets are packed as ddp.py's _pack packs them (the same test checks it).
"""

from __future__ import annotations

from canvas import *  # noqa: F403  the canvas and the colours

# -- the four collectives -------------------------------------------------------------------------------------------
COLLECTIVE_INPUTS = [[1, 2, 3], [10, 20, 30], [100, 200, 300]]  # rank r's tensor


def collective_results(inputs=COLLECTIVE_INPUTS) -> dict[str, list[list[int]]]:
    """What each rank ends with (a sum where there is one), for each collective."""
    n = len(inputs)
    total = [sum(column) for column in zip(*inputs)]
    gathered = [v for tensor in inputs for v in tensor]
    return {"all_reduce": [total] * n,
            "reduce_scatter": [[total[r]] for r in range(n)],
            "all_gather": [gathered] * n,
            "broadcast": [inputs[0]] * n}


def four_collectives() -> Canvas:
    inputs, results = COLLECTIVE_INPUTS, collective_results()
    n, k = len(inputs), len(inputs[0])
    c = Canvas("four_collectives", 356, "The four collectives of data parallelism, on three ranks",
               "Three ranks start with one tensor each: rank 0 holds 1, 2, 3; rank 1 holds 10, 20, 30; rank 2 "
               "holds 100, 200, 300. After all_reduce every rank holds the sum, 111, 222, 333. After "
               "reduce_scatter rank 0 holds 111, rank 1 222 and rank 2 333: one chunk of the sum each. After "
               "all_gather every rank holds all nine numbers in rank order. After a broadcast from rank 0 every "
               "rank holds 1, 2, 3. The all_gather of what reduce_scatter left gives the all_reduce's result.")
    cell_w, cell_h, pitch, label_w = 32, 22, 26, 50

    def panel(x, y, title, note, rows, colour_of):
        w = c.text(x, y, title, mono=True, bold=True)
        c.text(x + w + 10, y, note, size=MIN_FONT)
        for r, row in enumerate(rows):
            top = y + 10 + r * pitch
            c.text(x + label_w - 6, top + 16, f"rank {r}", anchor="end", size=MIN_FONT)
            for i, v in enumerate(row):
                c.box(x + label_w + i * cell_w, top, cell_w - 2, cell_h, str(v), colour_of(r, i), size=MIN_FONT)

    panel(10, 20, "before", "each rank's own tensor", inputs, lambda r, i: RANKS[r])
    panel(344, 20, "broadcast", "from rank 0", results["broadcast"], lambda r, i: RANKS[0])
    y = 136
    panel(10, y, "all_reduce", "the sum, everywhere", results["all_reduce"], lambda r, i: PURPLE)
    panel(344, y, "reduce_scatter", "chunk r of the sum", results["reduce_scatter"], lambda r, i: ORANGE)
    y += 116
    panel(10, y, "all_gather", "every tensor, in rank order", results["all_gather"], lambda r, i: RANKS[i // k])
    for i, s in enumerate(("all_gather what reduce_scatter left,", "111 | 222 | 333, and every rank has",
                           "the all_reduce's result.")):
        c.text(380, y + 26 + 18 * i, s, size=MIN_FONT)
    assert n == 3
    return c


# -- naive DDP against buckets and overlap ---------------------------------------------------------------------------
# One backward pass of four layers (4 time units each), each with a weight and a bias whose all-reduce moves
# 1.5 and 0.5 units of bytes; every call also pays a fixed cost. DDP's buckets are ddp.py's _pack of the
# gradients in the order backward produces them, with a cap of one layer's bytes (tests/test_diagrams_ch01.py).
DDP_LAYERS = (4, 3, 2, 1)                 # the order backward reaches them
DDP_T_LAYER = 4                           # backward compute of one layer
DDP_SEND = {"weight": 1.5, "bias": 0.5}   # time to move each gradient's bytes
DDP_FIXED = 1                             # the fixed cost of one call, whatever its size
DDP_CAP = 2                               # a bucket's cap, in the same units as DDP_SEND
DDP_BUCKETS = [(4,), (3,), (2,), (1,)]    # _pack's buckets: layers, in launch order
DDP_STEP = 2                              # the optimizer step


def ddp_timeline(mode: str):
    """(compute spans, channel spans), each (kind, label, start, end), for mode "naive" or "buckets": one FIFO
    channel carries the all-reduces, one at a time, in issue order."""
    compute, channel = [], []
    done = {}
    t = 0
    for layer in DDP_LAYERS:
        compute.append(("backward", f"layer {layer}", t, t + DDP_T_LAYER))
        t += DDP_T_LAYER
        done[layer] = t
    free = 0
    if mode == "naive":  # after backward, one blocking all_reduce per gradient
        free = t
        for layer in DDP_LAYERS:
            for name, send in DDP_SEND.items():
                channel.append(("fixed", "", free, free + DDP_FIXED))
                channel.append(("bytes", f"{name[0]}{layer}", free + DDP_FIXED, free + DDP_FIXED + send))
                free += DDP_FIXED + send
    else:  # each bucket, once its last gradient is ready, in bucket order
        for i, layers in enumerate(DDP_BUCKETS):
            start = max(free, max(done[layer] for layer in layers))
            send = sum(DDP_SEND.values()) * len(layers)
            channel.append(("fixed", "", start, start + DDP_FIXED))
            channel.append(("bytes", f"bucket {i}", start + DDP_FIXED, start + DDP_FIXED + send))
            free = start + DDP_FIXED + send
    if free > t:
        compute.append(("wait", "wait", t, free))
        t = free
    compute.append(("step", "step", t, t + DDP_STEP))
    return compute, channel


def ddp_naive_vs_overlap() -> Canvas:
    c = Canvas("ddp_naive_vs_overlap", 386, "Naive DDP against PyTorch's: buckets, and all-reduces during backward",
               "Two timelines of one backward pass over layers 4, 3, 2 and 1, then the optimizer step. NaiveDDP "
               "waits for backward to end, then all-reduces the eight gradients one after another, each call "
               "paying a fixed cost before its bytes: the processor waits 16 time units and the step starts at "
               "32. DistributedDataParallel packs the gradients into four buckets, one layer's weight and bias "
               "each, and starts each bucket's all-reduce as soon as its last gradient is ready: three of them "
               "travel while backward computes the next layers, four fixed costs instead of eight, and the step "
               "starts at 19.")
    x0, unit = 118, 16.4
    fills = {"backward": ORANGE, "wait": RED, "step": GREEN, "fixed": GRAY, "bytes": PURPLE}
    cases = [("NaiveDDP", "naive", "one blocking all_reduce per gradient, after backward"),
             ("DistributedDataParallel", "buckets", "buckets, each sent as soon as it is full")]
    y = 8
    for title, mode, note in cases:
        compute, channel = ddp_timeline(mode)
        step = next(start for kind, _, start, _ in compute if kind == "step")
        calls = sum(1 for kind, *_ in channel if kind == "fixed")
        w = c.text(10, y + 16, title, mono=True, bold=True)
        c.text(20 + w, y + 16, note, size=MIN_FONT)
        c.text(10, y + 36, f"{calls} calls · the step starts at {num(step)}", size=MIN_FONT)
        for lane, spans, top in (("compute", compute, y + 46), ("network", channel, y + 78)):
            c.text(x0 - 8, top + 17, lane, anchor="end", size=MIN_FONT)
            for kind, label, a, b in spans:
                width = (b - a) * unit
                fits = label and text_width(label, MIN_FONT) < width - 6
                c.box(x0 + a * unit + 0.5, top, width - 1, 26, label if fits else "", fills[kind], size=MIN_FONT)
        y += 126
    y += 2
    for t in range(0, 36, 4):
        c.text(x0 + t * unit, y, str(t), anchor="middle", size=MIN_FONT)
    c.text(x0 - 8, y, "time", anchor="end", size=MIN_FONT)
    y += 28
    x = swatch(c, 10, y, ORANGE, "backward of a layer") + 16
    x = swatch(c, x, y, GRAY, "a call's fixed cost") + 16
    swatch(c, x, y, PURPLE, "all_reduce of its bytes")
    y += 22
    x = swatch(c, 10, y, RED, "compute waiting for the network") + 16
    swatch(c, x, y, GREEN, "optimizer step")
    y += 28
    c.text(10, y, "Buckets: 4 calls instead of 8, so 4 fixed costs. Overlap: 3 of the 4 buckets travel", size=MIN_FONT)
    c.text(10, y + 18, "while backward computes the next layers. Both compute the same averages.", size=MIN_FONT)
    return c


# -- buckets strictly in order ------------------------------------------------------------------------------------
# Two ranks whose gradients fill bucket 1 before bucket 0 on rank 1: the order each rank issues its all-reduces,
# launched as they fill, and as DistributedDataParallel launches them (_launch_ready_buckets; the test
# replays it).
ORDER_FILLED = {0: (0, 1), 1: (1, 0)}  # rank: the order its buckets fill


def issue_order(filled, strict: bool) -> list[int]:
    """The buckets a rank issues, in order, as they fill: at once, or only after every earlier bucket."""
    if not strict:
        return list(filled)
    issued, ready = [], set()
    for b in filled:
        ready.add(b)
        while len(issued) in ready:
            issued.append(len(issued))
    return issued


def ddp_bucket_order() -> Canvas:
    c = Canvas("ddp_bucket_order", 304, "Why DDP launches its buckets strictly in order",
               "Two ranks, two buckets. On rank 1 bucket 1 fills before bucket 0. Launched as they fill, rank 0 "
               "issues bucket 0 then bucket 1, rank 1 bucket 1 then bucket 0, and since collectives are matched "
               "by the order ranks issue them, the first all_reduce adds rank 0's bucket 0 to rank 1's bucket 1: "
               "wrong sums, or a hang when the sizes differ. DistributedDataParallel launches strictly in bucket "
               "order: rank 1 holds bucket 1 until bucket 0 has gone, both ranks issue bucket 0 then bucket 1, "
               "and every all_reduce adds a bucket to the same bucket.")
    x0, w, gap = 130, 196, 12
    cases = [("launched as they fill", False), ("DistributedDataParallel: strictly in bucket order", True)]
    y = 20
    for title, strict in cases:
        c.text(10, y, title, bold=True)
        orders = {r: issue_order(ORDER_FILLED[r], strict) for r in ORDER_FILLED}
        for r, order in orders.items():
            top = y + 12 + r * 32
            c.text(x0 - 10, top + 18, f"rank {r} issues", anchor="end", size=MIN_FONT)
            for i, b in enumerate(order):
                c.box(x0 + i * (w + gap), top, w, 26, f"all_reduce bucket {b}", PURPLE, size=MIN_FONT)
        for i in range(2):
            same = orders[0][i] == orders[1][i]
            label = f"call {i + 1}: bucket {orders[0][i]} + bucket {orders[1][i]}"
            c.box(x0 + i * (w + gap), y + 80, w, 24, label, GREEN if same else RED, size=MIN_FONT)
        c.text(x0 + 2 * (w + gap) + 4, y + 97, "right" if strict else "wrong", size=MIN_FONT, bold=True)
        y += 134
    c.text(10, y - 10, "On rank 1 bucket 1 fills first. Collectives are matched by the order ranks issue them,",
           size=MIN_FONT)
    c.text(10, y + 8, "so DDP holds a bucket that fills early until every bucket before it has gone.",
           size=MIN_FONT)
    return c


# -- no_sync ----------------------------------------------------------------------------------------------------------
# Two micro-batches: the first forward runs inside no_sync(), so its backward sends nothing and .grad keeps g1;
# the second's backward all-reduces g1 + g2, bucket by bucket. tests/test_diagrams_ch01.py counts the
# all-reduces of each backward under DistributedDataParallel.
NO_SYNC_ALL_REDUCES = (0, 2)  # all-reduces issued by each backward, with two buckets


def ddp_no_sync() -> Canvas:
    c = Canvas("ddp_no_sync", 212, "no_sync: gradient accumulation sends once, after the last micro-batch",
               "A timeline of two micro-batches on one rank. The first forward runs inside no_sync(): its backward "
               "sends nothing, and .grad holds the first micro-batch's gradients, g1. The second forward runs "
               "outside: its backward adds g2 into .grad and all-reduces the sums, two buckets, while it runs; "
               "then .grad holds the average of g1 + g2 over the ranks, and the optimizer steps once.")
    x0, unit = 118, 17
    y = 30
    spans = [("forward 1", 0, 5, BLUE), ("backward 1", 5, 12, ORANGE), ("forward 2", 12, 17, BLUE),
             ("backward 2", 17, 24, ORANGE), ("", 24, 26, RED), ("step", 26, 31, GREEN)]
    c.rect(x0 - 3, y - 20, 12 * unit + 6, 52, dash=True, rx=4)
    c.text(x0 + 4, y - 6, "with model.no_sync():", size=MIN_FONT, mono=True)
    lanes = {"compute": y + 2, "network": y + 46, ".grad": y + 90}
    for name, top in lanes.items():
        c.text(x0 - 8, top + 17, name, anchor="end", size=MIN_FONT, mono=name == ".grad")
    for label, a, b, fill in spans:
        c.box(x0 + a * unit + 0.5, lanes["compute"], (b - a) * unit - 1, 26, label, fill, size=MIN_FONT)
    c.text(x0 + 2, lanes["network"] + 17, f"{NO_SYNC_ALL_REDUCES[0]} all-reduces: nothing sent", size=MIN_FONT)
    for i, (a, b) in enumerate(((20.5, 23.5), (24, 26))):  # two buckets, the second once backward 2 is over
        c.box(x0 + a * unit + 0.5, lanes["network"], (b - a) * unit - 1, 26, f"bucket {i}" if b - a > 3 else "",
              PURPLE, size=MIN_FONT)
    assert NO_SYNC_ALL_REDUCES[1] == 2
    c.text(x0 + 26 * unit + 8, lanes["network"] + 17, "2 buckets", size=MIN_FONT)
    for label, a, b in (("g1", 12, 17), ("g1 + g2, summing", 17, 26), ("average", 26, 31)):
        c.box(x0 + a * unit + 0.5, lanes[".grad"], (b - a) * unit - 1, 26, label, ORANGE, size=MIN_FONT)
    y = lanes[".grad"] + 58
    c.text(10, y, "The forward decides: a backward whose forward ran inside no_sync() only accumulates.",
           size=MIN_FONT)
    c.text(10, y + 18, "The next synced backward all-reduces the sums: one step's traffic for two micro-batches.",
           size=MIN_FONT)
    return c


# -- the bucket policy (exercise 1.4) ---------------------------------------------------------------------------------
# The toy model's trainable gradients (minifsdp/models.py's ToyModel), in the order backward produces them, and
# the buckets _pack makes of them under a cap of 2,048 B; tests/test_diagrams_ch01.py checks both against the
# package, and tests/test_ch01_ddp.py uses the same model and cap.
POLICY_GRADIENTS = (("head.weight", 68), ("out.bias", 68), ("out.weight", 1088), ("extra.bias", 64),
                    ("extra.weight", 1024), ("tied.weight", 1024), ("inp.bias", 60), ("inp.weight", 420))
POLICY_CAP = 2048
POLICY_BUCKETS = ((0, 1, 2, 3), (4, 5), (6, 7))  # indices into POLICY_GRADIENTS, in launch order


def ddp_bucket_policy() -> Canvas:
    sizes = [b for _, b in POLICY_GRADIENTS]
    total = sum(sizes)
    bucket_bytes = [sum(sizes[i] for i in b) for b in POLICY_BUCKETS]
    c = Canvas("ddp_bucket_policy", 202, "A bucket policy: the toy model's gradients under a 2,048 B cap",
               f"The toy model's eight gradients, {total:,} bytes in all, drawn to scale in the order backward "
               f"produces them: head.weight, out.bias, out.weight, extra.bias, extra.weight, tied.weight, inp.bias, "
               f"inp.weight. Under a cap of {POLICY_CAP:,} bytes a policy with the exercise's properties cuts them "
               f"into {len(POLICY_BUCKETS)} buckets of {', '.join(f'{b:,}' for b in bucket_bytes)} bytes, each of "
               f"gradients that arrive one after another, each within the cap, each sent as soon as its last "
               f"gradient is ready, so the first ones travel while backward still runs. A policy that ignores the "
               f"cap makes one bucket of {total:,} bytes, sent only once backward has produced its last gradient.")
    x0, width = 10, 660
    scale = width / total
    lefts = [x0 + sum(sizes[:i]) * scale for i in range(len(sizes) + 1)]
    y = 22
    c.text(x0, y, "gradients, in the order backward produces them (bytes to scale)", bold=True)
    for i, (name, b) in enumerate(POLICY_GRADIENTS):
        w = b * scale
        label = name if text_width(name, MIN_FONT) < w - 6 else ""
        c.box(lefts[i] + 0.5, y + 10, w - 1, 26, label, ORANGE, size=MIN_FONT)
    y += 52
    c.line(x0, y, x0 + POLICY_CAP * scale, y)
    for x in (x0, x0 + POLICY_CAP * scale):
        c.line(x, y - 5, x, y + 5)
    c.text(x0 + POLICY_CAP * scale + 8, y + 5, f"the cap: {POLICY_CAP:,} B", size=MIN_FONT)
    y += 26
    c.text(x0, y, f"a policy with the properties: {len(POLICY_BUCKETS)} buckets, each sent at its last gradient",
           bold=True)
    for k, (b, nbytes) in enumerate(zip(POLICY_BUCKETS, bucket_bytes)):
        a, z = lefts[b[0]], lefts[b[-1] + 1]
        label = f"bucket {k} · {nbytes:,} B"
        c.box(a + 0.5, y + 10, z - a - 1, 26, label if text_width(label, MIN_FONT) < z - a - 6 else f"{nbytes:,} B",
              PURPLE, size=MIN_FONT)
    y += 60
    c.text(x0, y, "the cap ignored: one bucket, sent only with the last gradient", bold=True)
    c.box(x0 + 0.5, y + 10, width - 1, 26, f"bucket 0 · {total:,} B", RED, size=MIN_FONT)
    return c


DIAGRAMS = (four_collectives, ddp_naive_vs_overlap, ddp_bucket_order, ddp_no_sync, ddp_bucket_policy)
