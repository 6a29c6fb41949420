"""minifsdp's DDP next to torch's DDP: step time and peak memory, measured side by side in one run.

    python bench/ddp_vs_torch.py [--world-size 2] [--steps 20] [--layers 4] [--embd 128]

Both run in the same ranks, alternating step by step (so a slow moment of the machine hits both alike),
on the same model, data and optimizer. Reports the median step time of each and the ratio ours / torch.
"""

import argparse
import statistics

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from interleave import rank_batch, time_interleaved
from minifsdp import DistributedDataParallel, GPTConfig, MemoryMeter, TinyGPT, launch


def bench(steps, config, batch_per_rank):
    runs = {}
    for name, wrap in (("minifsdp", DistributedDataParallel), ("torch", TorchDDP)):
        model = wrap(TinyGPT(config))
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    times = time_interleaved(runs, steps, config, batch_per_rank)
    x, y = rank_batch(config, steps - 1, batch_per_rank)
    peaks = {}
    for name, (model, opt) in runs.items():  # one more step each, metered (the meter slows steps down)
        meter = MemoryMeter(model.module, opt)
        with meter:
            model(x, y).backward()
            opt.step()
        peaks[name] = meter.peak
        opt.zero_grad()
    return {name: statistics.median(t[2:]) for name, t in times.items()}, peaks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    args = ap.parse_args()
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=args.layers, n_head=4, n_embd=args.embd)
    times, peaks = launch(bench, args.world_size, args=(args.steps, config, 4), device="cpu")[0]
    psi = sum(p.numel() for p in TinyGPT(config).parameters())
    print(f"tiny GPT, Ψ = {psi:,}, world size {args.world_size}, CPU + gloo, {args.steps} steps, rank 0")
    print("| | median step | peak memory (tracked) |\n|---|---|---|")
    for name in times:
        print(f"| {name} DDP | {1e3 * times[name]:.1f} ms | {peaks[name] / 1e6:.2f} MB |")
    print(f"| ratio minifsdp / torch | {times['minifsdp'] / times['torch']:.2f} | "
          f"{peaks['minifsdp'] / peaks['torch']:.2f} |")


if __name__ == "__main__":
    main()
