"""Chapter 5: the FlatParameter -- one unit's parameters as a single flat, padded, sharded tensor.

ZeRO-3 shards the parameters themselves. Sharding each parameter separately would mean one collective
per tensor (hundreds per step, each too small to use the network well); sharding whole tensors (as OSS
does) cannot balance a model with one big tensor. So, as PyTorch FSDP does, we *flatten*: the parameters
of one unit (say, a transformer block) are concatenated into one 1-D tensor, padded to a multiple of N,
and cut into N equal shards. Each rank keeps only its shard -- the one tensor the optimizer sees.

    unit parameters  w (2x3), b (3)        ->  flat [w00 w01 w02 w10 w11 w12 b0 b1 b2 | pad pad pad]
    N = 4, padded to 12                    ->  rank 0 [w00 w01 w02]   rank 1 [w10 w11 w12] ...

(The picture leaves one thing out: each parameter really starts on a 64-byte boundary -- 16 fp32
elements -- as in FlatOSS, so b starts at 16, not 6, and the buffer is padded to a multiple of 16N.
CPU matrix kernels take different code paths, and round differently, for data at odd addresses; aligned,
every view computes exactly what the original parameter did, so FSDP can match DDP bit for bit.)

unshard(): all-gather the shards into one buffer of the padded size, and make each original parameter a
*view* into that buffer (`module.weight` becomes `flat[0:6].view(2, 3)`). Views, because copying out of
the all-gather buffer would cost time and a second copy of the memory; the price is that the buffer
lives as long as anything uses a view -- which is why the PyTorch FSDP notes count 2x buffers.
unshard(async_op=True) only *starts* the all-gather; wait_for_unshard() waits for it and makes the views.

reshard(): free the buffer's memory -- its *storage* is resized to zero, so autograd's saved views stay
valid objects while costing nothing -- and let the parameter point at the shard again. The next unshard
re-allocates the storage and all-gathers into it, in place, so those saved views see the data again.

Gradients: the views are cut from the flat parameter itself, so autograd's backward of the split
concatenates every original gradient (zeros for the gaps) into one new flat gradient of the padded size --
a copy, with the pieces and the flat gradient alive at once while it runs (chapter 5 measures it).
reduce_scatter_grad() turns it into this rank's shard of the averaged gradient: the shape of the parameter
the optimizer steps.
"""

from __future__ import annotations

import contextlib
import enum
import weakref

import torch
import torch.nn as nn

from minifsdp import events
from minifsdp.distributed import comm
from minifsdp.fsdp.streams import keep_until_compute_is_past, side_stream
from minifsdp.zero.flat import ALIGN_BYTES, flat_layout


# --8<-- [start:storage]
def _free_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)
    # no op reports a resize: say it (the meter listens)
    events.emit(events.STORAGE_RESIZED, t.untyped_storage())


def _alloc_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())
    events.emit(events.STORAGE_RESIZED, t.untyped_storage())
# --8<-- [end:storage]


# --8<-- [start:state]
class ShardState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "all-gather in flight"
    UNSHARDED = "unsharded"
# --8<-- [end:state]


