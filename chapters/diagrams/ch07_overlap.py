"""Chapter 7's newer diagrams: why overlap matters, why a prefetch needs a second all-gather buffer, what the
caching allocator does when the CPU runs too far ahead, and what exercises 7.1 and 7.2's "next unit" must be.

The step model (step_timeline) is written here as data and rules, like backward_prefetch's in make_diagrams.py:
tests/test_diagrams_ch07_ch08.py checks what the page says of it, and that the names drawn are the code's.
"""

from __future__ import annotations

from canvas import *  # noqa: F403  the canvas and the colours

# One step of three units on one rank, in time units: forward 3 and backward 6 per unit (backward does about
# twice forward's work), an all-gather or a reduce-scatter 2. The channel carries one collective at a time, in
# issue order, as one NCCL stream (or chapter 7's throttled link) does.
STEP_UNITS, T_FORWARD, T_BACKWARD, T_COLLECTIVE = (1, 2, 3), 3, 6, 2


def step_timeline(overlap: bool, units=STEP_UNITS, t_forward=T_FORWARD, t_backward=T_BACKWARD,
                  t_collective=T_COLLECTIVE, issued: dict | None = None):
    """(compute spans, channel spans) of one step, each (kind, unit, start, end).

    overlap=False: every collective is issued when it is needed and waited for at once, on the compute's own
    path (what a single stream, or a blocking call, gives). overlap=True: the collectives run on a stream of
    their own, each unit's all-gather is issued one unit early (forward_prefetch, BACKWARD_PRE), and a
    reduce-scatter is waited for only at the end of backward. issued, if given, gets when each all-gather was
    issued, by (phase, unit): unshard() allocates the unit's full buffer then."""
    issued = {} if issued is None else issued
    compute, channel, ready = [], [], {}
    free, t = 0, 0

    def issue(kind, unit, at):
        nonlocal free
        if kind == "AG":
            issued[(phase, unit)] = at
        start = max(at, free)
        free = start + t_collective
        channel.append((kind, unit, start, free))
        return free

    def wait(until):
        nonlocal t
        if until > t:
            compute.append(("wait", None, t, until))
            t = until

    for phase, order, t_compute in (("F", list(units), t_forward), ("B", list(units)[::-1], t_backward)):
        for i, unit in enumerate(order):
            if (phase, unit) not in ready:
                ready[(phase, unit)] = issue("AG", unit, t)
            if overlap and i + 1 < len(order):  # the next unit's all-gather, before this one computes
                ready[(phase, order[i + 1])] = issue("AG", order[i + 1], t)
            wait(ready[(phase, unit)])
            compute.append((phase, unit, t, t + t_compute))
            t += t_compute
            if phase == "B":
                done = issue("RS", unit, t)
                if not overlap:
                    wait(done)
    wait(free)  # the last reduce-scatter, before the optimizer steps
    return compute, channel


def buffers_alive(overlap: bool, phase: str = "F") -> dict:
    """unit -> (from, to): when its full buffer exists in `phase`, from the all-gather's issue (unshard()
    allocates it then) to the end of the unit's compute (reshard() frees it)."""
    issued = {}
    compute, _ = step_timeline(overlap, issued=issued)
    ends = {u: end for kind, u, _, end in compute if kind == phase}
    return {u: (issued[(phase, u)], ends[u]) for u in STEP_UNITS}


def most_alive(spans: dict) -> int:
    """The most buffers alive at one moment."""
    return max(sum(a <= t < b for a, b in spans.values()) for t, _ in spans.values())


def exposed(compute) -> int:
    return sum(end - start for kind, _, start, end in compute if kind == "wait")


