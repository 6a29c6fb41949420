"""Chapter 3: ZeRO-1 with OSS, proven against torch's DDP with a plain local optimizer.

Tolerance: bit-exact (max |diff| == 0.0) at N = 1..4. The gradients come from chapter 1's DDP (itself
bit-exact against torch's), and SGD and AdamW are element-wise: stepping a parameter on its owner rank
computes exactly what every rank computes under DDP. (Optimizers that are not element-wise -- LAMB or
Adafactor-style per-tensor norms -- also stay exact under OSS, because OSS never splits a tensor; they
would differ under the flat design of tests/test_ch03_flat.py, which cuts tensors at shard boundaries.)
"""

import pytest
import torch
import torch.distributed as dist

from minifsdp import OSS, RankFailedError, analytic, comm, launch
from minifsdp.ddp import DistributedDataParallel
from minifsdp.measure.meter import optimizer_tensors
from minifsdp.models import TinyGPT
from minifsdp.reports.tour import TOUR_MODEL
from minifsdp.train import OPTIMIZER_SPECS, batch, build_model, loss_of, max_abs_diff, train
from minifsdp.zero.oss import imbalance, partition_by_order, partition_parameters
from mixed_dtypes import EXACT, MIXES, SGD, diff_by_dtype, torch_ddp, train_mixed, within
from per_world_size import PerWorldSize

WORLD_SIZES = (1, 2, 3, 4)
MODELS = ("gpt", "toy")
OPTIMS = ("sgd", "adamw")
STEPS = 10


# -- the partition -----------------------------------------------------------------------------------------
def shares(model, n):
    return [[p for g in rank for p in g["params"]] for rank in partition_parameters([{"params": list(
        model.parameters())}], n)]


@pytest.mark.exercise("3.1")
@pytest.mark.parametrize("n", range(1, 9))
def test_partition_covers_everything_once(n):
    model = TinyGPT(TOUR_MODEL)
    owned = [id(p) for share in shares(model, n) for p in share]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())


@pytest.mark.mechanism
@pytest.mark.exercise("3.1")
@pytest.mark.parametrize("n", range(1, 9))
def test_greedy_partition_balances(n):
    model = TinyGPT(TOUR_MODEL)
    parts = shares(model, n)
    sizes = [sum(p.numel() for p in share) for share in parts]
    largest = max(p.numel() for p in model.parameters())
    assert max(sizes) - min(sizes) <= largest  # greedy-largest-first: within one parameter of each other
    assert imbalance(parts) <= imbalance(partition_by_order([{"params": list(model.parameters())}], n))


@pytest.mark.mechanism
@pytest.mark.exercise("3.1")
def test_partition_is_greedy_largest_first():
    # sizes in registration order 1, 5, 3, 4, 2; then a second group of two equal ones, 3 and 3
    first = [torch.nn.Parameter(torch.zeros(k)) for k in (1, 5, 3, 4, 2)]
    second = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    index = {p: i for i, p in enumerate(first + second)}

    def owners(groups, n):
        return [sorted(index[p] for g in rank for p in g["params"]) for rank in partition_parameters(groups, n)]

    # 5 -> rank 0; 4 -> rank 1; 3 -> rank 1 (4 < 5); 2 -> rank 0 (7 > 5); 1 -> rank 0 (a tie at 7: the lower
    # rank). In registration order instead, greedy gives [[0, 2, 3], [1, 4]]; dealt round-robin, [[0, 2, 4],
    # [1, 3]]; largest first round-robin, [[0, 1, 2], [3, 4]]
    assert owners([{"params": first}], 2) == [[0, 1, 4], [2, 3]]
    assert owners([{"params": first}], 3) == [[1], [0, 3], [2, 4]]
    # the totals carry over from group to group (rank 1 has 7, rank 0 has 8), and a stable sort keeps equal
    # sizes in registration order: the first 3 goes to rank 1, the second to rank 0
    assert owners([{"params": first}, {"params": second}], 2) == [[0, 1, 4, 6], [2, 3, 5]]


@pytest.mark.exercise("3.1")
def test_one_huge_tensor_defeats_any_partition_of_whole_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 10))
    parts = shares(model, 4)
    # the 1000x1000 weight lands whole on one rank: that rank holds ~4x its fair share of the state
    assert imbalance(parts) > 3.9


