"""Chapter 11's measurements: the FlatParameter FSDP, minifsdp's fully_shard and torch's, side by side; and
HSDP's bytes within and across its groups.

    python -m minifsdp fsdp2 --world-sizes 2 4 --markdown chapters/generated/fsdp2.md

Each contender trains the same GPT (4 blocks, one unit or fully_shard per block and the root, AdamW,
global batch 12) in the same ranks, step by step in turn (a slow moment of the machine hits all alike),
from the same weights; torch's DDP runs beside them as the reference. Reported per contender: the largest
difference of the final parameters from DDP's, the peak per rank of the last step (minifsdp.MemoryMeter,
each design's unsharded-parameter buffers watched), the bytes each rank sends per step (minifsdp's
counter; torch's collectives do not pass through it, and its layout is minifsdp fully_shard's, so its
bytes are those), and the median step time as a ratio to torch's fully_shard.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.measure.meter import MemoryMeter
from minifsdp.models import Block, GPTConfig, TinyGPT
from minifsdp.reports.format import fmt_bytes, write_report
from minifsdp.state_dict import get_full_state_dict
from minifsdp.train import OPTIMIZERS, batch, loss_of, max_abs_diff

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
STEPS = 12  # the first is left out of the times; the last is metered
CONTENDERS = ("torch DDP", "FlatParameter FSDP", "minifsdp fully_shard", "torch fully_shard")


def _build(name: str):
    model = TinyGPT(CONFIG, seed=0)
    if name == "torch DDP":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif name == "FlatParameter FSDP":
        from minifsdp.fsdp import FullyShardedDataParallel, ModuleWrapPolicy
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    else:
        if name == "torch fully_shard":
            from torch.distributed.fsdp import fully_shard
        else:
            from minifsdp.fsdp2 import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model, OPTIMIZERS["adamw"](model.parameters())


def _unsharded(name: str, model) -> list[torch.Tensor]:
    """The storages each design keeps for its full parameters, resized in place (watched as parameters)."""
    if name == "FlatParameter FSDP":
        return [flat._full for unit in model.units() for flat in unit.flat_params]
    if name == "minifsdp fully_shard":
        return [p.unsharded for m in model.modules() if hasattr(m, "_fsdp")
                for p in m._fsdp.group.params if p.unsharded is not None]
    if name == "torch fully_shard":
        from torch.distributed.fsdp import FSDPModule
        out = []
        for m in model.modules():
            group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
            out += [t for p in group.fsdp_params for t in p.all_gather_outputs] if group is not None else []
        return out
    return []


def measure() -> dict:
    r, n = dist.get_rank(), dist.get_world_size()
    runs = {name: _build(name) for name in CONTENDERS}
    times = {name: [] for name in CONTENDERS}
    out = {name: {} for name in CONTENDERS}
    for step in range(STEPS):
        tensors = batch("gpt", step, 12, r, n, "cpu", CONFIG)
        for name, (model, opt) in runs.items():
            last = step == STEPS - 1
            meter = MemoryMeter(model.module if name == "torch DDP" else model, opt) if last else None
            if meter is not None:
                meter.watch(_unsharded(name, model), "params")
            dist.barrier()
            t0 = time.perf_counter()
            with comm.counting() as counter, (meter if meter is not None else contextlib.nullcontext()):
                loss_of("gpt", model, tensors).backward()
                opt.step()
                opt.zero_grad()
            if step > 0 and not last:
                times[name].append(time.perf_counter() - t0)
            if last:
                meter.close()
                out[name] |= {"peak": meter.peak, "bytes": sum(counter.bytes.values())}
    for name, (model, _) in runs.items():
        full = get_full_state_dict(model)
        out[name]["time"] = statistics.median(times[name])
        out[name]["params"] = full
    ref = out["torch DDP"]["params"]
    for name in CONTENDERS:
        out[name]["diff"] = max_abs_diff(out[name].pop("params"), ref)
    return out


def hsdp_bytes() -> dict:
    """One step of HSDP on a (2, 2) mesh: the bytes each group sent, and the ring model's figures."""
    from minifsdp.distributed.mesh import init_mesh
    from minifsdp.fsdp2 import fully_shard

    r, n = dist.get_rank(), dist.get_world_size()
    mesh = init_mesh((2, 2), ("replicate", "shard"))
    model = TinyGPT(CONFIG, seed=0)
    groups = [fully_shard(b, mesh=mesh) for b in model.blocks] + [fully_shard(model, mesh=mesh)]
    with comm.counting() as counter:
        loss_of("gpt", model, batch("gpt", 0, 12, r, n, "cpu", CONFIG)).backward()
    theory = {"shard": {"all_gather": 0.0, "reduce_scatter": 0.0}, "replicate": {"all_reduce": 0.0}}
    for g in groups:
        size = g._fsdp.group.world_size
        full = 4 * size * sum(p.padded_numel for p in g._fsdp.group.params)  # the group's padded fp32 bytes
        theory["shard"]["all_gather"] += (1 if g is model else 2) * comm.ring_bytes("all_gather", full, size)
        theory["shard"]["reduce_scatter"] += comm.ring_bytes("reduce_scatter", full, size)
        theory["replicate"]["all_reduce"] += comm.ring_bytes("all_reduce", full // size, 2)
    return {"counted": {g: dict(k) for g, k in counter.by_group.items()}, "theory": theory}


def run_fsdp2_report(world_sizes=(2, 4), markdown: str | None = None) -> None:
    psi = sum(p.numel() for p in TinyGPT(CONFIG, seed=0).parameters())
    rows = []
    for n in world_sizes:
        res = launch(measure, world_size=n, device="cpu")
        ref_time = res[0]["torch fully_shard"]["time"]
        for name in CONTENDERS:
            peak = max(r[name]["peak"] for r in res)
            sent = res[0][name]["bytes"] if name != "torch fully_shard" else res[0]["minifsdp fully_shard"]["bytes"]
            note = " (minifsdp fully_shard's layout)" if name == "torch fully_shard" else ""
            counted = "not counted" if name == "torch DDP" else f"{fmt_bytes(sent)}{note}"
            rows.append(f"| {n} | {name} | {max(r[name]['diff'] for r in res):.1e} | {fmt_bytes(peak)} | "
                        f"{counted} | {res[0][name]['time'] / ref_time:.2f} |")
    text = (f"GPT of {CONFIG.n_layer} blocks × {CONFIG.n_embd} (Ψ = {psi:,}), AdamW, global batch 12, CPU + gloo; "
            f"{STEPS} steps, the contenders in turn, step by step; peak: the largest rank's, last step; step "
            f"time: rank 0's median of steps 2 to {STEPS - 1}, as a ratio to torch's fully_shard\n\n"
            "| N | contender | max diff vs torch DDP | peak per rank | bytes sent per rank and step | step time |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    if 4 in world_sizes:
        h = launch(hsdp_bytes, world_size=4, device="cpu")[0]
        lines = [f"| {group} | {kind} | {fmt_bytes(h['counted'].get(group, {}).get(kind, 0))} | "
                 f"{fmt_bytes(value)} |" for group, kinds in h["theory"].items() for kind, value in kinds.items()]
        text += ("\n**HSDP** on a (2, 2) mesh (replicate, shard), one forward and backward, rank 0: bytes sent "
                 "in each group, counted and by the ring model\n\n| group | collective | counted | ring model |\n"
                 "|---|---|---|---|\n" + "\n".join(lines) + "\n")
    write_report(text, markdown)
