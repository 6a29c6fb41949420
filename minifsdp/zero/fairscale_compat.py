"""FairScale's surface on chapters 3 and 4: what a fairscale.optim.OSS or fairscale.nn.ShardedDataParallel
script calls beyond the idea each chapter teaches.

OSS (chapter 3): minifsdp.OSS is oss.py's OSS with FairScale's whole signature. Its force_broadcast_object
chooses between two ways of moving the state that are one way here, its refresh_trainable() has nothing
to re-plan, and consolidate_state_dict(to=...) is an older name for recipient_rank.

ShardedDataParallel (sdp.py) and FlatShardedDataParallel (flat_sdp.py) are chapter 1's DDP with another
way of sending the gradients. FairScale's ShardedDataParallel adds a few things a DDP does not have; they
live here, in one mixin both wrappers inherit, so that the two files keep to their chapter's idea:

    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=3e-3)
    model = ShardedDataParallel(model, optimizer, reduce_buffer_size=2**20, reduce_fp16=True)
    with model.no_sync():
        for x, y in micro_batches:
            model(x, y).backward()      # gradients accumulate locally, nothing is sent...
    model.reduce()                      # ...until now: each accumulated gradient goes to its owner
    optimizer.clip_grad_norm(1.0)
    optimizer.step()

- reduce_buffer_size (FairScale's bucket size, in elements) is turned into bucket_cap_mb;
- reduce_fp16=True averages the gradients in fp16 (half the bytes), and they land in fp32 .grad;
- auto_refresh_trainable=True re-plans the buckets at forward when parameters were frozen or unfrozen;
- reduce() sends the gradients accumulated under no_sync(); sync_buffers() broadcasts rank 0's buffers.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from minifsdp.distributed import comm
from minifsdp.mixed_precision import MixedPrecision
from minifsdp.zero import oss

FAIRSCALE_REDUCE_BUFFER_SIZE = 2 ** 23  # FairScale's default gradient bucket, in elements


class OSS(oss.OSS):
    """fairscale.optim.OSS: chapter 3's OSS (oss.py) with FairScale's arguments, in FairScale's order, then
    minifsdp's param_sync.

    force_broadcast_object: FairScale's switch between two ways of moving the state in
                            consolidate_state_dict; here there is one way (all_gather_object), the result
                            is the same, and the switch changes nothing.
    """

    def __init__(self, params, optim: type[torch.optim.Optimizer] = torch.optim.SGD, group=None,
                 broadcast_buffer_size: int = -1, broadcast_fp16: bool = False,
                 force_broadcast_object: bool = False, param_sync: str = "broadcast", **default):
        super().__init__(params, optim, group, broadcast_buffer_size, broadcast_fp16, param_sync=param_sync,
                         **default)
        self.force_broadcast_object = force_broadcast_object

    def consolidate_state_dict(self, recipient_rank: int = 0, to: int | None = None) -> None:
        """OSS's (oss.py); `to` is another name for recipient_rank."""
        super().consolidate_state_dict(recipient_rank if to is None else to)

    def refresh_trainable(self) -> None:
        """FairScale's hook for a change of requires_grad. Nothing to re-plan here: every parameter has had
        an owner since construction, frozen or not, and step() reads requires_grad each time."""


def bucket_cap_mb_from(reduce_buffer_size: int, bucket_cap_mb: float | None, module: nn.Module) -> float:
    """FairScale sizes the gradient buckets in elements (reduce_buffer_size), minifsdp in megabytes."""
    if bucket_cap_mb is not None:
        if reduce_buffer_size != FAIRSCALE_REDUCE_BUFFER_SIZE:
            raise ValueError("give the bucket size once: reduce_buffer_size (elements, FairScale's name) or "
                             "bucket_cap_mb (megabytes)")
        return bucket_cap_mb
    if isinstance(reduce_buffer_size, bool) or not isinstance(reduce_buffer_size, int) or reduce_buffer_size < 0:
        raise ValueError(f"reduce_buffer_size is a number of elements >= 0, got {reduce_buffer_size!r}")
    params = list(module.parameters()) if isinstance(module, nn.Module) else []
    element = max((p.element_size() for p in params), default=4)
    # 0 is FairScale's "no buckets": every gradient is reduced on its own, which a cap of one byte gives.
    return max(reduce_buffer_size * element, 1) / 2 ** 20


