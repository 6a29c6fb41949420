"""Chapter 4's diagrams: where the averaged gradients go under an all-reduce, a reduce to their owner and a
reduce-scatter; how ShardedDataParallel packs its buckets, one owner each; what the bucket size
(reduce_buffer_size) trades within a node and across nodes; and exercise 4.3's contract, the gradients that
wait unsent under one cap among the open buckets and under a whole cap for each owner's bucket.

What they show of the code is written here as data (the example's owners, from OSS's partition, and its
buckets, from ShardedDataParallel._bucket_groups), and tests/test_diagrams_ch04.py checks it against the
package (tests/test_diagrams_ch04_exercise.py the contract figure, in real backward passes).
"""

from __future__ import annotations

from canvas import *  # noqa: F403  the canvas and the colours

# -- where the gradients go ------------------------------------------------------------------------------------------
WHERE_N = 4


def zero2_where_gradients_go() -> Canvas:
    n = WHERE_N
    c = Canvas("zero2_where_gradients_go", 300, "Where the averaged gradients go: all-reduce, reduce to the owner, "
               "reduce-scatter",
               "Three panels, four ranks each, four buckets of gradients. Under an all_reduce (DDP, and OSS on "
               "DDP) every rank ends backward with the average of every bucket: 4 Psi bytes of gradients. Under "
               "ShardedDataParallel each bucket belongs to one owner and is reduced to it alone: rank r keeps the "
               "average of its own bucket and drops the others, about 4 Psi / N. Under FlatShardedDataParallel "
               "each bucket is reduce-scattered: every rank keeps its 1/N slice of every bucket, 4 Psi / N. Per "
               "rank and step, with the parameters made current after the step, the all-reduce design sends "
               "3 Psi (N - 1)/N, the other two 2 Psi (N - 1)/N, DDP's figure.")
    panels = [("all_reduce", "DDP, OSS", "all"), ("reduce", "SDP: to its owner", "owner"),
              ("reduce_scatter", "flat SDP", "slice")]
    cell, label_w, pw = 36, 46, 224
    held = {"all": "4Ψ of gradients", "owner": "about 4Ψ/N", "slice": "4Ψ/N"}
    sent = {"all": "3Ψ(N − 1)/N", "owner": "2Ψ(N − 1)/N", "slice": "2Ψ(N − 1)/N"}
    c.text(10, 18, "after backward: the averaged gradients each rank holds, N = 4, four buckets", bold=True)
    for p, (name, who, mode) in enumerate(panels):
        x = 4 + p * pw
        c.text(x + label_w, 46, name, mono=True, bold=True)
        c.text(x + label_w, 64, who, size=MIN_FONT)
        for r in range(n):
            y = 76 + r * 30
            c.text(x + label_w - 6, y + 17, f"rank {r}", anchor="end", size=MIN_FONT)
            for b in range(n):
                bx = x + label_w + b * cell
                if mode == "all" or (mode == "owner" and b == r):
                    c.box(bx, y, cell - 3, 24, f"b{b}", ORANGE, size=MIN_FONT)
                elif mode == "owner":
                    c.rect(bx, y, cell - 3, 24, dash=True)
                else:  # this rank's slice of every bucket
                    c.rect(bx, y, cell - 3, 24, dash=True)
                    c.rect(bx + r * (cell - 3) / n, y, (cell - 3) / n, 24, fill=ORANGE)
        c.text(x + label_w, 216, held[mode], size=MIN_FONT)
        c.text(x + label_w, 234, f"sends {sent[mode]}", size=MIN_FONT)
    y = 266
    x = swatch(c, 10, y, ORANGE, "averaged gradients, kept") + 16
    swatch(c, x, y, "none", "dropped once sent", dash=True)
    c.text(10, y + 24, "bn: bucket n. Under SDP bucket n belongs to rank n; each rank still computes them all.",
           size=MIN_FONT)
    return c


# -- SDP's buckets --------------------------------------------------------------------------------------------------
# Six layers at N = 2, one weight each, of these sizes (registration order). OSS's greedy partition gives the owners;
# ShardedDataParallel._bucket_groups packs the gradients, in the order backward produces them (L6 first), into
# buckets of one owner each, the open ones sharing a cap of 6. tests/test_diagrams_ch04.py checks both.
BUCKETS_N = 2
BUCKETS_SIZES = {"L1": 3, "L2": 2, "L3": 3, "L4": 1, "L5": 2, "L6": 3}
BUCKETS_OWNERS = {"L1": 0, "L2": 1, "L3": 1, "L4": 0, "L5": 1, "L6": 0}
BUCKETS_CAP = 6
BUCKETS = [(0, ("L6", "L4")), (1, ("L5", "L3")), (1, ("L2",)), (0, ("L1",))]  # (owner, layers), launch order
BUCKETS_SEND = 0.5  # time to reduce one unit of size


