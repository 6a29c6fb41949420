"""Chapter 6, drop-in: PyTorch FSDP1's wrap policies work unchanged, and make the units PyTorch makes.

A script written for torch.distributed.fsdp passes `functools.partial(size_based_auto_wrap_policy, ...)`,
`functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={...})` or its ModuleWrapPolicy.
Before, minifsdp called them with its own signature: the first two failed, and PyTorch's ModuleWrapPolicy
answered "recurse" for every module -- so every submodule became a unit, silently. Each policy must now
give exactly the units torch's FullyShardedDataParallel gives on the same model, and train like DDP.
"""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minifsdp import launch
from minifsdp.fsdp import FullyShardedDataParallel as FSDP
from minifsdp.models import Block, GPTConfig, TinyGPT
from minifsdp.train import OPTIMIZERS, batch, loss_of, max_abs_diff

CONFIG = GPTConfig(n_layer=3)
POLICIES = {
    "size_based": lambda: functools.partial(size_based_auto_wrap_policy, min_num_params=5_000),
    "size_based_small": lambda: functools.partial(size_based_auto_wrap_policy, min_num_params=4_000),
    "transformer": lambda: functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    "module_wrap": lambda: TorchModuleWrapPolicy({Block}),
}


def torch_units():
    """The units torch's FSDP1 makes, named as in the unwrapped model."""
    out = {}
    for name, policy in POLICIES.items():
        model = TorchFSDP(TinyGPT(CONFIG), auto_wrap_policy=policy(), device_id=torch.device("cpu"))
        out[name] = sorted(n.replace("_fsdp_wrapped_module.", "").removeprefix("_fsdp_wrapped_module")
                           for n, m in model.named_modules() if isinstance(m, TorchFSDP))
    return out


def train(model, net_for_params, steps=3):
    opt = OPTIMIZERS["sgd"](model.parameters())
    n, r = dist.get_world_size(), dist.get_rank()
    for step in range(steps):
        loss_of("gpt", model, batch("gpt", step, 8, r, n, "cpu", CONFIG)).backward()
        opt.step()
        opt.zero_grad()
    return net_for_params()


def cases():
    out = {"torch": torch_units(), "ours": {}, "params": {}}
    for name, policy in POLICIES.items():
        model = FSDP(TinyGPT(CONFIG, seed=dist.get_rank()), auto_wrap_policy=policy())
        out["ours"][name] = sorted(unit_name for unit_name, _ in model.named_units())
        out["params"][name] = train(model, model.full_state_dict)
    net = TinyGPT(CONFIG, seed=dist.get_rank())
    ddp = TorchDDP(net)
    out["oracle"] = train(ddp, lambda: {k: v.clone() for k, v in net.state_dict().items()})
    return out


@pytest.fixture(scope="module")
def results():
    return launch(cases, world_size=2)


@pytest.mark.exercise("5.1")  # the units are built; nothing runs
@pytest.mark.parametrize("policy", list(POLICIES))
def test_same_units_as_torch_fsdp1(results, policy):
    ours, theirs = results[0]["ours"][policy], results[0]["torch"][policy]
    assert ours == theirs
    assert len(ours) > 1  # the policy did wrap something (else the comparison is empty)


@pytest.mark.exercise("5.1")
def test_the_policies_differ(results):
    units = results[0]["ours"]
    assert units["size_based"] != units["size_based_small"] and units["transformer"] == units["module_wrap"]


@pytest.mark.exercise("6.1", "6.2")
@pytest.mark.parametrize("policy", list(POLICIES))
def test_trains_like_ddp(results, policy):
    for res in results:
        assert max_abs_diff(res["params"][policy], res["oracle"]) == 0.0
