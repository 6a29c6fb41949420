"""Chapter 13: the step-time model (minifsdp/measure/step_time/).

The alpha-beta formulas and the two-stream simulation are checked on cases worked by hand (exact, up to float
rounding). The FSDP program the model builds is checked against the issue order of a real minifsdp step at two
ranks, read from the recorder, in every prefetch mode. The rest are properties (more bandwidth is never
slower) and the bookkeeping of the published comparison: every row cites a source, the sources' own MFU
follows from their tokens/s under the model's FLOP convention, and the calibration rows are met.
"""

import math
import re
from dataclasses import replace

import pytest

from minifsdp import launch
from minifsdp.measure import step_time as st
from minifsdp.measure.timeline import Timeline
from minifsdp.models import GPTConfig
from minifsdp.reports.overlap import MODES, build, step

SMALL = GPTConfig(vocab_size=96, block_size=32, n_layer=3, n_head=2, n_embd=48)
PREFETCH = {None: None, "pre": "pre", "post": "post"}


# -- alpha-beta, by hand ---------------------------------------------------------------------------------------
def _ring_steps(kind, n):
    """The rounds of a ring, played out: each round every rank sends one message to its right-hand neighbour.
    An all-gather ends when every rank holds all n chunks; a reduce-scatter when the running sum of each chunk
    has picked up all n ranks' contributions; an all-reduce is the one, then the other."""
    if kind == "all_reduce":
        return _ring_steps("reduce_scatter", n) + _ring_steps("all_gather", n)
    held = [{r} for r in range(n)]  # all-gather: the chunks a rank holds; reduce-scatter: the contributions
    moving = list(range(n))         # in the sum it passes on (rank r's sum of chunk r + 1 starts as {r})
    rounds = 0
    while any(len(h) < n for h in held):
        arrived = [moving[(r - 1) % n] for r in range(n)]
        if kind == "all_gather":
            for r in range(n):
                held[r].add(arrived[r])
            moving = arrived
        else:
            held = [held[(r - 1) % n] | {r} for r in range(n)]
        rounds += 1
    return rounds


def _tree_steps(n):
    """Up: pairs of ranks that hold a partial sum combine (one sends, one adds), halving them, rounded up.
    Down: every rank that holds the result sends it to one that does not, doubling them."""
    up, holding = 0, n
    while holding > 1:
        holding, up = (holding + 1) // 2, up + 1
    down, have = 0, 1
    while have < n:
        have, down = 2 * have, down + 1
    return up + down


def _steps_msg(kind, n, algorithm, got, want, why):
    return (f"algorithm_steps({kind!r}, {n}, {algorithm!r}) is {got:,} steps, expected {want:,}: {why} "
            f"(exercise 13.1)")


@pytest.mark.mechanism
@pytest.mark.exercise("13.1")
def test_steps_are_counted_per_algorithm():
    """The latency term on its own: a ring pays alpha once per hop of the data around the ring (twice round
    for an all-reduce), a tree once per level, up and down."""
    for n, want in zip((1, 2, 3, 8), (0, 2, 4, 14)):
        got = st.algorithm_steps("all_reduce", n)
        assert got == want, _steps_msg("all_reduce", n, "ring", got, want,
                                       "a ring all-reduce goes round the ring twice, n - 1 hops each time "
                                       "(one rank: no step at all).")
    for kind in ("all_gather", "reduce_scatter"):
        got = st.algorithm_steps(kind, 5)
        assert got == 4, _steps_msg(kind, 5, "ring", got, 4, "one pass round the ring: n - 1 hops.")
    for n, want in zip((2, 3, 8, 9), (2, 4, 6, 8)):
        got = st.algorithm_steps("all_reduce", n, "tree")
        assert got == want, _steps_msg("all_reduce", n, "tree", got, want,
                                       "up the tree and down again, one step per level each way; a level "
                                       "that is not full still costs a step (round up).")
    with pytest.raises(ValueError, match="'ring' or 'tree'"):
        st.algorithm_steps("all_reduce", 4, "star")