def overlap_step() -> Canvas:
    plain, hidden = step_timeline(False), step_timeline(True)
    length = [max(end for *_, end in spans[0]) for spans in (plain, hidden)]
    c = Canvas("overlap_step", 308, "Why overlap matters: one step with and without overlap",
               f"Two timelines of one FSDP step of three units on one rank, each with a compute lane and a "
               f"communication lane. Without overlap, every all-gather and reduce-scatter is issued when it is "
               f"needed and waited for: the rank is blocked {exposed(plain[0])} of {length[0]} time units. With "
               f"overlap, the collectives run on a stream of their own and each unit's all-gather is issued one "
               f"unit early, so it travels while the previous unit computes: only the first all-gather of each "
               f"pass and the last reduce-scatter are exposed, {exposed(hidden[0])} time units, and the step "
               f"takes {length[1]}.")
    x0 = 128
    unit = (WIDTH - 10 - x0) / max(length)
    panels = [("without overlap", plain, "each collective issued when needed, and waited for"),
              ("with overlap", hidden, "comm on its own stream, each all-gather one unit early")]
    y = 8
    for title, (compute, channel), note in panels:
        c.text(10, y + 16, title, bold=True)
        end = max(e for *_, e in compute)
        c.text(WIDTH - 10, y + 16, f"step {end} · blocked {exposed(compute)}", anchor="end", size=MIN_FONT)
        c.text(10, y + 35, note, size=MIN_FONT)
        for lane, spans, top in (("compute", compute, y + 44), ("comm stream", channel, y + 76)):
            c.text(x0 - 8, top + 17, lane, anchor="end", size=MIN_FONT)
            for kind, u, a, b in spans:
                label, fill = {"wait": ("", RED), "F": (f"F{u}", GRAY), "B": (f"B{u}", GRAY),
                               "AG": (str(u), BLUE), "RS": (str(u), ORANGE)}[kind]
                c.box(x0 + a * unit + 0.5, top, (b - a) * unit - 1, 26, label, fill, size=MIN_FONT)
        y += 120
    for t in range(0, max(length) + 1, 5):
        c.text(x0 + t * unit, y, str(t), anchor="middle", size=MIN_FONT)
    c.text(x0 - 8, y, "time", anchor="end", size=MIN_FONT)
    y += 26
    x = swatch(c, 10, y, BLUE, "all_gather of unit i") + 14
    x = swatch(c, x, y, ORANGE, "reduce_scatter") + 14
    x = swatch(c, x, y, GRAY, "F / B: compute") + 14
    swatch(c, x, y, RED, "exposed: blocked waiting")
    c.text(10, y + 24, "The price of the early all-gather: unit i+1's full parameters arrive while unit i's are in use.",
           size=MIN_FONT)
    return c


# -- two all-gather buffers ------------------------------------------------------------------------------------------
BUFFER_VIEWS = ("ln_1", "attn.qkv", "attn.proj", "ln_2", "fc", "fc_proj")  # a Block's modules, in its flat order


