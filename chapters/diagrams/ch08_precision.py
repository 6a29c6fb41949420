"""Chapter 8's newer diagrams: the three float formats, where the gradient is rounded (FSDP against Megatron's
main_grad), how the ranks agree on a skipped fp16 step, what CPU offload keeps where, and exercise 8.1's contract
(what one unshard sends and copies; tests/test_diagrams_ch08_exercise.py checks it against comm's counters).

The formats are written here as data (FORMATS, LOST_UPDATE); tests/test_diagrams_ch07_ch08.py checks them against
torch.finfo and a bf16 addition, and that the names drawn are the code's.
"""

from __future__ import annotations

from canvas import *  # noqa: F403  the canvas and the colours

# name: (exponent bits, significand bits stored, largest finite value as printed, spacing of the numbers at 1.0)
FORMATS = {"fp32": (8, 23, "3.4e38", "2⁻²³ ≈ 1.2e-7"),
           "bf16": (8, 7, "3.4e38", "2⁻⁷ ≈ 0.0078"),
           "fp16": (5, 10, "65504", "2⁻¹⁰ ≈ 0.00098")}
LOST_UPDATE = (1.0, 1e-4)  # a weight, and an update a hundred times smaller than bf16's spacing there


def float_formats() -> Canvas:
    c = Canvas("float_formats", 304, "fp32, bf16 and fp16: where the bits go, and why the master stays fp32",
               "Three rows of bits. fp32: 1 sign bit, 8 exponent bits, 23 significand bits; largest value about "
               "3.4e38, numbers near 1 are 2 to the -23 apart. bf16: 1, 8 and 7: fp32's range, numbers near 1 are "
               "2 to the -7, about 0.0078, apart. fp16: 1, 5 and 10: largest value 65504, numbers near 1 are 2 to "
               "the -10 apart. Below, a number line near 1.0 with bf16's two neighbours, 1.0 and 1.0078: the "
               "weight 1.0 plus an update of 0.0001 lands far closer to 1.0 and rounds back to it, so in bf16 the "
               "update is lost; fp32's neighbours are 1.2e-7 apart and keep it.")
    x0, cell = 64, 12.5
    c.text(10, 20, "one number in each format", bold=True)
    c.text(WIDTH - 10, 20, "largest · spacing at 1.0", anchor="end", size=MIN_FONT)
    y = 34
    for name, (e, m, largest, spacing) in FORMATS.items():
        c.text(10, y + 18, name, bold=True)
        x = x0
        for bits, fill, label in ((1, GRAY, ""), (e, YELLOW, f"exponent {e}"), (m, TEAL, f"significand {m}")):
            c.rect(x, y, bits * cell, 26, fill=fill)
            for k in range(1, bits):
                c.line(x + k * cell, y + 20, x + k * cell, y + 26, colour=INK, width=1)
            if label and bits * cell > text_width(label, MIN_FONT) + 6:
                c.text(x + bits * cell / 2, y + 16, label, anchor="middle", size=MIN_FONT, colour=INK)
            elif label:
                c.text(x + bits * cell / 2, y + 16, str(bits), anchor="middle", size=MIN_FONT, colour=INK)
            x += bits * cell
        c.text(WIDTH - 10, y + 18, f"{largest} · {spacing}", anchor="end", size=MIN_FONT)
        y += 40
    swatch(c, x0, y + 6, GRAY, "sign")
    c.text(x0 + 70, y + 6, "bf16 keeps fp32's exponent (its range) and drops 16 significand bits.", size=MIN_FONT)

    # the lost update, on bf16's number line near 1.0
    weight, update = LOST_UPDATE
    y += 34
    c.line(10, y, WIDTH - 10, y, width=1)
    c.text(10, y + 24, f"optimizer step in bf16: {weight:g} + {update:g}", bold=True)
    ax, bx, ly = 90, 590, y + 78
    c.line(ax - 40, ly, bx + 40, ly, width=1.5)
    for x, label in ((ax, "1.0"), (bx, "1.0078")):
        c.line(x, ly - 8, x, ly + 8, width=2)
        c.text(x, ly + 26, label, anchor="middle", size=MIN_FONT)
    c.text((ax + bx) / 2, ly + 26, "bf16 has no number in between", anchor="middle", size=MIN_FONT)
    landed = ax + (bx - ax) * update / 2 ** -7
    c.box(landed - 4, ly - 34, 96, 22, f"{weight + update:g}", BLUE, size=MIN_FONT)
    c.line(landed + 2, ly - 12, ax + 2, ly - 3, arrow=True)
    c.text(landed + 100, ly - 18, "rounds back to 1.0: the step is lost. fp32 keeps it.", size=MIN_FONT)
    return c


