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
@pytest.mark.mechanism
@pytest.mark.exercise("13.1")
def test_steps_are_counted_per_algorithm():
    """The latency term on its own: a ring pays alpha once per hop of the data around the ring (twice round
    for an all-reduce), a tree once per level, up and down."""
    assert [st.algorithm_steps("all_reduce", n) for n in (1, 2, 3, 8)] == [0, 2, 4, 14]
    assert [st.algorithm_steps(k, 5) for k in ("all_gather", "reduce_scatter")] == [4, 4]
    assert [st.algorithm_steps("all_reduce", n, "tree") for n in (2, 3, 8, 9)] == [2, 4, 6, 8]
    with pytest.raises(ValueError, match="'ring' or 'tree'"):
        st.algorithm_steps("all_reduce", 4, "star")


@pytest.mark.exercise("13.1")
def test_alpha_beta_on_hand_computed_cases():
    link = st.Link(alpha=1e-6, busbw=1e9)
    # ring all-reduce of 1 MB on 8 ranks: 2*7 steps, 2 * 1e6 * 7/8 bytes
    assert st.alpha_beta("all_reduce", 1e6, 8, link) == pytest.approx(14e-6 + 1.75e-3)
    # all-gather / reduce-scatter: 7 steps, 1e6 * 7/8 bytes
    assert st.alpha_beta("all_gather", 1e6, 8, link) == pytest.approx(7e-6 + 0.875e-3)
    assert st.alpha_beta("reduce_scatter", 1e6, 8, link) == pytest.approx(7e-6 + 0.875e-3)
    # tree all-reduce: 2*log2(8) = 6 steps, 2 * 1e6 bytes
    assert st.alpha_beta("all_reduce", 1e6, 8, link, "tree") == pytest.approx(6e-6 + 2e-3)
    # a tree's own step time
    assert st.alpha_beta("all_reduce", 1e6, 8, replace(link, tree_alpha=5e-6), "tree") == pytest.approx(30e-6 + 2e-3)
    assert st.alpha_beta("all_reduce", 1e6, 1, link) == 0.0
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
    assert ring(s) == pytest.approx(tree(s))
    assert tree(s / 2) < ring(s / 2) and ring(2 * s) < tree(2 * s)
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
    assert c.collective("all_gather", 8e6, inside, "ring") == pytest.approx(7 * nvl.alpha + 7e6 / nvl.busbw)
    # 16 ranks over 2 nodes: 15 steps, one of which crosses; the node's 8 NICs carry the rings side by side
    world = st.Group(16, 8)
    assert c.busbw(world) == min(nvl.busbw, 8 * nic.busbw)
    assert c.collective("reduce_scatter", 16e6, world, "ring") == pytest.approx(
        14 * nvl.alpha + 1 * nic.alpha + 15e6 / c.busbw(world))
    # HSDP's replicas: one rank per node, one NIC each
    replicas = st.Group(2, 1)
    assert c.busbw(replicas) == nic.busbw
    assert c.collective("all_reduce", 1e6, replicas, "ring") == pytest.approx(2 * nic.alpha + 1e6 / nic.busbw)
    # the pessimistic network: every ring across nodes at one NIC
    assert replace(c, spread_rings=False).busbw(world) == nic.busbw


# -- the two-stream simulation, by hand -----------------------------------------------------------------------
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
    assert (sim.step, sim.compute, sim.comm, sim.waiting) == (8.0, 5.0, 6.0, 3.0)
    spans = {(s.lane, s.name): (s.start, s.end) for s in sim.spans}
    assert spans[("all_gather", "x")] == (2.0, 5.0)
    assert spans[("reduce_scatter", "w")] == (5.0, 6.0)
    assert spans[("all_reduce", "y")] == (6.0, 8.0)
    assert spans[("wait", "w")] == (3.0, 6.0)
    assert ("wait", "y") not in spans
    assert spans[("compute", "C")] == (6.0, 8.0)
    assert sim.hidden == pytest.approx(0.5)  # on the wire 2 -> 8, blocked 3 of those 6


