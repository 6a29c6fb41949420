"""Chapter 9's measurements: what accumulation, activation checkpointing and deferred init cost per rank.

    python -m minifsdp options --world-size 2 --markdown chapters/generated/training_options.md

Every row is measured on rank 0 of a GPT with four blocks (blocks as FSDP units, reshard after
forward), with the meter and the byte counter of chapter 2, next to what the model of the row predicts.
"""

from __future__ import annotations

import contextlib

import torch

from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.fsdp import FullyShardedDataParallel, ModuleWrapPolicy
from minifsdp.fsdp.checkpointing import checkpoint_module
from minifsdp.measure.meter import MemoryMeter
from minifsdp.models import Block, GPTConfig, TinyGPT, init_weights
from minifsdp.reports.format import fmt_bytes, write_report
from minifsdp.train import OPTIMIZERS, batch, loss_of

CONFIG = GPTConfig(n_layer=4)
MICRO = 3


def _fsdp(net, **kw):
    return FullyShardedDataParallel(net, auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)


def _padded_bytes(model) -> int:
    return sum(4 * f.shard_numel * comm.world_size() for u in model.units() for f in u.flat_params)


def accumulation() -> dict:
    """One optimizer step of MICRO micro-batches: bytes sent, and the gradients held between micro-batches."""
    n, r = comm.world_size(), comm.rank()
    out = {}
    for quiet in (False, True):
        model = _fsdp(TinyGPT(CONFIG))
        with comm.counting() as sent:
            for m in range(MICRO):
                with model.no_sync() if quiet and m < MICRO - 1 else contextlib.nullcontext():
                    (loss_of("gpt", model, batch("gpt", m, 12, r, n, "cpu", CONFIG)) / MICRO).backward()
                if m == 0:  # counted from the tensors themselves: the meter could also see a full gradient
                    # that gloo releases a moment after its reduce-scatter is waited on
                    between = sum(4 * t.numel() for u in model.units() for f in u.flat_params
                                  for t in (f.param.grad, f.unsharded_grad) if t is not None)
        out[quiet] = {"bytes": sent.total(), "between": between, "padded": _padded_bytes(model)}
    return out


def checkpointing() -> dict:
    """Per order: bytes sent and all-gathers in a step, live bytes after forward, and the step's peak."""
    n, r = comm.world_size(), comm.rank()
    out = {}
    for order, reentrant in (("none", False), ("FSDP(checkpoint(block))", False), ("checkpoint(FSDP(block))", False),
                             ("checkpoint(FSDP(block)), reentrant", True)):
        net = TinyGPT(CONFIG)
        if order.startswith("FSDP("):
            for block in net.blocks:
                checkpoint_module(block)
        model = _fsdp(net)
        if order.startswith("checkpoint("):
            for unit in model.units()[1:]:
                checkpoint_module(unit, use_reentrant=reentrant)
        opt = OPTIMIZERS["adamw"](model.parameters())
        meter = MemoryMeter(model, opt)
        for step in range(2):
            with meter if step == 1 else contextlib.nullcontext(), comm.counting() as sent:
                meter.reset_peak()
                base = meter.live()["total"]
                loss = loss_of("gpt", model, batch("gpt", step, 12, r, n, "cpu", CONFIG))
                kept = meter.live()["total"] - base
                loss.backward()
                opt.step()
                opt.zero_grad()
        meter.close()
        out[order] = {"bytes": sent.total(), "all_gathers": sent.calls["all_gather"], "kept": kept, "peak": meter.peak}
    return out


def deferred_init() -> dict:
    """Peak bytes while FSDP builds the model: from full weights, or from the meta device."""
    out = {}
    for how in ("eager", "deferred"):
        if how == "deferred":  # outside the meter: it counts meta tensors as the bytes they stand for
            with torch.device("meta"):
                net = TinyGPT(CONFIG)
        meter = MemoryMeter()
        with meter:  # the eager model's weights are made inside
            if how == "eager":
                model = _fsdp(TinyGPT(CONFIG))
            else:
                model = _fsdp(net, param_init_fn=init_weights)
        out[how] = {"peak": meter.peak, "padded": _padded_bytes(model),
                    "unit": max(4 * f.shard_numel * comm.world_size() for u in model.units() for f in u.flat_params)}
    return out


def measure() -> dict:
    return {"accumulation": accumulation(), "checkpointing": checkpointing(), "deferred": deferred_init()}


def run_options_report(world_size: int = 2, markdown: str | None = None) -> dict:
    res = launch(measure, world_size, device="cpu")[0]
    n, psi = world_size, sum(p.numel() for p in TinyGPT(CONFIG).parameters())
    acc, ck, de = res["accumulation"], res["checkpointing"], res["deferred"]
    lines = [f"Rank 0 of {n}, GPT with {CONFIG.n_layer} blocks (Ψ = {psi:,}), AdamW, blocks as FSDP units, CPU\n",
             f"**Gradient accumulation**, {MICRO} micro-batches per optimizer step\n",
             "| | bytes sent per optimizer step | gradients held after the first micro-batch's backward | model |",
             "|---|---|---|---|"]
    for quiet, label in ((False, "reduce-scatter every micro-batch"), (True, "no_sync() until the last")):
        model = acc[quiet]["padded"] if quiet else acc[quiet]["padded"] / n
        what = "4Ψ: every unit's full gradient" if quiet else "4Ψ/N: the gradient shards"
        lines.append(f"| {label} | {fmt_bytes(acc[quiet]['bytes'])} | {fmt_bytes(acc[quiet]['between'])} "
                     f"| {fmt_bytes(model)} ({what}) |")
    lines += ["", "**Activation checkpointing**, one step\n",
              "| | all-gathers | bytes sent | alive after forward (activations) | peak of the step |",
              "|---|---|---|---|---|"]
    for order, m in ck.items():
        lines.append(f"| {order} | {m['all_gathers']} | {fmt_bytes(m['bytes'])} | {fmt_bytes(m['kept'])} "
                     f"| {fmt_bytes(m['peak'])} |")
    lines += ["", "**Deferred initialisation**, while FSDP builds the model\n",
              "| | peak | model |", "|---|---|---|"]
    lines.append(f"| from full weights | {fmt_bytes(de['eager']['peak'])} | the whole model first, 4Ψ = "
                 f"{fmt_bytes(4 * psi)}, then each unit's flat copy on top |")
    lines.append(f"| on the meta device | {fmt_bytes(de['deferred']['peak'])} | at most the shards + one unit twice "
                 f"(its parameters and its flat copy): ≤ {fmt_bytes(de['deferred']['padded'] / n + 2 * de['deferred']['unit'])} |")
    text = "\n".join(lines)
    write_report(text, markdown)
    return res
