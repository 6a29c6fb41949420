"""Chapters 5-6, the naive FSDP (minifsdp/fsdp/naive.py): chapter 5's FlatParameter and three hooks, every
collective waited for where it is issued. Proven against torch's DDP like every strategy.

Tolerance: as chapter 6's runtime, whose arithmetic it shares (flatten, 1/N, one reduce-scatter per unit):
bit-exact at N = 1 and 2; 1e-6 absolute after the steps at N = 3 and 4, where gloo's reduce-scatter adds the
N contributions in another order than DDP's all-reduce. Four steps, zero_grad() between them (the naive
version sets a gradient shard once per backward: it adds nothing to an earlier one).

Its bytes are the ZeRO-3 figure with nothing saved: every unit, the root included, is all-gathered twice
and reduce-scattered once, 3 x its padded size x (N-1)/N per step.
"""

import pytest
import torch
import torch.distributed as dist

from minifsdp import comm, launch
from minifsdp.fsdp import NaiveFSDP
from minifsdp.models import Block
from minifsdp.train import OPTIMIZERS, batch, build_model, loss_of, max_abs_diff
from per_world_size import PerWorldSize

WORLD_SIZES = (1, 2, 3, 4)
ATOL = {1: 0.0, 2: 0.0, 3: 1e-6, 4: 1e-6}
STEPS = 4


def full_parameters(model: NaiveFSDP) -> dict[str, torch.Tensor]:
    """Every original parameter, whole, by its name in the unwrapped model (each unit gathered in turn)."""
    names = {id(m): prefix for prefix, m in model.module.named_modules()}
    out = {}
    for flat in model.flat_params:
        flat.unshard()
        for module, name in flat.places:
            out[f"{names[id(module)]}.{name}".lstrip(".")] = getattr(module, name).detach().clone()
        flat.reshard()
    return out


def train(kind: str, optimizer: str):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    net = build_model("gpt", seed=dist.get_rank())  # each rank its own: the wrappers must sync rank 0's
    model = NaiveFSDP(net, unit_classes=(Block,)) if kind == "naive" else TorchDDP(net)
    opt = OPTIMIZERS[optimizer](model.parameters())
    n, r = dist.get_world_size(), dist.get_rank()
    with comm.counting() as sent:
        for step in range(STEPS):
            loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu")).backward()
            opt.step()
            opt.zero_grad()
    if kind == "naive":
        padded = sum(f.shard_numel * f.world_size for f in model.flat_params)
        return full_parameters(model), dict(sent.bytes), padded
    return {k: v.clone() for k, v in net.named_parameters(remove_duplicate=False)}, None, None


def cases():
    return {(kind, opt): train(kind, opt) for kind in ("naive", "ddp") for opt in ("sgd", "adamw")}


@pytest.fixture(scope="module")
def ranks():
    return PerWorldSize(lambda n: launch(cases, world_size=n, device="cpu"), WORLD_SIZES)


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_naive_fsdp_trains_as_torch_ddp(ranks, n, opt):
    for r in range(n):
        ours, reference = ranks[n][r][("naive", opt)][0], ranks[n][r][("ddp", opt)][0]
        assert sorted(ours) == sorted(reference)
        assert max_abs_diff(ours, reference) <= ATOL[n]
        assert max_abs_diff(ours, ranks[n][0][("naive", opt)][0]) == 0.0  # replicas agree


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_unit_is_gathered_twice_and_reduce_scattered_once(ranks, n):
    _, sent, padded = ranks[n][0][("naive", "sgd")]
    per_collective = padded * 4 * (n - 1) / n  # fp32, the ring's share of one rank
    assert sent == {"all_gather": 2 * per_collective * STEPS, "reduce_scatter": per_collective * STEPS}
