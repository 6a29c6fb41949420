"""A script written for PyTorch's FSDP1 runs under minifsdp with only its import changed -- and trains the same.

The script (`fsdp1_script`) is written once, against the names of `torch.distributed.fsdp`, and run with
that module and with `minifsdp.fsdp` in its place: wrap with PyTorch's own size_based_auto_wrap_policy, build
the optimizer over model.parameters(), train a few epochs under an LR scheduler, save model.state_dict()
(FULL_STATE_DICT, rank0_only) on rank 0 and load it into the plain model, strictly.

Tolerances. minifsdp against torch's DDP running the same script: bit-exact (2 ranks: one commutative
addition per element; each parameter 64-byte aligned in the flat buffer, chapter 5). minifsdp against
torch's FSDP1: 1e-6 -- FSDP1 packs parameters end to end, and CPU matrix kernels round unaligned data
differently (chapter 5 measures 2.4e-7 per forward), so FSDP1 itself is not bit-exact against DDP here.
The rest of PyTorch's surface -- sharding strategies, state dict types, summon_full_params' arguments,
ignored_modules, fsdp_modules -- is tested against what PyTorch documents, on 2 and 3 ranks.
"""

import functools
import importlib
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minifsdp import launch
from minifsdp.train import max_abs_diff

EPOCHS, STEPS = 3, 2


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + torch.tanh(self.fc(x)))


class Net(nn.Module):
    """Odd sizes: nothing divides by 2 or 3, so every flat parameter is padded."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(5, 13)
        self.blocks = nn.Sequential(Block(13), Block(13))
        self.head = nn.Linear(13, 3)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def data(epoch, step, rank, n):
    g = torch.Generator().manual_seed(100 * epoch + step)
    x, y = torch.randn(12, 5, generator=g), torch.randn(12, 3, generator=g)
    return x[rank * 12 // n: (rank + 1) * 12 // n], y[rank * 12 // n: (rank + 1) * 12 // n]


# --- the script, as a PyTorch FSDP1 user writes it; `lib` is the only thing that changes ------------------------
def fsdp1_script(lib_name, optimizer="sgd", strategy="FULL_SHARD", path=None):
    lib = importlib.import_module(lib_name)
    FSDP = lib.FullyShardedDataParallel
    rank = dist.get_rank()
    model = FSDP(Net(), auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=150),
                 sharding_strategy=getattr(lib.ShardingStrategy, strategy), device_id=torch.device("cpu"))
    losses = train(model, optimizer)
    # (a GPU script adds offload_to_cpu=True; torch's FSDP1 fails with it when the shards are on the CPU)
    config = lib.FullStateDictConfig(rank0_only=True)
    with FSDP.state_dict_type(model, lib.StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    out = {"losses": losses, "keys": sorted(state)}
    if rank == 0:
        torch.save(state, path)
        plain = Net()
        out["load"] = str(plain.load_state_dict(torch.load(path, weights_only=True), strict=True))
        out["weights"] = {k: v.clone() for k, v in plain.state_dict().items()}
    return out
# --------------------------------------------------------------------------------------------------------------------


def train(model, optimizer):
    """A few epochs of the usual loop, under an LR scheduler; the losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    losses = []
    for epoch in range(EPOCHS):
        for step in range(STEPS):
            x, y = data(epoch, step, rank, world)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        scheduler.step()
    return losses


# summon_full_params as a PyTorch FSDP1 user reads and edits a model through it: (nested units?, strategy)
SUMMON_RUNS = [(False, "FULL_SHARD"), (True, "FULL_SHARD"), (True, "NO_SHARD")]


