"""Chapter 11: composition -- replicate() beside fully_shard(), and HSDP on a 2-D mesh -- against torch's DDP,
with the bytes each group sends counted and checked against the ring model.

HSDP on a (2, 2) mesh ("replicate", "shard") in a world of 4, built two ways -- fully_shard(mesh=...) and the
FlatParameter FSDP's sharding_strategy=HYBRID_SHARD (next to torch FSDP1's, within 1e-6): each parameter is sharded over the 2 ranks of a
row and replicated over the 2 rows; a gradient is reduce-scattered (averaged) in the row, then its shard is
all-reduced (averaged) across the rows. replicate(model) is the same with rows of one rank. Both are checked
against torch's DDP after 4 SGD-momentum steps: within 1e-6 (measured 7.5e-9). The average is exact (a power
of two), but it is summed in another order than DDP's all-reduce of its buckets.

Bytes, per rank and step, from the counter's per-group tally (comm.counting().by_group) against the ring model
(comm.ring_bytes) applied to each fully_shard group's padded size P (4 bytes per element, P = N_shard x the
padded shard): in the shard group, one all-gather of P per unshard (two for a block under
reshard_after_forward: forward and backward; one for the root, which keeps its parameters from forward to
backward) and one reduce-scatter of P; in the replicate group, one all-reduce of P / N_shard.
"""

import pytest
import torch
import torch.distributed as dist

from minifsdp import comm, launch
from minifsdp.distributed.mesh import init_mesh
from minifsdp.train import batch, build_model, loss_of

STEPS = 4
KINDS = ("ddp", "hsdp", "replicate root", "hybrid_shard", "torch hybrid_shard")


def train(kind):
    from minifsdp.fsdp2 import fully_shard, replicate

    n, r = dist.get_world_size(), dist.get_rank()
    model = build_model("gpt", seed=0)
    groups = []
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif kind in ("hybrid_shard", "torch hybrid_shard"):  # the FlatParameter FSDP, minifsdp's and torch's FSDP1
        model = hybrid_shard(model, torch_fsdp1=kind.startswith("torch"))
    elif kind == "hsdp":
        mesh = init_mesh((2, 2), ("replicate", "shard"))
        groups = [fully_shard(b, mesh=mesh) for b in model.blocks] + [fully_shard(model, mesh=mesh)]
    else:  # "replicate root": the blocks sharded over every rank, the rest replicated
        groups = [fully_shard(b) for b in model.blocks] + [replicate(model)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sent = []
    for step in range(STEPS):
        with comm.counting() as counter:
            loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu")).backward()
        opt.step()
        opt.zero_grad()
        sent.append({g: dict(kinds) for g, kinds in counter.by_group.items()})
    if kind.endswith("hybrid_shard"):
        full = full_state(model, kind)
    else:
        sd = (model.module if kind == "ddp" else model).state_dict()
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in sd.items()}
    layout = [(g._fsdp.group.world_size, 4 * g._fsdp.group.world_size * sum(p.padded_numel for p in g._fsdp.group.params),
               g is model) for g in groups]
    return {"full": full, "sent": sent[-1], "layout": layout}


def hybrid_shard(model, torch_fsdp1: bool):
    """FSDP1's HYBRID_SHARD on the (replicate, shard) mesh: minifsdp's FlatParameter FSDP, or torch's."""
    from minifsdp.models import Block

    mesh = init_mesh((2, 2), ("replicate", "shard"))
    if torch_fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_mesh=mesh,
                                        sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=torch.device("cpu"))
    from minifsdp.fsdp import FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_mesh=mesh,
                                    sharding_strategy=ShardingStrategy.HYBRID_SHARD)


def full_state(model, kind):
    if kind.startswith("torch"):
        from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                                      FullStateDictConfig(rank0_only=False)):
            return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model.full_state_dict()


@pytest.fixture(scope="module")
def runs():
    return {kind: launch(train, world_size=4, args=(kind,)) for kind in KINDS}


FULLY_SHARD = pytest.mark.exercise("11.1", "11.2")  # the kinds built on minifsdp's fully_shard


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=FULLY_SHARD) for kind in ("hsdp", "replicate root")]
                         + ["hybrid_shard", "torch hybrid_shard"])
def test_equals_ddp(runs, kind):
    ref = runs["ddp"][0]["full"]
    for r in range(4):
        got = runs[kind][r]["full"]
        assert got.keys() == ref.keys()
        assert max(float((got[k] - ref[k]).abs().max()) for k in ref) <= 1e-6


def _bytes(by_kind):
    return ", ".join(f"{k} {b:,.0f} B" for k, b in sorted(by_kind.items())) or "nothing"


