"""Chapter 11, the naive version: FSDP as a parametrization, with no runtime at all (in the spirit of
SimpleFSDP, torchtitan's compiler-friendly FSDP).

Each parameter is stored as a DTensor, Shard(0): every rank keeps its chunk. Reading the parameter
(`module.weight`, inside forward) all-gathers it: DTensor's `redistribute` to Replicate. Autograd records
that redistribute like any other op, and its backward is the collective that undoes it: the gradient,
Partial (each rank holds a summand of the whole) and averaged, is reduce-scattered back to Shard(0). So
the gradient of a sharded parameter arrives sharded, averaged as DDP averages, and the optimizer steps
the shards. Nothing else is needed: no hooks, no state, no order.

fully_shard (fully_shard.py, runtime.py, param.py) is this, improved by named steps.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

from minifsdp.distributed.launch import current_device


# --8<-- [start:simple]
def simple_fsdp(model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard every parameter of `model` over `mesh` (default: every rank);
    each read of one all-gathers it, and its gradient is reduce-scattered."""
    mesh = mesh or DeviceMesh.from_group(dist.group.WORLD,
                                         current_device().type)
    sharded = {}  # a tied parameter is sharded once, and stays tied
    for module in list(model.modules()):
        names = [n for n, p in module._parameters.items() if p is not None]
        for name in names:
            p = module._parameters[name]
            if id(p) not in sharded:
                sharded[id(p)] = nn.Parameter(
                    distribute_tensor(p.detach(), mesh, [Shard(0)]),
                    requires_grad=p.requires_grad)
            # registered as the parameter: what the optimizer and
            # state_dict() see is the shard
            module._parameters[name] = sharded[id(p)]
        if names:
            # a class of its own, whose attributes gather what they name
            module.__class__ = type(
                f"Simple{type(module).__name__}", (type(module),),
                {name: property(_gathered(name)) for name in names})
    return model


# --8<-- [start:simple_read]
def _gathered(name: str):
    def read(module: nn.Module):
        # forward: all-gather; backward: reduce-scatter the averaged gradient
        return module._parameters[name].redistribute(
            placements=[Replicate()]).to_local(
            grad_placements=[Partial("avg")])
    return read
# --8<-- [end:simple_read]
# --8<-- [end:simple]