def summon_script(lib_name, nested, strategy):
    lib = importlib.import_module(lib_name)
    FSDP = lib.FullyShardedDataParallel

    def wrap():
        return FSDP(Net(), auto_wrap_policy=TorchModuleWrapPolicy({Block}) if nested else None,
                    sharding_strategy=getattr(lib.ShardingStrategy, strategy), device_id=torch.device("cpu"))

    def listed(module):  # (the flat parameters' names differ: torch's `_flat_param` is our `flat_param_0`)
        return [(n.replace("_flat_param", "flat_param_0"), tuple(p.shape) if "flat_param" not in n else None,
                 type(p).__name__) for n, p in module.named_parameters()]

    model, out = wrap(), {}
    with FSDP.summon_full_params(model, writeback=False):
        out["named"], out["inner named"] = listed(model), listed(model.module)
        out["values"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["state dict"] = {k: v.clone() for k, v in model.state_dict().items()}
        out["named after state dict"] = listed(model)
    out["named outside"] = listed(model)
    with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
        out["rank0_only"] = listed(model)
    with FSDP.summon_full_params(model, writeback=False, recurse=False):
        out["recurse=False"] = listed(model)
    out["losses"], out["losses without summon"] = train(model, "sgd"), train(wrap(), "sgd")
    out["before edit"] = {k: v.clone() for k, v in model.state_dict().items()}
    with FSDP.summon_full_params(model):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in ("blocks.0.fc.weight", "head.bias"):
                    p.mul_(-2.0)
        out["state dict edited"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["after edit"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def ddp_script(optimizer="sgd"):
    """The same training under torch's DDP: the oracle."""
    net = Net()
    losses = train(TorchDDP(net), optimizer)
    return {"losses": losses, "weights": {k: v.clone() for k, v in net.state_dict().items()}}


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test reads the message
        return f"{type(e).__name__}: {e}"
    return None


def surface_cases(tmp):
    from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
    from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
    from torch.distributed.fsdp import StateDictType as TorchStateDictType
    from torch.distributed.tensor import DTensor, Shard

    from minifsdp.fsdp import (FSDP, FullStateDictConfig, ModuleWrapPolicy, ShardedStateDictConfig, ShardingStrategy,
                               StateDictType)

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for lib in ("torch.distributed.fsdp", "minifsdp.fsdp"):
        for opt in ("sgd", "adamw"):
            out[(lib, opt)] = fsdp1_script(lib, opt, path=f"{tmp}/{lib}-{opt}-{world}.pt")
        out[(lib, "SHARD_GRAD_OP")] = fsdp1_script(lib, "sgd", "SHARD_GRAD_OP", path=f"{tmp}/{lib}-sgo-{world}.pt")
        out[(lib, "NO_SHARD")] = fsdp1_script(lib, "sgd", "NO_SHARD", path=f"{tmp}/{lib}-ns-{world}.pt")
    out["ddp", "sgd"], out["ddp", "adamw"] = ddp_script("sgd"), ddp_script("adamw")
    for lib in ("torch.distributed.fsdp", "minifsdp.fsdp"):
        for run in SUMMON_RUNS:  # (a failure here is this feature's: kept for its test, not raised)
            try:
                out["summon", lib, run] = summon_script(lib, *run)
            except Exception as e:  # noqa: BLE001
                out["summon", lib, run] = {"error": f"{type(e).__name__}: {e}"}

    # strategies: what stays unsharded after forward, and what is sent
    policy = ModuleWrapPolicy({Block})
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        model = FSDP(Net(), sharding_strategy=getattr(TorchShardingStrategy, strategy), auto_wrap_policy=policy)
        loss = model(data(0, 0, rank, world)[0]).sum()
        out["unsharded after forward", strategy] = sorted(
            name for name, unit in model.named_units() if any(f.is_unsharded for f in unit.flat_params))
        loss.backward()
        out["shard numels", strategy] = [(f.param.numel(), f.numel) for u in model.units() for f in u.flat_params]
    out["hybrid"] = error_of(lambda: FSDP(Net(), sharding_strategy=ShardingStrategy.HYBRID_SHARD))
    out["both"] = error_of(lambda: FSDP(Net(), sharding_strategy=ShardingStrategy.FULL_SHARD,
                                        reshard_after_forward=False))
    out["orig params"] = error_of(lambda: FSDP(Net(), use_orig_params=True))
    out["bad prefetch"] = error_of(lambda: FSDP(Net(), backward_prefetch="pre"))
    out["torch prefetch"] = FSDP(Net(), backward_prefetch=TorchBackwardPrefetch.BACKWARD_POST).backward_prefetch.name
    out["default prefetch"] = FSDP(Net()).backward_prefetch.name

    # state dict types
    net = Net()
    model = FSDP(net, auto_wrap_policy=policy)
    full = model.state_dict()
    out["full keys"], out["plain keys"] = sorted(full), sorted(Net().state_dict())
    plain = Net()
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(-1.5)
    out["load plain"] = str(model.load_state_dict(plain.state_dict()))  # and back: the plain model's into FSDP
    out["after load plain"] = max_abs_diff(model.state_dict(), plain.state_dict())
    with FSDP.state_dict_type(model, TorchStateDictType.LOCAL_STATE_DICT):
        local = model.state_dict()
        model.load_state_dict({k: v.clone() for k, v in local.items()})
    out["local keys"] = sorted(local)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):  # PyTorch's default: ShardedTensors
        out["sharded default"] = sorted({type(v).__name__ for v in model.state_dict().values()})
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(_use_dtensor=True)):
        sharded = model.state_dict()
        out["sharded keys"] = sorted(sharded)
        out["sharded placements"] = {k: (type(v).__name__, tuple(v.placements), tuple(v.to_local().shape))
                                     for k, v in sharded.items()}
        out["sharded whole"] = max_abs_diff({k: v.full_tensor() for k, v in sharded.items()}, plain.state_dict())
        out["sharded is DTensor"] = all(isinstance(v, DTensor) and v.placements in ((Shard(0),),) for v in sharded.values())
        model.load_state_dict(sharded)
    out["after sharded load"] = max_abs_diff(model.state_dict(), plain.state_dict())
    out["default type back"] = sorted(model.state_dict()) == out["full keys"]
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True)):
        out["offloaded state dict"] = max_abs_diff(model.state_dict(), full)
    out["bad type"] = error_of(lambda: FSDP.state_dict_type(model, "full").__enter__())

    # summon_full_params: static and bound forms, writeback by default, rank0_only, recurse, with_grads
    model = FSDP(Net(), auto_wrap_policy=policy)
    inner = model.module
    with FSDP.summon_full_params(model):
        inner.head.bias.fill_(float(rank + 1))  # every rank writes a different value into its own slice
        out["shape inside"] = tuple(inner.blocks[0].fc.weight.shape)
    with model.summon_full_params(writeback=False):
        out["written back"] = inner.head.bias.clone()
        inner.head.bias.fill_(7.0)
    with model.summon_full_params(model, writeback=False):
        out["not written back"] = inner.head.bias.clone()
    with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
        out["rank0_only numel"] = inner.blocks[0].fc.weight.numel()
    with FSDP.summon_full_params(model, writeback=False, recurse=False):
        out["recurse=False"] = (inner.head.weight.numel(), inner.blocks[0].fc.weight.numel())
    with FSDP.summon_full_params(model, writeback=False, offload_to_cpu=True):
        out["offloaded device"] = inner.head.weight.device.type
    with FSDP.summon_full_params(model, offload_to_cpu=True):  # (torch's FSDP1 cannot offload CPU shards)
        out["offloaded named"] = [(n, type(p).__name__) for n, p in model.named_parameters()]
        for name, p in model.named_parameters():
            if name == "blocks.1.fc.bias":
                p.fill_(3.0)
    with FSDP.summon_full_params(model, writeback=False):
        out["offloaded edit"] = inner.blocks[1].fc.bias.clone()
    out["rank0_only writeback"] = error_of(lambda: FSDP.summon_full_params(model, rank0_only=True).__enter__())
    x, y = data(0, 0, rank, world)
    F.mse_loss(model(x), y).backward()
    with FSDP.summon_full_params(model, writeback=False, with_grads=True):
        out["grads"] = {"head.weight": inner.head.weight.grad.clone(), "blocks.1.fc.bias": inner.blocks[1].fc.bias.grad.clone()}
        out["named grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if n in out["grads"]}
    same = Net()
    same.load_state_dict(model.state_dict())  # the weights summon_full_params wrote back above
    reference = TorchDDP(same)
    F.mse_loss(reference(x), y).backward()
    out["ddp grads"] = {"head.weight": reference.module.head.weight.grad, "blocks.1.fc.bias": reference.module.blocks[1].fc.bias.grad}
    # clip_grad_norm_ as torch's on the whole gradient, sharded or not (NO_SHARD counts each gradient once)
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        clipped = FSDP(Net(), auto_wrap_policy=policy, sharding_strategy=getattr(ShardingStrategy, strategy))
        F.mse_loss(clipped(x), y).backward()
        norm = clipped.clip_grad_norm_(0.01)
        with FSDP.summon_full_params(clipped, writeback=False, with_grads=True):
            grads = {"head.weight": clipped.module.head.weight.grad.clone()}
        plain = TorchDDP(Net())
        F.mse_loss(plain(x), y).backward()
        torch_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01)
        out["clip", strategy] = (norm.item(), torch_norm.item(),
                                 max_abs_diff(grads, {"head.weight": plain.module.head.weight.grad}))
    out["fsdp_modules"] = (len(FSDP.fsdp_modules(model)), len(FSDP.fsdp_modules(model, root_only=True)),
                           len(FSDP.fsdp_modules(nn.Sequential(model))))

    # ignored_modules: left alone -- not flattened, not synced, gradients not averaged
    net = Net()
    torch.manual_seed(rank)
    net.head.reset_parameters()  # each rank its own head
    model = FSDP(net, auto_wrap_policy=policy, ignored_modules=[net.head])
    out["ignored head"] = (type(net.head.weight).__name__, tuple(net.head.weight.shape),
                           isinstance(net.head, FSDP), net.head.weight.clone())
    F.mse_loss(model(x), y).backward()
    out["ignored grad"] = net.head.weight.grad.clone()
    out["ignored in state dict"] = "head.weight" in model.state_dict()
    out["ignored in parameters"] = any(p is net.head.weight for p in model.parameters())

    # an optimizer built before wrapping is caught at the first forward; none of this costs any optimizer a hook
    net = Net()
    stale = torch.optim.SGD(net.parameters(), lr=0.1)
    model = FSDP(net)
    out["stale optimizer"] = error_of(lambda: model(x))
    del stale
    from torch.optim import optimizer as torch_optimizer
    out["global step hooks"] = len(torch_optimizer._global_optimizer_pre_hooks)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp1")
    return {n: launch(surface_cases, world_size=n, args=(str(tmp),), device="cpu") for n in (2, 3)}