# -- one launch per world size: every case that should succeed -----------------------------------------------
def torch_zero(model_name, optimizer):
    """torch's own ZeRO-1 (ZeroRedundancyOptimizer) with torch's DDP: a second oracle."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    cls, kw = OPTIMIZER_SPECS[optimizer]
    model = TorchDDP(build_model(model_name, seed=dist.get_rank()))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kw)
    n, r = dist.get_world_size(), dist.get_rank()
    for step in range(STEPS):
        loss_of(model_name, model, batch(model_name, step, 12, r, n, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def groups_and_scheduler(use_oss, add_later):
    """Two param groups with their own hyper-parameters, a StepLR on top, the second group added late."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    net = build_model("gpt", seed=dist.get_rank())
    model = DistributedDataParallel(net) if use_oss else TorchDDP(net)
    blocks = [p for n, p in net.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in net.named_parameters() if not n.startswith("blocks.")]
    first, second = {"params": blocks, "lr": 0.02, "weight_decay": 0.0}, {"params": rest, "lr": 0.005}
    groups = [first] if add_later else [first, second]
    opt = (OSS(groups, optim=torch.optim.AdamW, weight_decay=0.1) if use_oss
           else torch.optim.AdamW(groups, weight_decay=0.1))
    if add_later:
        opt.add_param_group(second)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    n, r = dist.get_world_size(), dist.get_rank()
    for step in range(6):
        loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu")).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return {k: v.clone() for k, v in net.state_dict().items()}, [g["lr"] for g in opt.param_groups]


def state_and_partition(optimizer, param_sync="broadcast"):
    """Three steps of OSS; then what each rank holds, what it sent, and the consolidated state."""
    cls, kw = OPTIMIZER_SPECS[optimizer]
    net = build_model("gpt", seed=0)
    model = DistributedDataParallel(net)
    opt = OSS(net.parameters(), optim=cls, param_sync=param_sync, **kw)
    n, r = dist.get_world_size(), dist.get_rank()
    with comm.counting() as sent:
        for step in range(3):
            loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu")).backward()
            opt.step()
            opt.zero_grad()
    mine = {id(p) for p in opt.owned_params(r)}
    owned_index = [i for i, p in enumerate(net.parameters()) if id(p) in mine]
    opt.consolidate_state_dict(to=0)
    full = opt.state_dict() if r == 0 else None
    share_sizes = [sum(p.numel() for p in opt.owned_params(k)) for k in range(n)]
    return {"optim_bytes": sum(t.numel() * t.element_size() for t in optimizer_tensors(opt)),
            "owned_index": owned_index, "share_sizes": share_sizes, "bytes": dict(sent.bytes),
            "calls": dict(sent.calls),
            "full_state": full, "params": {k: v.clone() for k, v in net.state_dict().items()}}


