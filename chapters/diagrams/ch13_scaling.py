"""Chapter 13's pictures: a collective's time the alpha-beta way, the two-level network it runs on, what not
resharding after forward buys on it, and the two-stream simulation's contract (exercise 13.2).

Drawn on the shared canvas (canvas.py); make_diagrams.py finds this module. The numbers are the step-time model's
(minifsdp.measure.step_time), written here as data; tests/test_diagrams_ch1213.py and
tests/test_diagrams_ch13_exercise.py compute them again from the package and check them.
"""

from __future__ import annotations

import math

from canvas import *  # noqa: F403

# An all-reduce of 2**12 .. 2**32 bytes over 8 H100s in one node, 64 over 8 nodes and 1,024 over 128 nodes,
# by ring and by tree: Cluster(H100, nodes=k).collective("all_reduce", size, Group(n, 8), algorithm), seconds.
AB_SIZES = [2**k for k in range(12, 33)]
AB_TIMES = {
    (8, 'ring'): [
        4.762e-05, 4.764e-05, 4.768e-05, 4.776e-05, 4.793e-05, 4.825e-05, 4.891e-05, 5.021e-05, 5.283e-05,
        5.806e-05, 6.851e-05, 8.942e-05, 0.0001312, 0.0002149, 0.0003822, 0.0007168, 0.001386, 0.002724,
        0.005401, 0.01075, 0.02146],
    (8, 'tree'): [
        0.000168, 0.000168, 0.0001681, 0.0001682, 0.0001684, 0.0001687, 0.0001695, 0.000171, 0.000174,
        0.0001799, 0.0001919, 0.0002158, 0.0002636, 0.0003592, 0.0005504, 0.0009328, 0.001698, 0.003227,
        0.006286, 0.0124, 0.02464],
    (64, 'ring'): [
        0.0005152, 0.0005152, 0.0005153, 0.0005154, 0.0005156, 0.0005159, 0.0005167, 0.0005181, 0.0005211,
        0.000527, 0.0005387, 0.0005623, 0.0006093, 0.0007034, 0.0008916, 0.001268, 0.002021, 0.003526,
        0.006538, 0.01256, 0.02461],
    (64, 'tree'): [
        0.000468, 0.000468, 0.0004681, 0.0004682, 0.0004684, 0.0004687, 0.0004695, 0.000471, 0.000474,
        0.0004799, 0.0004919, 0.0005158, 0.0005636, 0.0006592, 0.0008504, 0.001233, 0.001998, 0.003527,
        0.006586, 0.0127, 0.02494],
    (1024, 'ring'): [
        0.008531, 0.008531, 0.008531, 0.008531, 0.008532, 0.008532, 0.008533, 0.008534, 0.008537, 0.008543,
        0.008555, 0.008579, 0.008627, 0.008722, 0.008913, 0.009295, 0.01006, 0.01159, 0.01464, 0.02076,
        0.03298],
    (1024, 'tree'): [
        0.000868, 0.000868, 0.0008681, 0.0008682, 0.0008684, 0.0008687, 0.0008695, 0.000871, 0.000874,
        0.0008799, 0.0008919, 0.0009158, 0.0009636, 0.001059, 0.00125, 0.001633, 0.002398, 0.003927, 0.006986,
        0.0131, 0.02534],
}

# The hardware of the two-level picture: H100's NVLink and one 400 Gb/s NIC per GPU (cluster.py).
NVLINK_BUSBW, NVLINK_ALPHA = 351e9, 3.4e-6
NIC_BUSBW, NIC_ALPHA = 45e9, 9.6e-6
NICS_PER_NODE = 8

# NRAF: the FSDP program with no all-gather in backward, its step for Llama 2 7B on H100 nodes, 8,192 tokens per GPU
# (Run(seq_len=4096, micro_batch=2)): (spread rings?, nodes) -> (FULL_SHARD, no reshard after forward, HSDP), ms.
NRAF_NODES = (2, 8, 64)
NRAF_STEPS = {
    (True, 2): (801.0, 801.0, 809.1),
    (True, 8): (799.6, 799.6, 813.2),
    (True, 64): (806.4, 806.4, 815.4),
    (False, 2): (1142.0, 887.3, 809.1),
    (False, 8): (1213.5, 940.0, 813.2),
    (False, 64): (1410.3, 1075.0, 815.4),
}
NRAF_BLOCK_PARAMS, NRAF_LAYERS = 202_383_360, 32  # Llama 2 7B: one block's parameters, and the blocks

