"""Chapter 12: the parallelisms composed on a device mesh -- data parallel x tensor parallel, pipeline x data
parallel.

Each parallelism of this package takes a process group (`group=`, `process_group=`), and a mesh hands out one
group per dimension. Four ranks as a 2 x 2 mesh, [[0, 1], [2, 3]]:

    mesh = init_mesh((2, 2), ("dp", "tp"))
    mesh.get_group("tp")    # a row, {0, 1} or {2, 3}: one replica of the model, split in two
    mesh.get_group("dp")    # a column, {0, 2} or {1, 3}: the ranks holding the same slices, in the two replicas

Data parallel x tensor parallel needs nothing new. The tensor-parallel model is an nn.Module whose parameters
are this rank's slices, and the data-parallel wrappers of the earlier chapters wrap any module:

    model = TensorParallelGPT.from_gpt(gpt, group=mesh.get_group("tp"), sequence_parallel=True)
    model = DistributedDataParallel(model, process_group=mesh.get_group("dp"))   # or FSDP(...), ZeRO, ...

Each slice's gradient is averaged with the same slice of the other replicas, never with another slice. So the
sharding of ZeRO and FSDP applies to the data-parallel dimension only: a rank holds the model states / t,
sharded once more over the d replicas. Every byte of the tensor-parallel collectives stays inside a row and
every byte of the data-parallel ones inside a column, which is why Megatron puts the tensor-parallel group
inside a node (its all-reduces are on the critical path, four per block per step) and data parallelism across
nodes (one all-reduce of the gradients per step, which can overlap with backward).

Pipeline x data parallel is the same, but for one thing. A pipeline step runs m backwards, one per
micro-batch, and a data-parallel wrapper that averages in every backward would send the gradients m times.
The gradients are averaged once, when the pipeline has drained: `allreduce_gradients(stage_modules, group=dp)`
between `schedule.step(...)` and `optimizer.step()`, as Megatron-LM does after its pipeline's flush.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp.distributed import comm


# --8<-- [start:allreduce_gradients]
def allreduce_gradients(module: nn.Module, group=None) -> None:
    """Average the gradients of `module`'s parameters over the data-parallel
    `group`: one all-reduce of them all, flattened (one message instead of one
    per parameter, the bucket of chapter 1 made as large as the model). A
    parameter without a gradient sends zeros: every rank of the group must send
    the same bytes."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params or comm.world_size(group) == 1:
        return
    flat = torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
        for p in params])
    # divided before the sum, as DDP does: the sum cannot overflow in fp16
    flat.div_(comm.world_size(group))
    comm.all_reduce(flat, group=group, tag="data-parallel gradients")
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        if p.grad is None:
            p.grad = g.view_as(p).clone()
        else:
            p.grad.copy_(g.view_as(p))
# --8<-- [end:allreduce_gradients]