def plain_state(optimizer):
    """The same three steps with torch's DDP and a plain optimizer: its state dict is the reference."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    cls, kw = OPTIMIZER_SPECS[optimizer]
    net = build_model("gpt", seed=0)
    model = TorchDDP(net)
    opt = cls(net.parameters(), **kw)
    n, r = dist.get_world_size(), dist.get_rank()
    for step in range(3):
        loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    return opt.state_dict()


def chapter_cases():
    out = {"parity": {(m, o, s): train(strategy=s, model=m, optimizer=o, steps=STEPS, measure=False,
                                       set_to_none="alternate" if m == "gpt" else "always")
                      for m in MODELS for o in OPTIMS for s in ("torch_ddp", "oss")}}
    out["torch_zero"] = torch_zero("gpt", "adamw")
    out["groups"] = {kind: groups_and_scheduler(kind == "oss", add_later=kind == "oss")
                     for kind in ("oss", "torch")}
    out["state"] = {o: state_and_partition(o) for o in OPTIMS}
    out["all_gather"] = state_and_partition("adamw", param_sync="all_gather")
    out["plain_state"] = {o: plain_state(o) for o in OPTIMS}
    if dist.get_world_size() in (2, 3):
        out["mixed"] = {mix: mixed_dtypes(mix) for mix in MIXES}
    return out


@pytest.fixture(scope="module")
def ranks():
    return PerWorldSize(lambda n: launch(chapter_cases, world_size=n, device="cpu"), WORLD_SIZES)


@pytest.mark.exercise("3.1", "3.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("opt", OPTIMS)
def test_bit_exact_against_torch_ddp_with_a_local_optimizer(ranks, n, model, opt):
    for r in range(n):
        res = ranks[n][r]["parity"]
        assert max_abs_diff(res[(model, opt, "oss")]["params"], res[(model, opt, "torch_ddp")]["params"]) == 0.0


@pytest.mark.exercise("3.1", "3.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_bit_exact_against_torchs_zero_redundancy_optimizer(ranks, n):
    ours = ranks[n][0]["parity"][("gpt", "adamw", "oss")]["params"]
    assert max_abs_diff(ours, ranks[n][0]["torch_zero"]) == 0.0


@pytest.mark.exercise("3.1", "3.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_param_groups_schedulers_and_add_param_group(ranks, n):
    (ours, our_lrs), (theirs, their_lrs) = ranks[n][0]["groups"]["oss"], ranks[n][0]["groups"]["torch"]
    assert our_lrs == their_lrs == [0.02 * 0.125, 0.005 * 0.125]  # StepLR halved both, three times
    assert max_abs_diff(ours, theirs) == 0.0


@pytest.mark.exercise("3.1")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("opt", OPTIMS)
def test_optimizer_state_is_one_nth_within_the_partitions_imbalance(ranks, n, opt):
    model = build_model("gpt", seed=0)
    psi, params = sum(p.numel() for p in model.parameters()), list(model.parameters())
    total = analytic.adam_state_bytes(psi, len(params)) if opt == "adamw" else 4 * psi
    for r in range(n):
        res = ranks[n][r]["state"][opt]
        owned = [params[i] for i in res["owned_index"]]
        owned_psi = sum(p.numel() for p in owned)
        expected = analytic.adam_state_bytes(owned_psi, len(owned)) if opt == "adamw" else 4 * owned_psi
        assert res["optim_bytes"] == expected  # measured: exactly the state of the owned parameters
        worst = max(res["share_sizes"]) * n / psi  # the partition's imbalance, computed
        assert res["optim_bytes"] <= total / n * worst + 4 * len(params)


@pytest.mark.mechanism
@pytest.mark.exercise("3.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_bytes_per_step_broadcast_and_all_gather_designs(ranks, n):
    psi = sum(p.numel() for p in build_model("gpt", seed=0).parameters())
    for r in range(n):
        sent = ranks[n][r]["state"]["adamw"]["bytes"]
        # DDP's all-reduce (2Ψ) plus the owners' broadcast (Ψ): 3Ψ(N-1)/N, 1.5x DDP, with this design
        assert sent["all_reduce"] / 3 == pytest.approx(analytic.comm_bytes_per_step(psi, n, 1), abs=1e-6)
        assert sent.get("broadcast", 0) / 3 == pytest.approx(psi * 4 * (n - 1) / n, abs=1e-6)
        widest = max(ranks[n][r]["all_gather"]["share_sizes"])
        gathered = ranks[n][r]["all_gather"]["bytes"].get("all_gather", 0) / 3
        assert gathered == pytest.approx(n * widest * 4 * (n - 1) / n, abs=1e-6)  # padded to the widest
        assert gathered >= sent.get("broadcast", 0) / 3
    assert max_abs_diff(ranks[n][0]["all_gather"]["params"], ranks[n][0]["state"]["adamw"]["params"]) == 0.0


@pytest.mark.mechanism
@pytest.mark.exercise("3.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_each_owner_broadcasts_its_parameters_as_one_flat_tensor(ranks, n):
    # one broadcast per owner and step (no broadcast_buffer_size: one bucket each), nothing else after
    # DDP's all-reduces -- not one call per parameter, nor an all-gather or all-reduce in its place
    for r in range(n):
        res = ranks[n][r]["state"]["adamw"]
        owners = sum(size > 0 for size in res["share_sizes"])
        assert owners == n  # the tiny GPT has enough parameters for every rank to own some
        assert res["calls"]["broadcast"] == 3 * owners
        assert set(res["calls"]) == {"all_reduce", "broadcast"}


@pytest.mark.exercise("3.1", "3.2")
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("opt", OPTIMS)
def test_consolidated_state_equals_a_plain_optimizers(ranks, n, opt):
    full, plain = ranks[n][0]["state"][opt]["full_state"], ranks[n][0]["plain_state"][opt]
    assert full["state"].keys() == plain["state"].keys()
    for i, state in plain["state"].items():
        for k, v in state.items():
            assert torch.equal(full["state"][i][k], v), (i, k)
    assert [{k: v for k, v in g.items()} for g in full["param_groups"]] == plain["param_groups"]
    plain_optimizer = OPTIMIZER_SPECS[opt][0](build_model("gpt", 0).parameters(), lr=0.1)
    plain_optimizer.load_state_dict(full)  # the consolidated state loads into a plain local optimizer
    assert plain_optimizer.param_groups[0]["lr"] == OPTIMIZER_SPECS[opt][1]["lr"]


# -- parameters of several dtypes -------------------------------------------------------------------------------
MIXED_SYNCS = {"broadcast": {}, "all_gather": {"param_sync": "all_gather"},
               "buffer_size": {"broadcast_buffer_size": 20}, "fp16": {"broadcast_fp16": True}}


def mixed_dtypes(mix):
    """OSS over fp32 with fp64 (or bf16) layers (tests/mixed_dtypes.py), each way of syncing the replicas,
    against torch's DDP with a plain SGD."""
    reference = train_mixed(mix, torch_ddp)
    out = {}
    for name, kw in MIXED_SYNCS.items():
        params = train_mixed(mix, lambda net: (DistributedDataParallel(net),
                                               OSS(net.parameters(), optim=torch.optim.SGD, **kw, **SGD)))
        out[name] = {"params": params, "diff": diff_by_dtype(params, reference)}
    return out


