"""Chapter 11: per-parameter sharding -- each parameter a DTensor, Shard(0); a module's parameters gathered
and reduced together.

Chapter 5's FlatParameter concatenates a unit's parameters, pads the concatenation and cuts it in N: a rank's
shard crosses parameter boundaries, so the optimizer sees one flat tensor and the original parameters only
live on as views. FSDP2 cuts *each parameter* in N along dim 0, as torch.chunk does (the first chunks get
ceil(d0 / N) rows, the last may get fewer or none, and every chunk is padded to ceil(d0 / N) rows), and keeps
it as a DTensor: a tensor that knows it is chunk r of a global shape on a mesh. So `model.parameters()` are
still the user's parameters, with their names and shapes; the optimizer steps them one by one; frozen and
trainable parameters mix freely; `state_dict()` is already a sharded checkpoint.

The price is paid at the collectives, which still want one flat buffer per module (one all-gather of many
small tensors is slower than one of their concatenation):

    unshard  copy-in:  each parameter's padded shard, end to end         -> all-gather input   (Ψ_m / N)
             all-gather                                                   -> output, rank-major  (Ψ_m)
             copy-out: rank q's part of parameter i, for every q, into i's unsharded tensor
    reduce   copy-in:  each gradient, padded to N chunks, chunk q of every gradient side by side in slot q
             reduce-scatter                                               -> this rank's slot    (Ψ_m / N)
             each parameter's part of the slot is its sharded gradient (a view), as a DTensor

Each copy costs a pass over the bytes. What it buys: the unsharded parameters are tensors of their own, made
on the compute stream, not views into the all-gather's buffer, so the buffer lives only from the all-gather to
the copy-out and is freed right after it (on a GPU after a record_stream on the compute stream, chapter 7),
not at the module's reshard.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from minifsdp.distributed import comm
from minifsdp.fsdp.flat_param import ShardState, _alloc_storage, _free_storage
from minifsdp.fsdp.streams import side_stream


# --8<-- [start:shard]
class FSDPParam:
    """One parameter of a fully_shard'ed module: its padded shard (what the
    collectives read and write), the DTensor parameter the user and the
    optimizer see (a view of the shard's first rows), and, between unshard and
    reshard, the unsharded parameter the module computes with."""

    def __init__(self, places: list[tuple[nn.Module, str]], mesh, rank: int,
                 world_size: int):
        # places: (module, name); more than one for a tied parameter
        self.places, self.mesh = places, mesh
        # Sharded over the mesh's last dimension; on a 2-D mesh (HSDP),
        # replicated over the first.
        self.placements = ((Shard(0),) if mesh.ndim == 1
                           else (Replicate(), Shard(0)))
        module, name = places[0]
        param = module._parameters[name]
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard shards each parameter along dim 0, and {name!r} "
                f"of {type(module).__name__} is 0-dim: give it shape (1,) "
                f"(as torch's fully_shard)")
        self.shape, self.requires_grad = param.shape, param.requires_grad
        # --8<-- [start:shard_rows]
        # BEGIN EXERCISE 11.1: this rank's Shard(0), padded to ceil(d0 / N) rows
        # every rank's padded number of rows: chunk 0's
        self.rows = -(-param.shape[0] // world_size)
        first = min(rank * self.rows, param.shape[0])
        # this rank's real rows (the last may have none)
        self.length = min(self.rows, param.shape[0] - first)
        padded = param.new_zeros((self.rows,) + tuple(param.shape[1:]))
        padded[: self.length].copy_(param.detach()[first: first + self.length])
        # END EXERCISE
        self.padded = padded
        self.sharded = nn.Parameter(
            DTensor.from_local(padded[: self.length], mesh, self.placements,
                               run_check=False, shape=self.shape,
                               stride=_contiguous_stride(self.shape)),
            requires_grad=self.requires_grad)
        # --8<-- [end:shard_rows]
        # the nn.Parameter the module computes with between unshard and reshard
        self.unsharded = None
        # unsharded gradients added up while gradient sync is off
        self.unsharded_grad = None
        self.show(self.sharded)

    def alloc_unsharded(self, dtype: torch.dtype) -> torch.Tensor:
        """The unsharded parameter's memory, for the copy-out to fill. It is one
        Parameter for good, whose storage is freed at reshard and given back
        here: what forward saved for backward (a Linear saves its weight) is
        this same storage, so the pre-backward all-gather refills it. Written
        through .data, which autograd does not count as a change to a tensor it
        saved."""
        if self.unsharded is None or self.unsharded.dtype != dtype:
            self.unsharded = nn.Parameter(
                self.padded.new_empty(self.shape, dtype=dtype))
        # frozen or unfrozen since, as the user said
        self.unsharded.requires_grad_(self.sharded.requires_grad)
        if self.unsharded.untyped_storage().size() == 0:
            # (in place, announced: no op reports a resize; the meter listens)
            _alloc_storage(self.unsharded)
        return self.unsharded.data

    def free_unsharded(self) -> None:
        if self.unsharded is not None:
            _free_storage(self.unsharded)

    def show(self, param: nn.Parameter) -> None:
        """Register `param` at every place of this parameter: the module
        computes with what it finds there."""
        for module, name in self.places:
            module._parameters[name] = param
    # --8<-- [end:shard]

    # --8<-- [start:refresh]
    def refresh_sharded(self) -> None:
        """The module's DTensor parameter may have been given new memory since
        fully_shard (module.to_empty() after a meta-device build): take its data as
        this rank's shard again, keeping the Parameter object the optimizer may
        already hold."""
        module, name = self.places[0]
        param = module._parameters[name]
        # shown by an unshard() before the first forward: not a replacement
        if param is self.unsharded:
            return
        local = param.to_local() if isinstance(param, DTensor) else param
        # (a rank with no rows of it holds an empty shard, whose data_ptr is 0
        # on the meta device and off it: the device tells those apart)
        if (param is self.sharded and local.device == self.padded.device
                and (local.untyped_storage().data_ptr()
                     == self.padded.untyped_storage().data_ptr())):
            return
        padded = local.new_zeros((self.rows,) + tuple(self.shape[1:]))
        padded[: self.length].copy_(local.detach())
        self.padded, self.sharded = padded, param
        # (a DTensor's data is its local tensor)
        param._local_tensor = padded[: self.length]
        self.show(param)
    # --8<-- [end:refresh]

    @property
    def padded_numel(self) -> int:
        return self.padded.numel()


def _by_rank(t: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`t`'s rows as the ranks hold them (rank q: rows q*rows onwards, as torch.chunk cuts): the ranks with
    all `rows` rows as one (ranks, rows x row size) view, and the next rank's shorter part, if any (the ranks
    after it hold none). A copy through these moves every rank's rows at once: two copies, not one per rank
    -- at 1,024 ranks that is the difference between two kernels per parameter and 1,024."""
    full_ranks, left = divmod(t.shape[0], rows)
    flat = t.reshape(-1)  # (contiguous: a view, so copies into the pieces land in `t`)
    size = rows * (t.numel() // t.shape[0])
    return flat[: full_ranks * size].view(full_ranks, size), flat[full_ranks * size:] if left else None


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= size
    return tuple(reversed(out))


class FSDPParamGroup:
    """The parameters of one fully_shard call, gathered by one all-gather and reduced by one reduce-scatter."""

    def __init__(self, params: list[FSDPParam], group, param_dtype=None, reduce_dtype=None, name: str = "",
                 replicate_group=None):
        self.params, self.group, self.name = params, group, name
        self.replicate_group = replicate_group  # HSDP: the same shard on other groups, averaged with them
        self.world_size, self.rank = comm.world_size(group), comm.rank(group)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        # chapter 5's three states: SHARDED, UNSHARDING (the all-gather in
        # flight, into _all_gather_output), UNSHARDED
        self.state = ShardState.SHARDED
        self._all_gather_output = self._unshard_handle = None
        # _set_unshard_async_op(True): the hooks' unshards issue their
        # copy-in and all-gather from the compute stream
        self.unshard_async_op = False

    @property
    def device(self) -> torch.device:
        """Where the shards live (the all-gathers' device)."""
        return self.params[0].padded.device if self.params else torch.device("cpu")

    # --8<-- [start:unshard]
    def unshard(self, async_op: bool = False,
                on_compute_stream: bool = False) -> None:
        """All-gather every parameter's shard in one collective. Copy-in: the padded
        shards end to end, into this rank's own slot of the output, so that no
        separate input buffer is needed. On a GPU the copy-in and the all-gather
        run on the all-gather stream (chapter 7), or, with on_compute_stream, are
        issued from the compute stream (_set_unshard_async_op)."""
        if self.state is not ShardState.SHARDED or not self.params:
            return
        dtype = self.param_dtype or self.params[0].padded.dtype
        total = sum(p.padded_numel for p in self.params)
        with (contextlib.nullcontext() if on_compute_stream else
              side_stream("all_gather", self.params[0].padded,
                          after_compute=False)):
            out = self.params[0].padded.new_empty(total * self.world_size,
                                                  dtype=dtype)
            # in place: this rank's slot is the input
            inp = out[self.rank * total: (self.rank + 1) * total]
            offset = 0
            for p in self.params:
                # (cast to param_dtype)
                inp[offset: offset + p.padded_numel].copy_(p.padded.reshape(-1))
                offset += p.padded_numel
            handle = comm.all_gather(out, inp, async_op=True,
                                     tag=f"all_gather {self.name}",
                                     group=self.group)
        self._all_gather_output, self._unshard_handle = out, handle
        self.state = ShardState.UNSHARDING
        if not async_op:
            self.wait_for_unshard()

    # --8<-- [start:copy_out]
    def wait_for_unshard(self) -> None:
        """Copy-out: rank q's slot of the output holds its shard of every parameter,
        in order; parameter i's rows from every slot, stacked, are i's unsharded
        tensor (padding rows cut off)."""
        if self.state is not ShardState.UNSHARDING:
            return
        out = self._all_gather_output
        self._unshard_handle.wait()
        slots = out.view(self.world_size, -1)  # row q: rank q's shards, end to end
        offset = 0
        for p in self.params:
            # row q: rank q's real rows
            whole, last = _by_rank(p.alloc_unsharded(out.dtype), p.rows)
            whole.copy_(slots[: len(whole), offset: offset + whole.shape[1]])
            if last is not None:
                last.copy_(slots[len(whole), offset: offset + last.numel()])
            p.show(p.unsharded)  # the module computes with the whole parameter
            offset += p.padded_numel
        # made on the all-gather stream, read by the copy-out on this one: free
        # it after that
        if out.is_cuda:
            out.record_stream(torch.cuda.current_stream(out.device))
        # copied out: the all-gather's buffer goes now, not when gloo lets go of it
        comm.release(out)
        self._all_gather_output = self._unshard_handle = None
        self.state = ShardState.UNSHARDED
    # --8<-- [end:copy_out]
    # --8<-- [end:unshard]

    def reshard(self) -> None:
        """Back to the shards: the module's parameters are the DTensors again, the unsharded ones freed."""
        if self.state is ShardState.UNSHARDING:  # never free what is being written
            self.wait_for_unshard()
        for p in self.params:
            p.show(p.sharded)
            p.free_unsharded()
        self.state = ShardState.SHARDED

    # --8<-- [start:reduce]
    def take_grads(self) -> list[tuple[FSDPParam, torch.Tensor]]:
        """The unsharded gradients autograd left on the unsharded parameters (of
        those that were used), taken off them: the parameters can then be resharded
        before the gradients are sent."""
        out = [(p, p.unsharded.grad) for p in self.params
               if p.unsharded is not None and p.unsharded.grad is not None]
        for p, _ in out:
            p.unsharded.grad = None
        return out

    def reduce_scatter_grads(self,
                             grads: list[tuple[FSDPParam, torch.Tensor]]) -> None:
        """Average the unsharded gradients over the ranks, each rank keeping its own
        shard of each, with one reduce-scatter for the module's gradients."""
        if not grads:
            return
        # --8<-- [start:reduce_copy_in]
        params = [p for p, _ in grads]
        n = self.world_size
        dtype = self.reduce_dtype or grads[0][1].dtype
        # BEGIN EXERCISE 11.2: one reduce-scatter: lay out what each rank keeps
        inp = torch.zeros(n, sum(p.padded_numel for p in params),
                          dtype=dtype, device=grads[0][1].device)
        offset = 0
        for i, (p, grad) in enumerate(grads):
            whole, last = _by_rank(grad, p.rows)  # rank q's rows go to slot q
            inp[: len(whole), offset: offset + whole.shape[1]].copy_(whole)
            if last is not None:
                inp[len(whole), offset: offset + last.numel()].copy_(last)
            # copied in: the unsharded gradient goes now
            grads[i] = grad = whole = last = None
            offset += p.padded_numel
        out = inp.new_empty(inp.shape[1])
        comm.reduce_scatter(out, inp.view(-1), op=comm.ReduceOp.AVG,
                            tag=f"reduce_scatter {self.name}",
                            group=self.group)
        comm.release(inp)
        # HSDP: then average this shard with its replicas
        if self.replicate_group is not None:
            comm.all_reduce(out, op=comm.ReduceOp.AVG,
                            tag=f"all_reduce {self.name}",
                            group=self.replicate_group)
        # END EXERCISE
        # --8<-- [end:reduce_copy_in]
        offset = 0
        # this rank's slot holds its shard of every gradient, end to end
        for p in params:
            local = (out[offset: offset + p.padded_numel]
                     .view(p.padded.shape)[: p.length])
            offset += p.padded_numel
            local = local.to(p.padded.dtype)
            grad = DTensor.from_local(local, p.mesh, p.placements,
                                      run_check=False, shape=p.shape,
                                      stride=_contiguous_stride(p.shape))
            if p.sharded.grad is None:
                p.sharded.grad = grad
            else:
                # no zero_grad() since the last step: gradients add up, as
                # for any parameter
                p.sharded.grad += grad
    # --8<-- [end:reduce]

    def numel(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)