def sdp_bucket_timeline():
    """(backward spans (layer, start, end), reduce spans (bucket, owner, start, end)): each layer's backward
    takes its size; a bucket goes out when its last layer is done, on one channel, in bucket order."""
    spans, t, done = [], 0, {}
    for layer in sorted(BUCKETS_SIZES, reverse=True):
        spans.append((layer, t, t + BUCKETS_SIZES[layer]))
        t += BUCKETS_SIZES[layer]
        done[layer] = t
    reduces, free = [], 0
    for i, (owner, layers) in enumerate(BUCKETS):
        start = max(free, max(done[layer] for layer in layers))
        free = start + BUCKETS_SEND * sum(BUCKETS_SIZES[layer] for layer in layers)
        reduces.append((i, owner, start, free))
    return spans, reduces


def sdp_buckets() -> Canvas:
    c = Canvas("sdp_buckets", 300, "ShardedDataParallel's buckets: one owner each, reduced to it as soon as full",
               "A timeline of one backward pass over six layers at N = 2. OSS's partition gives layers 1, 4 and 6 "
               "to rank 0 and layers 2, 3 and 5 to rank 1. As each layer's gradient lands it joins its owner's "
               "open bucket; the open buckets share a cap of 6, and when the next gradient would overflow it the "
               "fullest one closes. Bucket 0 holds layers 6 and 4, for rank 0; bucket 1 layers 5 and 3, for rank "
               "1; bucket 2 layer 2, for rank 1; bucket 3 layer 1, for rank 0. Each is reduced to its owner as "
               "soon as its last gradient is ready, while backward goes on.")
    x0, unit = 150, 30
    spans, reduces = sdp_bucket_timeline()
    bucket_of = {layer: i for i, (_, layers) in enumerate(BUCKETS) for layer in layers}
    c.text(x0, 18, "one backward pass, time →  (gradients land last layer first)", size=MIN_FONT)
    lanes = {"backward": 28, "rank 0's buckets": 66, "rank 1's buckets": 98, "reduce": 140}
    for name, y in lanes.items():
        c.text(x0 - 10, y + 17, name, anchor="end", size=MIN_FONT, mono=name == "reduce")
    for layer, a, b in spans:
        c.box(x0 + a * unit + 0.5, lanes["backward"], (b - a) * unit - 1, 26, layer, ORANGE, size=MIN_FONT)
        owner = BUCKETS_OWNERS[layer]
        c.box(x0 + a * unit + 2, lanes[f"rank {owner}'s buckets"], (b - a) * unit - 4, 24,
              f"b{bucket_of[layer]}", GRAY, size=MIN_FONT, dash=True)
    for i, owner, a, b in reduces:
        label = f"b{i} → {owner}" if text_width(f"b{i} → {owner}", MIN_FONT) < (b - a) * unit - 6 else f"b{i}"
        c.box(x0 + a * unit + 0.5, lanes["reduce"], (b - a) * unit - 1, 26, label, TEAL, size=MIN_FONT)
    y = 196
    for s in ("Each gradient joins its owner's open bucket. The open buckets share one cap (6 here):",
              "when the next gradient would overflow it, the fullest closes. A bucket is reduced to its owner",
              "as soon as its last gradient is ready: b0 waits for L4, b1 for L3."):
        c.text(10, y, s, size=MIN_FONT)
        y += 18
    y += 12
    x = swatch(c, 10, y, ORANGE, "backward of a layer") + 16
    x = swatch(c, x, y, GRAY, "its gradient, in its owner's bucket", dash=True) + 16
    swatch(c, x, y, TEAL, "reduce to the owner")
    return c


# -- the bucket size per topology ---------------------------------------------------------------------------------------
# Eight gradients of one unit of bytes each, one every 2 time units of backward; each reduce costs a fixed cost
# plus its bytes, on one channel. Within a node the fixed cost is small, across nodes large.
SIZE_GRADIENTS, SIZE_EVERY = 8, 2
SIZE_FIXED = {"within a node": 0.5, "across nodes": 2.0}
SIZE_BUCKETS = {"a reduce a gradient": 1, "buckets of 2": 2}