@pytest.mark.exercise("3.1", "3.2")
@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("mix", MIXES)
def test_mixed_dtypes_reach_every_replica_with_the_owners_bits(ranks, n, mix):
    """An owner whose share holds an fp32 and an fp64 parameter (a bf16 and an fp32 one) sends one flat
    tensor per dtype: flattened in the dtype of its first parameter, the fp64 one would reach the others
    rounded to fp32 (1.000000000001 as 1.0) while the owner kept it whole. FairScale's OSS takes mixed
    dtypes; torch's ZeroRedundancyOptimizer refuses them."""
    for r in range(n):
        for name in MIXED_SYNCS:
            res = ranks[n][r]["mixed"][mix][name]
            assert max_abs_diff(res["params"], ranks[n][0]["mixed"][mix][name]["params"]) == 0.0, name
            if name != "fp16":
                assert within(res["diff"], EXACT), (name, res["diff"])
        fp16 = ranks[n][r]["mixed"][mix]["fp16"]["diff"]  # broadcast_fp16: rounded, close (and identical)
        assert 0 < max(fp16.values()) <= 2e-3, fp16


# -- state dicts across world sizes ----------------------------------------------------------------------------
def resume(params, state, use_oss, steps=3):
    """Load params + a full optimizer state, train `steps` more at this world size."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    cls, kw = OPTIMIZER_SPECS["adamw"]
    net = build_model("gpt", seed=0)
    net.load_state_dict(params)
    model = DistributedDataParallel(net) if use_oss else TorchDDP(net)
    opt = OSS(net.parameters(), optim=cls, **kw) if use_oss else cls(net.parameters(), **kw)
    opt.load_state_dict(state)
    n, r = dist.get_world_size(), dist.get_rank()
    for step in range(3, 3 + steps):
        loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu")).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.exercise("3.1", "3.2")
def test_a_state_saved_at_two_ranks_resumes_at_three(ranks):
    saved = ranks[2][0]["state"]["adamw"]
    ours = launch(resume, world_size=3, args=(saved["params"], saved["full_state"], True), device="cpu")
    theirs = launch(resume, world_size=3, args=(saved["params"], saved["full_state"], False), device="cpu")
    assert max_abs_diff(ours[0], theirs[0]) == 0.0
    assert max_abs_diff(ours[0], ours[2]) == 0.0


# -- bad input -------------------------------------------------------------------------------------------------
def duplicated_params():
    p = torch.nn.Parameter(torch.ones(3))
    OSS([{"params": [p]}, {"params": [p]}], optim=torch.optim.SGD, lr=0.1)


def state_dict_without_consolidating():
    OSS([torch.nn.Parameter(torch.ones(3))], optim=torch.optim.SGD, lr=0.1).state_dict()


@pytest.mark.exercise("3.1")  # the second case builds an OSS, partition and all
def test_bad_input_is_named():
    with pytest.raises(RankFailedError, match="more than one parameter group"):
        launch(duplicated_params, world_size=1, device="cpu")
    with pytest.raises(RankFailedError, match="consolidate_state_dict"):
        launch(state_dict_without_consolidating, world_size=1, device="cpu")