@pytest.mark.mechanism
@pytest.mark.exercise("13.1")
def test_a_ring_all_reduce_is_two_passes_of_n_minus_1_hops():
    """Each count is the rounds of the ring's schedule played out, for every group size up to 64; and an
    all-reduce costs exactly its reduce-scatter plus its all-gather, for every size up to 2,048."""
    for n in range(2, 65):
        for kind in ("reduce_scatter", "all_gather", "all_reduce"):
            got, want = st.algorithm_steps(kind, n, "ring"), _ring_steps(kind, n)
            assert got == want, _steps_msg(
                kind, n, "ring", got, want,
                "each rank sends one message a step, to its neighbour only, and a chunk must pass every "
                "other rank; an all-reduce is a reduce-scatter pass and then an all-gather pass. Is the count "
                "one pass for an all-reduce, or a formula fitted to a few sizes?")
    for n in range(2, 2049):
        parts = st.algorithm_steps("reduce_scatter", n) + st.algorithm_steps("all_gather", n)
        got = st.algorithm_steps("all_reduce", n)
        assert got == parts, _steps_msg("all_reduce", n, "ring", got, parts,
                                        "a ring all-reduce is a reduce-scatter followed by an all-gather, "
                                        "so it takes exactly their steps added up.")


@pytest.mark.mechanism
@pytest.mark.exercise("13.1")
def test_a_tree_halves_the_partial_sums_up_and_doubles_the_result_down():
    """The tree's count is the rounds of its schedule for every group size up to 4,096 (every power of two
    and the sizes either side of one included), and a tree is an all-reduce's only."""
    for n in range(2, 4097):
        got, want = st.algorithm_steps("all_reduce", n, "tree"), _tree_steps(n)
        assert got == want, _steps_msg(
            "all_reduce", n, "tree", got, want,
            "each step up halves the ranks still holding a partial sum (rounded up), each step down doubles "
            "those holding the result. Is a partly filled level left out, or counted in one direction only?")
    for kind in ("all_gather", "reduce_scatter"):
        with pytest.raises(ValueError, match="all-gather and reduce-scatter are rings"):
            st.algorithm_steps(kind, 8, "tree")
            pytest.fail(f"algorithm_steps({kind!r}, 8, 'tree') returned a count: a tree here is an "
                        f"all-reduce's only, anything else is a ValueError (exercise 13.1)")


def _time_msg(what, got, want, why, exercise="13.1"):
    return (f"{what} takes {got * 1e6:,.2f} us, expected {want * 1e6:,.2f} us: {why} (exercise {exercise})")


@pytest.mark.exercise("13.1")
def test_alpha_beta_on_hand_computed_cases():
    link = st.Link(alpha=1e-6, busbw=1e9)
    cases = [  # (kind, algorithm, link, expected, how it is made up)
        ("all_reduce", "ring", link, 14e-6 + 1.75e-3, "2 x 7 steps of 1 us, 2 x 1 MB x 7/8 at 1 GB/s"),
        ("all_gather", "ring", link, 7e-6 + 0.875e-3, "7 steps of 1 us, 1 MB x 7/8 at 1 GB/s"),
        ("reduce_scatter", "ring", link, 7e-6 + 0.875e-3, "7 steps of 1 us, 1 MB x 7/8 at 1 GB/s"),
        ("all_reduce", "tree", link, 6e-6 + 2e-3, "2 x log2(8) = 6 steps of 1 us, 2 x 1 MB at 1 GB/s"),
        ("all_reduce", "tree", replace(link, tree_alpha=5e-6), 30e-6 + 2e-3, "6 tree steps of 5 us, 2 MB at 1 GB/s"),
    ]
    for kind, algorithm, l, want, how in cases:
        got = st.alpha_beta(kind, 1e6, 8, l, algorithm)
        assert got == pytest.approx(want), _time_msg(f"a {algorithm} {kind} of 1 MB on 8 ranks", got, want, how)
    got = st.alpha_beta("all_reduce", 1e6, 1, link)
    assert got == 0.0, _time_msg("an all-reduce on one rank", got, 0.0, "one rank sends nothing, in no step")
    # the bytes are the comm counter's ring bytes
    from minifsdp.distributed.comm import ring_bytes
    assert st.wire_bytes("all_gather", 1e6, 8) == ring_bytes("all_gather", 1e6, 8)
    with pytest.raises(ValueError, match="all-gather and reduce-scatter are rings"):
        st.alpha_beta("all_gather", 1e6, 8, link, "tree")


