"""Chapter 8: modules kept in full precision under MixedPrecision -- torch FSDP1's _module_classes_to_ignore.

With an auto_wrap_policy, `MixedPrecision(..., _module_classes_to_ignore=(nn.LayerNorm,))` makes every LayerNorm a
unit of its own in fp32, its input cast to fp32 and its output back (minifsdp/mixed_precision.py,
keep_full_precision). Held to torch's FSDP1 on CPU + gloo (device_id=torch.device("cpu")), on the tiny GPT at two
ranks: the same units, the same dtypes inside the LayerNorm, and the same parameters after the steps, bit for
bit -- every tensor of this GPT is a multiple of 16 elements, so FSDP1's packing end to end is aligned too, and
two ranks add each element once (chapter 6). `python -m minifsdp fp32-modules` is the longer run of the page.
"""

import pytest
import torch
import torch.nn as nn

from minifsdp import launch
from minifsdp.mixed_precision import MixedPrecision
from minifsdp.reports.full_precision import measure
from minifsdp.train import max_abs_diff

BF16, KEPT = "bf16", "bf16, LayerNorm in fp32"


def units_with_batchnorm():
    """torch's default _module_classes_to_ignore, BatchNorm, under both: which modules become units, in what."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    from minifsdp.fsdp import FullyShardedDataParallel, ModuleWrapPolicy

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16)), nn.Linear(16, 4))

    low = dict(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    ours = FullyShardedDataParallel(net(), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
                                    mixed_precision=MixedPrecision(**low))
    theirs = TorchFSDP(net(), auto_wrap_policy=TorchPolicy({nn.Sequential}), device_id=torch.device("cpu"),
                       mixed_precision=TorchMixedPrecision(**low))
    out = {}
    for who, units in (("ours", ours.units()), ("torch", TorchFSDP.fsdp_modules(theirs))):
        out[who] = sorted((type(u.module).__name__, str(getattr(u.mixed_precision, "param_dtype", None)))
                          for u in units)
    x = torch.randn(6, 8)
    out["same output"] = torch.equal(ours(x), theirs(x))
    # the BatchNorm unit has no mixed precision: its statistics are not cast to buffer_dtype either
    out["statistics"] = [str(next(m for m in model.modules() if isinstance(m, nn.BatchNorm1d)).running_mean.dtype)
                         for model in (ours, theirs)]
    return out


def work():
    res = measure(steps=3, policies=(BF16, KEPT))
    res["batchnorm"] = units_with_batchnorm()
    return res


@pytest.fixture(scope="module")
def res():
    return launch(work, world_size=2, device="cpu")[0]


def test_the_default_is_torchs():
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    assert MixedPrecision()._module_classes_to_ignore == tuple(TorchMixedPrecision()._module_classes_to_ignore)


def test_each_layernorm_is_a_unit_of_its_own_in_fp32(res):
    for which in ("minifsdp", "torch FSDP1"):
        kept, low = res[which, KEPT], res[which, BF16]
        assert (kept["units"], kept["fp32_units"]) == (8, 5)  # root, 2 blocks, 2 LayerNorms each and ln_f
        assert (low["units"], low["fp32_units"]) == (3, 0)
        assert kept["seen"] == {"weight": "float32", "input": "float32", "output": "bfloat16"}
        assert low["seen"] == {"weight": "bfloat16", "input": "bfloat16", "output": "bfloat16"}


def test_trains_as_torch_fsdp1_does(res):
    for policy in (BF16, KEPT):
        assert max_abs_diff(res["minifsdp", policy]["params"], res["torch FSDP1", policy]["params"]) == 0.0
        assert res["minifsdp", policy]["losses"] == res["torch FSDP1", policy]["losses"]
    # and keeping the LayerNorms in fp32 is not bf16 in disguise
    assert max_abs_diff(res["minifsdp", KEPT]["params"], res["minifsdp", BF16]["params"]) > 0


def test_the_fp32_units_cost_their_own_collectives(res):
    # Five LayerNorm units of 64 fp32 elements (256 bytes; a multiple of 16 and of N, so no padding): each block's
    # two are gathered twice and reduced once, ln_f's too, 3 x 256 / 2 bytes each per step at N = 2: 1,920 bytes.
    # In all-bf16 the same 320 elements were 2-byte elements of the units around them: each block's 128 (256
    # bytes, 128 sent per collective) went 3 times, and ln_f's 64 in the root (64 bytes sent per collective)
    # twice, gathered once and reduced once: 2 x 3 x 128 + 2 x 64 = 896 bytes.
    assert res["minifsdp", KEPT]["bytes"] - res["minifsdp", BF16]["bytes"] == 1920 - 896


def test_batchnorm_is_kept_in_fp32_by_default_as_in_torch(res):
    bn = res["batchnorm"]
    assert bn["ours"] == bn["torch"] == sorted([("BatchNorm1d", "None"), ("Sequential", "torch.bfloat16"),
                                                ("Sequential", "torch.bfloat16")])
    assert bn["same output"]
    assert bn["statistics"] == ["torch.float32", "torch.float32"]


def test_fairscales_mixed_precision_true_is_named():
    from minifsdp.mixed_precision import check_master_dtype, require_policy

    # FSDP calls require_policy before anything else; DDP calls it through check_master_dtype
    for check in (require_policy, lambda policy: check_master_dtype(policy, [])):
        with pytest.raises(TypeError, match=r"MixedPrecision\(param_dtype=torch.float16, buffer_dtype=torch.float16\)"):
            check(True)
