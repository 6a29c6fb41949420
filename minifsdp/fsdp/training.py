"""Chapter 9: what FullyShardedDataParallel adds for real training -- accumulation without communication
(no_sync), clipping the norm of sharded gradients, and deferred initialisation from the meta device.

Each is a function of what it needs (the units, a FlatParameter, the modules a unit owns); the runtime
(fsdp.py) calls them, so chapter 6's runtime stays one sitting's read and nothing here imports it.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from minifsdp.distributed import comm
from minifsdp.zero.clip import clip_sharded_grad_norm_

if TYPE_CHECKING:
    from minifsdp.fsdp.flat_param import FlatParameter


# --8<-- [start:materialize]
def materialize(modules: list[nn.Module], param_init_fn, device: torch.device,
                broadcast: bool, group=None) -> None:
    """Deferred init: give memory to the meta parameters and buffers of
    `modules` (what one unit owns), and initialise them with
    param_init_fn(module) (default: module.reset_parameters()) for each module.
    Units are built innermost first and each shards its parameters right after,
    so a rank never holds more than one unit in full: a model larger than one
    rank's memory can be built."""
    # id(meta tensor) -> (meta tensor, its real replacement): a tied one is
    # replaced once
    fresh = {}
    for m in modules:
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None and t.is_meta:
                    if id(t) not in fresh:
                        real = torch.empty_like(t, device=device)
                        if isinstance(t, nn.Parameter):
                            real = nn.Parameter(
                                real, requires_grad=t.requires_grad)
                        fresh[id(t)] = (t, real)
                    table[name] = fresh[id(t)][1]
    for m in modules:
        if param_init_fn is not None:
            param_init_fn(m)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()
    # as sync_module_states does for a model built eagerly: rank 0's values
    # everywhere
    if broadcast:
        comm.broadcast_tensors([real for _, real in fresh.values()], src=0,
                               group=group)
# --8<-- [end:materialize]


# --8<-- [start:no_sync]
@contextlib.contextmanager
def no_sync(units: list):
    """Backward passes inside the block send nothing: every unit keeps its
    full flat gradient and adds the next one to it. The first backward after
    the block adds them in and reduce-scatters once. The FSDP paper's trade:
    one reduce-scatter per unit instead of one per micro-batch, for 4Ψ of
    unsharded gradients (DDP's amount) held between the micro-batches."""
    before = [u._sync_gradients for u in units]
    for u in units:
        u._sync_gradients = False
    try:
        yield
    finally:
        for u, b in zip(units, before):
            u._sync_gradients = b


def accumulate_unsharded(flat: FlatParameter, sync_gradients: bool) -> bool:
    """Inside no_sync(): keep the full gradient and reshard (True). Outside:
    fold in what no_sync kept."""
    full_grad = flat.param.grad
    # BEGIN EXERCISE 9.1: no_sync: keep and add up full gradients; then fold in
    if not sync_gradients:
        flat.param.grad = None
        flat.unsharded_grad = (full_grad if flat.unsharded_grad is None
                               else flat.unsharded_grad.add_(full_grad))
        flat.reshard()
        return True
    if flat.unsharded_grad is not None:
        # the same sum DDP's no_sync makes, before averaging
        full_grad.add_(flat.unsharded_grad)
        flat.unsharded_grad = None
    return False
    # END EXERCISE
# --8<-- [end:no_sync]


# --8<-- [start:clip]
def clip_grad_norm_(flat_params: list[FlatParameter], max_norm: float,
                    norm_type: float = 2.0, group=None) -> torch.Tensor:
    """Scale every gradient so that the norm of the whole model's gradient is
    at most `max_norm`, as torch.nn.utils.clip_grad_norm_ would on the full
    gradients; returns that norm (before clipping). Each rank holds a disjoint
    shard of every flat gradient: see zero/clip.py."""
    grads = [flat.param.grad for flat in flat_params
             if flat.param.grad is not None and flat.sharded]
    # NO_SHARD: every rank holds the same whole gradient, so only rank 0
    # counts it in the norm; all scale it
    replicated = [flat.param.grad for flat in flat_params
                  if flat.param.grad is not None and not flat.sharded]
    counted = replicated if comm.rank(group) == 0 else []
    return clip_sharded_grad_norm_(grads + counted, max_norm, norm_type,
                                   group=group, scaled=grads + replicated)
# --8<-- [end:clip]