# -- where the gradient is rounded: FSDP, and Megatron's main_grad ---------------------------------------------------
def main_grad() -> Canvas:
    c = Canvas("main_grad", 374, "Two gradient paths: FSDP reduces then upcasts; Megatron accumulates in fp32",
               "Two rows of four boxes. FSDP, minifsdp's and PyTorch's: autograd's weight-gradient GEMM writes a "
               "bf16 gradient; the unit's flat gradient param.grad is bf16, P elements; it is cast to reduce_dtype "
               "and reduce-scattered; grad_for_optimizer casts this rank's shard to fp32, P/N elements, for the "
               "optimizer. Megatron with gradient_accumulation_fusion: a fused weight-gradient GEMM adds its result "
               "straight into main_grad, an fp32 buffer of P elements that every micro-batch accumulates into; "
               "after the last micro-batch the fp32 buffer is all-reduced or reduce-scattered; the optimizer's fp32 "
               "main parameters take it as their gradient. Without the fusion, Megatron's backward writes a bf16 "
               "weight.grad and a hook adds it into main_grad: one more tensor and one more kernel.")
    xs, w, h = (10, 178, 346, 514), 156, 52
    rows = [("FSDP (minifsdp, PyTorch): the gradient is bf16, reduced, then upcast", 34,
             [("weight-grad GEMM", "autograd: bf16 out", GRAY), ("param.grad", "flat, bf16, P", ORANGE),
              ("reduce_scatter", "in reduce_dtype", ORANGE), (".grad", "fp32, P/N", YELLOW)]),
            ("Megatron, gradient_accumulation_fusion: accumulated in fp32 by the GEMM", 164,
             [("fused wgrad GEMM", "adds into main_grad", GRAY), ("main_grad", "fp32, P elements", YELLOW),
              ("all-reduce or RS", "of the fp32 buffer", PURPLE), ("main param .grad", "fp32", YELLOW)])]
    for title, y, boxes in rows:
        c.text(10, y - 10, title, bold=True, size=MIN_FONT)
        for x, (name, note, fill) in zip(xs, boxes):
            code = name.startswith((".", "param", "main_grad", "reduce_"))
            c.box(x, y, w, h, [(name, {"mono": code}), note], fill, size=MIN_FONT)
        for i in range(3):
            c.line(xs[i] + w + 2, y + h / 2, xs[i + 1] - 2, y + h / 2, arrow=True)
    c.text(10, 108, "rounded to bf16 once per backward; in the sum too if reduce_dtype is bf16;", size=MIN_FONT)
    c.text(10, 126, "grad_for_optimizer casts the shard up. Between steps only P/N fp32 elements stay.", size=MIN_FONT)
    c.text(10, 238, "never a bf16 gradient: the GEMM's fp32 sum lands in fp32, every micro-batch adds", size=MIN_FONT)
    c.text(10, 256, "there, at the price of P fp32 elements per rank, all the time.", size=MIN_FONT)
    c.line(10, 276, WIDTH - 10, 276, width=1)
    c.text(10, 300, "Megatron without the fusion: weight.grad in bf16, then a hook adds it into main_grad:",
           size=MIN_FONT)
    c.text(10, 318, "one more bf16 tensor and one more kernel per weight.", size=MIN_FONT)
    c.text(10, 346, "minifsdp takes FSDP's path; it has no main_grad buffer and no fused GEMM.", size=MIN_FONT,
           bold=True)
    return c