def fp16_reduction(reduce_fp16: bool, mixed_precision: MixedPrecision | None) -> MixedPrecision | None:
    """reduce_fp16=True is chapter 8's MixedPrecision(reduce_dtype=torch.float16): each bucket is cast to
    fp16, averaged, and copied back into the fp32 .grad."""
    if not reduce_fp16:
        return mixed_precision
    if mixed_precision is not None:
        raise ValueError("reduce_fp16=True is mixed_precision=MixedPrecision(reduce_dtype=torch.float16): "
                         "give one of the two")
    return MixedPrecision(reduce_dtype=torch.float16)


class FairScaleMethods:
    """What FairScale's ShardedDataParallel has beyond a DDP, for the two ZeRO-2 wrappers (DDP subclasses).

    sync_models_at_startup: False skips the broadcast of rank 0's model at construction (the DDP base's
        init_sync), on the promise that the ranks already agree, as in FairScale.
    auto_refresh_trainable: at forward, notice parameters frozen or unfrozen since the buckets were planned
        and re-plan them (True, FairScale's default), or raise an error naming them (False).
    warn_on_trainable_params_changed: warn when auto_refresh_trainable re-plans.
    """

    def _init_fairscale(self, sync_models_at_startup: bool, auto_refresh_trainable: bool,
                        warn_on_trainable_params_changed: bool) -> None:
        self.sync_models_at_startup = sync_models_at_startup
        self.auto_refresh_trainable = auto_refresh_trainable
        self.warn_on_trainable_params_changed = warn_on_trainable_params_changed
        self._trainable = self._trainable_now()
        self._buffer_broadcasts = []   # sync_buffers(blocking=False) in flight
        self._grads_to_reduce = False  # a backward ran under no_sync(): reduce() has something to send

    def _trainable_now(self) -> set:
        return {p for p in self.module.parameters() if p.requires_grad}

    # --8<-- [start:trainable]
    def _before_forward(self) -> None:
        now = self._trainable_now()
        if now != self._trainable:
            changed = sorted(self._names[p] for p in now ^ self._trainable)
            if not self.auto_refresh_trainable:
                raise RuntimeError(
                    f"the set of trainable parameters changed since "
                    f"{type(self).__name__} was built ({changed}); call "
                    f"refresh_trainable() so their gradients are routed")
            if self.warn_on_trainable_params_changed:
                warnings.warn(
                    f"{type(self).__name__}: the trainable parameters "
                    f"changed ({changed}); re-planning the buckets "
                    f"(auto_refresh_trainable=True)", stacklevel=3)
            self.refresh_trainable()
        # forward reads the buffers: they must have arrived
        for handle in self._buffer_broadcasts:
            handle.wait()
        self._buffer_broadcasts = []
        if torch.is_grad_enabled():
            self._grads_to_reduce = not self.require_backward_grad_sync

    def refresh_trainable(self) -> None:
        """Re-plan after parameters were frozen or unfrozen: the optimizer's
        part, then the buckets and the hooks (DDP's). Call it on every rank,
        before the next forward: the buckets must match."""
        self._refresh_optimizer()
        self._setup_buckets_and_hooks()
        self._trainable = self._trainable_now()
    # --8<-- [end:trainable]

    def _refresh_optimizer(self) -> None:
        """The optimizer's part of a re-plan: none for an OSS, whose partition gave every parameter an owner,
        frozen or not (the flat design lays its parameters out again)."""

    def reduce(self) -> None:
        """Send the gradients accumulated under no_sync() now, as the backward of a forward outside no_sync()
        would have (FairScale's manual reduction). Call it on every rank."""
        if not self._grads_to_reduce:
            raise RuntimeError(f"{type(self).__name__}.reduce(): no gradients are waiting. The last forward ran "
                               f"outside no_sync(), so its backward sent them already (or reduce() did)")
        self._grads_to_reduce = False
        self._unused = {p for p in self._bucket_of if p.grad is None}  # for find_unused_parameters' used map
        self._next = 0
        while self._next < len(self._buckets):  # every bucket, in the order every rank launches them
            self._launch(self._buckets[self._next])
            self._next += 1
        self._finish_buckets()

    @torch.no_grad()
    def sync_buffers(self, blocking: bool = False) -> None:
        """Every rank's buffers (BatchNorm statistics, say) become rank 0's. blocking=False returns at once:
        the broadcasts finish in the background, and the next forward waits for them before it reads any."""
        handles = [comm.broadcast(b, src=0, async_op=True, tag="buffers", group=self.process_group)
                   for b in self.module.buffers()]
        if blocking:
            for handle in handles:
                handle.wait()
        else:
            self._buffer_broadcasts.extend(handles)
