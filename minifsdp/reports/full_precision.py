"""Chapter 8's measurement: some modules kept in full precision under MixedPrecision, next to torch's FSDP1.

    python -m minifsdp fp32-modules --world-size 2 --markdown chapters/generated/fp32_modules.md

`MixedPrecision(param_dtype=torch.bfloat16, _module_classes_to_ignore=(nn.LayerNorm,))` with an auto_wrap_policy
makes every LayerNorm a unit of its own without mixed precision: its parameters are gathered, used and
reduced in fp32, its input is cast to fp32 and its output back to bf16. The default GPT trains for a few AdamW
steps under fp32, all-bf16 and bf16 with the LayerNorms in fp32, under minifsdp's FSDP and torch's FSDP1
(device_id=torch.device("cpu"), gloo), on rank 0 of N: the units, the bytes a step sends (minifsdp's counter;
torch's collectives do not pass through it), the loss, and how far the parameters end from the fp32 run's.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.models import Block, GPTConfig, TinyGPT
from minifsdp.reports.format import fmt_bytes, md_table, write_report
from minifsdp.train import OPTIMIZERS, batch, loss_of, max_abs_diff

CONFIG = GPTConfig(n_layer=2)
POLICIES = ("fp32", "bf16", "bf16, LayerNorm in fp32")


def _wrap(which: str, policy: str):
    if which == "minifsdp":
        from minifsdp.fsdp import FullyShardedDataParallel as FSDP
        from minifsdp.fsdp import MixedPrecision, ModuleWrapPolicy
        options = {}
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        options = {"device_id": torch.device("cpu")}
    # the same spelling for both; () switches off torch's default, BatchNorm (this GPT has none)
    mp = None if policy == "fp32" else MixedPrecision(
        param_dtype=torch.bfloat16, _module_classes_to_ignore=(nn.LayerNorm,) if "LayerNorm" in policy else ())
    return FSDP(TinyGPT(CONFIG), auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp, **options), FSDP


# --8<-- [start:measure]
def train_policy(which: str, policy: str, steps: int) -> dict:
    """Train under one policy; what the first LayerNorm computes with, the units, the losses, the bytes, the
    final parameters (the full state dict)."""
    n, r = comm.world_size(), comm.rank()
    model, wrapper = _wrap(which, policy)
    norm = next(m for m in model.modules() if isinstance(m, nn.LayerNorm))
    seen = {}
    norm.register_forward_hook(lambda m, args, out: seen.update(
        weight=m.weight.dtype, input=args[0].dtype, output=out.dtype))  # (runs after the casting hooks)
    units = [m for m in model.modules() if isinstance(m, wrapper)]
    opt = OPTIMIZERS["adamw"](model.parameters())
    losses = []
    with comm.counting() as sent:
        for step in range(steps):
            loss = loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu", CONFIG))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    params = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "bytes": sent.total() / steps, "units": len(units),
            "fp32_units": sum(getattr(u.mixed_precision, "param_dtype", None) is None for u in units),
            "seen": {k: str(v).replace("torch.", "") for k, v in seen.items()},
            "params": params, "eval_loss": fp32_loss(params)}


def fp32_loss(params: dict) -> float:
    """The loss of these parameters in fp32, on a batch no step trained on: a loss computed from bf16 logits
    is itself a bf16 number, 2^-7 of it apart, too coarse to tell two bf16 runs apart."""
    net = TinyGPT(CONFIG)
    net.load_state_dict(params)
    with torch.no_grad():
        return loss_of("gpt", net, batch("gpt", 10_000, 48, 0, 1, "cpu", CONFIG)).item()
# --8<-- [end:measure]


def measure(steps: int = 30, which=("minifsdp", "torch FSDP1"), policies=POLICIES) -> dict:
    return {(w, p): train_policy("minifsdp" if w == "minifsdp" else "torch", p, steps) for w in which for p in policies}


def run_full_precision_report(world_size: int = 2, steps: int = 30, markdown: str | None = None) -> dict:
    res = launch(measure, world_size, device="cpu", args=(steps,))[0]
    reference = res["minifsdp", "fp32"]["params"]
    rows = []
    for (which, policy), m in res.items():
        rows.append([f"{which}: {policy}", f"{m['units']} ({m['fp32_units']} in fp32)",
                     fmt_bytes(m["bytes"]) if which == "minifsdp" else "not counted",
                     f"{m['seen']['weight']} / {m['seen']['input']} / {m['seen']['output']}",
                     f"{m['eval_loss']:.5f}", f"{max_abs_diff(m['params'], reference):.2e}"])
    same = max_abs_diff(res["minifsdp", POLICIES[2]]["params"], res["torch FSDP1", POLICIES[2]]["params"])
    text = (f"The default GPT ({CONFIG.n_layer} blocks, blocks as units), AdamW, {steps} steps, rank 0 of "
            f"{world_size}, CPU + gloo\n\n"
            + md_table(["FSDP: policy", "units", "bytes sent / step",
                        "first LayerNorm: weight / input / output", "loss after the steps, evaluated in fp32",
                        "max abs diff of the parameters from minifsdp's fp32 run"], rows)
            + f"\n\nminifsdp against torch's FSDP1, both with the LayerNorms in fp32: the parameters differ by at "
              f"most {same:.2e} after {steps} steps.")
    write_report(text, markdown)
    return res