# -- fp16: the ranks agree on a skipped step ----------------------------------------------------------------------------
def loss_scale_agreement() -> Canvas:
    c = Canvas("loss_scale_agreement", 332, "fp16 loss scaling under sharding: one MAX all-reduce makes the ranks agree",
               "Two columns, rank 0 and rank 1, each holding its shard of the gradients. Rank 1's shard holds an "
               "inf, rank 0's does not. unscale_ divides each shard by the scale S and sets a one-element flag: 0 "
               "on rank 0, 1 on rank 1. One all_reduce with MAX turns both flags into 1. Both ranks then skip the "
               "step and halve S. Without the all_reduce, rank 0 would step and keep S while rank 1 skipped and "
               "halved it: the model would be half stepped, and the ranks' scales would differ from then on.")
    cols = (60, 370)
    w = 250
    for r, x in enumerate(cols):
        c.box(x, 10, w, 28, f"rank {r}", RANKS[r], bold=True)
    rows = [(52, ["its shard of the gradients, ×S", "no overflow"], ["its shard of the gradients, ×S",
                                                                    "one element is inf"], GRAY),
            (130, ["unscale_: ÷S, look for inf", "found_inf = 0"], ["unscale_: ÷S, look for inf", "found_inf = 1"],
             GRAY)]
    for y, left, right, fill in rows:
        for x, lines in zip(cols, (left, right)):
            c.box(x, y, w, 48, lines, fill if not lines[1].endswith("inf") else RED, size=MIN_FONT)
            c.line(x + w / 2, y - 12, x + w / 2, y - 2, arrow=True) if y > 52 else None
    c.box(cols[0], 208, cols[1] + w - cols[0], 32, "all_reduce(found_inf, op=MAX): one element, every step", PURPLE,
          size=MIN_FONT, mono=False)
    for x in cols:
        c.line(x + w / 2, 180, x + w / 2, 206, arrow=True)
        c.line(x + w / 2, 242, x + w / 2, 258, arrow=True)
        c.box(x, 260, w, 48, ["found_inf = 1", "skip the step, halve S"], GREEN, size=MIN_FONT)
    c.text(10, 326, "Each rank deciding alone: rank 0 steps, rank 1 skips, and their S differ from then on.",
           size=MIN_FONT)
    return c


# -- CPU offload --------------------------------------------------------------------------------------------------------
def cpu_offload() -> Canvas:
    c = Canvas("cpu_offload", 292, "CPU offload: the model states on the host, what is computed on the device",
               "Two columns. Host memory holds the fp32 master shard (P/N elements per unit), its fp32 gradient shard "
               "and AdamW's two fp32 moments: 16 bytes per parameter over N, and optimizer.step() runs on the CPU. "
               "Device memory holds what is being computed: the full bf16 parameters of the units unsharded at the "
               "moment, the gradient shard a reduce-scatter has just made, and the activations. At every unshard, copy_to sends the fp32 shard host_to_device, where it "
               "is cast and all-gathered; at every reduce-scatter the averaged gradient shard comes back "
               "device_to_host in reduce_dtype and is cast to fp32 there.")
    hx, dx, w = 10, 420, 250
    c.text(hx, 20, "host memory (pinned)", bold=True)
    c.text(dx, 20, "device memory", bold=True)
    host = [("master shard", "param: fp32, P/N", BLUE), (".grad", "fp32, P/N", YELLOW),
            ("AdamW state", "2 × fp32, P/N", GREEN), ("optimizer.step()", "runs on the CPU", GRAY)]
    device = [("_full", "cast, all-gathered: bf16, P", TEAL), ("gradient shard", "reduce_scatter's: P/N", ORANGE),
              ("activations", "bf16", GRAY)]
    for column, x in ((host, hx), (device, dx)):
        for i, (name, note, fill) in enumerate(column):
            code = name.startswith((".", "_", "optimizer"))
            c.box(x, 32 + i * 58, w, 48, [(name, {"mono": code}), note], fill, size=MIN_FONT)
    mid = (hx + w + dx) / 2
    c.line(hx + w + 4, 56, dx - 4, 56, arrow=True)
    c.text(mid, 48, "host_to_device", anchor="middle", size=MIN_FONT, mono=True)
    c.text(mid, 76, "fp32, every unshard", anchor="middle", size=MIN_FONT)
    c.line(dx - 4, 114, hx + w + 4, 114, arrow=True)
    c.text(mid, 106, "device_to_host", anchor="middle", size=MIN_FONT, mono=True)
    c.text(mid, 134, "in reduce_dtype", anchor="middle", size=MIN_FONT)
    c.text(dx, 222, "what is computed now", size=MIN_FONT)
    c.text(dx, 240, "stays on the device", size=MIN_FONT)
    c.text(10, 280, "The model states, 16Ψ/N, leave the device; every unshard pays a copy over PCIe.", size=MIN_FONT)
    return c


# -- what one unshard sends and copies (exercise 8.1) -------------------------------------------------------------
# One Block unit of the default GPT (FSDP with ModuleWrapPolicy({Block})) at N = 4, rank 0: its shard's and its
# padded flat parameter's elements, and what comm counts for one unshard() of it in each run (all-gathers,
# bytes on the wire, bytes copied host_to_device). tests/test_diagrams_ch08_exercise.py checks them against the
# package's counters, and the two wrong designs' numbers against a patched _cast_shard and the fp32 run.
CAST_N = 4
CAST_SHARD_NUMEL, CAST_PADDED_NUMEL = 3152, 12608
CAST_RUNS = (("fp32", False, 1, 37824, 0), ("bf16", False, 1, 18912, 0),
             ("fp32", True, 1, 37824, 12608), ("bf16", True, 1, 18912, 12608))  # dtype, offload, calls, wire, copied