def test_the_signature_is_pytorchs_in_its_order():
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    from minifsdp.fsdp import FSDP

    theirs = list(inspect.signature(TorchFSDP.__init__).parameters)
    ours = list(inspect.signature(FSDP.__init__).parameters)
    assert ours[: len(theirs)] == theirs
    assert inspect.signature(FSDP.__init__).parameters["backward_prefetch"].default.name == "BACKWARD_PRE"


@pytest.mark.parametrize("run", ["sgd", "adamw", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("n", (2, 3))
def test_fsdp1_script_with_the_import_changed_trains_as_torchs(ranks, n, run):
    for r in range(n):
        ours, theirs = ranks[n][r][("minifsdp.fsdp", run)], ranks[n][r][("torch.distributed.fsdp", run)]
        assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-6)
        if r == 0:
            assert ours["keys"] == theirs["keys"]
        else:  # rank0_only: the others get {} (torch's FSDP1 ignores rank0_only under NO_SHARD; minifsdp does not)
            assert ours["keys"] == [] and (theirs["keys"] == [] or run == "NO_SHARD")
    ours, theirs = ranks[n][0][("minifsdp.fsdp", run)], ranks[n][0][("torch.distributed.fsdp", run)]
    assert ours["load"] == theirs["load"] == "<All keys matched successfully>"
    assert max_abs_diff(ours["weights"], theirs["weights"]) <= 1e-6  # see the module docstring
    if run in ("sgd", "adamw"):
        oracle = ranks[n][0][("ddp", run)]
        assert max_abs_diff(ours["weights"], oracle["weights"]) <= (0.0 if n == 2 else 1e-6)
        assert max_abs_diff(ours["weights"], Net().state_dict()) > 1e-2  # it trained


@pytest.mark.parametrize("n", (2, 3))
def test_sharding_strategies(ranks, n):
    res = ranks[n][0]
    assert res["unsharded after forward", "FULL_SHARD"] == [""]  # the root only (its backward is next)
    assert res["unsharded after forward", "SHARD_GRAD_OP"] == ["", "blocks.0", "blocks.1"]
    assert res["unsharded after forward", "NO_SHARD"] == ["", "blocks.0", "blocks.1"]
    for (kept, numel), (shard, _) in zip(res["shard numels", "NO_SHARD"], res["shard numels", "FULL_SHARD"]):
        assert kept >= numel and shard < numel <= shard * n  # NO_SHARD: every rank keeps the whole unit
    assert "HYBRID_SHARD needs its two groups" in res["hybrid"]  # a mesh (replicate, shard) or two groups
    assert res["both"].startswith("ValueError") and "give one of them" in res["both"]
    assert res["orig params"].startswith("NotImplementedError") and "use_orig_params" in res["orig params"]
    assert res["bad prefetch"].startswith("ValueError") and "backward_prefetch" in res["bad prefetch"]
    assert res["torch prefetch"] == "BACKWARD_POST" and res["default prefetch"] == "BACKWARD_PRE"


@pytest.mark.parametrize("n", (2, 3))
def test_state_dict_types(ranks, n):
    for r in range(n):
        res = ranks[n][r]
        assert res["full keys"] == res["plain keys"]  # the original names, nothing of the wrappers
        assert res["load plain"] == "<All keys matched successfully>" and res["after load plain"] == 0.0
        # the flat shards under nn.Module's own names: one per unit here (no buffers, nothing frozen)
        assert res["local keys"] == ["flat_param_0", "module.blocks.0.flat_param_0", "module.blocks.1.flat_param_0"]
        assert res["sharded keys"] == res["plain keys"] and res["sharded is DTensor"]
        assert res["sharded default"] == ["ShardedTensor"]
        assert res["sharded whole"] == 0.0 and res["after sharded load"] == 0.0
        # Shard(0) of each original parameter: rank r holds rows chunk r of 13 (5, 4, 4 at N = 3)
        rows = list(torch.arange(13).chunk(n))[r].numel()
        assert res["sharded placements"]["blocks.0.fc.weight"][2] == (rows, 13)
        assert res["default type back"] and res["offloaded state dict"] > 0  # (the full one was taken before loading)
        assert "state_dict_type must be one of" in res["bad type"]


@pytest.mark.parametrize("n", (2, 3))
def test_summon_full_params_takes_pytorchs_arguments(ranks, n):
    for r in range(n):
        res = ranks[n][r]
        assert res["shape inside"] == (13, 13)
        # writeback=True by default: each rank wrote back its own slice of what it wrote
        assert res["written back"].tolist() == res["not written back"].tolist()
        assert set(res["written back"].tolist()) <= {float(k + 1) for k in range(n)} and 7.0 not in res["not written back"].tolist()
        assert res["rank0_only numel"] == (169 if r == 0 else 0)
        assert res["recurse=False"] == (39, 0)  # the root's own (head) only; blocks.0 is a unit of its own
        assert res["offloaded device"] == "cpu"
        assert res["offloaded named"] == [(name, "Parameter") for name, _ in Net().named_parameters()]
        assert res["offloaded edit"].tolist() == [3.0] * 13  # written back from the host copy
        assert "rank0_only=True, writeback=True" in res["rank0_only writeback"]
        assert max_abs_diff(res["grads"], res["ddp grads"]) <= (0.0 if n == 2 else 1e-6)
        assert max_abs_diff(res["named grads"], res["grads"]) == 0.0
        assert res["fsdp_modules"] == (3, 1, 3)
        for strategy in ("FULL_SHARD", "NO_SHARD"):
            ours, theirs, grad_diff = res["clip", strategy]
            assert ours == pytest.approx(theirs, rel=1e-6) and theirs > 0.01 and grad_diff <= 1e-7, strategy


@pytest.mark.parametrize("run", SUMMON_RUNS, ids=["flat", "nested", "nested-NO_SHARD"])
@pytest.mark.parametrize("n", (2, 3))
def test_summon_full_params_shows_the_original_parameters_as_pytorchs(ranks, n, run):
    """Inside the block model.named_parameters() gives the originals, as nn.Parameters under the names before
    wrapping, and state_dict() works there; edits made through them are written back; training afterwards
    is what it would have been without the block."""
    for r in range(n):
        ours, theirs = ranks[n][r]["summon", "minifsdp.fsdp", run], ranks[n][r]["summon", "torch.distributed.fsdp", run]
        assert "error" not in ours and "error" not in theirs, ours.get("error") or theirs.get("error")
        assert ours["named"] == theirs["named"] and ("blocks.0.fc.weight", (13, 13), "Parameter") in ours["named"]
        assert [name for name, _, _ in ours["named"]] == [name for name, _ in Net().named_parameters()]
        if not run[0]:  # the wrapped module's own names (nested, the wrappers' attribute names differ)
            assert ours["inner named"] == theirs["inner named"] == ours["named"]
        assert max_abs_diff(ours["values"], theirs["values"]) == 0.0
        assert max_abs_diff(ours["values"], Net().state_dict()) == 0.0
        assert max_abs_diff(ours["state dict"], theirs["state dict"]) == 0.0  # (inside the block, both)
        assert ours["named after state dict"] == ours["named"]  # the state dict left the block's units alone
        assert all(name.endswith("flat_param_0") for name, _, _ in ours["named outside"])
        # rank0_only: the other ranks hold their shards inside the block, and list the flat parameters
        assert ours["rank0_only"] == theirs["rank0_only"]
        flat_only = all(name.endswith("flat_param_0") for name, _, _ in ours["rank0_only"])
        assert (ours["rank0_only"] == ours["named"]) if r == 0 else flat_only
        # recurse=False: the root's own originals, and the nested units' flat parameters
        assert ours["recurse=False"] == theirs["recurse=False"]
        assert ours["losses"] == ours["losses without summon"]
        assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-6)
        assert max_abs_diff(ours["state dict edited"], ours["after edit"]) == 0.0  # the edit is written back ...
        assert max_abs_diff(ours["after edit"], theirs["after edit"]) <= 1e-6       # ... as torch's FSDP1 writes it
        edited = {k: v * (-2.0 if k in ("blocks.0.fc.weight", "head.bias") else 1.0)
                  for k, v in ours["before edit"].items()}
        assert max_abs_diff(ours["after edit"], edited) == 0.0


