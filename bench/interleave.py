"""What the benches share: several (model, optimizer) pairs trained in the same ranks, step by step in turn.

Alternating step by step, with a barrier before each timed step, makes a slow moment of the machine hit
every contender alike; the ratios of their medians are then what a bench reports.
"""

import time

import torch.distributed as dist

from minifsdp import gpt_batch


def rank_batch(config, step: int, batch_per_rank: int):
    """This rank's share (every N-th sequence) of the global batch of `step`."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = gpt_batch(config, step, batch_per_rank * n)
    return x[rank::n], y[rank::n]


def time_interleaved(runs: dict, steps: int, config, batch_per_rank: int) -> dict[str, list[float]]:
    """Train each of `runs` (name -> (model, optimizer)) for `steps` steps, in turn; each step's seconds."""
    times = {name: [] for name in runs}
    for step in range(steps):
        x, y = rank_batch(config, step, batch_per_rank)
        for name, (model, opt) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            times[name].append(time.perf_counter() - t0)
    return times