@pytest.mark.exercise("13.1")
def test_ring_and_tree_cross_where_the_formula_says():
    link = st.Link(alpha=1e-6, busbw=1e11)
    s = st.ring_tree_crossover(8, link)
    assert s == pytest.approx(8 * 1e11 * (7 - 3) * 1e-6)  # n B (n - 1 - log2 n) a = 3.2 MB
    ring = lambda nbytes: st.alpha_beta("all_reduce", nbytes, 8, link, "ring")
    tree = lambda nbytes: st.alpha_beta("all_reduce", nbytes, 8, link, "tree")
    assert ring(s) == pytest.approx(tree(s)), _time_msg(
        f"at the crossover ({s:,.0f} B on 8 ranks) the tree", tree(s), ring(s),
        "the ring's time there: with 14 ring steps and 6 tree steps of 1 us, the two are equal at 3.2 MB")
    assert tree(s / 2) < ring(s / 2) and ring(2 * s) < tree(2 * s), (
        "below the crossover the tree must be faster, above it the ring: are the steps of the two algorithms "
        "the right way round? (exercise 13.1)")
    assert st.alpha_beta("all_reduce", s / 2, 8, link, "auto") == tree(s / 2)
    assert st.ring_tree_crossover(2, link) == 0.0  # two ranks: a ring has as few steps, and fewer bytes
    slow_tree = replace(link, tree_alpha=1e-5)      # a tree step as costly as NCCL's: the ring wins sooner
    assert st.ring_tree_crossover(8, slow_tree) == 0.0
    assert st.ring_tree_crossover(1024, slow_tree) > 0


@pytest.mark.exercise("13.1")
def test_hierarchical_collectives():
    c = st.Cluster(st.H100, nodes=2)
    nvl, nic = st.H100.nvlink, c.nic
    inside = st.Group(8, 8)
    got, want = c.collective("all_gather", 8e6, inside, "ring"), 7 * nvl.alpha + 7e6 / nvl.busbw
    assert got == pytest.approx(want), _time_msg("an all-gather of 8 MB in a node", got, want,
                                                 "7 NVLink steps and 7 MB at NVLink's bus bandwidth")
    # 16 ranks over 2 nodes: 15 steps, one of which crosses; the node's 8 NICs carry the rings side by side
    world = st.Group(16, 8)
    assert c.busbw(world) == min(nvl.busbw, 8 * nic.busbw)
    got = c.collective("reduce_scatter", 16e6, world, "ring")
    want = 14 * nvl.alpha + 1 * nic.alpha + 15e6 / c.busbw(world)
    assert got == pytest.approx(want), _time_msg("a reduce-scatter of 16 MB over 2 nodes of 8", got, want,
                                                 "15 ring steps, one of them across the network")
    # HSDP's replicas: one rank per node, one NIC each
    replicas = st.Group(2, 1)
    assert c.busbw(replicas) == nic.busbw
    got, want = c.collective("all_reduce", 1e6, replicas, "ring"), 2 * nic.alpha + 1e6 / nic.busbw
    assert got == pytest.approx(want), _time_msg("an all-reduce of 1 MB over 2 nodes, one rank each", got, want,
                                                 "2 ring steps across the network, 1 MB at one NIC")
    # the pessimistic network: every ring across nodes at one NIC
    assert replace(c, spread_rings=False).busbw(world) == nic.busbw


# -- the two-stream simulation, by hand -----------------------------------------------------------------------
def _spans(sim):
    return {(s.lane, s.name): (s.start, s.end) for s in sim.spans}


def _span_msg(what, got, want, why):
    return f"{what} ran {got}, expected {want} (seconds, start to end): {why} (exercise 13.2)"


