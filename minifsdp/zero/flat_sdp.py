"""Chapter 4, the flat design: ZeRO-2 on the flat ZeRO-1 of chapter 3 (flat.py).

FlatOSS alone reduce-scatters every gradient in step(), after backward, so each rank holds the full
gradients (4Ψ) until then. FlatShardedDataParallel moves the reduce-scatter into backward, bucket by
bucket, as DDP's all-reduce does: once a bucket is sent, its params' full .grad is freed, and a rank ends
backward holding only the gradients of its slice (4Ψ/N). step() then only steps and all-gathers.

    opt = FlatOSS(model.parameters(), optim=torch.optim.AdamW, bucket_cap_mb=1, lr=3e-3)
    model = FlatShardedDataParallel(model, opt)
    loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

It is chapter 1's DistributedDataParallel with its buckets taken from the FlatOSS (each a slice of one
flat buffer) and a different launch: a reduce-scatter into this rank's slice instead of an all-reduce.
The hooks, the in-order launching and the end-of-backward callback are DDP's own.

Parameters the autograd graph of the output does not reach count as ready (a zero gradient) at forward,
so every rank launches every bucket, in the same order, and nothing waits forever.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp.ddp.ddp import DistributedDataParallel, _Bucket
from minifsdp.distributed import comm
from minifsdp.zero.fairscale_compat import FairScaleMethods
from minifsdp.zero.flat import FlatOSS


class FlatShardedDataParallel(FairScaleMethods, DistributedDataParallel):
    """ZeRO-2, flat: reduce-scatter each gradient bucket during backward and free the full gradients.

    module:             built identically on every rank; rank 0's params and buffers are broadcast.
    flat_optimizer:     a FlatOSS over this module's trainable params, built with a bucket_cap_mb: its
                        buckets are the units that are reduce-scattered as soon as backward completes them.
    process_group:      the FlatOSS's group (the default; its `group=`), or the same ranks.
    broadcast_buffers:  re-broadcast rank 0's buffers before each forward, as DDP does.
    reduce_buffer_size: refused: the buckets are the FlatOSS's, sized by its bucket_cap_mb.
    reduce_fp16:        reduce-scatter the gradients in fp16: half the bytes; the slices' .grad stay fp32.
    The other arguments and the methods are ShardedDataParallel's, FairScale's (fairscale_compat.py), and
    zero_grad() also clears the slices' gradients.
    """

    rebuild_buckets = False  # the buckets are the FlatOSS's slices: their layout is fixed

    def __init__(self, module: nn.Module, flat_optimizer: FlatOSS, process_group=None, broadcast_buffers: bool = True,
                 sync_models_at_startup: bool = True, reduce_buffer_size: int | None = None,
                 auto_refresh_trainable: bool = True, reduce_fp16: bool = False,
                 warn_on_trainable_params_changed: bool = True):
        if not isinstance(flat_optimizer, FlatOSS):
            raise TypeError(f"FlatShardedDataParallel needs a FlatOSS (it reduce-scatters into the FlatOSS's "
                            f"flat shards), got {type(flat_optimizer).__name__}. Build one with "
                            f"FlatOSS(module.parameters(), optim=<optimizer class>, bucket_cap_mb=..., lr=...)")
        if flat_optimizer.bucket_cap_mb is None:
            raise ValueError("FlatShardedDataParallel needs a FlatOSS built with bucket_cap_mb=...: its buckets "
                             "are reduce-scattered one by one during backward, and with bucket_cap_mb=None a "
                             "whole param group would be one bucket, sent only when backward is over")
        if reduce_buffer_size is not None:
            raise ValueError("FlatShardedDataParallel's buckets are its FlatOSS's: size them there, with "
                             "FlatOSS(bucket_cap_mb=...) or FlatOSS(broadcast_buffer_size=...), not reduce_buffer_size")
        if process_group is not None and comm.group_ranks(process_group) != comm.group_ranks(flat_optimizer.group):
            raise ValueError("FlatShardedDataParallel(process_group=...) must be the group its FlatOSS spreads its "
                             "slices over (FlatOSS(..., group=...))")
        self.optimizer = flat_optimizer
        self.reduce_dtype = torch.float16 if reduce_fp16 else None  # None: the gradients' own dtype
        self._plan(module)
        flat_optimizer.reduce_in_backward()  # its step() now only steps and all-gathers
        self._in_flight = []  # (flat bucket, its reduce-scattered chunk, the flat input kept alive, handle)
        # find_unused_parameters: parameters the graph does not reach count as ready at forward (as zeros)
        super().__init__(module, broadcast_buffers=broadcast_buffers, find_unused_parameters=True,
                         process_group=flat_optimizer.group, init_sync=sync_models_at_startup)
        self._init_fairscale(sync_models_at_startup, auto_refresh_trainable, warn_on_trainable_params_changed)

    def _plan(self, module: nn.Module) -> None:
        """Check that the FlatOSS holds exactly the module's trainable parameters, and order its buckets."""
        names = {p: n for n, p in module.named_parameters()}
        trainable = [p for p in module.parameters() if p.requires_grad]
        in_optimizer = {p for b in self.optimizer.buckets for p in b.params}
        for p in trainable:
            if p not in in_optimizer:
                raise ValueError(f"parameter {names[p]!r} of the module is not in the FlatOSS: build the FlatOSS "
                                 f"over this module's parameters")
        for p in in_optimizer - set(trainable):
            raise ValueError(f"the FlatOSS holds a parameter of shape {tuple(p.shape)} that is not a trainable "
                             f"parameter of this module ({names.get(p, 'not in the module')})")
        # The order backward completes the buckets: the one whose earliest param comes latest goes first.
        # It depends on the model only, so every rank launches the same collectives in the same order.
        position = {p: i for i, p in enumerate(trainable)}
        self._flat_buckets = sorted(self.optimizer.buckets, key=lambda b: -min(position[p] for p in b.params))

    def _refresh_optimizer(self) -> None:
        self.optimizer.refresh_trainable()  # a new layout: new flat buckets, in a new order
        self._plan(self.module)

    def forward(self, *args, **kwargs):
        self._before_forward()  # parameters frozen or unfrozen since, buffers in flight (fairscale_compat.py)
        return super().forward(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.optimizer.zero_grad(set_to_none)  # the reduce-scattered gradients live on the FlatOSS's slices

    def _bucket_groups(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        return [b.params for b in self._flat_buckets]

    # --8<-- [start:launch]
    def _launch(self, bucket: _Bucket) -> None:
        # The previous reduce-scatter had this bucket's backward to finish:
        # hand it over, free its input now.
        # At most one in flight, as in torch's FSDP2, and a fixed rule, so
        # memory is the same in every run.
        self._retire()
        # the FlatOSS's bucket: where these params live, flat
        layout = self._flat_buckets[self._next]
        # BEGIN EXERCISE 4.2: reduce-scatter averaged grads (async), free full grads
        # .grad dropped as copied
        flat = layout.flat_grad(1.0 / self.world_size, self.reduce_dtype,
                                release=True)
        chunk = torch.empty_like(layout.shard, dtype=flat.dtype)
        handle = comm.reduce_scatter(chunk, flat, async_op=True,
                                     tag=f"bucket{self._next}",
                                     group=self.process_group)
        self._in_flight.append((layout, chunk, flat, handle))
        # END EXERCISE
    # --8<-- [end:launch]

    def _retire(self) -> None:
        """Hand finished reduce-scatters to the optimizer and drop their inputs."""
        for layout, chunk, flat, handle in self._in_flight:
            handle.wait()
            comm.release(flat)  # the full-size input: gone now, not whenever the backend lets go of it
            if layout.shard.grad is None:
                layout.shard.grad = chunk.to(layout.shard.dtype)  # (reduce_fp16: back to the slice's fp32)
            else:  # two synced backward passes without zero_grad(): gradients add up, as in DDP
                layout.shard.grad.add_(chunk)
        self._in_flight = []

    def _finish_buckets(self) -> None:
        """End of backward (every bucket has gone out: DDP's _finish checked): wait for the last one."""
        self._retire()

