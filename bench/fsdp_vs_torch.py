"""minifsdp's FSDP next to torch's FSDP2 (fully_shard), FSDP1 and DDP: step time and peak memory, in one run.

    python bench/fsdp_vs_torch.py [--world-size 2] [--steps 8] [--warmup 2] [--layers 8] [--embd 448]

Every strategy trains the same model (the site's "bench GPT" of about 20M parameters with the defaults, one unit per
transformer Block for the sharded ones) on the same data with the same AdamW, in the same ranks (CPU +
gloo), alternating step by step with a barrier before each timed step, so a slow moment of the machine
hits all alike. The median step time leaves out the warm-up steps (the first also builds the optimizer
state and lets the FSDPs record their order / lazily initialise).

Memory is measured with minifsdp.MemoryMeter over one more, metered step each (forward, backward,
optimizer step; after the optimizer state exists, so the steady state is measured): it counts the bytes
of the tensor storages that are live on this rank -- the watched model's parameters (for the FSDPs:
this rank's shards) and gradients, the optimizer state, and every storage an op creates inside the
metered step (activations, gradients, temporaries, communication buffers), until it is freed. It re-reads
the size of every storage it knows on every op, so a buffer resized in place is seen -- if the meter
knows it. The FSDPs keep their unsharded-parameter buffers from step to step and only resize them
(0 bytes while sharded, full size while a unit computes), and those buffers were created before the
meter, so they are registered with `meter.watch(..., "params")`: minifsdp's `flat._full` of every unit,
torch FSDP1's `flat_param._full_param_padded` of every handle and torch FSDP2's `all_gather_outputs` of
every FSDPParam, and minifsdp fully_shard's (chapter 11) unsharded parameters. (Unregistered, they are still found through the views of them that ops produce, but
only once such an op runs, and counted as "other".) Buffers allocated anew every step (FSDP2's all-gather
and reduce-scatter staging buffers, say) are seen as they are created, as "other". The figure is tracked tensor bytes, not the process's RSS (no allocator overhead, no gloo
internals). As a plausibility check, every FSDP's peak must reach at least its sharded model states
(parameters, gradients and AdamW's two moments: 16Ψ/N bytes) plus one Block's full parameters, and DDP's
at least 16Ψ.

Reported (rank 0, Markdown): per strategy the median step time, the peak memory (rank 0, and every
rank's), both as ratios to torch FSDP2; then the largest difference of the final parameters of each FSDP
against torch DDP (the full state gathered on every rank).
"""

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import FullStateDictConfig, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from interleave import rank_batch, time_interleaved
from minifsdp import GPTConfig, MemoryMeter, ModuleWrapPolicy, TinyGPT, launch
from minifsdp.fsdp import BACKWARD_PRE, FullyShardedDataParallel
from minifsdp.fsdp2 import FSDPModule as MinifsdpFSDPModule
from minifsdp.fsdp2 import fully_shard as minifsdp_fully_shard
from minifsdp.models import Block
from minifsdp.train import max_abs_diff

ADAMW = dict(lr=1e-3, weight_decay=0.1)
LABELS = {"minifsdp": "minifsdp FSDP", "minifsdp_defaults": "minifsdp FSDP, defaults",
          "minifsdp_noprefetch": "minifsdp FSDP, no prefetch", "fully_shard": "minifsdp fully_shard",
          "fsdp2": "torch FSDP2 (fully_shard)", "fsdp1": "torch FSDP1", "ddp": "torch DDP"}
REFERENCE = "fsdp2"  # the ratios are to this one


