"""Chapter 4: ZeRO-2, gradient sharding -- ShardedDataParallel, with FairScale's name and signature.

After chapter 3 each rank steps only the parameters it owns, yet DDP still hands every rank the averaged
gradient of *every* parameter: 4Ψ bytes per rank, of which (N-1)/N is thrown away unread. ZeRO-2 sends
each gradient only where it is needed:

- buckets are formed per owner (every parameter of a bucket is owned by one rank);
- when a bucket's gradients are ready in backward, it is *reduced* (not all-reduced) to its owner,
  asynchronously, while backward goes on;
- the other ranks drop their copy of those gradients at once, so gradient memory per rank falls toward
  4Ψ/N; after the optimizer step the owners broadcast the updated parameters (OSS does that).

    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=3e-3)
    model = ShardedDataParallel(model, optimizer)
    model(x, y).backward(); optimizer.step()

This is chapter 1's DistributedDataParallel with three methods changed: how parameters are grouped into
buckets, what launching a bucket does, and what happens to the result. Traffic per rank: a reduce
(Ψ(N-1)/N) plus the owners' broadcast (Ψ(N-1)/N) = 2Ψ(N-1)/N, the same as DDP's all-reduce, for 1/N of
the gradient memory.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp.ddp.ddp import DistributedDataParallel, _Bucket
from minifsdp.distributed import comm
from minifsdp.zero.fairscale_compat import (FAIRSCALE_REDUCE_BUFFER_SIZE, FairScaleMethods, bucket_cap_mb_from,
                                            fp16_reduction, one_sharded_optimizer)
from minifsdp.zero.oss import OSS


class OwnedBucket(_Bucket):
    """A bucket whose gradients all belong to one rank: reduced to it alone."""

    def __init__(self, params: list[nn.Parameter], owner: int):
        super().__init__(params)
        self.owner = owner     # the rank that steps these parameters
        self.had_grad = None   # at launch: which params had a gradient here


class ShardedDataParallel(FairScaleMethods, DistributedDataParallel):
    """ZeRO-2 data parallelism for a model whose optimizer is an OSS. FairScale's arguments, in its order:

    sharded_optimizer:      the OSS over the module's trainable parameters, or, as in FairScale, a list of
                            OSS over disjoint parts of them.

    process_group:          the OSS's group (the default); another group would send gradients to ranks that
                            do not own them, so it is refused.
    broadcast_buffers:      as in DistributedDataParallel.
    sync_models_at_startup, auto_refresh_trainable, warn_on_trainable_params_changed: see fairscale_compat.py.
    reduce_buffer_size:     size of a gradient bucket, in elements (every bucket belongs to one owner rank);
                            0: a bucket per gradient.
    reduce_fp16:            average the gradients in fp16: half the bytes, and fp16's rounding.
    and minifsdp's, by name: bucket_cap_mb (the bucket size in MB instead of reduce_buffer_size),
    find_unused_parameters and mixed_precision (as in DistributedDataParallel). Trainable parameters that
    get no gradient need no switch, as in FairScale (fairscale_compat.py's _unlaunched_buckets); with
    find_unused_parameters=True they are found at forward and handled as torch's DDP does.
    Methods: no_sync() (DDP's), reduce(), sync_buffers(), refresh_trainable() (fairscale_compat.py), and
    nn.Module's zero_grad(set_to_none=True).
    """

    rebuild_buckets = False  # buckets are grouped by owner; a rebuild by arrival order would mix owners

    # --8<-- [start:init]
    def __init__(self, module: nn.Module, sharded_optimizer: OSS | list[OSS],
                 process_group=None, broadcast_buffers: bool = True,
                 sync_models_at_startup: bool = True,
                 reduce_buffer_size: int = FAIRSCALE_REDUCE_BUFFER_SIZE,
                 auto_refresh_trainable: bool = True, reduce_fp16: bool = False,
                 warn_on_trainable_params_changed: bool = True, *,
                 bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, mixed_precision=None):
        # an OSS, or FairScale's list of them (fairscale_compat.py)
        sharded_optimizer = one_sharded_optimizer(sharded_optimizer)
        if process_group is None:
            process_group = sharded_optimizer.group
        elif (comm.group_ranks(process_group)
              != comm.group_ranks(sharded_optimizer.group)):
            raise ValueError("ShardedDataParallel(process_group=...) must be "
                             "the group its OSS shards over "
                             "(OSS(..., group=...)): owner ranks are ranks of "
                             "that group")
        self.sharded_optimizer = sharded_optimizer
        self.rank = comm.rank(process_group)
        self._reduced, self._saved = set(), {}  # see forward
        # buckets this rank reduced to another owner, still in flight
        # (_retire_sent)
        self._sent = []
        super().__init__(
            module, bucket_cap_mb_from(reduce_buffer_size, bucket_cap_mb, module),
            broadcast_buffers, find_unused_parameters,
            fp16_reduction(reduce_fp16, mixed_precision), process_group,
            init_sync=sync_models_at_startup)
        self._init_fairscale(sync_models_at_startup, auto_refresh_trainable,
                             warn_on_trainable_params_changed)

    def _owners(self) -> dict:
        owner = {p: r for r in range(self.world_size)
                 for p in self.sharded_optimizer.owned_params(r)}
        for name, p in self.module.named_parameters():
            if p.requires_grad and p not in owner:
                raise ValueError(f"parameter {name!r} requires grad but is not "
                                 f"in the sharded optimizer, so no rank owns its "
                                 f"gradient. Build the OSS over "
                                 f"module.parameters().")
        return owner
    # --8<-- [end:init]

    # --8<-- [start:bucket_groups]
    # --8<-- [start:owner_buckets]
    def _bucket_groups(
            self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """Buckets of one owner (and one dtype, as DDP's) each, in the order
        they fill up as backward produces gradients."""
        owner = self._owners()
        # BEGIN EXERCISE 4.3: owner buckets: one owner each, one cap among them
        open_buckets, sizes, groups = {}, {}, []
        for p in reversed(params):  # the order backward produces gradients
            key = (owner[p], p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            if open_buckets and sum(sizes.values()) + nbytes > self._cap:
                # The open buckets, one per owner (and dtype), together wait
                # for no more than one cap, as DDP's one open bucket does: the
                # fullest is launched now. Were each owner's bucket allowed a
                # whole cap, N caps of gradients could wait unsent; and since
                # OSS deals the parameters out across the whole model, a cap as
                # large as a share (FairScale's default) fills only at
                # backward's end.
                fullest = max(sizes, key=sizes.get)
                groups.append(open_buckets.pop(fullest))
                del sizes[fullest]
            open_buckets.setdefault(key, []).append(p)
            sizes[key] = sizes.get(key, 0) + nbytes
        groups.extend(open_buckets.values())
        # END EXERCISE
        return groups
    # --8<-- [end:owner_buckets]

    def _set_buckets(self, groups) -> None:
        self._owner = self._owners()
        super()._set_buckets(groups)

    def _new_bucket(self, params: list[nn.Parameter]) -> OwnedBucket:
        return OwnedBucket(params, owner=self._owner[params[0]])
    # --8<-- [end:bucket_groups]

    def forward(self, *args, **kwargs):
        self._before_forward()  # parameters frozen or unfrozen since, buffers in flight (fairscale_compat.py)
        if torch.is_grad_enabled():
            # An owner's .grad may still hold the average of an earlier backward (no zero_grad since).
            # Under DDP every rank holds that average, so adding new gradients and averaging again is
            # right; here only the owner does, so set it aside and add it back after this reduction.
            for p in self._reduced:
                if p.grad is not None:
                    self._saved[p], p.grad = p.grad, None
            self._reduced = set()
        return super().forward(*args, **kwargs)

    # --8<-- [start:launch]
    def _launch(self, bucket: OwnedBucket) -> None:
        # the previous send had this bucket's backward to finish: its flat
        # copy goes now
        self._retire_sent()
        # for the owner's write-back
        bucket.had_grad = [p.grad is not None for p in bucket.params]
        # BEGIN EXERCISE 4.1: flatten, dropping grads as copied; reduce to the owner
        # every rank: the owner gets the sum back in `flat`
        bucket.flat = self._flatten(bucket, release=True)
        bucket.handle = comm.reduce(bucket.flat, dst=bucket.owner,
                                    async_op=True, tag=f"bucket{self._next}",
                                    group=self.process_group)
        if bucket.owner != self.rank:
            self._sent.append(bucket)  # scratch once the reduce is done
        # END EXERCISE
    # --8<-- [end:launch]

    # --8<-- [start:retire]
    def _retire_sent(self) -> None:
        """Let go of the flat copies this rank sent to other owners. Kept until
        backward ends, they would add up to the 4Ψ(N-1)/N ZeRO-2 is meant to
        save. At most one send is in flight, as in torch's FSDP2 (each
        reduce-scatter's input is freed when the next one is issued): a fixed
        rule, not "whichever happens to have finished", so memory is the same
        from run to run; and the wait rarely blocks."""
        for bucket in self._sent:
            bucket.handle.wait()
            comm.release(bucket.flat)
            bucket.handle = bucket.flat = None
        self._sent = []
    # --8<-- [end:retire]

    # --8<-- [start:write_back]
    def _write_back(self, bucket: OwnedBucket, globally_used) -> None:
        if bucket.owner != self.rank:
            self._retire_sent()  # (the last one sent)
            return
        bucket.handle.wait()
        # The owner's gradients become views of the reduced flat bucket: no
        # second copy of them.
        offset = 0
        for p, had_grad in zip(bucket.params, bucket.had_grad):
            average = bucket.flat[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
            if had_grad or globally_used is None or globally_used[p]:
                p.grad = (average if average.dtype == p.dtype
                          else average.to(p.dtype))
            # an earlier backward's average (see forward)
            saved = self._saved.pop(p, None)
            if saved is not None:
                p.grad = saved if p.grad is None else p.grad.add_(saved)
            self._reduced.add(p)
    # --8<-- [end:write_back]


SDP = ShardedDataParallel
