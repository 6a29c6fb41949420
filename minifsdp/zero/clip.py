"""Chapter 9: clipping the gradient norm when every rank holds only a slice of the gradients.

torch.nn.utils.clip_grad_norm_ scales all gradients by max_norm / ||g|| when the norm of the whole
model's gradient g exceeds max_norm. Under ZeRO-2 and ZeRO-3 no rank has g: each holds a disjoint slice
(its owned parameters, or its shard of every flat parameter, whose padding is zero). The norm still
follows, because a p-norm is a sum over elements:

    ||g||_p = (sum over ranks of the rank's sum |g_i|^p) ^ (1/p)       ||g||_inf = max over ranks

so each rank computes a partial sum, one all-reduce of one number adds them up, and every rank scales
its own slice by the same coefficient.
"""

from __future__ import annotations

import torch

from minifsdp.distributed import comm
from minifsdp.distributed.launch import current_device


# --8<-- [start:clip]
@torch.no_grad()
def clip_sharded_grad_norm_(
        grads: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
        group=None, scaled: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Clip gradients sliced disjointly across ranks as if they were one;
    returns the total norm (before).
    scaled: the gradients to scale, if not `grads` themselves (FairScale's
    filter_params_fn counts only some gradients in the norm, and scales them
    all)."""
    p = float(norm_type)
    # where the collective runs (NCCL: this rank's GPU), wherever the grads live
    device = current_device()
    # BEGIN EXERCISE 9.2: the whole gradient's norm from partial sums (or max)
    if grads:
        norms = torch.stack([torch.linalg.vector_norm(g, p).to(device)
                             for g in grads])
    else:
        norms = torch.zeros(1, device=device)
    if p == float("inf"):
        total = norms.max().clone()
        comm.all_reduce(total, op=comm.ReduceOp.MAX, tag="clip_grad_norm",
                        group=group)
    else:
        total = norms.pow(p).sum()
        comm.all_reduce(total, tag="clip_grad_norm", group=group)
        total = total.pow(1.0 / p)
    # END EXERCISE
    # torch's formula, so the results agree
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads if scaled is None else scaled:
        # in place, where each gradient lives (CPU offload: the host)
        g.mul_(coef.to(g.device))
    return total
# --8<-- [end:clip]
