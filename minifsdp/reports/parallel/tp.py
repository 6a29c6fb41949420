"""Chapter 12's report, tensor parallelism (`python -m minifsdp parallel --parts tp`): TinyGPT over a
tensor-parallel group of t = 1, 2, 4 ranks (one launch per t; the model and batch of the tensor-parallel tests), with
and without sequence parallelism: each rank's parameter bytes (MemoryMeter) against 4 (Psi_split / t +
Psi_replicated); the bytes one training step sends on the group, counted, against the formulas of
tests/test_ch12_tensor_parallel.py; the bytes forward saves for backward (torch.autograd.graph.saved_tensors_hooks),
in the LayerNorm region -- what sequence parallelism divides by t -- and elsewhere.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.measure.meter import MemoryMeter
from minifsdp.models import GPTConfig, TinyGPT, gpt_batch
from minifsdp.parallel import TensorParallelGPT
from minifsdp.reports.format import md_table

# the tensor-parallel tests' model and batch (tests/test_ch12_tensor_parallel.py)
TP_CONFIG = GPTConfig(n_head=4, n_embd=32, vocab_size=96, n_layer=2, block_size=16)
TP_BATCH = 4


def _is_replicated(name: str) -> bool:
    """TinyGPT's parameters that tensor parallelism keeps whole on every rank (the others are split over t)."""
    return name.startswith(("wpe", "ln_f")) or ".ln_" in name or name.endswith(("proj.bias", "fc_proj.bias"))


def split_and_replicated(config: GPTConfig) -> tuple[int, int]:
    """(Psi_split, Psi_replicated) of the whole TinyGPT, the tied embedding counted once."""
    named = dict(TinyGPT(config, seed=0).named_parameters())  # (a tied weight is listed once)
    replicated = sum(p.numel() for k, p in named.items() if _is_replicated(k))
    return sum(p.numel() for p in named.values()) - replicated, replicated


def named_group(name: str):
    """Every rank, as a group of its own counted under `name` (the world group itself is counted as "world")."""
    group = dist.new_group(list(range(dist.get_world_size())))
    comm.name_group(group, name)
    return group


def tp_step_bytes_formula(config: GPTConfig, b: int, t: int, sequence_parallel: bool) -> dict[str, float]:
    """Bytes one rank sends on the tensor-parallel group in one training step (the derivation is in
    tests/test_ch12_tensor_parallel.py): S = b s h 4 bytes of activation, P = b s 4 (a number per token),
    G = (6L + 2) h 4 (the sequence-parallel parameters' gradients), rho = (t - 1)/t."""
    if t == 1:
        return {}
    rho, L = (t - 1) / t, config.n_layer
    S, P = b * config.block_size * config.n_embd * 4, b * config.block_size * 4
    if not sequence_parallel:
        return {"all_reduce": 2 * rho * (S * (4 * L + 2) + 3 * P)}
    G = (6 * L + 2) * config.n_embd * 4
    return {"all_reduce": 2 * rho * (S + 3 * P + G), "all_gather": rho * S * (6 * L + 3),
            "reduce_scatter": rho * S * (4 * L + 1)}


def ln_region_formula(config: GPTConfig, b: int) -> int:
    """Bytes the LayerNorm region saves without sequence parallelism: per block ln_1's and ln_2's inputs, means
    and rstds, qkv's and fc's inputs; then ln_f's and the lm head's. Sequence parallelism divides it by t."""
    S, per_token = b * config.block_size * config.n_embd * 4, b * config.block_size * 4
    return config.n_layer * (4 * S + 4 * per_token) + (2 * S + 2 * per_token)


def is_sp_region(name: str) -> bool:
    """The modules that run on token shards under sequence parallelism, and the column layers that save their
    inputs (the LayerNorms' outputs)."""
    return name.split(".")[-1] in ("ln_1", "ln_2", "ln_f", "qkv", "fc", "lm_head")


def saved_for_backward(model: TensorParallelGPT, x, y) -> dict[str, int]:
    """Bytes one forward saves for backward, by the module that saved them (each storage once, parameters left
    out; the lm head, a method, counted as a module of its own)."""
    stack, hooks = [""], []

    def leave(module, args, output):
        stack.pop()  # (and return None: a forward hook's result would replace the output)

    for name, m in model.named_modules():
        hooks.append(m.register_forward_pre_hook(lambda m, args, name=name: stack.append(name)))
        hooks.append(m.register_forward_hook(leave))
    lm_logits = model.lm_logits

    def lm_head(h):
        stack.append("lm_head")
        try:
            return lm_logits(h)
        finally:
            stack.pop()

    model.lm_logits = lm_head
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), (stack[-1], storage.nbytes()))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x, y)
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
        del model.lm_logits  # the method again
    out = defaultdict(int)
    for name, nbytes in saved.values():
        out[name] += nbytes
    return dict(out)


