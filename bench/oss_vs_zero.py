"""minifsdp's OSS next to torch's ZeroRedundancyOptimizer: step time, memory and optimizer state, in one run.

    python bench/oss_vs_zero.py [--world-size 2] [--steps 20] [--layers 4] [--embd 192]

Both shard AdamW's state across the ranks (ZeRO-1), and both run under torch's own DDP, so the sharded
optimizer is the only difference. They train the same model (a tiny GPT of about 1.8M parameters with the
defaults, large enough that a step is not all overhead) on the same data, in the same ranks, alternating
step by step, so a slow moment of the machine hits both alike. Reported (rank 0, Markdown): the median
step time, the tracked peak memory of one more, metered step each, the optimizer state every rank holds,
the ratios minifsdp / torch, and the largest difference between the two final models.
"""

import argparse
import statistics

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from interleave import rank_batch, time_interleaved
from minifsdp import OSS, GPTConfig, MemoryMeter, TinyGPT, launch
from minifsdp.measure.meter import optimizer_tensors
from minifsdp.train import max_abs_diff

ADAMW = dict(lr=1e-3, weight_decay=0.1)


def sharded_optimizer(name, params):
    if name == "minifsdp":
        return OSS(params, optim=torch.optim.AdamW, **ADAMW)
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **ADAMW)


def bench(steps, config, batch_per_rank):
    runs = {}
    for name in ("minifsdp", "torch"):
        model = TorchDDP(TinyGPT(config))  # the same seed: both start from the same weights
        runs[name] = (model, sharded_optimizer(name, model.parameters()))
    times = time_interleaved(runs, steps, config, batch_per_rank)
    x, y = rank_batch(config, steps - 1, batch_per_rank)
    peaks, state = {}, {}
    for name, (model, opt) in runs.items():  # one more step each, metered (the meter slows steps down)
        # Both keep the optimizer over this rank's share as `.optim`: the state this rank really holds.
        meter = MemoryMeter(model.module, opt.optim)
        with meter:
            model(x, y).backward()
            opt.step()
        meter.close()
        peaks[name] = meter.peak
        opt.zero_grad()
        state[name] = sum(t.numel() * t.element_size() for t in optimizer_tensors(opt.optim))
    params = {name: {k: v.detach().clone() for k, v in model.module.state_dict().items()}
              for name, (model, _) in runs.items()}
    medians = {name: statistics.median(t[2:] or t) for name, t in times.items()}
    return {"times": medians, "peaks": peaks, "state": state,
            "max_diff": max_abs_diff(params["minifsdp"], params["torch"])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=192)
    args = ap.parse_args()
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=args.layers, n_head=4, n_embd=args.embd)
    per_rank = launch(bench, args.world_size, args=(args.steps, config, 4), device="cpu")
    r0 = per_rank[0]
    psi = sum(p.numel() for p in TinyGPT(config).parameters())
    print(f"tiny GPT ({args.layers} layers, n_embd {args.embd}), Ψ = {psi:,}, AdamW under torch DDP, "
          f"world size {args.world_size}, CPU + gloo, {args.steps} steps, rank 0\n")
    names = {"minifsdp": "minifsdp OSS", "torch": "torch ZeroRedundancyOptimizer"}
    print("| | median step | peak memory (tracked) | optimizer state per rank (rank 0 / 1 / ...) |")
    print("|---|---|---|---|")
    state = {name: [r["state"][name] for r in per_rank] for name in names}
    for name, label in names.items():
        print(f"| {label} | {1e3 * r0['times'][name]:.1f} ms | {r0['peaks'][name] / 1e6:.2f} MB | "
              + " / ".join(f"{b / 1e6:.2f} MB" for b in state[name]) + " |")
    print(f"| ratio minifsdp / torch | {r0['times']['minifsdp'] / r0['times']['torch']:.2f} "
          f"| {r0['peaks']['minifsdp'] / r0['peaks']['torch']:.2f} "
          f"| {max(state['minifsdp']) / max(state['torch']):.2f} (largest rank) |")
    diffs = [r["max_diff"] for r in per_rank]
    print(f"\nmax |param difference| minifsdp vs torch after {args.steps + 1} steps: {max(diffs)} "
          f"({'the same parameters' if max(diffs) == 0.0 else 'they differ'})")


if __name__ == "__main__":
    main()