def bucket_size_timeline(fixed: float, per_bucket: int):
    """The reduces (start, end) when every `per_bucket` gradients go out together."""
    calls, free = [], 0.0
    for k in range(per_bucket, SIZE_GRADIENTS + 1, per_bucket):
        start = max(free, k * SIZE_EVERY)
        free = start + fixed + per_bucket
        calls.append((start, fixed, free))
    return calls


def sdp_bucket_size() -> Canvas:
    c = Canvas("sdp_bucket_size", 330, "The bucket size per topology: a call per gradient within a node, buckets "
               "across nodes",
               "Four timelines of one backward pass producing eight gradients, one every two time units, each "
               "taking one unit to send. Within a node, where each call's fixed cost is small, a reduce per "
               "gradient (reduce_buffer_size=0) ends at 17.5 and buckets of two gradients at 18.5: buckets only "
               "delay the first sends. Across nodes, where each call's fixed cost is 2 units, a reduce per "
               "gradient queues up and ends at 26, while buckets of two ends at 20: fewer fixed costs.")
    x0, unit = 150, 18
    y = 18
    for topology, fixed in SIZE_FIXED.items():
        c.text(10, y, f"{topology}: a call's fixed cost {num(fixed)}", bold=True)
        y += 12
        for option, per_bucket in SIZE_BUCKETS.items():
            calls = bucket_size_timeline(fixed, per_bucket)
            c.text(x0 - 10, y + 15, option, anchor="end", size=MIN_FONT)
            for start, f, end in calls:
                c.rect(x0 + start * unit + 0.5, y, f * unit, 22, fill=GRAY)
                c.rect(x0 + (start + f) * unit + 0.5, y, (end - start - f) * unit - 1, 22, fill=ORANGE)
            end = calls[-1][2]
            c.text(x0 + end * unit + 6, y + 15, f"ends {num(end)}", size=MIN_FONT)
            y += 30
        y += 22
    c.text(x0 - 10, y - 4, "backward", anchor="end", size=MIN_FONT)
    for k in range(SIZE_GRADIENTS):
        c.rect(x0 + k * SIZE_EVERY * unit + 0.5, y - 18, SIZE_EVERY * unit - 1, 18, fill=ORANGE)
    for t in range(0, 28, 4):
        c.text(x0 + t * unit, y + 16, str(t), anchor="middle", size=MIN_FONT)
    c.text(x0 - 10, y + 16, "time", anchor="end", size=MIN_FONT)
    y += 44
    x = swatch(c, 10, y, GRAY, "a call's fixed cost") + 16
    swatch(c, x, y, ORANGE, "a reduce's bytes; in backward, a layer producing a gradient")
    y += 26
    c.text(10, y, "reduce_buffer_size=0 gives a reduce a gradient: best where calls are cheap, within a node.",
           size=MIN_FONT)
    c.text(10, y + 18, "Where each call costs more, across nodes, buckets pay: fewer fixed costs.", size=MIN_FONT)
    return c


# -- exercise 4.3's contract: gradients waiting to be sent ---------------------------------------------------------------
# Twelve parameters of 1 KiB at N = 2, registered w1..w12; backward produces w12 first. OSS's partition deals them
# out in turn (w12, w10, ... to rank 1). Under a 4 KiB cap, two designs of owner buckets (bucket parameters in
# the order they arrive, buckets in launch order): the open buckets sharing one cap (the package's), and a whole
# cap for each owner's bucket. tests/test_diagrams_ch04_exercise.py runs both in a real backward and checks the
# owners, the buckets and, at each arrival, what contract_waiting says.
CONTRACT_GRADIENTS = tuple(f"w{i}" for i in range(12, 0, -1))  # backward's order
CONTRACT_OWNERS = {f"w{i}": (i + 1) % 2 for i in range(1, 13)}
CONTRACT_BYTES, CONTRACT_CAP = 1024, 4096
CONTRACT_DESIGNS = {
    "one cap among the open buckets": [("w12", "w10"), ("w11", "w9", "w7"), ("w8", "w6", "w4"), ("w5", "w3", "w1"),
                                       ("w2",)],
    "a whole cap for each owner's bucket": [("w12", "w10", "w8", "w6"), ("w11", "w9", "w7", "w5"), ("w4", "w2"),
                                            ("w3", "w1")],
}