class FlatParameter:
    """The parameters of one unit as one sharded flat tensor. `param` is what the optimizer steps.

    places:          (module, attribute name) of each original parameter; a tied parameter appears at
                     several places but is stored once (its places all get the same view).
    group:           the process group the unit is sharded over (default: every rank).
    replicate_group: ranks that hold the same shard, on other groups (HSDP, chapter 11): each gradient
                     shard is then averaged across them too.
    """

    # --8<-- [start:init]
    def __init__(self, places: list[tuple[nn.Module, str]],
                 requires_grad: bool = True, group=None,
                 replicate_group=None):
        self.group, self.replicate_group = group, replicate_group
        self.rank, self.world_size = comm.rank(group), comm.world_size(group)
        self.places = places
        # index[i]: which of `params` the i-th place shows
        params, self.index = [], []
        for module, name in places:
            p = getattr(module, name)
            if not any(p is q for q in params):
                params.append(p)
            self.index.append(next(i for i, q in enumerate(params) if q is p))
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)
        # --8<-- [start:flatten]
        # BEGIN EXERCISE 5.1: flatten, pad to N equal shards, keep this rank's shard
        # where each parameter starts, and the size padded so that it cuts
        # into N equal shards. Each starts on a 64-byte boundary, as in
        # FlatOSS: CPU matmul kernels round differently at odd offsets, and an
        # aligned view computes exactly what the original parameter did
        align = max(1, ALIGN_BYTES // params[0].element_size())
        self.offsets, padded_numel = flat_layout(self.numels, self.world_size,
                                                 align)
        self.shard_numel = padded_numel // self.world_size
        padded = torch.zeros(padded_numel, dtype=params[0].dtype,
                             device=params[0].device)
        # straight into place: no second full copy
        for p, offset in zip(params, self.offsets):
            padded[offset: offset + p.numel()].copy_(p.detach().reshape(-1))
        start = self.rank * self.shard_numel
        # a copy: `padded`'s memory is released
        shard = padded[start: start + self.shard_numel].clone()
        # END EXERCISE
        self.param = nn.Parameter(shard, requires_grad=requires_grad)
        # the one copy that persists
        self._shard = shard
        # becomes the all-gather buffer: no memory while sharded
        self._full = padded
        _free_storage(self._full)
        self.state = ShardState.SHARDED
        # --8<-- [end:flatten]
        # the all-gather in flight (UNSHARDING), and what it sends
        self._unshard_handle = self._all_gather_input = None
        # what a reduce-scatter in flight sends (kept alive until its wait)
        self.reduce_input = None
        # the unit's name, for the byte counter's tags
        self.name = ""
        # the autograd node of the views' split (_set_views)
        self.concat_node = None
        # the originals live on only as views
        for module, name in places:
            delattr(module, name)
        for p in params:
            # and an old reference holds nothing
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        # an optimizer still holding one is caught (chapter 6)
        self._originals = [weakref.ref(p) for p in params]
        self._set_views(use_full=False)
    # --8<-- [end:init]

    # --8<-- [start:unshard]
    # --8<-- [start:unshard_call]
    def unshard(self, async_op: bool = False) -> None:
        """All-gather the full parameters and point every original parameter
        at its view into them. async_op=True: only start the all-gather (a
        prefetch); wait_for_unshard() finishes it."""
        if self.state is ShardState.SHARDED:
            # (on a GPU, a stream of its own: chapter 7)
            with side_stream("all_gather", self._full, after_compute=False):
                # BEGIN EXERCISE 5.3: reallocate the full buffer, all-gather into it
                # memory of the all-gather stream, the buffer's writer
                _alloc_storage(self._full)
                self._all_gather_input = self.all_gather_input()
                self._unshard_handle = comm.all_gather(
                    self._full, self._all_gather_input, async_op=True,
                    tag=f"unshard {self.name}", group=self.group)
                # END EXERCISE
            self.state = ShardState.UNSHARDING
        if not async_op:
            self.wait_for_unshard()
    # --8<-- [end:unshard_call]

    def all_gather_input(self) -> torch.Tensor:
        """What this rank sends to the all-gather: its shard (chapter 8: a
        cast of it)."""
        return self._shard

    def wait_for_unshard(self) -> None:
        """Block until the all-gather (if one is in flight) has filled the
        buffer; then show the views.

        The views are made here, just before the unit computes, not when a
        prefetch starts: autograd runs the nodes made last first, and views
        made early would put this unit's gradient behind the previous unit's
        backward, delaying its reduce-scatter and keeping its buffer alive
        longer."""
        if self.state is ShardState.UNSHARDING:
            self._unshard_handle.wait()
            self._unshard_handle = self._all_gather_input = None
            self.param.data = self._full
            self._set_views(use_full=True)
            self.state = ShardState.UNSHARDED
    # --8<-- [end:unshard]

    # --8<-- [start:reshard]
    def reshard(self) -> None:
        """Back to the shard only: the unsharded buffer's memory is released
        (its views stay as objects)."""
        if self.state is ShardState.SHARDED:
            return
        # never free a buffer the network is still writing into
        if self.state is ShardState.UNSHARDING:
            self._unshard_handle.wait()
            self._unshard_handle = self._all_gather_input = None
        self.param.data = self._shard
        # (on a GPU the compute stream may still be reading it: chapter 7)
        keep_until_compute_is_past(self._full)
        _free_storage(self._full)
        self._set_views(use_full=False)
        self.state = ShardState.SHARDED
    # --8<-- [end:reshard]

    # --8<-- [start:free_before_concat]
    def free_before_concat(self) -> None:
        """Free the full parameters' memory inside backward, just before autograd
        concatenates their gradients into the flat gradient (the split's
        backward, concat_node): no node that reads them is left, and the
        concatenation needs a flat gradient's worth of memory. The parameter
        keeps its full shape until reshard(), which follows as soon as the flat
        gradient is complete: autograd checks that gradient against it, and
        reads nothing else of it."""
        if self.state is ShardState.UNSHARDED:
            keep_until_compute_is_past(self._full)  # as in reshard()
            _free_storage(self._full)
    # --8<-- [end:free_before_concat]

    # --8<-- [start:views]
    def _set_views(self, use_full: bool) -> None:
        # Cut from self.param (now the full buffer), so autograd sends their
        # gradients into param.grad -- even when made inside backward, where
        # grad mode is off: a forward recomputed there (activation
        # checkpointing, chapter 9) computes with these views, and its
        # gradients must reach param.grad.
        with torch.enable_grad():
            # one split of the whole buffer, gaps included: autograd then
            # writes the flat gradient once (a slice per parameter would give
            # each its own zero-filled full-size gradient, summed)
            # --8<-- [start:split]
            if use_full:
                sizes, end = [], 0
                for offset, numel in zip(self.offsets, self.numels):
                    # the gap before this parameter, then the parameter
                    sizes += [offset - end, numel]
                    end = offset + numel
                views = self.param.split(sizes + [self.param.numel() - end])[1::2]
                # its backward concatenates the views' gradients into the flat
                # one: it runs once every node that reads these parameters has
                # run (free_before_concat)
                self.concat_node = views[0].grad_fn
            # --8<-- [end:split]
            else:
                # sharded: the originals are not usable; empty tensors make a
                # stray use fail loudly
                empty = torch.empty(0, dtype=self._shard.dtype,
                                    device=self._shard.device)
                views = [empty] * len(self.numels)
            for (module, name), i in zip(self.places, self.index):
                setattr(module, name,
                        views[i].view(self.shapes[i]) if use_full else views[i])
    # --8<-- [end:views]

    # --8<-- [start:reduce_scatter_grad]
    # --8<-- [start:reduce_scatter]
    def reduce_scatter_grad(self, full_grad: torch.Tensor):
        """Start averaging the flat gradient across ranks; returns (async
        handle, this rank's shard of it). The tensor being sent -- `full_grad`
        itself, scaled by 1/N in place -- is left in self.reduce_input: it must
        stay alive until the handle is waited on."""
        self.reduce_input = full_grad
        # on a GPU: off the compute stream
        with side_stream("reduce_scatter", full_grad, after_compute=True):
            # BEGIN EXERCISE 5.2: this rank's averaged shard, by one reduce-scatter
            # average as DDP does: 1/N first (in place: no second copy)
            full_grad.mul_(1.0 / self.world_size)
            # in place: the output is this rank's own chunk of the input (NCCL
            # and gloo allow it), so no second buffer waits beside full_grad
            # while the reduce-scatter is in flight (grad_for_optimizer copies
            # it out)
            start = self.rank * self.shard_numel
            grad_shard = full_grad[start: start + self.shard_numel]
            handle = comm.reduce_scatter(grad_shard, full_grad, async_op=True,
                                         tag=f"reduce_scatter {self.name}",
                                         group=self.group)
            # END EXERCISE
    # --8<-- [end:reduce_scatter]
        if self.replicate_group is not None:
            handle = _ThenAverageAcross(handle, grad_shard,
                                        self.replicate_group, self.name)
        return handle, grad_shard

    def grad_for_optimizer(self, grad_shard: torch.Tensor,
                           read_now: bool = False) -> torch.Tensor:
        """Once the reduce-scatter is done: the gradient shard the optimizer
        steps, copied out of the full gradient, which goes now. (read_now: the
        caller reads it at once; chapter 8's offload may copy it later.)"""
        grad = grad_shard.to(self._shard.dtype, copy=True)
        sent, self.reduce_input = self.reduce_input, None
        # freed now, not whenever the backend lets go of it (comm.release)
        comm.release(sent)
        return grad
    # --8<-- [end:reduce_scatter_grad]

    # --8<-- [start:write_back]
    def write_back_shard(self) -> None:
        """Copy this rank's slice of the (edited) full parameters back into
        its shard."""
        start = self.rank * self.shard_numel
        with torch.no_grad():
            self._shard.copy_(self._full[start: start + self.shard_numel])
    # --8<-- [end:write_back]

    def full_precision(self):
        """Inside: unshard() gathers what the optimizer steps (chapter 8's fp32
        masters); without mixed precision, that is what it gathers anyway."""
        return contextlib.nullcontext()

    @property
    def uses_sharded_strategy(self) -> bool:
        """Each rank holds 1/N of the unit (FSDP1's NO_SHARD holds all of it)."""
        return True

    @property
    def is_unsharded(self) -> bool:
        """Whether the full buffer holds (or is receiving) memory: any state but SHARDED."""
        return self.state is not ShardState.SHARDED


# --8<-- [start:then_average]
class _ThenAverageAcross:
    """HSDP's second step: once the reduce-scatter within the shard group is
    done, the gradient shard is averaged across the replicas. On gloo two
    groups' collectives keep no order between them, so the all-reduce may only
    be issued after the reduce-scatter is waited for -- and, for every rank to
    issue the replicas' all-reduces in the same order, at a point of the program
    every rank reaches in the same order: wait(), never a poll."""

    def __init__(self, handle, grad_shard, group, name: str):
        self._handle, self._shard = handle, grad_shard
        self._group, self._name = group, name

    def is_completed(self) -> bool:
        return False  # the second collective is issued by wait() alone

    def wait(self) -> None:
        self._handle.wait()
        self._shard.mul_(1.0 / comm.world_size(self._group))
        comm.all_reduce(self._shard, tag=f"all_reduce {self._name}",
                        group=self._group)
# --8<-- [end:then_average]
