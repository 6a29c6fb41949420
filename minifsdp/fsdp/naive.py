"""Chapters 5-6, first: FSDP at its most naive -- chapter 5's FlatParameter and three hooks.

    model = NaiveFSDP(TinyGPT(), unit_classes=(Block,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)    # over the shards
    model(x, y).backward(); optimizer.step(); optimizer.zero_grad()

Each module of `unit_classes`, and the model itself for what is left, becomes a unit: one FlatParameter.
Before a unit's forward, all-gather its parameters; after it, free them; when the gradient of its output
arrives, all-gather them again; when its flat gradient is complete, reduce-scatter it and free them. Every
collective is waited for where it is issued, and the root is a unit like any other.

It trains exactly as DDP does (tests/test_ch06_naive.py), and holds 1/N of the model between steps. What
chapter 6's runtime (runtime.py) adds, step by named step: the root keeps its parameters from forward to
backward (one all-gather fewer); reduce-scatters run while backward goes on, waited for only when their
memory is needed; the full parameters are freed before autograd concatenates the gradients; a gradient
left from an earlier backward is added, not overwritten; units come from a wrap policy, and tied or frozen
parameters are handled. Chapter 7 then starts all-gathers before they are needed.
"""

from __future__ import annotations

import torch.nn as nn
from torch.utils._pytree import tree_leaves

from minifsdp.distributed import comm
from minifsdp.fsdp.flat_param import FlatParameter


# --8<-- [start:naive]
# --8<-- [start:naive_units]
class NaiveFSDP(nn.Module):
    def __init__(self, module: nn.Module, unit_classes: tuple = ()):
        super().__init__()
        # every rank starts from rank 0's model, as under DDP
        comm.sync_from_rank0(list(module.named_parameters())
                             + list(module.named_buffers()))
        self.module, self.flat_params = module, []
        units = [m for m in module.modules() if isinstance(m, unit_classes)]
        # the model last: it takes the parameters no other unit took
        for i, unit in enumerate(units + [module]):
            places = [(m, name) for m in unit.modules()
                      for name, _ in m.named_parameters(recurse=False)]
            flat = FlatParameter(places)
            self.flat_params.append(flat)
            self.register_parameter(f"flat_param_{i}", flat.param)
            _hook(unit, flat)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
# --8<-- [end:naive_units]


# --8<-- [start:naive_hooks]
def _hook(unit: nn.Module, flat: FlatParameter) -> None:
    def before_forward(module, args):
        flat.unshard()

    def after_forward(module, args, out):
        flat.reshard()
        for t in tree_leaves(out):  # backward will need them again
            if getattr(t, "requires_grad", False):
                t.register_hook(before_backward)

    def before_backward(grad):
        flat.unshard()
        return grad

    def after_backward(param):  # the flat gradient is complete
        full_grad, param.grad = param.grad, None
        handle, grad_shard = flat.reduce_scatter_grad(full_grad)
        handle.wait()
        flat.reshard()
        param.grad = flat.grad_for_optimizer(grad_shard)

    unit.register_forward_pre_hook(before_forward)
    unit.register_forward_hook(after_forward)
    flat.param.register_post_accumulate_grad_hook(after_backward)
# --8<-- [end:naive_hooks]
# --8<-- [end:naive]