@pytest.mark.mechanism
@pytest.mark.exercise("13.2")
def test_simulation_of_a_hand_worked_program():
    program = [st.Compute("A", 2.0),
               st.Collective("x", "all_gather", "c1", 3.0),               # 2 -> 5
               st.Collective("w", "reduce_scatter", "c1", 1.0),           # queued behind x: 5 -> 6
               st.Collective("y", "all_reduce", "c2", 2.0, after=("w",)),  # own channel, but after w: 6 -> 8
               st.Compute("B", 1.0),                                      # 2 -> 3
               st.Wait("w"),                                              # blocked 3 -> 6
               st.Compute("C", 2.0),                                      # 6 -> 8
               st.Wait("y")]                                              # done at 8: no wait
    sim = st.simulate(program)
    spans = _spans(sim)
    assert spans.get(("all_gather", "x")) == (2.0, 5.0), _span_msg(
        "all-gather x", spans.get(("all_gather", "x")), (2.0, 5.0),
        "it is issued after compute A (0 to 2) and cannot start before the compute issued ahead of it is done.")
    assert spans.get(("reduce_scatter", "w")) == (5.0, 6.0), _span_msg(
        "reduce-scatter w", spans.get(("reduce_scatter", "w")), (5.0, 6.0),
        "it is issued on channel c1 behind x, and a channel carries one collective at a time, in issue order.")
    assert spans.get(("all_reduce", "y")) == (6.0, 8.0), _span_msg(
        "all-reduce y", spans.get(("all_reduce", "y")), (6.0, 8.0),
        "its channel c2 is idle, but it is `after` w, which ends at 6.")
    assert spans.get(("wait", "w")) == (3.0, 6.0), _span_msg(
        "the wait for w", spans.get(("wait", "w")), (3.0, 6.0),
        "the compute stream reaches it at 3 (after B) and sits until w completes.")
    assert ("wait", "y") not in spans, (
        f"a wait span for y {spans[('wait', 'y')]}, but y completes at 8, when compute C ends: a wait on a "
        f"collective already complete costs nothing and leaves no span (exercise 13.2)")
    assert spans.get(("compute", "C")) == (6.0, 8.0), _span_msg(
        "compute C", spans.get(("compute", "C")), (6.0, 8.0),
        "it follows the wait for w: is the compute clock moved to w's end when the stream is blocked?")
    got = (sim.step, sim.compute, sim.comm, sim.waiting)
    assert got == (8.0, 5.0, 6.0, 3.0), (
        f"(step, compute, comm, waiting) = {got} s, expected (8, 5, 6, 3): comm adds each collective's "
        f"seconds once, waiting the time the compute stream sat blocked (exercise 13.2)")
    assert sim.hidden == pytest.approx(0.5), (
        f"hidden fraction {sim.hidden:.3f}, expected 0.5: on the wire from 2 to 8, blocked 3 of those 6 s "
        f"(exercise 13.2)")


@pytest.mark.mechanism
@pytest.mark.exercise("13.2")
def test_each_channel_is_a_fifo_of_its_own():
    """Two process groups' collectives run side by side; one group's run one at a time in the order they were
    issued, the short one behind the long one, and one held back by its `after` holds back those behind it."""
    program = [st.Collective("long", "all_gather", "shard", 3.0),                   # 0 -> 3
               st.Collective("short", "all_gather", "shard", 1.0),                  # behind it: 3 -> 4
               st.Collective("r", "all_reduce", "replicate", 2.0),                  # side by side: 0 -> 2
               st.Collective("h", "all_reduce", "replicate", 1.0, after=("short",)),  # 4 -> 5
               st.Collective("k", "all_reduce", "replicate", 0.5),                  # behind h: 5 -> 5.5
               st.Wait("k")]
    spans = _spans(st.simulate(program))
    assert spans.get(("all_reduce", "r")) == (0.0, 2.0), _span_msg(
        "all-reduce r on channel 'replicate'", spans.get(("all_reduce", "r")), (0.0, 2.0),
        "nothing was issued on its channel before it; the collectives of channel 'shard' are another "
        "process group's and do not hold it back. Do all channels share one queue?")
    assert spans.get(("all_gather", "short")) == (3.0, 4.0), _span_msg(
        "all-gather short", spans.get(("all_gather", "short")), (3.0, 4.0),
        "it was issued on channel 'shard' after 'long', and a channel runs its collectives one at a time in "
        "the order they were issued, whatever their sizes.")
    assert spans.get(("all_reduce", "h")) == (4.0, 5.0), _span_msg(
        "all-reduce h", spans.get(("all_reduce", "h")), (4.0, 5.0),
        "it waits for 'short' (its `after`), which ends at 4.")
    assert spans.get(("all_reduce", "k")) == (5.0, 5.5), _span_msg(
        "all-reduce k", spans.get(("all_reduce", "k")), (5.0, 5.5),
        "it was issued on channel 'replicate' behind h, which cannot start before 4: a FIFO does not let a "
        "later collective overtake one that waits for its `after`.")


