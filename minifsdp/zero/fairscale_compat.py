"""FairScale's surface on chapters 3 and 4: what a fairscale.optim.OSS or fairscale.nn.ShardedDataParallel
script calls beyond the idea each chapter teaches.

OSS (chapter 3): minifsdp.OSS is oss.py's OSS with FairScale's whole signature: step(closure, **kwargs)
hands the keyword arguments on to the wrapped optimizer's step. Its force_broadcast_object
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
        self._step_kwargs = {}  # step()'s keyword arguments, for _local_step

    def step(self, closure=None, **kwargs):
        """OSS's step (oss.py); as in FairScale, keyword arguments go on to the wrapped optimizer's step
        (apex's fused optimizers take some)."""
        self._step_kwargs = kwargs
        try:
            return super().step(closure)
        finally:
            self._step_kwargs = {}

    def _local_step(self, closure):
        if closure is None:
            return self.optim.step(**self._step_kwargs)
        return self.optim.step(closure=closure, **self._step_kwargs)

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


class ShardedOptimizers:
    """FairScale's list of sharded optimizers, each over parameters of its own, seen by ShardedDataParallel
    as one: which rank owns each parameter. Each OSS steps and broadcasts its own parameters."""

    def __init__(self, optimizers: list[oss.OSS]):
        self.optimizers = optimizers
        self.group = optimizers[0].group

    def owned_params(self, rank: int) -> list[torch.Tensor]:
        return [p for optimizer in self.optimizers for p in optimizer.owned_params(rank)]


def one_sharded_optimizer(sharded_optimizer) -> oss.OSS | ShardedOptimizers:
    """ShardedDataParallel's sharded_optimizer: an OSS, or, as in FairScale, a list of them over disjoint
    parameters and the same ranks (two optimizers over two parameter sets, say)."""
    optimizers = list(sharded_optimizer) if isinstance(sharded_optimizer, (list, tuple)) else [sharded_optimizer]
    for optimizer in optimizers:
        if not isinstance(optimizer, oss.OSS):
            name = type(optimizer).__name__
            raise TypeError(f"ShardedDataParallel needs a sharded optimizer (minifsdp.OSS), or a list of them, to "
                            f"know which rank owns each gradient; got {name}. Wrap it: "
                            f"OSS(model.parameters(), optim={name}, ...)")
    if not optimizers:
        raise ValueError("ShardedDataParallel got an empty list of sharded optimizers")
    if len({tuple(comm.group_ranks(optimizer.group)) for optimizer in optimizers}) > 1:
        raise ValueError("ShardedDataParallel's sharded optimizers must shard over the same ranks (group=...)")
    params = [p for optimizer in optimizers for p in optimizer._all_params()]
    if len(set(params)) < len(params):
        raise ValueError("a parameter is in two of ShardedDataParallel's sharded optimizers: it would be stepped "
                         "twice; give each optimizer parameters of its own")
    return optimizers[0] if len(optimizers) == 1 else ShardedOptimizers(optimizers)


def refuse_grads_requiring_grad(params, names: dict, wrapper: str) -> None:
    """A .grad that itself requires grad (backward(create_graph=True), for a double backward) would be
    reduced as plain numbers, its graph dropped: refused, as FairScale refuses it."""
    for p in params:
        if p.grad is not None and p.grad.requires_grad:
            raise RuntimeError(f"{wrapper} only works with gradients that do not require grad; the "
                               f"gradient of {names.get(p, 'a parameter')!r} does (backward(create_graph=True), "
                               f"or a .grad set by hand). Reduce higher-order gradients without the wrapper")


class FairScaleMethods:
    """What FairScale's ShardedDataParallel has beyond a DDP, for the two ZeRO-2 wrappers (DDP subclasses).

    sync_models_at_startup: False skips the broadcast of rank 0's model at construction (the DDP base's
        init_sync), on the promise that the ranks already agree, as in FairScale.
    auto_refresh_trainable: at forward, notice parameters frozen or unfrozen since the buckets were planned
        and re-plan them (True, FairScale's default), or raise an error naming them (False).
    warn_on_trainable_params_changed: warn when auto_refresh_trainable re-plans.

    Beyond the arguments, as in FairScale: torch DDP's attributes is_multi_device_module and device_type;
    attributes the wrapper does not have are the module's; trainable parameters may get no gradient in a
    step without a switch (_unlaunched_buckets); a .grad that requires grad is refused.
    """

    def _init_fairscale(self, sync_models_at_startup: bool, auto_refresh_trainable: bool,
                        warn_on_trainable_params_changed: bool) -> None:
        self.sync_models_at_startup = sync_models_at_startup
        self.auto_refresh_trainable = auto_refresh_trainable
        self.warn_on_trainable_params_changed = warn_on_trainable_params_changed
        self._trainable = self._trainable_now()
        self._buffer_broadcasts = []   # sync_buffers(blocking=False) in flight
        self._grads_to_reduce = False  # a backward ran under no_sync(): reduce() has something to send
        # torch DDP's attributes, which scripts read (FairScale has them too)
        devices = {p.device for p in self.module.parameters()}
        if len({d.type for d in devices}) > 1:
            raise ValueError(f"{type(self).__name__}: the module's parameters are on several types of device "
                             f"({sorted({d.type for d in devices})}); move them to one")
        self.is_multi_device_module = len(devices) > 1
        self.device_type = next(iter(devices)).type if devices else "cpu"

    def __getattr__(self, name: str):
        """As in FairScale: what the wrapper does not have, the wrapped module may (model.config, say)."""
        try:
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules
        except AttributeError:
            if name == "module":  # (not set yet, during __init__)
                raise
            return getattr(self.module, name)

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
        # (FairScale refuses a .grad that requires grad here)
        refuse_grads_requiring_grad(self._trainable, self._names,
                                    type(self).__name__)
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

    def _on_grad_ready(self, p) -> None:
        # (the gradient backward(create_graph=True) just made)
        refuse_grads_requiring_grad([p], self._names, type(self).__name__)
        super()._on_grad_ready(p)

    def _unlaunched_buckets(self) -> None:
        """As in FairScale, trainable parameters may get no gradient in a step (a head unused in pre-training):
        their buckets go at the end of backward, with zeros for them, in the order every rank launches them.
        Nothing is spent on finding them when every gradient arrives; when one does not, the buckets after
        its own wait for the end of backward. Its owner gets the average, or zeros if no rank used it (the
        optimizer steps it: momentum and weight decay act), as FairScale's buckets give. With
        find_unused_parameters=True, torch DDP's way: a parameter no rank used keeps .grad = None."""
        self._launch_from(self._next)

    def _launch_from(self, first: int) -> None:
        """Launch the buckets from `first` on, in order, as every rank does."""
        self._next = first
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
            self._next += 1

    def reduce(self) -> None:
        """Send the gradients accumulated under no_sync() now, as the backward of a forward outside no_sync()
        would have (FairScale's manual reduction). Call it on every rank."""
        if not self._grads_to_reduce:
            raise RuntimeError(f"{type(self).__name__}.reduce(): no gradients are waiting. The last forward ran "
                               f"outside no_sync(), so its backward sent them already (or reduce() did)")
        self._grads_to_reduce = False
        self._unused = {p for p in self._bucket_of if p.grad is None}  # for find_unused_parameters' used map
        self._launch_from(0)
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