def two_all_gather_buffers() -> Canvas:
    alive = buffers_alive(True)
    c = Canvas("two_all_gather_buffers", 486,
               "Two all-gather buffers: the next unit's all-gather cannot write where this unit computes",
               "Top left: blocks.1's full buffer _full, cut into the views its modules compute with (ln_1, qkv, "
               "proj, ln_2, fc, fc_proj); the compute stream reads them during blocks.1's forward. Top right: "
               "blocks.2's own _full, which unshard() allocated and the all_gather is filling with every rank's "
               "shard at the same time: it cannot write into blocks.1's buffer, since that memory is blocks.1's "
               "weights until its compute is done, whether the CPU ran ahead by itself (implicit prefetch, on a GPU) "
               "or was told to (forward_prefetch). Below, the forward of three blocks with each all-gather "
               "issued one unit early: each block's buffer lives from its all-gather's issue to the end of its "
               f"compute, and at most {most_alive(alive)} are alive at once. reshard() frees a buffer after "
               "record_stream, so the memory is reused only once the compute stream is past it, and "
               "limit_all_gathers keeps the CPU at most two frees ahead of the device.")
    w = 320
    xs = (10, WIDTH - 10 - w)
    c.text(xs[0], 20, "blocks.1 computes", bold=True)
    c.text(xs[1], 20, "blocks.2's all-gather arrives", bold=True)
    c.box(xs[0], 34, w, 30, "forward of blocks.1: compute stream", GRAY, size=MIN_FONT)
    c.box(xs[1], 34, w, 30, "all_gather: all-gather stream", BLUE, size=MIN_FONT)
    for k in range(4):
        c.line(xs[0] + 20 + k * 88, 66, xs[0] + 20 + k * 88, 94, arrow=True)
    c.text(xs[0] + w / 2, 84, "reads", anchor="middle", size=MIN_FONT)
    for x in (xs[1] + 60, xs[1] + w - 60):
        c.line(x, 66, x, 94, arrow=True)
    c.text(xs[1] + w / 2, 84, "writes", anchor="middle", size=MIN_FONT)
    seg = w / len(BUFFER_VIEWS)
    for i, name in enumerate(BUFFER_VIEWS):
        c.box(xs[0] + i * seg, 98, seg, 30, name.split(".")[-1], TEAL, size=MIN_FONT)
    for r in range(2):
        c.box(xs[1] + r * w / 2, 98, w / 2, 30, f"from rank {r}", TEAL, size=MIN_FONT)
    for x, name, lines in ((xs[0], "blocks.1's _full", ["its parameters are views into it:", "this memory is blocks.1's weights"]),
                           (xs[1], "blocks.2's _full", ["so the all_gather needs a buffer", "of its own: a second one"])):
        c.text(x, 148, name, size=MIN_FONT, mono=True)
        for i, line in enumerate(lines):
            c.text(x, 168 + 18 * i, line, size=MIN_FONT)

    # the buffers' lifetimes in one forward, each all-gather issued one unit early
    y0 = 214
    c.line(10, y0, WIDTH - 10, y0, width=1)
    c.text(10, y0 + 24, "forward of three blocks, each all-gather issued one unit early", bold=True)
    compute, channel = step_timeline(True)
    end = max(e for k, _, _, e in compute if k == "F")
    x0 = 150
    unit = (WIDTH - 10 - x0) / end
    lanes = [("compute", [(k, u, a, b) for k, u, a, b in compute if b <= end and k in ("F", "wait")]),
             ("comm stream", [(k, u, a, b) for k, u, a, b in channel if b <= end])]
    lanes += [(f"blocks.{u} _full", [("buffer", u, *alive[u])]) for u in STEP_UNITS]
    y = y0 + 38
    for lane, spans in lanes:
        c.text(x0 - 8, y + 17, lane, anchor="end", size=MIN_FONT, mono=lane.endswith("_full"))
        for kind, u, a, b in spans:
            label, fill = {"wait": ("", RED), "F": (f"F{u}", GRAY), "AG": (f"all_gather {u}", BLUE),
                           "buffer": ("alive", TEAL)}[kind]
            c.box(x0 + a * unit + 0.5, y, (b - a) * unit - 1, 24, label, fill, size=MIN_FONT)
        y += 30
    for t in range(0, end + 1):
        c.text(x0 + t * unit, y + 10, str(t), anchor="middle", size=MIN_FONT)
    y += 36
    c.text(10, y, f"At most {most_alive(alive)} full buffers at once: the one computing and the one arriving.",
           size=MIN_FONT)
    c.text(10, y + 20, "reshard() frees after record_stream: the memory is reused once the compute stream is past",
           size=MIN_FONT)
    c.text(10, y + 40, "it; limit_all_gathers keeps the CPU at most two frees ahead of the device.", size=MIN_FONT)
    return c