@pytest.mark.mechanism
@pytest.mark.exercise("13.2")
def test_a_wait_blocks_until_its_own_collective_only():
    """A wait stops the compute stream until its own collective completes, not until its channel is idle:
    the channel may still carry collectives issued after it."""
    program = [st.Collective("a", "all_gather", "shard", 1.0),      # 0 -> 1
               st.Collective("b", "all_gather", "shard", 4.0),      # 1 -> 5
               st.Wait("a"),                                        # blocked 0 -> 1
               st.Compute("f", 1.0),                                # 1 -> 2
               st.Wait("b"),                                        # blocked 2 -> 5
               st.Compute("g", 1.0)]                                # 5 -> 6
    sim = st.simulate(program)
    spans = _spans(sim)
    assert spans.get(("wait", "a")) == (0.0, 1.0), _span_msg(
        "the wait for a", spans.get(("wait", "a")), (0.0, 1.0),
        "a completes at 1; b, issued after it on the same channel, is still running, but the wait is for a "
        "only. Does a wait block until the whole channel is idle?")
    assert spans.get(("compute", "f")) == (1.0, 2.0), _span_msg(
        "compute f", spans.get(("compute", "f")), (1.0, 2.0), "it starts as soon as a is complete.")
    assert spans.get(("wait", "b")) == (2.0, 5.0), _span_msg(
        "the wait for b", spans.get(("wait", "b")), (2.0, 5.0), "the compute stream reaches it at 2; b ends at 5.")
    assert (sim.step, sim.waiting) == (6.0, 4.0), (
        f"(step, waiting) = {(sim.step, sim.waiting)} s, expected (6, 4): 1 s blocked on a, 3 s on b "
        f"(exercise 13.2)")


def _random_program(rng, length):
    program, issued = [], []
    for i in range(length):
        r = rng.random()
        if r < 0.35:
            program.append(st.Compute(f"compute {i}", rng.choice([0.5, 1.0, 2.0, 3.0])))
        elif r < 0.75 or not issued:
            after = tuple(rng.sample(issued, min(len(issued), rng.choice([0, 0, 0, 1, 2]))))
            program.append(st.Collective(f"c{i}", rng.choice(["all_gather", "reduce_scatter", "all_reduce"]),
                                         rng.choice(["shard", "replicate", "pipe"]), rng.choice([0.5, 1.0, 4.0]),
                                         after))
            issued.append(f"c{i}")
        else:
            program.append(st.Wait(rng.choice(issued)))
    return program


@pytest.mark.mechanism
@pytest.mark.exercise("13.2")
def test_any_program_keeps_the_contract():
    """On 300 random programs (three channels, dependencies across them, waits anywhere), every collective
    lasts its seconds and starts at the latest of three times, the compute issued before it done, its
    channel's previous collective done, its `after` done, and no later; the compute runs in program order,
    back to back but for the waits, and a wait lasts until its own collective completes."""
    import random

    rng = random.Random(13)
    for trial in range(300):
        program = _random_program(rng, rng.randint(3, 25))
        sim = st.simulate(program)
        spans, waits = _spans(sim), [s for s in sim.spans if s.lane == "wait"]
        clock, channel_end, end, blocked, expected_waits = 0.0, {}, {}, 0.0, 0
        for op in program:
            if isinstance(op, st.Compute):
                got = spans.get(("compute", op.name))
                assert got == (clock, clock + op.seconds), _span_msg(
                    f"{op.name} (program {trial})", got, (clock, clock + op.seconds),
                    "compute runs in program order, each segment starting when the one before it, or the wait "
                    "before it, ends.")
                clock = got[1]
            elif isinstance(op, st.Collective):
                got = spans.get((op.kind, op.tag))
                bounds = {"the compute issued before it": clock,
                          f"the collectives issued before it on channel {op.channel!r}": channel_end.get(op.channel, 0.0)}
                bounds.update({f"{t}, in its `after`": end[t] for t in op.after})
                start = max(bounds.values())
                assert got is not None and got[1] - got[0] == pytest.approx(op.seconds), (
                    f"collective {op.tag} (program {trial}) has span {got}, expected one lasting "
                    f"{op.seconds} s (exercise 13.2)")
                assert got[0] == start, _span_msg(
                    f"collective {op.tag} on channel {op.channel!r} (program {trial})", got,
                    (start, start + op.seconds),
                    "it starts as soon as all of these are done: " + "; ".join(
                        f"{k}, at {v} s" for k, v in bounds.items())
                    + (f". It started before {next(k for k, v in bounds.items() if got[0] < v)} was done."
                       if got[0] < start else
                       ". It started later than all of them: does it queue behind another channel's "
                       "collectives, or behind a wait?"))
                end[op.tag] = channel_end[op.channel] = got[1]
            elif end[op.tag] > clock:
                got = spans.get(("wait", op.tag))
                assert got == (clock, end[op.tag]), _span_msg(
                    f"the wait for {op.tag} (program {trial})", got, (clock, end[op.tag]),
                    "the compute stream blocks from where it stands until that collective completes, not "
                    "until its channel is idle.")
                blocked += end[op.tag] - clock
                clock, expected_waits = end[op.tag], expected_waits + 1
        assert len(waits) == expected_waits, (
            f"program {trial}: {len(waits)} wait spans, expected {expected_waits}: a wait on a collective "
            f"already complete leaves no span (exercise 13.2)")
        step = max([clock] + list(end.values()))
        assert (sim.step, sim.waiting) == (pytest.approx(step), pytest.approx(blocked)), (
            f"program {trial}: (step, waiting) = {(sim.step, sim.waiting)} s, expected {(step, blocked)} "
            f"(exercise 13.2)")
        assert sim.comm == pytest.approx(sum(op.seconds for op in program if isinstance(op, st.Collective))), (
            f"program {trial}: comm {sim.comm} s is not the collectives' seconds added up (exercise 13.2)")


