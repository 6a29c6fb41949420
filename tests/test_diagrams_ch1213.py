"""What chapters 12 and 13's diagrams show of the code is what the package computes.

The diagrams (chapters/diagrams/ch12_parallel.py, ch13_scaling.py) import nothing from the package; their numbers
are written as data, and these tests compute them again: the qkv pieces each tensor-parallel rank keeps, the
stages split_gpt makes, an all-reduce's time on the step-time model's cluster, the two-level network's numbers,
and the FSDP step with and without resharding after forward.
"""

import math

import pytest

from diagram_modules import diagram_module

ch12 = diagram_module("ch12_parallel")
ch13 = diagram_module("ch13_scaling")


# -- chapter 12 ---------------------------------------------------------------------------------------------------
def test_qkv_pieces_are_shard_of_with_stride_3():
    torch = pytest.importorskip("torch")
    from minifsdp.parallel.mappings import shard_of

    t = ch12.QKV_T
    rows = len(ch12.QKV_PIECES)  # one row per piece: the piece's name is its row
    full = torch.arange(rows).unsqueeze(1)
    for r in range(t):
        kept = shard_of(full, 0, r, t, stride=3).flatten().tolist()
        assert [ch12.QKV_PIECES[i] for i in kept] == ch12.QKV_KEPT[r]
    assert ch12.QKV_PIECES == [f"{m}{r}" for m in "qkv" for r in range(t)]  # q rows, then k, then v


def test_stages_are_split_gpt():
    pytest.importorskip("torch")
    from minifsdp.models import GPTConfig, TinyGPT
    from minifsdp.parallel import split_gpt

    p = len(ch12.STAGE_MODULES)
    model = TinyGPT(GPTConfig(n_layer=8), seed=0)
    for r in range(p):
        stage, = split_gpt(model, num_stages=p, stage_indices=[r])
        held = [name for name in ("wte", "wpe", "ln_f", "lm_head") if getattr(stage, name) is not None]
        held += [f"blocks.{k}" for k in stage.blocks]
        assert sorted(held) == sorted(ch12.STAGE_MODULES[r]), (r, held)


# -- chapter 13 ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def st():
    pytest.importorskip("torch")
    from minifsdp.measure import step_time

    return step_time


def test_alpha_beta_times_are_the_cluster_s(st):
    nodes = {8: 1, 64: 8, 1024: 128}
    for (n, algorithm), times in ch13.AB_TIMES.items():
        cluster = st.Cluster(st.H100, nodes=nodes[n])
        group = st.Group(n, 8)
        for size, drawn in zip(ch13.AB_SIZES, times):
            assert drawn == pytest.approx(cluster.collective("all_reduce", size, group, algorithm), rel=1e-3)
    # what the picture says: in a node the ring wins everywhere, over 1,024 GPUs the tree does
    assert all(r < t for r, t in zip(ch13.AB_TIMES[(8, "ring")], ch13.AB_TIMES[(8, "tree")]))
    assert all(t < r for r, t in zip(ch13.AB_TIMES[(1024, "ring")], ch13.AB_TIMES[(1024, "tree")]))


def test_two_level_network_is_the_cluster_s(st):
    assert (ch13.NVLINK_BUSBW, ch13.NVLINK_ALPHA) == (st.H100.nvlink.busbw, st.H100.nvlink.alpha)
    assert (ch13.NIC_BUSBW, ch13.NIC_ALPHA) == (st.IB_400G.busbw, st.IB_400G.alpha)
    cluster = st.Cluster(st.H100, nodes=2)
    assert ch13.NICS_PER_NODE == cluster.nics_per_node
    assert cluster.busbw(st.Group(16, 8)) == min(ch13.NVLINK_BUSBW, ch13.NICS_PER_NODE * ch13.NIC_BUSBW)
    assert cluster.busbw(st.Group(2, 1)) == ch13.NIC_BUSBW  # HSDP's replicas
    one_nic = st.Cluster(st.H100, nodes=2, spread_rings=False)
    assert one_nic.busbw(st.Group(16, 8)) == ch13.NIC_BUSBW
    # a ring all-gather over both nodes: 15 steps, one of them across the network
    steps, across = st.algorithm_steps("all_gather", 16), st.Group(16, 8).nodes - 1
    assert (steps, across) == (15, 1)
    latency = cluster.collective("all_gather", 1e-30, st.Group(16, 8), "ring")
    assert latency == pytest.approx((steps - across) * ch13.NVLINK_ALPHA + across * ch13.NIC_ALPHA)


def _no_reshard_after_forward_step(st, model, cluster, run):
    """The model's FSDP program (strategies.programs, "fsdp") with no all-gather in backward: each unit's second
    gather takes no time, as under NRAF the unit still holds its parameters."""
    from minifsdp.measure.step_time.program import Compute, simulate

    units = st.units(model, cluster, run)
    world = st.Group(cluster.world, cluster.gpus_per_node)
    gathered = set()

    def all_gather(unit):
        first = unit.name not in gathered
        gathered.add(unit.name)
        return cluster.collective("all_gather", unit.params * run.param_bytes, world) if first else 0.0

    def reduce_scatter(unit):
        return cluster.collective("reduce_scatter", unit.params * run.grad_bytes, world)

    def program(gather):
        gathered.clear()
        prog = st.fsdp_program(units, gather, reduce_scatter, forward_prefetch=run.forward_prefetch,
                               backward_prefetch=run.backward_prefetch)
        return prog + [Compute("optimizer", st.optimizer_seconds(model.params(run.seq_len) / world.size, cluster))]

    every_time = lambda unit: cluster.collective("all_gather", unit.params * run.param_bytes, world)  # noqa: E731
    return simulate(program(every_time)).step, simulate(program(all_gather)).step


def test_nraf_steps_are_the_model_s(st):
    model, run = st.LLAMA2_7B, st.Run(seq_len=4096, micro_batch=2)
    assert (ch13.NRAF_BLOCK_PARAMS, ch13.NRAF_LAYERS) == (model.block_params(), model.layers)
    for (spread, nodes), (raf, nraf, hsdp) in ch13.NRAF_STEPS.items():
        assert nodes in ch13.NRAF_NODES
        cluster = st.Cluster(st.H100, nodes=nodes, spread_rings=spread)
        rebuilt, no_reshard = _no_reshard_after_forward_step(st, model, cluster, run)
        # the program rebuilt here is the one predict() runs, to the bit
        assert rebuilt == st.predict("fsdp", model, cluster, run).step
        assert raf == pytest.approx(rebuilt * 1e3, abs=0.05)
        assert nraf == pytest.approx(no_reshard * 1e3, abs=0.05)
        assert hsdp == pytest.approx(st.predict("hsdp", model, cluster, run).step * 1e3, abs=0.05)
        assert nraf <= raf
        if spread:  # where the all-gathers hide, not resharding buys nothing
            assert math.isclose(nraf, raf)


def test_published_errors_are_compare_published(st):
    predicted = [x for x in st.compare_published() if not x["row"].calibration]
    assert len(ch13.PUBLISHED_ERRORS) == len(predicted)
    for (source, checkpointed, error), x in zip(ch13.PUBLISHED_ERRORS, predicted):
        assert source == x["row"].source.name
        assert checkpointed == (x["row"].run.ac != "none")
        assert error == pytest.approx(x["error"], abs=5e-5)