# The 53 published runs the model predicts (not the two it was calibrated on): (source, activation checkpointing?,
# predicted / published - 1), as compare_published() gives them.
PUBLISHED_ERRORS = [
    ('torchtitan (A100)', True, 0.0348),
    ('torchtitan (A100)', True, 0.0743),
    ('torchtitan (A100)', True, -0.0372),
    ('torchtitan (A100)', False, 0.0789),
    ('torchtitan (A100)', True, 0.0473),
    ('torchtitan (A100)', True, 0.1014),
    ('torchtitan (A100)', True, 0.1603),
    ('torchtitan (A100)', True, -0.0227),
    ('torchtitan (H100)', True, 0.2999),
    ('torchtitan (H100)', True, 0.3384),
    ('llm-foundry (H100)', True, -0.1461),
    ('llm-foundry (H100)', True, -0.1653),
    ('llm-foundry (H100)', True, -0.1815),
    ('llm-foundry (H100)', True, -0.1269),
    ('llm-foundry (H100)', True, -0.1349),
    ('llm-foundry (H100)', True, -0.1523),
    ('llm-foundry (H100)', True, -0.1342),
    ('llm-foundry (H100)', True, -0.1353),
    ('llm-foundry (H100)', True, -0.1481),
    ('llm-foundry (H100)', False, 0.0341),
    ('llm-foundry (H100)', False, 0.0201),
    ('llm-foundry (H100)', False, 0.0016),
    ('llm-foundry (H100)', True, -0.1649),
    ('llm-foundry (H100)', True, -0.0705),
    ('llm-foundry (H100)', True, 0.1782),
    ('llm-foundry (H100)', True, -0.0515),
    ('llm-foundry (H100)', True, -0.1822),
    ('llm-foundry (H100)', True, -0.1694),
    ('llm-foundry (H100)', True, -0.0898),
    ('llm-foundry (H100)', True, -0.1064),
    ('llm-foundry (H100)', True, -0.1301),
    ('llm-foundry (H100)', False, 0.0710),
    ('llm-foundry (H100)', False, 0.0759),
    ('llm-foundry (H100)', False, 0.0888),
    ('llm-foundry (H100)', False, 0.0829),
    ('llm-foundry (H100)', True, -0.1837),
    ('llm-foundry (H100)', True, -0.0190),
    ('llm-foundry (H100)', True, -0.0998),
    ('llm-foundry (H100)', True, -0.1516),
    ('llm-foundry (A100)', True, -0.0896),
    ('llm-foundry (A100)', True, -0.0457),
    ('llm-foundry (A100)', True, 0.2310),
    ('llm-foundry (A100)', True, -0.0787),
    ('llm-foundry (A100)', True, -0.1332),
    ('llm-foundry (A100)', True, -0.1419),
    ('llm-foundry (A100)', True, -0.1511),
    ('llm-foundry (A100)', True, -0.1197),
    ('llm-foundry (A100)', True, -0.1443),
    ('llm-foundry (A100)', False, 0.0342),
    ('llm-foundry (A100)', True, -0.1717),
    ('llm-foundry (A100)', True, -0.0894),
    ('llm-foundry (A100)', True, -0.0969),
    ('llm-foundry (A100)', True, -0.1472),
]