@pytest.mark.exercise("13.2")
def test_the_step_is_not_max_of_compute_and_comm():
    """Same compute, same communication, different order: the waits differ, and so does the step."""
    late = [st.Compute("f", 1.0), st.Collective("g", "all_gather", "c", 1.0), st.Wait("g"), st.Compute("h", 1.0)]
    early = [st.Collective("g", "all_gather", "c", 1.0), st.Compute("f", 1.0), st.Wait("g"), st.Compute("h", 1.0)]
    got = (st.simulate(late).step, st.simulate(early).step)
    assert got == (3.0, 2.0), (
        f"steps {got} s, expected (3, 2): the collective issued after f cannot hide under it, the one issued "
        f"before can (exercise 13.2)")


# -- the FSDP program against a recorded minifsdp step ---------------------------------------------------------
def _record(mode):
    model, opt = build(SMALL, mode)
    for i in range(2):  # the first step records the unit order; prefetching starts with the second
        step(model, opt, SMALL, i)
    with Timeline() as tl:
        step(model, opt, SMALL, 2)
    o = tl.origin
    return dict(events=[(e.issued - o, e.kind, e.tag) for e in tl.counter.events],
                segments=[(s - o, name) for name, s, _ in tl._segments],
                waits=[(w.start - o, w.end - o, w.tag) for w in tl.counter.waits],
                end=tl.spans()[-1].end if tl.spans() else 0.0)


def _record_all():
    return {mode: _record(mode) for mode in MODES}


@pytest.fixture(scope="module")
def recorded():
    return launch(_record_all, world_size=2, device="cpu")


def _units(n):
    return [st.Unit("(root)", 1, (1.0, 1.0), (1.0, 1.0))] + [st.Unit(f"blocks.{i}", 1, (1.0,), (1.0,))
                                                            for i in range(n)]


@pytest.mark.parametrize("mode", list(MODES))
def test_built_issue_order_equals_a_recorded_minifsdp_step(recorded, mode):
    bp = MODES[mode]["backward_prefetch"]
    built = st.issue_sequence(st.fsdp_program(_units(SMALL.n_layer), lambda u: 1.0, lambda u: 1.0,
                                              forward_prefetch=MODES[mode]["forward_prefetch"],
                                              backward_prefetch=None if bp is None else bp.value))
    for rank in recorded:
        r = rank[mode]
        assert st.recorded_sequence(r["events"], r["segments"]) == built, mode


@pytest.mark.exercise("13.2")
def test_a_recorded_step_fed_in_keeps_its_own_structure(recorded):
    """The recorded program with instant collectives: the host computes exactly as it did between its waits,
    so the simulated step is the recorded span less the time it sat blocked."""
    r = recorded[0]["forward_prefetch + BACKWARD_PRE"]
    events = [(t, kind, tag, 1.0) for t, kind, tag in r["events"]]
    end = max([r["end"]] + [e for _, e, _ in r["waits"]])
    sim = st.simulate(st.program_from_recording(events, r["waits"], end, lambda kind, nbytes: 0.0))
    blocked = sum(e - s for s, e, _ in r["waits"])
    assert sim.step == pytest.approx(end - blocked), (
        f"the recorded step with instant collectives takes {sim.step * 1e3:,.3f} ms, expected "
        f"{(end - blocked) * 1e3:,.3f} ms, the recorded {end * 1e3:,.3f} ms less the {blocked * 1e3:,.3f} ms it "
        f"sat blocked: a wait on a collective already complete must cost nothing (exercise 13.2)")
    assert [s.name.split(" #")[0] for s in sim.spans if s.lane not in ("compute", "wait")] == \
        [tag for _, _, tag in sorted(r["events"])], (
        "the collectives' spans are not in the order the step issued them: with no time on the wire each "
        "starts when it is issued (exercise 13.2)")