def tp_measure(config: GPTConfig = TP_CONFIG, b: int = TP_BATCH) -> dict:
    """On each rank of a tensor-parallel group of every rank: parameter bytes, bytes per step, saved bytes."""
    group = named_group("tp")
    model = TensorParallelGPT.from_gpt(TinyGPT(config, seed=0), group=group)
    meter = MemoryMeter(model)
    out = {"t": comm.world_size(group), "param_bytes": meter.live()["params"]}
    meter.close()
    x, y = gpt_batch(config, 0, b)
    for sp in (False, True):
        model = TensorParallelGPT.from_gpt(TinyGPT(config, seed=0), group=group, sequence_parallel=sp)
        with comm.counting() as counter:
            model(x, y).backward()
            model.allreduce_sequence_parallel_grads()
        out[("bytes", sp)] = {g: dict(kinds) for g, kinds in counter.by_group.items()}
        model.zero_grad()
        saved = saved_for_backward(model, x, y)
        out[("saved", sp)] = sum(saved.values())
        out[("ln_region", sp)] = sum(v for k, v in saved.items() if is_sp_region(k))
    return out


def tp_results(world_sizes=(1, 2, 4), config: GPTConfig = TP_CONFIG, b: int = TP_BATCH) -> list[dict]:
    """A row per t: what the ranks measured (the largest over ranks) and the formulas."""
    split, replicated = split_and_replicated(config)
    rows = []
    for t in world_sizes:
        res = launch(tp_measure, world_size=t, kwargs=dict(config=config, b=b), device="cpu")
        row = {"t": t, "param_bytes": max(r["param_bytes"] for r in res),
               "param_theory": 4 * (split // t + replicated), "ln_region_theory": ln_region_formula(config, b)}
        for sp in (False, True):
            row[("bytes", sp)] = max(sum(r[("bytes", sp)].get("tp", {}).values()) for r in res)
            row[("bytes_off_tp", sp)] = max(sum(sum(k.values()) for g, k in r[("bytes", sp)].items() if g != "tp")
                                            for r in res)
            row[("bytes_theory", sp)] = sum(tp_step_bytes_formula(config, b, t, sp).values())
            row[("saved", sp)] = max(r[("saved", sp)] for r in res)
            row[("ln_region", sp)] = max(r[("ln_region", sp)] for r in res)
        rows.append(row)
    return rows


def tp_table(rows: list[dict], config: GPTConfig = TP_CONFIG, b: int = TP_BATCH) -> str:
    """Four short tables, each with the measured next to its formula (nine columns in one would scroll sideways
    in the docs' column, md_table)."""
    split, replicated = split_and_replicated(config)
    head = (f"**Tensor parallelism**, TinyGPT ({config.n_layer} blocks, h = {config.n_embd}, {config.n_head} heads, "
            f"vocabulary {config.vocab_size}; Ψ_split = {split:,}, Ψ_replicated = {replicated:,}), b = {b}, "
            f"s = {config.block_size}, fp32; per rank, the largest over the t ranks.")
    params = md_table(["t", "parameter bytes", "4·(Ψ_split/t + Ψ_replicated)"],
                      [[r["t"], f"{r['param_bytes']:,}", f"{r['param_theory']:,}"] for r in rows],
                      caption="Parameter bytes per rank")
    step = md_table(["t", "TP", "formula", "TP + SP", "formula"],
                    [[r["t"], *(f"{r[(k, sp)]:,.0f}" for sp in (False, True) for k in ("bytes", "bytes_theory"))]
                     for r in rows],
                    caption="Bytes per training step on the tp group, counted and by the formula")
    region = md_table(["t", "TP", "TP + SP", "ratio", "formula: region / t"],
                      [[r["t"], f"{r[('ln_region', False)]:,}", f"{r[('ln_region', True)]:,}",
                        f"1/{r[('ln_region', False)] / r[('ln_region', True)]:.3g}",
                        f"{r['ln_region_theory'] // r['t']:,}"] for r in rows],
                      caption="Activations saved for backward by one forward, bytes per rank, in the LayerNorm "
                              "region (ln_1, ln_2, ln_f and the column layers that keep their outputs)")
    rest = md_table(["t", "elsewhere, TP", "TP + SP", "all saved, TP", "TP + SP"],
                    [[r["t"], f"{r[('saved', False)] - r[('ln_region', False)]:,}",
                      f"{r[('saved', True)] - r[('ln_region', True)]:,}", f"{r[('saved', False)]:,}",
                      f"{r[('saved', True)]:,}"] for r in rows],
                    caption="… elsewhere, and in all, without and with sequence parallelism")
    return "\n\n".join([head, params, step, region, rest]) + "\n"