# -- the allocator's retry ("soft OOM") ------------------------------------------------------------------------------
def allocator_retry() -> Canvas:
    c = Canvas("allocator_retry", 424, "The caching allocator's soft OOM: free the cache, synchronize, retry",
               "Left: a bar of device memory. memory_allocated() counts the blocks live tensors use; "
               "memory_reserved() adds the cached blocks the allocator keeps from cudaMalloc for reuse, among "
               "them the blocks freed with record_stream that wait for a stream to pass. Right: what one "
               "allocation does. A cached block that fits is reused, in microseconds. If none fits, cudaMalloc "
               "asks the driver for more. If that fails, the allocator releases cached blocks: it waits for every "
               "stream event pending on them, which stalls the CPU until the GPU gets there, and returns them "
               "with cudaFree, which synchronizes the device; then it calls cudaMalloc again. That retry is "
               "counted in num_alloc_retries. Only if it fails too is the OutOfMemoryError raised.")
    # the memory bar, with memory_allocated() on its left and memory_reserved() on its right
    bx, bw, top = 140, 130, 32
    parts = [(["live tensors"], 150, BLUE), (["cached, free"], 64, GRAY),
             (["cached: waits", "for a stream"], 56, YELLOW), (["not reserved"], 86, None)]
    c.text(bx, 20, "device memory", bold=True)
    y, ends = top, []
    for lines, h, fill in parts:
        if fill is None:
            c.rect(bx, y, bw, h, dash=True)
            c.text(bx + bw / 2, y + h / 2 + 5, lines[0], anchor="middle", size=MIN_FONT)
        else:
            c.box(bx, y, bw, h, lines, fill, size=MIN_FONT)
        y += h
        ends.append(y)
    allocated_end, reserved_end = ends[0], ends[2]
    c.path(f"M{bx - 4},{top} h-6 V{allocated_end} h6", points=[(bx - 10, top), (bx - 4, allocated_end)])
    c.text(bx - 14, (top + allocated_end) / 2 - 4, "memory_", anchor="end", size=MIN_FONT, mono=True)
    c.text(bx - 14, (top + allocated_end) / 2 + 14, "allocated()", anchor="end", size=MIN_FONT, mono=True)
    c.path(f"M{bx + bw + 4},{top} h6 V{reserved_end} h-6", points=[(bx + bw + 4, top), (bx + bw + 10, reserved_end)])
    c.text(bx + bw + 14, (top + reserved_end) / 2 - 4, "memory_", size=MIN_FONT, mono=True)
    c.text(bx + bw + 14, (top + reserved_end) / 2 + 14, "reserved()", size=MIN_FONT, mono=True)
    # the flow of one allocation
    fx, fw, fh = 374, 228, 40
    steps = [(36, ["a cached block fits?", "reuse it: microseconds"], GREEN),
             (112, ["cudaMalloc(n)", "the driver: slower, no sync"], GRAY),
             (188, ["fails: release the cache", "after waiting on pending events"], RED),
             (264, ["cudaFree its free segments", "(each call syncs the device)"], RED),
             (340, ["cudaMalloc(n) again", "num_alloc_retries += 1"], YELLOW)]
    c.text(fx, 20, "torch.empty(n) on the GPU", bold=True)
    for i, (y, lines, fill) in enumerate(steps):
        c.box(fx, y, fw, fh, [(lines[0], {"mono": lines[0].startswith(("cuda",))}), lines[1]], fill, size=MIN_FONT)
        if i + 1 < len(steps):
            c.line(fx + fw / 2, y + fh + 2, fx + fw / 2, steps[i + 1][0] - 2, arrow=True)
            if i < 2:
                c.text(fx + fw / 2 + 8, y + fh + 24, "no", size=MIN_FONT)
    for y, s in ((60, "yes: done"), (136, "ok: done"), (356, "ok: go on"), (374, "fails: OOM")):
        c.text(fx + fw + 8, y, s, size=MIN_FONT)
    c.text(10, 408, "The retry is the soft OOM: the step goes on, but the CPU's run-ahead is lost.", size=MIN_FONT)
    return c


# -- the next unit (exercises 7.1 and 7.2) ------------------------------------------------------------------------
# The tests' models (tests/test_ch07_overlap.py), each Linear a unit. OutOfOrder: the module tree lists its units
# in one order, they run in another. Reordered: its last two units swap every other step. The orders are what the
# package records (ExecutionOrder), and the all-gathers what a step issues, with forward_prefetch and
# BACKWARD_PRE, for a design with the exercises' properties and for a wrong one; tests/test_diagrams_ch07_exercise.py
# runs both models and checks every row.
NEXT_TREE = ("(root)", "inp", "c", "b", "a")           # OutOfOrder's root.units(): the order modules were registered
NEXT_FORWARD = ("(root)", "inp", "a", "b", "c")        # its order.order["forward"]
NEXT_BACKWARD = ("(root)", "c", "b", "a", "inp")       # its order.order["backward"]
# the all-gathers of a forward from the second step on: "next" as the units run, and "next" in the module tree
NEXT_FORWARD_GATHERS = (("inp", "a", "b", "c"), ("inp", "c", "a", "b", "a", "b"))
SWAP_RECORDED = ("(root)", "c", "b", "a", "inp")       # Reordered's order.order["backward"], recorded in step 0
SWAP_ODD = ("(root)", "b", "c", "a", "inp")            # what an odd step's backward runs (and would record)
# the all-gathers of an odd step's backward: a design with the properties, and one that prefetches the recorded
# next unit even when its backward has begun
SWAP_GATHERS = (("c", "b", "a", "inp"), ("c", "b", "a", "b", "inp"))


