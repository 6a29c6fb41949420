"""Chapter 9's measurement: gradient accumulation under each sharding strategy, per micro-batch.

    python -m minifsdp accumulation --world-size 2 --markdown chapters/generated/accumulation.md

One optimizer step of MICRO micro-batches of the GPT with four blocks, blocks as units, under FULL_SHARD (RAF),
SHARD_GRAD_OP (NRAF) and NO_SHARD, each reducing every micro-batch or inside no_sync() until the last. Per row:
the bytes each micro-batch sends (comm's counter), the bytes alive between two micro-batches and the peak of a
micro-batch (the meter), on rank 0. Torch's FSDP1 under SHARD_GRAD_OP with no_sync() is measured beside them
(its collectives do not pass through comm, so its all-gathers are counted where it calls torch.distributed).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.fsdp import FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy
from minifsdp.measure.meter import MemoryMeter
from minifsdp.models import Block, GPTConfig, TinyGPT
from minifsdp.reports.format import fmt_bytes, md_table, write_report
from minifsdp.train import OPTIMIZERS, batch, loss_of

CONFIG = GPTConfig(n_layer=4)
MICRO = 3
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


@contextlib.contextmanager
def _torch_all_gathers():
    """Count the all-gathers torch's FSDP1 issues, at the torch.distributed functions it calls."""
    calls = []
    # (on CPU tensors FSDP1 calls dist.all_gather with a list of chunks; on GPUs, the single-tensor form)
    # (every tensor all-gather torch.distributed has, under every spelling this torch knows)
    names = [n for n in dir(dist) if n.startswith("all_gather") and "object" not in n and callable(getattr(dist, n))]
    saved = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, lambda *a, _f=saved[n], **k: calls.append(1) or _f(*a, **k))
    try:
        yield calls
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def _steps(model, quiet: bool, counted) -> dict:
    """One optimizer step's micro-batches (the second step: the first records the order); per micro-batch, the
    bytes (or all-gathers) it sent, what is alive after its backward, and its peak."""
    n, r = comm.world_size(), comm.rank()
    opt = OPTIMIZERS["adamw"](model.parameters())
    meter = MemoryMeter(model, opt)
    out = {}
    for step in range(2):
        sent, held, peaks = [], [], []
        with meter if step == 1 else contextlib.nullcontext():
            for m in range(MICRO):
                meter.reset_peak()
                with model.no_sync() if quiet and m < MICRO - 1 else contextlib.nullcontext(), counted() as c:
                    (loss_of("gpt", model, batch("gpt", 10 * step + m, 12, r, n, "cpu", CONFIG)) / MICRO).backward()
                sent.append(c.total() if hasattr(c, "total") else len(c))
                held.append(meter.live()["total"])
                peaks.append(meter.peak)
            opt.step()
            opt.zero_grad()
        out = {"sent": sent, "held": held, "peak": max(peaks)}
    meter.close()
    return out


# --8<-- [start:measure]
def accumulation_by_strategy() -> dict:
    """Per (strategy, no_sync or not): bytes per micro-batch, bytes alive between micro-batches, the peak."""
    out = {}
    for strategy in STRATEGIES:
        for quiet in (False, True):
            model = FullyShardedDataParallel(TinyGPT(CONFIG), auto_wrap_policy=ModuleWrapPolicy({Block}),
                                             sharding_strategy=ShardingStrategy[strategy])
            out[strategy, quiet] = _steps(model, quiet, comm.counting)
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    torch_model = TorchFSDP(TinyGPT(CONFIG), auto_wrap_policy=TorchModuleWrapPolicy({Block}),
                            sharding_strategy=TorchShardingStrategy.SHARD_GRAD_OP, device_id=torch.device("cpu"))
    out["torch FSDP1 SHARD_GRAD_OP", True] = _steps(torch_model, True, _torch_all_gathers)
    return out
# --8<-- [end:measure]


def run_accumulation_report(world_size: int = 2, markdown: str | None = None) -> dict:
    res = launch(accumulation_by_strategy, world_size, device="cpu")[0]
    psi = sum(p.numel() for p in TinyGPT(CONFIG).parameters())
    rows = []
    for (strategy, quiet), m in res.items():
        if strategy.startswith("torch"):
            sent = " / ".join(str(c) for c in m["sent"]) + " all-gathers"
        else:
            sent = " / ".join(fmt_bytes(b) for b in m["sent"])
        rows.append([strategy, "no_sync() until the last" if quiet else "reduce every micro-batch", sent,
                     fmt_bytes(m["held"][0]), fmt_bytes(m["peak"])])
    text = (f"Rank 0 of {world_size}, GPT with {CONFIG.n_layer} blocks (Ψ = {psi:,}; 4Ψ = {fmt_bytes(4 * psi)}), "
            f"blocks as units, AdamW, {MICRO} micro-batches per optimizer step, CPU, the second step\n\n"
            + md_table(["sharding_strategy", "accumulation", "sent by micro-batch 1 / 2 / 3",
                        "alive after micro-batch 1", "peak of a micro-batch"], rows))
    write_report(text, markdown)
    return res