@pytest.mark.exercise("13.2")
def test_the_step_is_not_max_of_compute_and_comm():
    """Same compute, same communication, different order: the waits differ, and so does the step."""
    late = [st.Compute("f", 1.0), st.Collective("g", "all_gather", "c", 1.0), st.Wait("g"), st.Compute("h", 1.0)]
    early = [st.Collective("g", "all_gather", "c", 1.0), st.Compute("f", 1.0), st.Wait("g"), st.Compute("h", 1.0)]
    assert st.simulate(late).step == 3.0 and st.simulate(early).step == 2.0


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
    assert sim.step == pytest.approx(end - sum(e - s for s, e, _ in r["waits"]))
    assert [s.name.split(" #")[0] for s in sim.spans if s.lane not in ("compute", "wait")] == \
        [tag for _, _, tag in sorted(r["events"])]


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
    assert st.predict(strategy, model, faster_net, run).step <= t
    assert st.predict(strategy, model, replace(base, gpu=replace(st.H100, efficiency=0.6)), run).step <= t
    slower_hops = replace(base, nic=replace(base.nic, alpha=10 * base.nic.alpha))
    assert st.predict(strategy, model, slower_hops, run).step >= t


@pytest.mark.exercise("13.1", "13.2")
@pytest.mark.parametrize("nodes", [2, 4, 16, 64])
def test_hsdp_is_never_slower_than_full_shard_across_nodes(nodes):
    """Where each rank's bytes cross nodes on its own NIC, HSDP moves its all-gathers and reduce-scatters onto
    NVLink, and is never slower. Where rings spread over every NIC of a node (the default network), FULL_SHARD
    and HSDP move the same bytes between nodes, and HSDP can be slower -- by no more than its two costs: an
    optimizer step over 1/8 of the model instead of 1/N, and the replicas' all-reduces of the last block and of
    the root, which end the backward (minifsdp waits for a unit's reductions before the next unit's concat)."""
    run = st.Run()
    for m in (st.LLAMA2_7B, st.LLAMA2_70B):
        flat = st.Cluster(st.H100, nodes=nodes, spread_rings=False)
        assert st.predict("hsdp", m, flat, run).step <= st.predict("fsdp", m, flat, run).step
        c = st.Cluster(st.H100, nodes=nodes)
        hsdp, fsdp = st.predict("hsdp", m, c, run).step, st.predict("fsdp", m, c, run).step
        replicas = st.Group(nodes, 1)
        tail = sum(c.collective("all_reduce", p * run.grad_bytes / 8, replicas)
                   for p in (m.root_params(run.seq_len), m.block_params()))
        optimizer = st.optimizer_seconds(m.params() / 8, c) - st.optimizer_seconds(m.params() / c.world, c)
        assert hsdp <= fsdp + optimizer + tail


@pytest.mark.exercise("13.1", "13.2")
def test_hiding_threshold_separates_hidden_from_exposed():
    c, run = st.Cluster(st.H100, nodes=8), st.Run(seq_len=4096)
    t = st.hiding_threshold("fsdp", st.LLAMA2_7B, c, run)
    assert 256 < t < 65536

    def frac(tokens):
        p = st.predict("fsdp", st.LLAMA2_7B, c, replace(run, micro_batch=tokens / run.seq_len))
        return p.exposed / p.step

    assert frac(1.01 * t) <= 0.05 < frac(0.9 * t)
    assert frac(t / 4) > frac(t / 2) > frac(t)  # fewer tokens per GPU, more of the step exposed


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
            assert st.predict_published(row).tokens_per_s_per_gpu == pytest.approx(row.tokens_per_s_per_gpu, rel=0.005)
            assert st.calibrate_efficiency(row) == pytest.approx(row.gpu.efficiency, rel=0.005)


@pytest.mark.exercise("13.1", "13.2")
def test_the_command_writes_both_pages(tmp_path):
    from minifsdp.__main__ import main

    md, pub = tmp_path / "step_time.md", tmp_path / "published.md"
    assert main(["step-time", "--no-calibrate", "--models", "7b", "--nodes", "1", "2", "--markdown", str(md),
                 "--published", str(pub)]) == 0
    assert "HSDP" in md.read_text() and "tokens/s/GPU" in md.read_text()
    assert "pytorch/torchtitan" in pub.read_text() and "mosaicml/llm-foundry" in pub.read_text()