def _twice(names) -> set:
    """The positions of the units gathered a second time."""
    return {i for i, u in enumerate(names) if u in names[:i]}


def prefetch_next_unit() -> Canvas:
    c = Canvas("prefetch_next_unit", 360, "Exercises 7.1 and 7.2: the next unit is the one that runs next",
               f"Three panels. First, the tests' model OutOfOrder: its module tree lists its units as "
               f"{', '.join(NEXT_TREE)}; its forward runs them as {', '.join(NEXT_FORWARD)} and its backward as "
               f"{', '.join(NEXT_BACKWARD)}, the orders the root records in the first step. Second, exercise 7.1: "
               f"from the second step on, with forward_prefetch, a forward whose next unit is the one that runs "
               f"next issues {len(NEXT_FORWARD_GATHERS[0])} all-gathers, {', '.join(NEXT_FORWARD_GATHERS[0])}, each "
               f"unit once; taking the next unit from the module tree issues "
               f"{len(NEXT_FORWARD_GATHERS[1])}, {', '.join(NEXT_FORWARD_GATHERS[1])}: a and b are gathered twice. "
               f"Third, exercise 7.2: the model Reordered, whose last two units swap every other step, recorded its "
               f"backward as {', '.join(SWAP_RECORDED)}, but an odd step runs {', '.join(SWAP_ODD)}. A design with "
               f"the exercise's properties issues {', '.join(SWAP_GATHERS[0])} in that backward, each unit at most "
               f"once; a design that prefetches the recorded next unit even when its backward has begun issues "
               f"{', '.join(SWAP_GATHERS[1])}: c's backward gathers b again, after b's backward has run.")
    lx, bx, bw, pitch = 176, 186, 50, 56   # labels end at lx; boxes from bx
    column = bx + 6 * pitch + 4             # the orders' names in the package

    def row(y, label, names, fill, note="", red=frozenset()):
        c.text(lx, y + 17, label, anchor="end", size=MIN_FONT)
        for i, u in enumerate(names):
            c.box(bx + i * pitch, y, bw, 24, u, RED if i in red else fill, size=MIN_FONT)
        if note.startswith(("root.", "order")):
            c.text(column, y + 17, note, size=MIN_FONT, mono=True)
        elif note:  # what a row of all-gathers shows, just after it
            c.text(bx + len(names) * pitch + 4, y + 17, note, size=MIN_FONT)

    y = 18
    c.text(10, y, "OutOfOrder, a model of the tests: its units listed in one order, run in another", bold=True)
    y += 10
    row(y, "the module tree lists", NEXT_TREE, GRAY, "root.units()")
    row(y + 30, "forward runs", NEXT_FORWARD, BLUE, 'order["forward"]')
    row(y + 60, "backward runs", NEXT_BACKWARD, ORANGE, 'order["backward"]')

    y += 112
    c.text(10, y, "7.1: a forward's all-gathers, from the second step on (forward_prefetch)", bold=True)
    y += 10
    row(y, "next: the unit run next", NEXT_FORWARD_GATHERS[0], BLUE, "each unit once")
    row(y + 30, "next: the tree's next", NEXT_FORWARD_GATHERS[1], BLUE, "a and b twice",
        red=_twice(NEXT_FORWARD_GATHERS[1]))

    y += 82
    c.text(10, y, "7.2: Reordered swaps its last two units every other step (BACKWARD_PRE)", bold=True)
    y += 10
    row(y, "recorded in step 0", SWAP_RECORDED, ORANGE, 'order["backward"]')
    row(y + 30, "an odd step runs", SWAP_ODD, ORANGE)
    row(y + 60, "a design that passes", SWAP_GATHERS[0], BLUE, "each unit at most once")
    row(y + 90, "a begun unit prefetched", SWAP_GATHERS[1], BLUE, "b again, its backward begun",
        red=_twice(SWAP_GATHERS[1]))
    return c


DIAGRAMS = (overlap_step, two_all_gather_buffers, allocator_retry, prefetch_next_unit)