@pytest.mark.mechanism
@pytest.mark.exercise("11.1", "11.2")
def test_hsdp_bytes_in_and_across_the_rows_match_the_ring_model(runs):
    for r in range(4):
        res = runs["hsdp"][r]
        shard, across = {"all_gather": 0.0, "reduce_scatter": 0.0}, 0.0
        for n_shard, nbytes, is_root in res["layout"]:
            shard["all_gather"] += (1 if is_root else 2) * comm.ring_bytes("all_gather", nbytes, n_shard)
            shard["reduce_scatter"] += comm.ring_bytes("reduce_scatter", nbytes, n_shard)
            across += comm.ring_bytes("all_reduce", nbytes // n_shard, 2)
        got = res["sent"]["shard"]
        assert got == pytest.approx(shard), (
            f"HSDP rank {r} sent {_bytes(got)} in its shard group (rows of 2), expected {_bytes(shard)}: each block "
            f"gathered twice and reduce-scattered once, each of its padded gradients' bytes (exercise 11.2: one "
            f"reduce-scatter per module, not an all-reduce)")
        got = res["sent"]["replicate"]
        assert got == pytest.approx({"all_reduce": across}), (
            f"HSDP rank {r} sent {_bytes(got)} across the rows, expected all_reduce {across:,.0f} B: one all-reduce "
            f"of this rank's shard of each module, not of the whole gradient (exercise 11.2)")


@pytest.mark.mechanism
@pytest.mark.exercise("11.1", "11.2")
def test_replicate_sends_the_root_by_all_reduce_only(runs):
    res = runs["replicate root"][0]
    root = [(n, b) for n, b, is_root in res["layout"] if is_root]
    assert len(root) == 1 and root[0][0] == 1  # the root's parameters: shards of one rank, whole everywhere
    blocks = sum(b for n, b, is_root in res["layout"] if not is_root)
    across = sum(v.get("all_reduce", 0.0) for v in res["sent"].values())
    want = comm.ring_bytes("all_reduce", root[0][1], 4)
    assert across == pytest.approx(want), (
        f"replicate on the root sent {across:,.0f} B by all-reduce, expected {want:,.0f} B: one all-reduce of the "
        f"root's {root[0][1]:,} B of gradients and none for the sharded blocks (exercise 11.2: a block's gradients "
        f"go by one reduce-scatter)")
    gathered = sum(v.get("all_gather", 0.0) for v in res["sent"].values())
    want = 2 * comm.ring_bytes("all_gather", blocks, 4)  # the root's "gather" of one: 0
    assert gathered == pytest.approx(want), (
        f"the blocks' all-gathers sent {gathered:,.0f} B, expected {want:,.0f} B: each block gathered twice "
        f"(forward, backward), each rank's padded rows (exercise 11.1)")


def test_flat_hybrid_shard_equals_torchs_and_sends_each_shard_across_once(runs):
    ours, torchs = runs["hybrid_shard"][0]["full"], runs["torch hybrid_shard"][0]["full"]
    assert max(float((ours[k] - torchs[k]).abs().max()) for k in torchs) <= 1e-6
    for r in range(4):
        sent = runs["hybrid_shard"][r]["sent"]
        # each rank's reduce-scatter input is the unit's padded flat gradient F; in the row it sends F/2,
        # and its shard, F/2, is all-reduced across the two rows: 2 x (F/2) x (1/2) = F/2 again
        assert sent["replicate"]["all_reduce"] == pytest.approx(sent["shard"]["reduce_scatter"])


def save_hybrid(path):
    """The FlatParameter HYBRID_SHARD trains 2 steps and saves a chapter-10 checkpoint: the replicas of a
    shard describe the same boxes, and DCP writes each box once."""
    from minifsdp import checkpoint
    from minifsdp.state_dict import get_full_state_dict

    r, n = dist.get_rank(), dist.get_world_size()
    model = hybrid_shard(build_model("gpt", seed=0), torch_fsdp1=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(2):
        loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(path, model, opt)
    return get_full_state_dict(model)


def load_into_ddp(path):
    from minifsdp import checkpoint
    from minifsdp.state_dict import get_full_state_dict
    from minifsdp.train import STRATEGIES

    model, opt = STRATEGIES["ddp"].build(build_model("gpt", seed=1), "adamw", False)
    checkpoint.load(path, model, opt)
    return get_full_state_dict(model), {k: v.clone() for s in opt.state.values() for k, v in s.items()}


def test_a_hybrid_shard_checkpoint_loads_into_one_rank(tmp_path):
    saved = launch(save_hybrid, world_size=4, args=(tmp_path / "ckpt",))[0]
    loaded, state = launch(load_into_ddp, world_size=1, args=(tmp_path / "ckpt",))[0]
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(state)  # the optimizer state came along
