"""Chapter 9: what FullyShardedDataParallel adds for real training -- accumulation without communication
(no_sync), clipping the norm of sharded gradients, and deferred initialisation from the meta device.

These are methods of FullyShardedDataParallel (it inherits them from TrainingOptions); they live here so
that chapter 6's runtime in fsdp.py stays one sitting's read.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from minifsdp import comm
from minifsdp.clip import clip_sharded_grad_norm_

if TYPE_CHECKING:
    from minifsdp.flat_param import FlatParameter


class TrainingOptions:
    """Mixed into FullyShardedDataParallel: every method here runs on a unit (self)."""

    # --8<-- [start:materialize]
    def _materialize_own(self, param_init_fn, device: torch.device, broadcast: bool) -> None:
        """Deferred init: give memory to the meta parameters and buffers this unit owns, and initialise them
        with param_init_fn(module) (default: module.reset_parameters()) for each module it owns. Units are
        built innermost first and each shards its parameters right after, so a rank never holds more than
        one unit in full: a model larger than one rank's memory can be built."""
        from minifsdp.fsdp import _modules_not_in_units  # (fsdp.py imports this module)

        modules = list(_modules_not_in_units(self.module))
        fresh = {}  # id(meta tensor) -> (meta tensor, its real replacement): a tied one is replaced once
        for m in modules:
            for table in (m._parameters, m._buffers):
                for name, t in table.items():
                    if t is not None and t.is_meta:
                        if id(t) not in fresh:
                            real = torch.empty_like(t, device=device)
                            if isinstance(t, nn.Parameter):
                                real = nn.Parameter(real, requires_grad=t.requires_grad)
                            fresh[id(t)] = (t, real)
                        table[name] = fresh[id(t)][1]
        for m in modules:
            if param_init_fn is not None:
                param_init_fn(m)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
        if broadcast:  # as sync_module_states does for a model built eagerly: rank 0's values everywhere
            _broadcast([real for _, real in fresh.values()])
    # --8<-- [end:materialize]

    # --8<-- [start:no_sync]
    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside the block send nothing: every unit keeps its full flat gradient and adds
        the next one to it. The first backward after the block adds them in and reduce-scatters once. The
        FSDP paper's trade: one reduce-scatter per unit instead of one per micro-batch, for 4Ψ of
        unsharded gradients (DDP's amount) held between the micro-batches."""
        units = self.units()
        before = [u._sync_gradients for u in units]
        for u in units:
            u._sync_gradients = False
        try:
            yield
        finally:
            for u, b in zip(units, before):
                u._sync_gradients = b

    def _accumulate_unsharded(self, flat: FlatParameter) -> bool:
        """Inside no_sync(): keep the full gradient and reshard (True). Outside: fold in what no_sync kept."""
        full_grad = flat.param.grad
        # BEGIN EXERCISE 9.1: no_sync: keep (and add up) the full gradient; after it, fold it in
        if not self._sync_gradients:
            flat.param.grad = None
            flat.unsharded_grad = full_grad if flat.unsharded_grad is None else flat.unsharded_grad.add_(full_grad)
            flat.reshard()
            return True
        if flat.unsharded_grad is not None:
            full_grad.add_(flat.unsharded_grad)  # the same sum DDP's no_sync makes, before averaging
            flat.unsharded_grad = None
        return False
        # END EXERCISE
    # --8<-- [end:no_sync]

    # --8<-- [start:clip]
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient so that the norm of the whole model's gradient is at most `max_norm`, as
        torch.nn.utils.clip_grad_norm_ would on the full gradients; returns that norm (before clipping).
        Each rank holds a disjoint shard of every flat gradient: see minifsdp/clip.py."""
        if not self.is_root:
            raise RuntimeError("clip_grad_norm_() clips the whole model: call it on the root unit")
        grads = [flat.param.grad for unit in self.units() for flat in unit.flat_params
                 if flat.param.grad is not None]
        return clip_sharded_grad_norm_(grads, max_norm, norm_type)
    # --8<-- [end:clip]


def _broadcast(tensors) -> None:
    with torch.no_grad():
        for t in tensors:
            comm.broadcast(t, src=0)

