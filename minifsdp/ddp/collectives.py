"""Chapter 1, first half: the collective data parallelism is made of, taken apart.

DDP averages gradients with one all-reduce; every later chapter uses its two halves separately.
Run the demonstration on 3 CPU ranks (both ways must give the same sum, for the same bytes):

    python -m minifsdp demo --world-size 3
"""

from __future__ import annotations

import torch

from minifsdp.distributed import comm


# --8<-- [start:all_reduce_by_parts]
def all_reduce_by_parts(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """An all-reduce (sum) built from its two halves: reduce-scatter, then
    all-gather.

    Each rank ends the reduce-scatter owning the sum of one 1/N chunk; the
    all-gather hands every rank every chunk. Each half sends (N-1)/N of the data
    per rank, so together 2(N-1)/N: exactly what a ring all-reduce costs. ZeRO
    is this observation put to work: stop after the first half and each rank
    holds the reduced gradients of just its own shard.
    """
    n = comm.world_size(group)
    flat = tensor.reshape(-1)
    # BEGIN EXERCISE 1.1: all-reduce = reduce-scatter + all-gather (padded)
    chunk = -(-flat.numel() // n)  # ceil: every rank's chunk the same size
    padded = torch.zeros(chunk * n, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    mine = torch.empty(chunk, dtype=flat.dtype, device=flat.device)
    comm.reduce_scatter(mine, padded, group=group)
    comm.all_gather(padded, mine, group=group)
    result = padded[: flat.numel()]
    # END EXERCISE
    return result.view_as(tensor)
# --8<-- [end:all_reduce_by_parts]


def demo_all_reduce_by_parts() -> dict:
    """Each rank contributes (rank+1) * [1, 2, ..., 7]; both ways must give the same sum."""
    x = (comm.rank() + 1) * torch.arange(1.0, 8.0)
    expected = x.clone()
    with comm.counting() as direct:
        comm.all_reduce(expected)
    with comm.counting() as parts:
        result = all_reduce_by_parts(x)
    return {"rank": comm.rank(), "all_reduce": expected.tolist(), "by_parts": result.tolist(),
            "bytes_all_reduce": direct.total(), "bytes_by_parts": dict(parts.bytes)}
