"""Chapter 12: tensor parallelism (Megatron-LM) -- every big weight split across the t ranks of a group -- and
sequence parallelism.

Data parallelism splits the batch: every rank still computes every layer. Tensor parallelism splits the layers
themselves. The t ranks of a tensor-parallel group all see the same batch; each holds 1/t of every large weight
and computes 1/t of every large matmul. Megatron's recipe for a transformer needs two kinds of linear layer:

    ColumnParallelLinear  the weight split by output features (rows of nn.Linear's weight): rank r computes
                          Y_r = X A_r^T, its own slice of the output features. X must be whole on every rank.
    RowParallelLinear     the weight split by input features (columns): rank r computes Z_r = Y_r B_r^T from
                          its slice Y_r, a *partial sum*; the output is the sum of the t partial sums.

Put back to back -- column then row, as an MLP (fc, gelu, fc_proj) or attention (qkv, each rank's heads on
their own, proj) -- the slice Y_r never leaves rank r (gelu is element-wise, a head needs only its own q, k, v).
The only communication is the sum after the row layer, and in backward its mirror image before the column layer:

    x --f--> [column: A_r] --> Y_r --> [row: B_r] --> Z_r --g--> z          (rank r of t)

f and g, the collectives between the layers, and the sequence-parallel pairs are in mappings.py.

The vocabulary is split too (vocab_parallel.py): the embedding by vocabulary range, and the loss computed from
vocab-parallel logits without ever gathering them.

Every split parameter says how (Megatron's attributes): `tensor_model_parallel`, `partition_dim`,
`partition_stride`; `full_tensor(p, p)` puts one back together, `full_tensor(p.grad, p)` its gradient. A replicated
parameter that works on sequence shards gets only its shard's part of the gradient: it is marked
`sequence_parallel`, and `allreduce_sequence_parallel_grads(model)` must sum those gradients over the group before
the optimizer steps.

Sizes must divide: t ranks hold equal slices of the output features, the input features, the vocabulary and
(under sequence parallelism) the sequence, as in Megatron-LM. Anything else is refused with an error naming the
layer, the size and t.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from minifsdp import events
from minifsdp.distributed import comm
from minifsdp.parallel.mappings import (_all_gather_dim0, _mark_split, copy_to_tensor_model_parallel_region, divide,
                                        gather_from_sequence_parallel_region, gather_from_tensor_model_parallel_region,
                                        reduce_from_tensor_model_parallel_region,
                                        reduce_scatter_to_sequence_parallel_region,
                                        scatter_to_tensor_model_parallel_region, shard_of)



# -- the column-parallel matmul, its input gradient reduced while the weight gradient is computed ----------------------
# --8<-- [start:async]
class _LinearWithAsyncGradAllreduce(torch.autograd.Function):
    """y = x W^T + b for a column-parallel layer; f (or, under sequence
    parallelism, the all-gather) built in.

    Backward has two matmuls: dL/dx = dL/dy W, which must then be summed over
    the group, and dL/dW = dL/dy^T x, which needs no communication. Computing
    dL/dx first and starting its all-reduce asynchronously hides the collective
    behind the dL/dW matmul (Megatron-LM's async tensor-parallel all-reduce).
    Under sequence parallelism forward keeps only this rank's tokens of x for
    backward (1/t of the memory: that is the point of sequence parallelism) and
    all-gathers them again in backward, overlapped with dL/dx; dL/dx is then
    reduce-scattered, overlapped with dL/dW."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, name):
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        ctx.name, ctx.has_bias = name, bias is not None
        ctx.save_for_backward(x, weight)
        if sequence_parallel and comm.world_size(group) > 1:
            x = _all_gather_dim0(x, group, f"forward {name} gather input")
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        group, name = ctx.group, ctx.name
        t = comm.world_size(group)
        gather = None
        if ctx.sequence_parallel and t > 1:
            x_shard = x.contiguous()
            x = x.new_empty((t * x.shape[0],) + tuple(x.shape[1:]))
            gather = comm.all_gather(x, x_shard, async_op=True, group=group,
                                     tag=f"backward {name} gather input")
        # --8<-- [start:async_backward]
        # the same matmuls, in the same orientation, as autograd's for
        # F.linear: the same bits as the plain path
        grad_input = grad_output.matmul(weight)
        reduction = None
        if t > 1:
            if ctx.sequence_parallel:
                gather.wait()  # (dL/dW below needs the whole x)
                full, grad_input = grad_input, grad_input.new_empty(
                    (grad_input.shape[0] // t,) + grad_input.shape[1:])
                reduction = comm.reduce_scatter(
                    grad_input, full.contiguous(), async_op=True, group=group,
                    tag=f"backward {name} input gradient")
            else:
                reduction = comm.all_reduce(
                    grad_input, async_op=True, group=group,
                    tag=f"backward {name} input gradient")
        # ... and while it travels:
        events.emit(events.COMPUTE_BEGIN, f"backward {name} weight gradient")
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        x_2d = x.reshape(-1, x.shape[-1])
        grad_weight = grad_2d.t().mm(x_2d)
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        events.emit(events.COMPUTE_END, f"backward {name} weight gradient")
        if reduction is not None:
            reduction.wait()
        return grad_input, grad_weight, grad_bias, None, None, None
        # --8<-- [end:async_backward]
# --8<-- [end:async]


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group=None,
                           sequence_parallel: bool = False, async_grad_allreduce: bool = True,
                           name: str = "column_parallel_linear") -> torch.Tensor:
    """x (whole; under sequence parallelism this rank's tokens) times this rank's rows of a weight: this rank's
    slice of the output features, for every token. The plain path is f (or the sequence all-gather) then
    F.linear; the async path is the same arithmetic with the input gradient's reduction overlapped."""
    if async_grad_allreduce:
        return _LinearWithAsyncGradAllreduce.apply(x, weight, bias, group, sequence_parallel, name)
    if sequence_parallel:
        x = gather_from_sequence_parallel_region(x, group)
    else:
        x = copy_to_tensor_model_parallel_region(x, group)
    return F.linear(x, weight, bias)


# -- layers ------------------------------------------------------------------------------------------------------------
def _linear_init(weight: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # nn.Linear's


def _full_init(shape, init_method) -> torch.Tensor:
    """The whole weight, initialised, from which each rank keeps its part: every rank draws the same numbers
    (seed them alike), as Megatron-LM's CPU initialisation. It costs the whole weight for a moment."""
    full = torch.empty(shape)
    with torch.no_grad():
        init_method(full)
    return full


# --8<-- [start:column]
class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by output features (rows): rank r holds rows [r out/t, (r+1) out/t) of A and
    of b, and returns its slice of the output features -- all of them if gather_output (an all-gather).

    sequence_parallel: the input is this rank's s/t tokens of an [s, b, in] tensor, all-gathered here.
    async_grad_allreduce: reduce the input gradient while the weight gradient is computed (else: f, then
    F.linear; the same bits, no overlap).
    stride: the weight is `stride` matrices stacked along the output features (see shard_of).
    init_method: initialises the whole weight (every rank the same); default nn.Linear's. The bias starts at zero,
    as Megatron's. `from_full(linear)` starts from an nn.Linear's weights instead."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False, *,
                 group=None, sequence_parallel: bool = False, async_grad_allreduce: bool = True, stride: int = 1,
                 init_method=None, name: str | None = None):
        super().__init__()
        t = comm.world_size(group)
        label = f"ColumnParallelLinear({in_features}, {out_features})" + (f" {name}" if name else "")
        divide(out_features, t, f"{label}: out_features", stride)
        if gather_output and sequence_parallel:
            raise ValueError(f"{label}: gather_output=True with sequence_parallel=True; the "
                             f"output of a column layer stays split (the next row layer takes the slices)")
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        self.group, self.sequence_parallel, self.async_grad_allreduce = group, sequence_parallel, async_grad_allreduce
        self.name = name or "ColumnParallelLinear"  # (in the timeline and the collectives' tags)
        rank = comm.rank(group)
        full = _full_init((out_features, in_features), init_method or _linear_init)
        self.weight = nn.Parameter(shard_of(full, 0, rank, t, stride))
        _mark_split(self.weight, 0, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features // t))
            _mark_split(self.bias, 0, stride)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_full(cls, linear: nn.Linear, *, group=None, stride: int = 1, **kwargs) -> ColumnParallelLinear:
        """This rank's rows of `linear`'s weight and bias (every rank passes the same nn.Linear)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group=group,
                    stride=stride, init_method=lambda w: w.copy_(linear.weight), **kwargs)
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(shard_of(linear.bias, 0, comm.rank(group), comm.world_size(group), stride))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel_linear(x, self.weight, self.bias, group=self.group,
                                   sequence_parallel=self.sequence_parallel,
                                   async_grad_allreduce=self.async_grad_allreduce, name=self.name)
        return gather_from_tensor_model_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank: "
                f"{self.weight.shape[0]}), bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")
# --8<-- [end:column]


# --8<-- [start:row]
class RowParallelLinear(nn.Module):
    """Z = Y B^T + b with B split by input features (columns): rank r holds
    columns [r in/t, (r+1) in/t) of B, multiplies its slice of Y's features, and
    the partial products are summed over the group (g: an all-reduce; under
    sequence parallelism a reduce-scatter that leaves each rank its s/t tokens).
    The bias is whole on every rank and added once, after the sum.

    input_is_parallel: Y arrives already split (a column layer's output); if
    not, each rank takes its slice. Under sequence parallelism the bias works on
    token shards, so it is marked `sequence_parallel` (its gradient is partial:
    see allreduce_sequence_parallel_grads)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = True, *, group=None,
                 sequence_parallel: bool = False, init_method=None,
                 name: str | None = None):
        super().__init__()
        t = comm.world_size(group)
        label = (f"RowParallelLinear({in_features}, {out_features})"
                 + (f" {name}" if name else ""))
        divide(in_features, t, f"{label}: in_features")
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                f"{label}: sequence_parallel=True needs input_is_parallel=True "
                f"(the input of a sequence-parallel row layer is a column "
                f"layer's output)")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.group, self.sequence_parallel = group, sequence_parallel
        self.name = name or "RowParallelLinear"
        full = _full_init((out_features, in_features),
                          init_method or _linear_init)
        self.weight = nn.Parameter(shard_of(full, 1, comm.rank(group), t))
        _mark_split(self.weight, 1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_full(cls, linear: nn.Linear, *, group=None,
                  **kwargs) -> RowParallelLinear:
        """This rank's columns of `linear`'s weight, and its whole bias."""
        layer = cls(linear.in_features, linear.out_features,
                    bias=linear.bias is not None, group=group,
                    init_method=lambda w: w.copy_(linear.weight), **kwargs)
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias)
        return layer

    # --8<-- [start:row_forward]
    def forward(self, y: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            y = scatter_to_tensor_model_parallel_region(y, self.group)
        partial = F.linear(y, self.weight)
        if self.sequence_parallel:
            z = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            z = reduce_from_tensor_model_parallel_region(partial, self.group)
        return z if self.bias is None else z + self.bias
    # --8<-- [end:row_forward]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} "
                f"(this rank: {self.weight.shape[1]}), "
                f"out_features={self.out_features}, "
                f"bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}")
# --8<-- [end:row]


# --8<-- [start:sp_grads]
def allreduce_sequence_parallel_grads(module: nn.Module, group=None) -> None:
    """Sum, over the group, the gradients of `module`'s parameters marked
    `sequence_parallel` (LayerNorms and row-layer biases under sequence
    parallelism): each rank saw only its s/t tokens, so each holds a partial
    sum.

    A training loop calls it after backward and before the optimizer steps,
    where it also reduces data-parallel gradients (Megatron's
    finalize_model_grads). Not a hook: hooks would send one small all-reduce per
    parameter per backward (per micro-batch under gradient accumulation); here
    all of them go in one flat all-reduce."""
    grads = [p.grad for p in module.parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or comm.world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=group, tag="sequence-parallel grads")
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()
# --8<-- [end:sp_grads]
