"""Chapter 12: the collectives of tensor and sequence parallelism, as conjugate autograd functions (Megatron-LM's
mappings), and how a tensor is split across a tensor-parallel group and put back together.

The layers (tensor_parallel.py) need communication at two places, around a column-then-row pair:

    x --f--> [column: A_r] --> Y_r --> [row: B_r] --> Z_r --g--> z          (rank r of t)

f and g are a conjugate pair of autograd functions, each the other's transpose:

                forward         backward
    f           identity        all-reduce      every rank holds all of x; each A_r contributed to dL/dx
    g           all-reduce      identity        the sum of the Z_r; dL/dz is the same for every term of a sum

so a transformer block costs two all-reduces of the activations forward (after attention, after the MLP) and
two backward, each of b*s*h elements.

Sequence parallelism. Between a row layer and the next column layer -- the residual add, LayerNorm, dropout --
every rank computes the same thing on the same full tensor, and keeps the same activations for backward: t
copies. Those operations work token by token, so split them along the sequence instead. An all-reduce is a
reduce-scatter followed by an all-gather: do the reduce-scatter after the row layer (each rank keeps the sum for
its s/t tokens), run LayerNorm and the residual on that shard, and all-gather just before the column layer. The
same bytes on the wire, and the activations of those regions divided by t. Three more pairs of functions:

                                            forward         backward
    reduce_scatter_to_sequence_parallel_region  reduce-scatter  all-gather   (after a row layer: g's place)
    gather_from_sequence_parallel_region        all-gather      reduce-scatter (before a column layer: f's place)
    scatter_to_sequence_parallel_region         split           all-gather   (into the region: after the embedding)

Layout: sequence first, [s, b, h], as Megatron. A rank's sequence shard is then a run of whole rows of dim 0
(tokens [r s/t, (r+1) s/t) of every sequence), which is exactly what comm's all_gather and reduce_scatter
concatenate and cut along, so no transposes around the collectives.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp.distributed import comm


# -- how a tensor is split, and put back together ----------------------------------------------------------------------
def divide(size: int, t: int, what: str, stride: int = 1) -> int:
    """size / (stride * t), or an error naming what does not divide."""
    if size % (stride * t):
        by = f"t = {t}" if stride == 1 else f"stride x t = {stride * t} (stride {stride}, t = {t})"
        raise ValueError(f"{what} = {size} does not divide by {by}: each of the t tensor-parallel ranks must hold an "
                         f"equal slice (Megatron-LM requires the same)")
    return size // (stride * t)


# --8<-- [start:shard_of]
# --8<-- [start:stride]
def shard_of(full: torch.Tensor, dim: int, rank: int, world_size: int,
             stride: int = 1) -> torch.Tensor:
    """Rank `rank`'s part of `full`, split along `dim` (a copy: the full tensor
    can go).

    stride k: the dimension is k matrices stacked (TinyGPT's qkv weight: all q
    rows, then all k, then all v), so it is cut in k*t pieces and rank r takes
    pieces r, r + t, ..., r + (k-1)t -- its slice of each matrix."""
    pieces = full.detach().chunk(stride * world_size, dim)
    return torch.cat(pieces[rank::world_size], dim)
# --8<-- [end:stride]


def full_tensor(local: torch.Tensor, param: nn.Parameter,
                group=None) -> torch.Tensor:
    """The whole tensor of which `local` (the parameter `param` itself, or its
    gradient) is this rank's part, all-gathered from the group; a replicated
    parameter's tensor is returned as it is (a copy)."""
    if (not getattr(param, "tensor_model_parallel", False)
            or comm.world_size(group) == 1):
        return local.detach().clone()
    t, dim, stride = (comm.world_size(group), param.partition_dim,
                      param.partition_stride)
    moved = local.detach().movedim(dim, 0).contiguous()
    out = moved.new_empty((t * moved.shape[0],) + tuple(moved.shape[1:]))
    comm.all_gather(out, moved, group=group, tag="full_tensor")
    # rank-major pieces [t, stride, n/stride, ...] back into the full order
    # [stride, t, n/stride, ...]
    rest = tuple(moved.shape[1:])
    out = (out.view(t, stride, moved.shape[0] // stride, *rest)
           .transpose(0, 1).reshape(-1, *rest))
    return out.movedim(0, dim).contiguous()


def _mark_split(param: nn.Parameter, dim: int, stride: int = 1) -> None:
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = (
        True, dim, stride)


def mark_sequence_parallel(module: nn.Module) -> None:
    """Flag `module`'s parameters as working on sequence shards: their gradients
    are partial sums."""
    for p in module.parameters():
        p.sequence_parallel = True
# --8<-- [end:shard_of]


# -- the collectives the mappings are made of --------------------------------------------------------------------------
def _all_gather_dim0(x: torch.Tensor, group, tag: str) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((comm.world_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    comm.all_gather(out, x, group=group, tag=tag)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group, tag: str) -> torch.Tensor:
    rows = divide(x.shape[0], comm.world_size(group), f"{tag}: the sequence length (dim 0 of {tuple(x.shape)})")
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    comm.reduce_scatter(out, x.contiguous(), group=group, tag=tag)
    return out


def _split_dim0(x: torch.Tensor, group, what: str) -> torch.Tensor:
    rows = divide(x.shape[0], comm.world_size(group), f"{what}: the sequence length (dim 0 of {tuple(x.shape)})")
    r = comm.rank(group)
    # a copy, not a view: a view would keep the whole tensor alive as long as the shard is
    return x[r * rows: (r + 1) * rows].clone()


def _all_gather_last_dim(x: torch.Tensor, group, tag: str) -> torch.Tensor:
    return _all_gather_dim0(x.movedim(-1, 0), group, tag).movedim(0, -1).contiguous()


def _split_last_dim(x: torch.Tensor, group, what: str) -> torch.Tensor:
    divide(x.shape[-1], comm.world_size(group), f"{what}: the last dimension of {tuple(x.shape)}")
    return x.chunk(comm.world_size(group), dim=-1)[comm.rank(group)].contiguous()


# -- f and g, and the sequence-parallel pairs --------------------------------------------------------------------------
# --8<-- [start:f_g]
# --8<-- [start:f_or_g]
def _f_or_g(mapping: str, direction: str, x: torch.Tensor,
            group) -> torch.Tensor:
    """One of the four passes of the conjugate pair: f or g, forward or backward
    (the module docstring's table)."""
    # BEGIN EXERCISE 12.1: f and g: which two of four passes all-reduce, and how
    sums = (mapping, direction) in (("f", "backward"), ("g", "forward"))
    if not sums or comm.world_size(group) == 1:
        # f forward: x is whole on every rank already; g backward: dL/dz is
        # every term's gradient
        return x
    # f backward: each rank's weight slice gave a part of dL/dx; g forward:
    # each rank's output is a partial sum.
    # Summed in a copy: the tensor autograd hands us is not ours to overwrite.
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group=group, tag=f"{mapping} {direction}")
    return out
    # END EXERCISE
# --8<-- [end:f_or_g]


class _CopyToModelParallelRegion(torch.autograd.Function):
    """f: into a tensor-parallel region (before a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _f_or_g("f", "forward", x, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _f_or_g("f", "backward", grad_output, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """g: out of a tensor-parallel region (after a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _f_or_g("g", "forward", x, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _f_or_g("g", "backward", grad_output, ctx.group), None
# --8<-- [end:f_g]


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dimension (a row layer's input that is not split yet); backward:
    all-gather the slices' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        if comm.world_size(group) == 1:
            return x
        return _split_last_dim(x, group, "scatter_to_tensor_model_parallel_region")

    @staticmethod
    def backward(ctx, grad_output):
        if comm.world_size(ctx.group) == 1:
            return grad_output, None
        return _all_gather_last_dim(grad_output, ctx.group, "scatter_to_tp backward"), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather the ranks' slices of the last dimension (a column layer's output, when the next layer needs it
    whole); backward: keep this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x if comm.world_size(group) == 1 else _all_gather_last_dim(x, group, "gather_from_tp forward")

    @staticmethod
    def backward(ctx, grad_output):
        if comm.world_size(ctx.group) == 1:
            return grad_output, None
        return _split_last_dim(grad_output, ctx.group, "gather_from_tensor_model_parallel_region backward"), None


# --8<-- [start:sequence_parallel]
class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Into the sequence-parallel region: keep this rank's s/t tokens; backward:
    all-gather their gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        if comm.world_size(group) == 1:
            return x
        return _split_dim0(x, group, "scatter_to_sequence_parallel_region")

    @staticmethod
    def backward(ctx, grad_output):
        if comm.world_size(ctx.group) == 1:
            return grad_output, None
        return _all_gather_dim0(grad_output, ctx.group,
                                "scatter_to_sp backward"), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """f's place under sequence parallelism: all-gather the tokens; backward:
    each rank's column slice gave a part of every token's gradient -- sum them,
    and keep this rank's tokens (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        if comm.world_size(group) == 1:
            return x
        return _all_gather_dim0(x, group, "gather_from_sp forward")

    @staticmethod
    def backward(ctx, grad_output):
        if comm.world_size(ctx.group) == 1:
            return grad_output, None
        return _reduce_scatter_dim0(grad_output, ctx.group,
                                    "gather_from_sp backward"), None


# --8<-- [start:sp_reduce_scatter]
class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """g's place under sequence parallelism: sum the row layer's partial outputs
    and keep this rank's tokens; backward: every rank needs every token's
    gradient (all-gather)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        if comm.world_size(group) == 1:
            return x
        return _reduce_scatter_dim0(x, group, "reduce_scatter_to_sp forward")

    @staticmethod
    def backward(ctx, grad_output):
        if comm.world_size(ctx.group) == 1:
            return grad_output, None
        return _all_gather_dim0(grad_output, ctx.group,
                                "reduce_scatter_to_sp backward"), None
# --8<-- [end:sp_reduce_scatter]
# --8<-- [end:sequence_parallel]


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: identity forward, all-reduce backward."""
    return _CopyToModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return _ReduceFromModelParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's slice of the last dimension forward, all-gather backward."""
    return _ScatterToModelParallelRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dimension forward, this rank's slice backward."""
    return _GatherFromModelParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's s/t tokens (dim 0) forward, all-gather backward."""
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather the tokens (dim 0) forward, reduce-scatter backward."""
    return _GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter over the tokens (dim 0) forward, all-gather backward."""
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)