@pytest.mark.parametrize("n", (2, 3))
def test_ignored_modules_are_left_alone(ranks, n):
    heads = [ranks[n][r]["ignored head"] for r in range(n)]
    assert all(h[:3] == ("Parameter", (3, 13), False) for h in heads)
    assert not torch.equal(heads[0][3], heads[1][3])  # not synced from rank 0
    assert not torch.equal(ranks[n][0]["ignored grad"], ranks[n][1]["ignored grad"])  # not averaged
    assert ranks[n][0]["ignored in state dict"] and ranks[n][0]["ignored in parameters"]


@pytest.mark.parametrize("n", (2, 3))
def test_an_optimizer_built_before_wrapping_is_caught_without_a_global_hook(ranks, n):
    res = ranks[n][0]
    assert "build the optimizer after wrapping" in res["stale optimizer"]
    assert res["global step hooks"] == 0


def summon_inner_state_dict(fsdp_module: str) -> dict[str, torch.Tensor]:
    """Two units beside the root, one of them frozen; after steps that prefetch in backward (the default
    BACKWARD_PRE), the wrapped module's own state_dict() inside summon_full_params, as a script may ask for
    it. Each unit's link to the unit whose backward comes next must not make that unit its submodule:
    the frozen unit's state_dict() would walk into the other one's."""
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    FSDP = importlib.import_module(fsdp_module).FullyShardedDataParallel
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.Linear(7, 3))
    net[2].requires_grad_(False)
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m is net[0] or m is net[2])
    model = FSDP(net, auto_wrap_policy=policy, device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):  # the first backward records the order; the later ones prefetch by it
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with FSDP.summon_full_params(model):
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def test_the_wrapped_modules_state_dict_inside_summon_full_params_is_torchs():
    ours = launch(summon_inner_state_dict, world_size=2, args=("minifsdp.fsdp",), device="cpu")
    theirs = launch(summon_inner_state_dict, world_size=2, args=("torch.distributed.fsdp",), device="cpu")
    for mine, torchs in zip(ours, theirs):
        assert mine.keys() == torchs.keys()
        assert max_abs_diff(mine, torchs) <= 1e-6  # FSDP1 packs its flat buffer unaligned: see the docstring