def cast_shard_contract() -> Canvas:
    n, shard, padded = CAST_N, CAST_SHARD_NUMEL, CAST_PADDED_NUMEL
    wire = {(d, o): b for d, o, _, b, _ in CAST_RUNS}
    copied = {(d, o): b for d, o, *_, b in CAST_RUNS}
    bf16_wire, fp32_wire, copy = wire["bf16", True], wire["fp32", False], copied["bf16", True]
    host_cast = 2 * shard  # a bf16 copy of the shard
    c = Canvas("cast_shard_contract", 364,
               "Exercise 8.1's contract: what one unshard sends and copies, and what two wrong designs do",
               f"One unshard of a Block unit of the default GPT at N = {n}, rank 0, in bf16 with offload: the fp32 "
               f"master shard, {shard:,} elements, stays fp32 on the host; {copy:,} bytes of fp32 cross "
               f"host_to_device; what the rank sends is {shard:,} bf16 elements on the device; one all-gather "
               f"fills the bf16 buffer of {padded:,} elements and carries {bf16_wire:,} bytes, 2 bytes times "
               f"{padded:,} times {n - 1}/{n}. A table of rank 0's counters for one unshard: one all-gather in "
               f"every run; {fp32_wire:,} bytes on the wire in fp32 and {bf16_wire:,} in bf16, with or without "
               f"offload; {copy:,} bytes copied with offload and none without. Two designs break the contract: "
               f"gathering the fp32 shards and casting the full buffer puts {fp32_wire:,} bytes on the wire, "
               f"fp32's, not half; casting on the host and copying bf16 copies {host_cast:,} bytes, not the fp32 "
               f"shard's {copy:,}.")
    c.text(10, 20, f"one unshard of a Block unit, default GPT, N = {n}, bf16 with offload: rank 0", bold=True)
    xs, w, y, h = (10, 265, 505), 165, 34, 52
    boxes = [(["self._shard, host", f"fp32 · {shard:,} elements"], BLUE),
             (["what it sends, device", f"bf16 · {shard:,} elements"], TEAL),
             (["self._full, device", f"bf16 · {padded:,} elements"], TEAL)]
    for x, (lines, fill) in zip(xs, boxes):
        c.box(x, y, w, h, lines, fill, size=MIN_FONT)
    for (a, b), (above, below) in zip(((xs[0] + w, xs[1]), (xs[1] + w, xs[2])),
                                      (("copy, fp32", f"{copy:,} B"), ("all-gather", f"{bf16_wire:,} B"))):
        c.line(a + 3, y + h / 2, b - 3, y + h / 2, arrow=True)
        c.text((a + b) / 2, y + h / 2 - 7, above, anchor="middle", size=MIN_FONT)
        c.text((a + b) / 2, y + h / 2 + 19, below, anchor="middle", size=MIN_FONT)
    c.text(10, 112, f"copied: 4 B × {shard:,} = {copy:,} B, the fp32 shard, cast on the device; self._shard unchanged.",
           size=MIN_FONT)
    c.text(10, 130, f"on the wire: 2 B × {padded:,} × {n - 1}/{n} = {bf16_wire:,} B, half of fp32's.", size=MIN_FONT)

    y = 162
    cols = ((10, "start", "run"), (290, "end", "all-gathers"), (470, "end", "on the wire"),
            (670, "end", "host_to_device"))
    for x, anchor, head in cols:
        c.text(x, y, head, anchor=anchor, size=MIN_FONT, bold=True, mono=head == "host_to_device")
    c.line(10, y + 7, WIDTH - 10, y + 7, width=1)
    for dtype, offload, calls, sent, into in CAST_RUNS:
        y += 20
        cells = (f"{dtype}, offload" if offload else dtype, str(calls), f"{sent:,} B",
                 f"{into:,} B" if into else "nothing")
        for (x, anchor, _), s in zip(cols, cells):
            c.text(x, y, s, anchor=anchor, size=MIN_FONT, bold=dtype == "bf16" and offload)

    y += 34
    c.text(10, y, "two designs that break it, as the counters see them", bold=True)
    wrong = [f"gathers fp32, casts the full buffer: {fp32_wire:,} B on the wire, fp32's, not half",
             f"casts on the host, copies bf16: {host_cast:,} B copied, not the fp32 shard's {copy:,} B"]
    for i, s in enumerate(wrong):
        c.box(10, y + 12 + i * 38, WIDTH - 20, 30, s, RED, size=MIN_FONT)
    return c


DIAGRAMS = (float_formats, main_grad, loss_scale_agreement, cpu_offload, cast_shard_contract)