# -- properties ------------------------------------------------------------------------------------------------
CASES = [(s, m) for s in st.STRATEGIES for m in (st.LLAMA2_7B, st.LLAMA2_13B)]


@pytest.mark.exercise("13.1", "13.2")
@pytest.mark.parametrize("strategy,model", CASES)
def test_more_bandwidth_or_compute_is_never_slower(strategy, model):
    run = st.Run(seq_len=2048, micro_batch=1)
    base = st.Cluster(st.H100, nodes=4)
    t = st.predict(strategy, model, base, run).step
    faster_net = replace(base, nic=replace(base.nic, busbw=2 * base.nic.busbw),
                         gpu=replace(st.H100, nvlink=replace(st.H100.nvlink, busbw=2 * st.H100.nvlink.busbw)))
    changed = {"twice the bandwidth": (faster_net, "<="),
               "a faster GPU": (replace(base, gpu=replace(st.H100, efficiency=0.6)), "<="),
               "ten times the network's alpha": (replace(base, nic=replace(base.nic, alpha=10 * base.nic.alpha)),
                                                 ">=")}
    for what, (cluster, op) in changed.items():
        got = st.predict(strategy, model, cluster, run).step
        assert (got <= t) if op == "<=" else (got >= t), (
            f"{strategy}: with {what} a step takes {got * 1e3:,.1f} ms, against {t * 1e3:,.1f} ms before: "
            f"{'never slower' if op == '<=' else 'never faster'} in a model where every collective starts as "
            f"soon as it may (exercises 13.1, 13.2)")


@pytest.mark.mechanism
@pytest.mark.exercise("13.1", "13.2")
@pytest.mark.parametrize("nodes", [2, 4, 16, 64])
def test_hsdp_is_never_slower_than_full_shard_across_nodes(nodes):
    """Where each rank's bytes cross nodes on its own NIC, HSDP moves its all-gathers and reduce-scatters onto
    NVLink, and is never slower. Where rings spread over every NIC of a node (the default network), FULL_SHARD
    and HSDP move the same bytes between nodes, and HSDP can be slower -- by no more than its two costs: an
    optimizer step over 1/8 of the model instead of 1/N, and the replicas' all-reduces of the last block and of
    the root, which end the backward (minifsdp waits for a unit's reductions before the next unit's concat).
    Both hold only if the replicas' all-reduces, on a channel of their own, run beside the shard group's
    collectives (a mechanism of exercise 13.2)."""
    run = st.Run()
    for m in (st.LLAMA2_7B, st.LLAMA2_70B):
        flat = st.Cluster(st.H100, nodes=nodes, spread_rings=False)
        hsdp, fsdp = st.predict("hsdp", m, flat, run).step, st.predict("fsdp", m, flat, run).step
        assert hsdp <= fsdp, (
            f"{m.name} on {nodes} nodes, one NIC per ring: HSDP's step {hsdp * 1e3:,.1f} ms, FULL_SHARD's "
            f"{fsdp * 1e3:,.1f} ms: do the replicas' all-reduces queue behind the shard group's collectives? "
            f"Each channel is a FIFO of its own (exercise 13.2)")
        c = st.Cluster(st.H100, nodes=nodes)
        hsdp, fsdp = st.predict("hsdp", m, c, run).step, st.predict("fsdp", m, c, run).step
        replicas = st.Group(nodes, 1)
        tail = sum(c.collective("all_reduce", p * run.grad_bytes / 8, replicas)
                   for p in (m.root_params(run.seq_len), m.block_params()))
        optimizer = st.optimizer_seconds(m.params() / 8, c) - st.optimizer_seconds(m.params() / c.world, c)
        assert hsdp <= fsdp + optimizer + tail, (
            f"{m.name} on {nodes} nodes: HSDP's step {hsdp * 1e3:,.1f} ms, more than FULL_SHARD's "
            f"{fsdp * 1e3:,.1f} ms plus its larger optimizer step ({optimizer * 1e3:,.1f} ms) and its last "
            f"all-reduces ({tail * 1e3:,.1f} ms): do the replicas' all-reduces queue behind the shard group's "
            f"collectives? Each channel is a FIFO of its own (exercise 13.2)")