def _log_axis(v, lo, hi, a, b):
    return a + (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * (b - a)


def alpha_beta() -> Canvas:
    c = Canvas("alpha_beta", 372, "An all-reduce's time against its size: a flat latency floor, then bandwidth",
               "A log-log plot of the predicted time of an all-reduce on H100s against its size, 4 kB to 4 GB, for "
               "three groups: 8 GPUs in one node, 64 GPUs on 8 nodes and 1,024 GPUs on 128 nodes, each by ring (solid) "
               "and by tree (dashed). Every line is flat at small sizes, where the time is the algorithm's steps "
               "times alpha, and rises with slope one at large sizes, where it is the bytes over the bandwidth. In a "
               "node the ring's 14 steps of 3.4 microseconds beat the tree at every size; over 64 GPUs the two are "
               "close; over 1,024 GPUs the ring's 2,046 steps cost 8.5 ms and the tree, 20 steps, wins at every size "
               "shown.")
    c.text(10, 20, "All-reduce on H100s: time = α · steps + bytes on the wire / β", bold=True)
    x0, x1, y0, y1 = 70, 540, 40, 300
    tlo, thi = 1e-5, 1e-1
    slo, shi = AB_SIZES[0], AB_SIZES[-1]
    c.rect(x0, y0, x1 - x0, y1 - y0)
    for t, label in ((1e-5, "10 µs"), (1e-4, "100 µs"), (1e-3, "1 ms"), (1e-2, "10 ms"), (1e-1, "100 ms")):
        y = _log_axis(t, tlo, thi, y1, y0)
        c.line(x0 - 4, y, x0, y, width=1)
        c.text(x0 - 7, y + 5, label, anchor="end", size=MIN_FONT)
    for s, label in ((2**12, "4 kB"), (2**16, "64 kB"), (2**20, "1 MB"), (2**24, "16 MB"), (2**28, "256 MB"),
                     (2**32, "4 GB")):
        x = _log_axis(s, slo, shi, x0, x1)
        c.line(x, y1, x, y1 + 4, width=1)
        c.text(x, y1 + 19, label, anchor="middle", size=MIN_FONT)
    c.text((x0 + x1) / 2, y1 + 38, "all-reduce size", anchor="middle", size=MIN_FONT)
    colours = {8: GREEN, 64: BLUE, 1024: ORANGE}
    for (n, algorithm), times in AB_TIMES.items():
        pts = [(_log_axis(s, slo, shi, x0, x1), _log_axis(t, tlo, thi, y1, y0)) for s, t in zip(AB_SIZES, times)]
        d = "M" + " L".join(f"{num(x)},{num(y)}" for x, y in pts)
        c.path(d, points=pts, colour=colours[n], width=3 if algorithm == "ring" else 2.5,
               dash=algorithm == "tree")
    labels = {(8, "ring"): ("8 GPUs: ring", 8, -6), (8, "tree"): ("8: tree", 190, -6),
              (64, "ring"): ("64: ring ≈ tree", 8, 17), (1024, "ring"): ("1,024: ring", 8, -6),
              (1024, "tree"): ("1,024: tree", 190, -6)}
    for (n, algorithm), (text, dx, dy) in labels.items():
        y = _log_axis(AB_TIMES[(n, algorithm)][0], tlo, thi, y1, y0)
        c.text(x0 + dx, y + dy, text, size=MIN_FONT)
    c.text(x1 + 8, y0 + 62, "flat: the steps,", size=MIN_FONT)
    c.text(x1 + 8, y0 + 80, "α each (latency)", size=MIN_FONT)
    c.text(x1 + 8, y0 + 170, "rising: bytes / β", size=MIN_FONT)
    c.text(x1 + 8, y0 + 188, "(bandwidth)", size=MIN_FONT)
    y = 364
    x = swatch(c, 10, y, GREEN, "1 node") + 12
    x = swatch(c, x, y, BLUE, "8 nodes") + 12
    x = swatch(c, x, y, ORANGE, "128 nodes") + 12
    c.text(x, y, "solid: ring, 2(n − 1) steps · dashed: tree, 2⌈log₂ n⌉", size=MIN_FONT)
    return c


def two_level_network() -> Canvas:
    c = Canvas("two_level_network", 372, "Two levels: NVLink inside a node, one NIC per GPU between nodes",
               "Two nodes of 8 GPUs. Inside a node the GPUs share an NVSwitch: NVLink, 351 GB/s of bus bandwidth on an "
               "H100 and 3.4 microseconds a ring step. Each GPU also has its own 400 Gb/s NIC on the network between "
               "nodes: 45 GB/s reached and 9.6 microseconds a step. A ring over both nodes takes most of its steps on "
               "NVLink and a few across the network; NCCL runs one channel per NIC, so with 8 of the group's ranks on "
               "a node the node's 8 NICs carry the ring side by side, 8 times 45 = 360 GB/s, and the ring runs at "
               "NVLink's 351. HSDP's replicas, one rank per node, get one NIC: 45 GB/s.")
    c.text(10, 20, "Two nodes of 8 H100s: NVLink inside, a NIC per GPU between", bold=True)
    for k in range(2):
        nx = 10 + k * 340
        c.rect(nx, 34, 320, 176, dash=True)
        c.text(nx + 8, 52, f"node {k}", size=MIN_FONT, bold=True)
        c.box(nx + 12, 60, 296, 26, f"NVSwitch: {NVLINK_BUSBW / 1e9:.0f} GB/s, α {NVLINK_ALPHA * 1e6:.1f} µs",
              TEAL, size=MIN_FONT)
        for g in range(8):
            gx = nx + 14 + g * 37
            c.line(gx + 15, 88, gx + 15, 104, width=1.5)
            c.box(gx, 104, 31, 28, f"G{g}", GRAY, size=MIN_FONT)
            c.line(gx + 15, 134, gx + 15, 152, width=1.5)
            c.box(gx, 152, 31, 22, "NIC", YELLOW, size=MIN_FONT)
            c.line(gx + 15, 176, gx + 15, 226, width=1.5)
    c.box(10, 226, 660, 28, f"network: a 400 Gb/s NIC per GPU, {NIC_BUSBW / 1e9:.0f} GB/s reached, "
                            f"α {NIC_ALPHA * 1e6:.1f} µs a step", YELLOW, size=MIN_FONT)
    lines = ["A ring all-gather over both nodes: 15 steps, 14 on NVLink and 1 across the network.",
             f"FULL_SHARD: {NICS_PER_NODE} channels, one per NIC, side by side: "
             f"min({NVLINK_BUSBW / 1e9:.0f}, {NICS_PER_NODE} × {NIC_BUSBW / 1e9:.0f}) = "
             f"{min(NVLINK_BUSBW, NICS_PER_NODE * NIC_BUSBW) / 1e9:.0f} GB/s: NVLink's speed.",
             f"HSDP's replicas, one rank per node: one NIC, {NIC_BUSBW / 1e9:.0f} GB/s.",
             f"spread_rings=False: every ring across nodes gets one NIC, {NIC_BUSBW / 1e9:.0f} GB/s."]
    for i, s in enumerate(lines):
        c.text(10, 280 + i * 24, s, size=MIN_FONT)
    return c


def nraf_step() -> Canvas:
    c = Canvas("nraf_step", 490, "RAF, NRAF and HSDP on two networks: Llama 2 7B on H100 nodes",
               "Predicted step times of Llama 2 7B with 8,192 tokens per GPU on 2, 8 and 64 nodes of 8 H100s, for "
               "FULL_SHARD resharding after forward (RAF), not resharding after forward (NRAF: no all-gather in "
               "backward) and HSDP. With rings spread over a node's 8 NICs, RAF and NRAF take the same time at every "
               "size: FSDP's all-gathers already hide under compute. With one NIC per ring, RAF's exposed all-gathers "
               "cost far more time than HSDP, and NRAF recovers part of it by dropping "
               "backward's all-gathers; HSDP, which keeps its all-gathers inside the node, is fastest. NRAF's price is "
               "memory: every block's bf16 parameters kept from forward to backward, whatever the number of GPUs.")
    c.text(10, 20, "Llama 2 7B, 8,192 tokens per GPU: the predicted step", bold=True)
    x0, scale = 150, 0.30  # px per ms
    kinds = (("RAF (FULL_SHARD)", GRAY), ("NRAF", TEAL), ("HSDP", YELLOW))
    y = 34
    for spread, title in ((True, "rings spread over a node's 8 NICs (the model's network)"),
                          (False, "one NIC per ring (spread_rings=False)")):
        c.text(10, y + 14, title, size=MIN_FONT, bold=True)
        y += 24
        for k in NRAF_NODES:
            c.text(x0 - 10, y + 28, f"{k} nodes", anchor="end", size=MIN_FONT)
            for i, (name, fill) in enumerate(kinds):
                ms = NRAF_STEPS[(spread, k)][i]
                c.rect(x0, y + i * 16, ms * scale, 14, fill=fill)
                c.text(x0 + ms * scale + 6, y + i * 16 + 12, f"{ms:,.0f} ms", size=MIN_FONT)
            y += 3 * 16 + 8
        y += 4
    y += 8
    x = 10
    for name, fill in kinds:
        x = swatch(c, x, y, fill, name) + 16
    extra = 2 * NRAF_BLOCK_PARAMS * NRAF_LAYERS
    c.text(10, y + 26, f"NRAF keeps every block's bf16 parameters from forward to backward: "
                       f"{extra / 1e9:.1f} GB on every GPU,", size=MIN_FONT)
    c.text(10, y + 44, "whatever the number of GPUs.", size=MIN_FONT)
    return c


def published_errors() -> Canvas:
    sources = ["torchtitan (A100)", "torchtitan (H100)", "llm-foundry (A100)", "llm-foundry (H100)"]
    errors = [abs(e) for _, _, e in PUBLISHED_ERRORS]
    median = sorted(errors)[len(errors) // 2]
    within = sum(e <= 0.15 for e in errors)
    c = Canvas("published_errors", 286, "The step-time model against 53 published FSDP runs",
               "A strip plot of the model's error, predicted over published tokens per second per GPU minus one, "
               "for 53 published runs from torchtitan's and llm-foundry's tables, a row per source and GPU, each run "
               "a tick, blue without activation checkpointing and orange with it. A dashed box marks errors within 15 "
               "percent, where most runs fall. Runs without checkpointing come out mostly high, runs with it mostly "
               "low; torchtitan's two H100 runs, on power-limited H100s, come out 30 percent high or more.")
    c.text(10, 20, "Predicted tokens/s ÷ published − 1, for 53 runs the model was not fitted to", bold=True)
    x0, x1, lo, hi = 170, 640, -0.5, 0.5
    top, pitch = 40, 40

    def x(e):
        return x0 + (e - lo) / (hi - lo) * (x1 - x0)
    c.rect(x(-0.15), top, x(0.15) - x(-0.15), pitch * len(sources), dash=True)
    for k, source in enumerate(sources):
        y = top + k * pitch
        n = sum(s == source for s, _, _ in PUBLISHED_ERRORS)
        c.text(x0 - 10, y + 25, f"{source}: {n}", anchor="end", size=MIN_FONT)
        c.line(x0, y + pitch, x1, y + pitch, width=0.5)
        for s, checkpointed, e in PUBLISHED_ERRORS:
            if s == source:
                c.rect(x(e) - 1.5, y + 10, 3, 20, fill=ORANGE if checkpointed else BLUE, stroke="none", rx=0)
    y = top + pitch * len(sources)
    c.line(x(0), top, x(0), y, dash=True)
    for e in (-0.5, -0.25, 0, 0.25, 0.5):
        c.line(x(e), y, x(e), y + 4, width=1)
        c.text(x(e), y + 19, f"{e:+.0%}" if e else "0", anchor="middle", size=MIN_FONT)
    y += 46
    xx = swatch(c, 10, y, BLUE, "no activation checkpointing") + 16
    xx = swatch(c, xx, y, ORANGE, "with it") + 16
    swatch(c, xx, y, "none", "dashed: within ±15%", dash=True)
    c.text(10, y + 24, f"Median error {median:.0%}: {within} of {len(errors)} runs within 15%.", size=MIN_FONT)
    return c


# -- two streams (exercise 13.2) ----------------------------------------------------------------------------------
# A program worked by hand, in issue order: ("compute", name, seconds), ("collective", tag, kind, channel, seconds,
# after) and ("wait", tag), the steps of program.py's Compute, Collective and Wait. Its spans, (lane, name) ->
# (start, end) in seconds, as simulate() times it, and as it times the same program with every collective put on
# one channel (a design with one queue for every channel); tests/test_diagrams_ch13_exercise.py runs both.
STREAMS_PROGRAM = (
    ("compute", "A", 2.0),
    ("collective", "x", "all_gather", "c1", 3.0, ()),
    ("collective", "w", "reduce_scatter", "c1", 1.0, ()),
    ("collective", "r", "all_reduce", "c2", 2.0, ()),
    ("collective", "y", "all_reduce", "c2", 2.0, ("w",)),
    ("compute", "B", 1.0),
    ("wait", "w"),
    ("compute", "C", 2.0),
    ("wait", "y"),
)
STREAMS_SPANS = {
    ("compute", "A"): (0.0, 2.0), ("compute", "B"): (2.0, 3.0), ("wait", "w"): (3.0, 6.0),
    ("compute", "C"): (6.0, 8.0),
    ("all_gather", "x"): (2.0, 5.0), ("reduce_scatter", "w"): (5.0, 6.0),
    ("all_reduce", "r"): (2.0, 4.0), ("all_reduce", "y"): (6.0, 8.0),
}
STREAMS_ONE_QUEUE_SPANS = {
    ("compute", "A"): (0.0, 2.0), ("compute", "B"): (2.0, 3.0), ("wait", "w"): (3.0, 6.0),
    ("compute", "C"): (6.0, 8.0), ("wait", "y"): (8.0, 10.0),
    ("all_gather", "x"): (2.0, 5.0), ("reduce_scatter", "w"): (5.0, 6.0),
    ("all_reduce", "r"): (6.0, 8.0), ("all_reduce", "y"): (8.0, 10.0),
}
STREAMS_STEPS = (8.0, 10.0)  # the step, right and with one queue


def simulate_contract() -> Canvas:
    step, wrong_step = STREAMS_STEPS
    c = Canvas("simulate_contract", 280, "Two streams: when each collective of a small program may start",
               "A program issued in this order: compute A, 2 s; all-gather x on channel c1, 3 s; reduce-scatter w "
               "on c1, 1 s; all-reduce r on channel c2, 2 s; all-reduce y on c2, 2 s, after w; compute B, 1 s; "
               "a wait for w; compute C, 2 s; a wait for y. On one compute stream and a channel per process group, "
               "a collective starts no earlier than three times: x and r not before A, the compute issued before "
               "them, ends at 2; w, though shorter, not before x, issued before it on c1, ends at 5; y not before "
               "w, in its after, ends at 6, although c2 is idle from 4. The two channels run side by side: r "
               "runs while x does. The wait for w blocks the compute stream from 3 until w ends at 6, not until "
               "y ends; C runs from 6 to 8 and the step ends at 8. A design with one queue for every channel "
               "puts r behind w and y behind r, so the wait for y blocks from 8 to 10: a step of 10 s.")
    fills = {"compute": GRAY, "wait": RED, "all_gather": BLUE, "reduce_scatter": ORANGE, "all_reduce": PURPLE}
    channel = {op[1]: op[3] for op in STREAMS_PROGRAM if op[0] == "collective"}
    x0, unit, h = 118, 50, 24

    def tx(t):
        return x0 + t * unit

    def lanes(spans, rows, top):
        """rows: (label, which spans) ; draws each row's spans as boxes, returns the y of each row."""
        ys = []
        for k, (label, pick) in enumerate(rows):
            y = top + k * (h + 8)
            ys.append(y)
            c.text(x0 - 8, y + 17, label, anchor="end", size=MIN_FONT)
            for (lane, name), (a, b) in spans.items():
                if pick(lane, name):
                    text = f"wait {name}" if lane == "wait" else name
                    c.box(tx(a) + 0.5, y, (b - a) * unit - 1, h, text, fills[lane], size=MIN_FONT)
        return ys

    c.text(10, 20, "A collective starts at the latest of three times; a wait, when its own one ends", bold=True)
    c.text(10, 40, "issued in order: A · x, w on c1 · r, y on c2, y after w · B · wait w · C · wait y",
           size=MIN_FONT)
    # the right timing: one compute stream, one FIFO per channel
    top = 70
    ys = lanes(STREAMS_SPANS, [("compute", lambda lane, n: lane in ("compute", "wait")),
                               ("channel c1", lambda lane, n: lane not in ("compute", "wait") and channel[n] == "c1"),
                               ("channel c2", lambda lane, n: lane not in ("compute", "wait") and channel[n] == "c2")],
               top)
    bottom = ys[-1] + h
    label_y = top - 10
    marks = ((STREAMS_SPANS[("all_gather", "x")][0], "① compute before it", "end"),
             (STREAMS_SPANS[("reduce_scatter", "w")][0], "② FIFO: behind x", "end"),
             (STREAMS_SPANS[("all_reduce", "y")][0], "③ its after: w", "start"))
    for t, text, anchor in marks:
        c.line(tx(t), label_y + 2, tx(t), bottom + 4, dash=True, width=1.2)
        c.text(tx(t) + (-5 if anchor == "end" else 5), label_y, text, anchor=anchor, size=MIN_FONT)
    c.line(tx(step), top - 4, tx(step), bottom + 4, width=1.5)
    c.text(tx(step) + 5, label_y, f"step {step:g} s", size=MIN_FONT, bold=True)
    axis = bottom + 8
    c.line(x0, axis, tx(wrong_step), axis, width=1)
    for t in range(int(wrong_step) + 1):
        c.line(tx(t), axis, tx(t), axis + 4, width=1)
        c.text(tx(t), axis + 18, f"{t} s" if t == wrong_step else str(t), anchor="middle", size=MIN_FONT)
    # the counter-example: every collective on one queue
    y = axis + 38
    c.text(10, y, f"One queue for every channel (wrong): r behind w, y behind r, a step of {wrong_step:g} s",
           bold=True, size=MIN_FONT)
    ys = lanes(STREAMS_ONE_QUEUE_SPANS, [("compute", lambda lane, n: lane in ("compute", "wait")),
                                         ("one queue", lambda lane, n: lane not in ("compute", "wait"))], y + 10)
    c.line(tx(wrong_step) - 0.5, y + 6, tx(wrong_step) - 0.5, ys[-1] + h + 4, width=1.5)
    return c


DIAGRAMS = (alpha_beta, two_level_network, nraf_step, published_errors, simulate_contract)