def contract_waiting(buckets):
    """At each gradient's arrival, once the buckets it lets go are sent: (the buckets sent then, the bytes of
    each rank's gradients computed and not yet sent). A bucket goes when its last gradient is in and every
    bucket listed before it has gone."""
    arrived, sent, rows = set(), 0, []
    for g in CONTRACT_GRADIENTS:
        arrived.add(g)
        first = sent
        while sent < len(buckets) and arrived.issuperset(buckets[sent]):
            sent += 1
        waiting = [0, 0]
        for b in buckets[sent:]:
            for q in arrived.intersection(b):
                waiting[CONTRACT_OWNERS[q]] += CONTRACT_BYTES
        rows.append((tuple(range(first, sent)), tuple(waiting)))
    return rows


def sdp_owner_buckets_contract() -> Canvas:
    limit = CONTRACT_CAP + CONTRACT_BYTES
    kib = lambda b: f"{b // 1024} KiB"  # noqa: E731
    peaks = {name: max(sum(w) for _, w in contract_waiting(b)) for name, b in CONTRACT_DESIGNS.items()}
    (right, right_peak), (wrong, wrong_peak) = peaks.items()
    c = Canvas("sdp_owner_buckets_contract", 474, "Exercise 4.3's contract: the gradients waiting to be sent stay "
               "within one cap plus the largest gradient",
               f"Twelve gradients of 1 KiB arrive in backward's order, w12 to w1, owned in turn by rank 1 and rank 0; "
               f"the cap is {kib(CONTRACT_CAP)}, so at most {kib(limit)} may wait unsent. Under each arrival, a bar "
               f"of the gradients computed and not yet sent, split by owner, and the buckets sent then. With "
               f"{right}, {len(CONTRACT_DESIGNS[right])} buckets, at most {kib(right_peak)} wait. With {wrong}, "
               f"{len(CONTRACT_DESIGNS[wrong])} buckets give the same averages, but {kib(wrong_peak)} wait after "
               f"the sixth gradient: over the limit. A bucket goes once its last gradient is in and every bucket "
               f"before it has gone, so the buckets are listed in the order they close.")
    x0, col, unit = 96, 41, 11  # the columns of the twelve arrivals; a bar's pixels per KiB
    xs = [x0 + i * col for i in range(len(CONTRACT_GRADIENTS))]
    right_edge = xs[-1] + col
    c.text(10, 18, f"twelve gradients of 1 KiB, in the order backward produces them; the cap {kib(CONTRACT_CAP)}",
           bold=True)
    c.text(x0 - 8, 45, "arrives", anchor="end", size=MIN_FONT)
    for x, g in zip(xs, CONTRACT_GRADIENTS):
        c.box(x + 2, 28, col - 4, 26, g, RANKS[CONTRACT_OWNERS[g]], size=MIN_FONT)
    y = 84
    for name, buckets in CONTRACT_DESIGNS.items():
        rows = contract_waiting(buckets)
        c.text(10, y, f"{name}: {len(buckets)} buckets, at most {kib(peaks[name])} wait", bold=True)
        base = y + 12 + 7 * unit
        top = base - (limit // 1024) * unit
        c.line(x0, top, right_edge, top, dash=True)
        c.text(right_edge + 6, top + 5, f"{kib(limit)} limit", size=MIN_FONT)
        c.line(x0, base, right_edge, base)
        c.text(x0 - 8, base + 19, "KiB waiting", anchor="end", size=MIN_FONT)
        c.text(x0 - 8, base + 39, "sent", anchor="end", size=MIN_FONT)
        for x, (sent, waiting) in zip(xs, rows):
            h = base
            for rank, nbytes in enumerate(waiting):
                px = nbytes // 1024 * unit
                if px:
                    c.rect(x + 8, h - px, col - 16, px, fill=RANKS[rank])
                    h -= px
            c.text(x + col / 2, base + 19, str(sum(waiting) // 1024), anchor="middle", size=MIN_FONT,
                   bold=sum(waiting) > limit)
            if sent:
                c.text(x + col / 2, base + 39, " ".join(f"b{k}" for k in sent), anchor="middle", size=MIN_FONT)
        y = base + 70
    for s in ("A bucket goes once its last gradient is in and every bucket listed before it has gone: list them",
              "in the order they close. Any policy whose bars stay under the line passes, whether a bucket closes",
              "before or after the gradient that crosses the cap joins it."):
        c.text(10, y, s, size=MIN_FONT)
        y += 18
    y += 10
    x = swatch(c, 10, y, RANKS[0], "rank 0's gradients") + 16
    swatch(c, x, y, RANKS[1], "rank 1's gradients")
    return c


DIAGRAMS = (zero2_where_gradients_go, sdp_buckets, sdp_bucket_size, sdp_owner_buckets_contract)