def build(name, config):
    """The wrapped model, and the tensors that hold its unsharded parameters (resized in place)."""
    model = TinyGPT(config)  # the same seed everywhere: every strategy, every rank starts from the same weights
    if name in ("minifsdp", "minifsdp_noprefetch"):
        prefetch = name == "minifsdp"
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         reshard_after_forward=True, forward_prefetch=prefetch,
                                         backward_prefetch=BACKWARD_PRE if prefetch else None)
    elif name == "minifsdp_defaults":  # PyTorch FSDP1's defaults: BACKWARD_PRE, no forward prefetch
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    elif name in ("fsdp2", "fully_shard"):  # torch's fully_shard, or minifsdp's (chapter 11), the same way
        shard = fully_shard if name == "fsdp2" else minifsdp_fully_shard
        for block in model.blocks:
            shard(block)
        shard(model)
    elif name == "fsdp1":
        with warnings.catch_warnings():  # FSDP1 is deprecated in favour of fully_shard: we know
            warnings.simplefilter("ignore", FutureWarning)
            model = TorchFSDP(model, auto_wrap_policy=TorchModuleWrapPolicy({Block}),
                              sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"))
    elif name == "ddp":
        model = TorchDDP(model)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def unsharded_buffers(name, model):
    """The storages each FSDP keeps across steps for its full parameters, freed and refilled in place.
    They exist only after the first forward (FSDP1 and FSDP2 create them lazily)."""
    if name.startswith("minifsdp"):
        return [flat._full for unit in model.units() for flat in unit.flat_params]
    if name == "fully_shard":  # each parameter's unsharded tensor, one for good, its storage freed and refilled
        return [p.unsharded for m in model.modules() if isinstance(m, MinifsdpFSDPModule)
                for p in m._fsdp.group.params if p.unsharded is not None]
    if name == "fsdp1":
        return [m._handle.flat_param._full_param_padded for m in model.modules()
                if isinstance(m, TorchFSDP) and m._handle is not None]
    if name == "fsdp2":
        out = []
        for m in model.modules():
            group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
            if group is not None:
                out += [t for p in group.fsdp_params for t in p.all_gather_outputs]
        return out
    return []


def full_state(name, model):
    """The full (unsharded) parameters, by their names in the unwrapped model, on every rank."""
    if name.startswith("minifsdp"):
        return model.full_state_dict()
    if name == "ddp":
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    if name == "fsdp1":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            with TorchFSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                           FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
                return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def bench(names, steps, warmup, config, batch_per_rank):
    runs = {name: build(name, config) for name in names}
    times = time_interleaved(runs, warmup + steps, config, batch_per_rank)
    peaks, split = {}, {}
    x, y = rank_batch(config, warmup + steps, batch_per_rank)
    for name, (model, opt) in runs.items():  # one more step each, metered (the meter slows steps down)
        dist.barrier()
        meter = MemoryMeter(model.module if name == "ddp" else model, opt)
        meter.watch(unsharded_buffers(name, model), "params")
        with meter:
            model(x, y).backward()
            opt.step()
        meter.close()
        opt.zero_grad()
        peaks[name], split[name] = meter.peak, meter.peak_by_category
    states = {name: full_state(name, model) for name, (model, _) in runs.items()}
    return {"times": {name: statistics.median(t[warmup:]) for name, t in times.items()},
            "peaks": peaks, "split": split,
            "max_diff": {name: max_abs_diff(states[name], states["ddp"]) for name in names if name != "ddp"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="timed steps, after the warm-up ones")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=448)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="sequences of 128 tokens per rank")
    args = ap.parse_args()
    config = GPTConfig(vocab_size=256, block_size=128, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    n = args.world_size
    t0 = time.perf_counter()
    per_rank = launch(bench, n, args=(list(LABELS), args.steps, args.warmup, config, args.batch), device="cpu")
    wall = time.perf_counter() - t0
    r0 = per_rank[0]
    model = TinyGPT(config)
    psi = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters())
    print(f"{'bench GPT' if (args.layers, args.embd) == (8, 448) else 'GPT'} ({args.layers} layers, n_embd {args.embd}, {args.batch}x{config.block_size} tokens per rank), "
          f"Ψ = {psi:,}, AdamW, world size {n}, CPU + gloo, median of {args.steps} steps after {args.warmup} "
          f"warm-up, rank 0\n")
    ref_t, ref_m = r0["times"][REFERENCE], r0["peaks"][REFERENCE]
    print("| | median step | peak memory (rank 0) | peak per rank (0 / 1 / ...) | step time / FSDP2 "
          "| memory / FSDP2 |")
    print("|---|---|---|---|---|---|")
    for name, label in LABELS.items():
        t, m = r0["times"][name], r0["peaks"][name]
        print(f"| {label} | {1e3 * t:.0f} ms | {m / 1e6:.1f} MB | "
              + " / ".join(f"{r['peaks'][name] / 1e6:.1f}" for r in per_rank)
              + f" MB | {t / ref_t:.2f} | {m / ref_m:.2f} |")
    # plausibility: sharded model states (fp32 params, grads, 2 AdamW moments) + one Block's full parameters
    floor = {name: 16 * psi / n + 4 * block for name in LABELS}
    floor["ddp"] = 16 * psi
    low = [LABELS[name] for name in LABELS if min(r["peaks"][name] for r in per_rank) < floor[name]]
    print(f"\nplausibility (peak ≥ 16Ψ/N + one Block's full parameters = {floor[REFERENCE] / 1e6:.1f} MB, "
          f"DDP ≥ 16Ψ = {floor['ddp'] / 1e6:.1f} MB): " + ("every peak passes" if not low else
                                                            "TOO LOW: " + ", ".join(low)))
    print("peak split on rank 0 (params / grads / optim / other, MB): " + "; ".join(
        f"{LABELS[name]} " + " / ".join(f"{r0['split'][name][c] / 1e6:.1f}"
                                        for c in ("params", "grads", "optim", "other")) for name in LABELS))
    diffs = {name: max(r["max_diff"][name] for r in per_rank) for name in r0["max_diff"]}
    print(f"max |final parameter difference| vs torch DDP after {args.warmup + args.steps + 1} steps: "
          + ", ".join(f"{LABELS[name]} {d:.2e}" for name, d in diffs.items()))
    print(f"wall time of the run (all ranks, building included): {wall:.0f} s")


if __name__ == "__main__":
    main()
