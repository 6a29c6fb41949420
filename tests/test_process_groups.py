"""Data parallelism on a sub-group: two independent groups of 2 inside a world of 4.

Every strategy takes a process group (`process_group=` for the module wrappers, FairScale's `group=` for
the sharded optimizers; train(..., group=) passes it on). Ranks {0, 1} and {2, 3} each train their own
replicas -- from different initial weights, so the groups must end apart -- and each group must match
torch's DDP run on the same group: bit-exact, as at world size 2 (one commutative addition per element).
Every byte must be counted under the group's name and none under the world's.
"""

import pytest
import torch

from minifsdp import RankFailedError, launch
from minifsdp.distributed import comm
from minifsdp.distributed.mesh import init_mesh
from minifsdp.train import STRATEGIES, max_abs_diff, train

STRATEGY_NAMES = ("ddp", "oss", "sdp", "oss_flat", "sdp_flat", "fsdp", "fsdp_nraf", "torch_fsdp2")
STEPS = 3


def work():
    mesh = init_mesh((2, 2), ("replica", "dp"))  # rows {0, 1} and {2, 3} are the data-parallel groups
    dp = mesh.get_group("dp")
    out = {"oracle": train("torch_ddp", optimizer="sgd", steps=STEPS, global_batch=8, group=dp, measure=False)}
    for name in STRATEGY_NAMES:
        out[name] = train(name, optimizer="sgd", steps=STEPS, global_batch=8, group=dp, measure=False)

    # the counter keeps groups apart, and ranks given to a collective are ranks of the group
    t = torch.ones(6)
    with comm.counting() as counter:
        comm.all_reduce(t, group=dp)
        comm.all_reduce(t.clone(), group=mesh.get_group("replica"))
        comm.all_reduce(t.clone())
    src = torch.tensor([float(comm.rank())])
    comm.broadcast(src, src=1, group=dp)
    out["by_group"] = {g: dict(k) for g, k in counter.by_group.items()}
    out["sum_in_dp"] = t.tolist()
    out["broadcast_from_group_rank_1"] = src.item()

    # point to point along a column of the mesh ({0, 2} and {1, 3}): group rank 0 sends to group rank 1
    col = mesh.get_group("replica")
    msg = torch.full((5,), float(comm.rank()))
    with comm.counting() as counter:
        if comm.rank(col) == 0:
            comm.send(msg, 1, group=col)
        else:
            comm.recv(msg, 0, async_op=True, group=col).wait()
    out["p2p"] = msg.tolist(), {g: dict(k) for g, k in counter.by_group.items()}
    return out


@pytest.fixture(scope="module")
def results():
    return launch(work, world_size=4)


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_each_group_matches_torch_ddp_on_that_group(results, name):
    for rank, res in enumerate(results):
        assert max_abs_diff(res[name]["params"], res["oracle"]["params"]) == 0.0, f"rank {rank}"


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_the_groups_train_independently(results, name):
    params = [res[name]["params"] for res in results]
    assert max_abs_diff(params[0], params[1]) == 0.0 and max_abs_diff(params[2], params[3]) == 0.0
    assert max_abs_diff(params[0], params[2]) > 0.01  # different initial weights: the groups never mixed


@pytest.mark.parametrize("name", [n for n in STRATEGY_NAMES if not n.startswith("torch")])
def test_every_byte_is_counted_under_the_group(results, name):
    for res in results:
        by_group, total = res[name]["comm_bytes_by_group"], sum(res[name]["comm_bytes"].values())
        assert set(by_group) == {"dp"}, by_group
        assert sum(by_group["dp"].values()) == total
        # and the group has 2 ranks: the bytes of a world of 2 (FSDP's root keeps its parameters from
        # forward to backward, so it sends less than three passes)
        psi, passes = res[name]["psi"], STRATEGIES[name].comm_passes
        theory = passes * psi * 4 * (2 - 1) / 2 * STEPS
        if name == "fsdp":
            assert 2 * theory / 3 < total < theory
        else:
            assert total == theory


def test_counter_names_each_group(results):
    nbytes = 6 * 4
    for res in results:
        assert res["by_group"] == {"dp": {"all_reduce": 2 * nbytes * 1 / 2},
                                   "replica": {"all_reduce": 2 * nbytes * 1 / 2},
                                   "world": {"all_reduce": 2 * nbytes * 3 / 4}}
        assert res["sum_in_dp"] == [2.0] * 6


def test_collective_ranks_are_group_ranks(results):
    assert [res["broadcast_from_group_rank_1"] for res in results] == [1.0, 1.0, 3.0, 3.0]


def test_send_and_recv_use_group_ranks_and_the_sender_counts_the_bytes(results):
    for rank, res in enumerate(results):
        received, by_group = res["p2p"]
        sender = rank % 2  # the first rank of this rank's column
        assert received == [float(sender)] * 5
        assert by_group == ({"replica": {"send": 5 * 4}} if rank < 2 else {"replica": {"recv": 0.0}})


def mesh_of_the_wrong_size():
    init_mesh((3, 2), ("a", "b"))


def test_mesh_checks_its_shape():
    with pytest.raises(RankFailedError, match="a mesh of 6 ranks, but the world has 2"):
        launch(mesh_of_the_wrong_size, world_size=2)