@pytest.mark.exercise("13.1", "13.2")
def test_hiding_threshold_separates_hidden_from_exposed():
    c, run = st.Cluster(st.H100, nodes=8), st.Run(seq_len=4096)
    t = st.hiding_threshold("fsdp", st.LLAMA2_7B, c, run)
    assert 256 < t < 65536, f"the hiding threshold is {t:,.0f} tokens per GPU, expected 256 to 65,536 (exercises 13.1, 13.2)"

    def frac(tokens):
        p = st.predict("fsdp", st.LLAMA2_7B, c, replace(run, micro_batch=tokens / run.seq_len))
        return p.exposed / p.step

    assert frac(1.01 * t) <= 0.05 < frac(0.9 * t), (
        f"at {t:,.0f} tokens per GPU just above the threshold {frac(1.01 * t):.1%} of the step is exposed, just "
        f"below it {frac(0.9 * t):.1%}: the threshold must separate at most 5% from more (exercises 13.1, 13.2)")
    fracs = [frac(t / 4), frac(t / 2), frac(t)]  # fewer tokens per GPU, more of the step exposed
    assert fracs[0] > fracs[1] > fracs[2], (
        f"exposed {', '.join(f'{f:.1%}' for f in fracs)} of the step at a quarter, half and all of {t:,.0f} "
        f"tokens per GPU: less compute must hide less (exercises 13.1, 13.2)")


def test_flops_and_parameters_match_the_models_and_the_sources():
    assert st.LLAMA2_7B.params() == 6_738_415_616 and st.LLAMA3_8B.params() == 8_030_261_248
    # llm-foundry's NumParams column (learned positions: one row per position of the sequence)
    numparams = {(st.MPT_7B, 2048): 6658859008, (st.MPT_7B, 65536): 6918905856, (st.MPT_13B, 2048): 12853954560,
                 (st.MPT_30B, 2048): 29975214080, (st.MPT_70B, 2048): 64862437376}
    for (m, seq), n in numparams.items():
        assert m.params(seq) == n
    # every published MFU follows from its tokens/s under our convention (6 x params + 12 L d s, peak as stated)
    for row in st.PUBLISHED:
        if row.mfu is not None:
            mfu = row.tokens_per_s_per_gpu * row.model.model_flops_per_token(row.run.seq_len) / row.gpu.peak_flops
            assert mfu == pytest.approx(row.mfu, abs=0.003), row.label


# -- the published comparison -----------------------------------------------------------------------------------
def test_every_published_row_cites_a_source_and_the_table_regenerates():
    from minifsdp.reports.step_time import published_text

    assert len(st.PUBLISHED) >= 20
    for row in st.PUBLISHED:
        src = row.source
        assert src in st.SOURCES and src.repo and src.path and re.fullmatch(r"[0-9a-f]{40}", src.commit)
        assert row.table and row.label and row.tokens_per_s_per_gpu > 0
    text = published_text()
    for src in st.SOURCES:
        assert src.citation in text
    table = [line for line in text.splitlines() if line.startswith("    | ")]  # each source's tab, not its fold
    assert sum(line.count("(calibration)") for line in table) == 2
    for c in st.compare_published():
        assert math.isfinite(c["error"]) and c["predicted"] > 0


@pytest.mark.exercise("13.1", "13.2")
def test_calibration_rows_are_met_by_the_stored_efficiencies():
    for row in st.PUBLISHED:
        if row.calibration:
            got = st.predict_published(row).tokens_per_s_per_gpu
            assert got == pytest.approx(row.tokens_per_s_per_gpu, rel=0.005), (
                f"{row.label}: predicted {got:,.0f} tokens/s per GPU, published {row.tokens_per_s_per_gpu:,.0f} "
                f"(within 0.5%): the efficiency was fitted to this run, so its step is off: a wait that lasts "
                f"past its own collective, or a collective that starts late? (exercises 13.1, 13.2)")
            assert st.calibrate_efficiency(row) == pytest.approx(row.gpu.efficiency, rel=0.005)


@pytest.mark.exercise("13.1", "13.2")
def test_the_command_writes_both_pages(tmp_path):
    from minifsdp.__main__ import main

    md, pub = tmp_path / "step_time.md", tmp_path / "published.md"
    assert main(["step-time", "--no-calibrate", "--models", "7b", "--nodes", "1", "2", "--markdown", str(md),
                 "--published", str(pub)]) == 0
    assert "HSDP" in md.read_text() and "tokens/s/GPU" in md.read_text()
    assert "pytorch/torchtitan" in pub.read_text() and "mosaicml/llm-foundry" in pub.read_text()
