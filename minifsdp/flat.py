"""Chapters 3 and 4, the flat design: ZeRO-1 and ZeRO-2 laid out as the ZeRO paper and llm.c do.

OSS (FairScale) hands each rank whole parameters, picked greedily by size. The flat design instead lays
every trainable parameter of a param group end to end in one flat buffer, pads it to a multiple of N,
and gives rank r the r-th contiguous 1/N of it. Two things follow:
- the shards are equal to the element, whatever the shapes (the ranks' real elements differ by at most
  the padding);
- the communication is DDP's all-reduce cut in its two halves (chapter 1): the gradients are
  reduce-scattered (each rank gets the sum of its own 1/N only), the owner steps its slice, and the
  parameters are all-gathered back. Per step: 2 x padded bytes x (N-1)/N, DDP's 2Ψ(N-1)/N.

    opt = FlatOSS(model.parameters(), optim=torch.optim.AdamW, bucket_cap_mb=1, lr=3e-3)  # ZeRO-1 (no DDP)
    model = FlatShardedDataParallel(model, opt)                                           # ... and ZeRO-2
    loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

ZeRO-1 (FlatOSS alone): backward leaves each rank its full local gradients; step() reduce-scatters them
into the owned slice's gradient, steps the slice, all-gathers the parameters. Every rank keeps the
optimizer state of its slice only (8Ψ/N for Adam instead of 8Ψ).

ZeRO-2 (FlatShardedDataParallel): the reduce-scatter moves into backward, bucket by bucket, as DDP's
all-reduce does; once a bucket is sent, its params' full .grad is freed, so a rank ends backward holding
only the gradients of its slice (4Ψ/N instead of 4Ψ). step() then only steps and all-gathers.

Layout. With bucket_cap_mb=None a group is one bucket; otherwise it is cut into consecutive buckets of
about that size, in reverse registration order (the order backward produces gradients). Inside a bucket
each param starts on a 64-byte boundary (ALIGN_BYTES, below); each bucket is padded to a multiple of N on
its own, and rank r owns chunk r of every bucket. The parameters become views into the flat buffer, so
once the all-gather lands they are current without a copy. Padding is zero and stays zero: its gradient
is zero on every rank, and an element-wise optimizer maps (0, 0) to 0.

Semantics that differ from torch's optimizers. The local optimizer steps one tensor per (group, bucket),
every element of it, every step. So a parameter that got no gradient is stepped with a zero gradient:
momentum and weight decay still act on it. torch's per-parameter optimizers skip a parameter whose .grad
is None. The two agree whenever every trainable parameter gets a gradient. Optimizers that are not
element-wise (per-tensor norms: LAMB, Adafactor) see a slice instead of a parameter and legitimately
differ.

Run it on 2 CPU ranks (`demo` below: a tiny GPT, 3 steps of ZeRO-2 with AdamW):

    python -c "from minifsdp import launch; from minifsdp.flat import demo; print(launch(demo, world_size=2))"
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from minifsdp import comm
from minifsdp.ddp import DistributedDataParallel, _pack, _params_reached_from


# --8<-- [start:layout]
# Each param starts on a 64-byte boundary, as it would in a tensor of its own: CPU matrix kernels take
# another code path (so round differently) for unaligned data, and the params must compute as DDP's do.
ALIGN_BYTES = 64


def _layout(params: list[nn.Parameter], world_size: int) -> tuple[list[int], int]:
    """Where each param starts in its bucket, and the bucket's padded size (N equal chunks, aligned)."""
    align = max(1, ALIGN_BYTES // params[0].element_size())
    offsets, end = [], 0
    for p in params:
        offsets.append(-(-end // align) * align)
        end = offsets[-1] + p.numel()
    unit = math.lcm(align, world_size)  # a multiple of N, and the next bucket starts aligned
    return offsets, -(-end // unit) * unit
# --8<-- [end:layout]


class FlatBucket:
    """Consecutive params of one group, living in one padded slice of the group's flat buffer."""

    def __init__(self, group: int, params: list[nn.Parameter], offsets: list[int], flat: torch.Tensor,
                 rank: int, world_size: int):
        self.group, self.params, self.offsets, self.flat = group, params, offsets, flat
        self.numel = sum(p.numel() for p in params)  # real elements; the other flat.numel() - numel are padding
        chunk = flat.numel() // world_size
        self.start = rank * chunk  # where this rank's chunk begins in `flat`
        # The tensor the local optimizer steps. A plain (non-grad) view is a leaf, so optimizers accept it,
        # and stepping it in place updates the flat buffer, hence the params that view it.
        self.shard = flat[self.start: self.start + chunk]

    def flat_grad(self, scale: float) -> torch.Tensor:
        """The bucket's gradients in its flat layout, times `scale`; zeros for padding and missing grads."""
        out = torch.zeros_like(self.flat)
        for p, start in zip(self.params, self.offsets):
            if p.grad is not None:
                out[start: start + p.numel()].copy_(p.grad.reshape(-1))
        # x * (1/N) before the sum, as torch's DDP does: the same rounding, so the same bits (ddp.py).
        return out.mul_(scale)


class FlatOSS(torch.optim.Optimizer):
    """ZeRO-1, flat: each rank owns a contiguous 1/N of every bucket and keeps optimizer state for it only.

    params:        as for any torch optimizer (param groups work; an LR scheduler drives param_groups).
    optim:         the optimizer class that steps this rank's slices, e.g. torch.optim.AdamW.
    bucket_cap_mb: None: one bucket per param group; else buckets of about this size (needed for ZeRO-2).
    **defaults:    the optimizer's hyper-parameters (lr=..., weight_decay=...).

    Do not wrap the model in DDP: step() averages the gradients itself (reduce-scatter), and rank 0's
    values of the parameters are broadcast at construction so that every replica starts the same.
    """

    def __init__(self, params, optim=torch.optim.SGD, bucket_cap_mb: float | None = None, **defaults):
        comm.require_process_group()
        self.buckets: list[FlatBucket] | None = None  # add_param_group is allowed until the layout exists
        super().__init__(params, defaults)
        self.world_size, self.rank = comm.world_size(), comm.rank()
        self.bucket_cap_mb = bucket_cap_mb
        # FlatShardedDataParallel turns this off: it reduce-scatters during backward, into the shards' .grad.
        self.reduce_in_step = True

        # The layout must be identical on every rank, or the collectives would mix up slices.
        comm.assert_same_across_ranks([(f"param_groups[{g}][{i}]", p) for g, group in enumerate(self.param_groups)
                                       for i, p in enumerate(group["params"])])
        # --8<-- [start:buffers]
        cap = math.inf if bucket_cap_mb is None else bucket_cap_mb * 1024 * 1024
        self.buckets, self._buffers = [], []
        for g, group in enumerate(self.param_groups):
            # Frozen params are never communicated; a param listed twice is laid out once.
            trainable = list(dict.fromkeys(p for p in group["params"] if p.requires_grad))
            if not trainable:
                continue
            if len({(p.dtype, p.device) for p in trainable}) > 1:
                raise ValueError(f"param group {g} mixes dtypes or devices; one flat buffer needs one of each")
            # Reverse registration order, registration order inside a bucket: as ddp.py packs its buckets.
            groups = [b[::-1] for b in _pack(trainable[::-1], cap)]
            layouts = [_layout(b, self.world_size) for b in groups]
            buffer = torch.zeros(sum(size for _, size in layouts), dtype=trainable[0].dtype,
                                 device=trainable[0].device)
            self._buffers.append(buffer)
            start = 0
            for bucket_params, (offsets, size) in zip(groups, layouts):
                bucket = FlatBucket(g, bucket_params, offsets, buffer[start: start + size], self.rank,
                                    self.world_size)
                for p, offset in zip(bucket_params, bucket.offsets):
                    view = bucket.flat[offset: offset + p.numel()].view_as(p)
                    view.copy_(p.detach())
                    p.data = view  # the param now lives in the flat buffer
                self.buckets.append(bucket)
                start += size
        # --8<-- [end:buffers]
        if not self.buckets:
            raise ValueError("FlatOSS got no trainable parameters")
        for buffer in self._buffers:
            comm.broadcast(buffer, src=0)

        self._local = optim([dict(self._hyper(b.group), params=[b.shard]) for b in self.buckets], **defaults)
        # Complete our groups with the class's defaults, so they read like a plain torch optimizer's.
        for b, local_group in zip(self.buckets, self._local.param_groups):
            for k, v in local_group.items():
                if k != "params":
                    self.param_groups[b.group].setdefault(k, v)
        # The state this rank really holds, keyed by its shards: what a memory meter should see.
        self.state = self._local.state

    def add_param_group(self, param_group: dict) -> None:
        if self.buckets is not None:
            raise NotImplementedError("FlatOSS lays out its parameters once, at construction: pass every "
                                      "param group to the constructor")
        super().add_param_group(param_group)

    def _hyper(self, g: int) -> dict:
        return {k: v for k, v in self.param_groups[g].items() if k != "params"}

    # --8<-- [start:step]
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Our param_groups are the ones an LR scheduler writes to; the local optimizer must follow them.
        for b, local_group in zip(self.buckets, self._local.param_groups):
            local_group.update(self._hyper(b.group))
        # BEGIN EXERCISE 3.3: reduce-scatter the gradients into the owned slices, step them, all-gather the params
        for b in self.buckets:
            if self.reduce_in_step:
                if b.shard.grad is None:
                    b.shard.grad = torch.empty_like(b.shard)
                comm.reduce_scatter(b.shard.grad, b.flat_grad(1.0 / self.world_size), tag="grads")
            elif b.shard.grad is None:
                b.shard.grad = torch.zeros_like(b.shard)  # no backward since zero_grad(): a zero gradient
        self._local.step()
        for b in self.buckets:
            # In place (the input is chunk `rank` of the output), as NCCL allows and llm.c does: no copy.
            comm.all_gather(b.flat, b.shard, tag="params")
        # END EXERCISE
        return loss
    # --8<-- [end:step]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._local.zero_grad(set_to_none=set_to_none)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard of the state (one file per rank), with every group's hyper-parameters."""
        return {"world_size": self.world_size, "rank": self.rank,
                "shard_numels": [b.shard.numel() for b in self.buckets],
                "param_groups": [self._hyper(g) for g in range(len(self.param_groups))],
                "local": self._local.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict() saved by this rank of the same layout, or a plain torch optimizer's state
        dict over the same params (e.g. from consolidated_state_dict(), at any world size)."""
        if "local" not in state_dict:
            return self._load_consolidated(state_dict)
        saved = (state_dict["world_size"], state_dict["rank"], state_dict["shard_numels"])
        mine = (self.world_size, self.rank, [b.shard.numel() for b in self.buckets])
        if saved != mine:
            raise ValueError(f"this sharded state dict is (world_size, rank, shard sizes) = {saved}, but this "
                             f"FlatOSS is {mine}. Load a consolidated_state_dict() to change the layout.")
        self._local.load_state_dict(state_dict["local"])
        for group, hyper in zip(self.param_groups, state_dict["param_groups"]):
            group.update(hyper)

    def _torch_indices(self) -> tuple[dict, list]:
        """Param -> index as torch's Optimizer.state_dict() numbers them, and the packed param groups."""
        index, packed, n = {}, [], 0
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                index.setdefault(p, n)
                ids.append(index[p])
                n += 1
            packed.append(dict(self._hyper(len(packed)), params=ids))
        return index, packed

    def consolidated_state_dict(self) -> dict:
        """On every rank: the state dict a plain torch optimizer over the same params would have.

        Element-wise state (momentum, exp_avg, ...) is all-gathered bucket by bucket and cut back into
        per-parameter tensors; per-slice scalars (Adam's step) are the same for every param of a bucket.
        """
        index, packed = self._torch_indices()
        state: dict[int, dict] = {}
        for b in self.buckets:
            for key, value in self._local.state.get(b.shard, {}).items():
                if torch.is_tensor(value) and value.shape == b.shard.shape:
                    full = torch.empty_like(b.flat)
                    comm.all_gather(full, value.contiguous(), tag="state")
                    for p, start in zip(b.params, b.offsets):
                        state.setdefault(index[p], {})[key] = full[start: start + p.numel()].view_as(p).clone()
                else:
                    for p in b.params:
                        state.setdefault(index[p], {})[key] = value.clone() if torch.is_tensor(value) else value
        return {"state": state, "param_groups": packed}

    def _load_consolidated(self, state_dict: dict) -> None:
        index, _ = self._torch_indices()
        saved = state_dict["state"]
        local_state = {}
        for i, b in enumerate(self.buckets):
            have = [saved[index[p]] for p in b.params if index[p] in saved]
            if not have:
                continue  # never stepped
            local_state[i] = {}
            for key, value in have[0].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    full = torch.zeros_like(b.flat)  # a param without state starts from zeros
                    for p, start in zip(b.params, b.offsets):
                        if key in saved.get(index[p], {}):
                            full[start: start + p.numel()].copy_(saved[index[p]][key].reshape(-1))
                    local_state[i][key] = full[b.start: b.start + b.shard.numel()].clone()
                else:
                    local_state[i][key] = value
        for group, hyper in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in hyper.items() if k != "params"})
        self._local.load_state_dict({"state": local_state, "param_groups": [
            dict(self._hyper(b.group), params=[i]) for i, b in enumerate(self.buckets)]})


class FlatShardedDataParallel(nn.Module):
    """ZeRO-2, flat: reduce-scatter each gradient bucket during backward and free the full gradients.

    module:            built identically on every rank; rank 0's params and buffers are broadcast.
    flat_optimizer:    a FlatOSS over this module's trainable params, built with a bucket_cap_mb: its
                       buckets are the units that are reduce-scattered as soon as backward completes them.
    broadcast_buffers: re-broadcast rank 0's buffers before each forward, as DDP does.

    Parameters the autograd graph of the output does not reach count as ready (a zero gradient) at
    forward, so every rank launches every bucket, in the same order, and nothing waits forever.
    """

    def __init__(self, module: nn.Module, flat_optimizer: FlatOSS, broadcast_buffers: bool = True):
        super().__init__()
        comm.require_process_group()
        if not isinstance(flat_optimizer, FlatOSS):
            raise TypeError(f"FlatShardedDataParallel needs a FlatOSS (it reduce-scatters into the FlatOSS's "
                            f"flat shards), got {type(flat_optimizer).__name__}. Build one with "
                            f"FlatOSS(module.parameters(), optim=<optimizer class>, bucket_cap_mb=..., lr=...)")
        if not flat_optimizer.reduce_in_step:
            raise ValueError("this FlatOSS already belongs to a FlatShardedDataParallel")
        if flat_optimizer.bucket_cap_mb is None:
            raise ValueError("FlatShardedDataParallel needs a FlatOSS built with bucket_cap_mb=...: its buckets "
                             "are reduce-scattered one by one during backward, and with bucket_cap_mb=None a "
                             "whole param group would be one bucket, sent only when backward is over")
        names = {p: n for n, p in module.named_parameters()}
        trainable = [p for p in module.parameters() if p.requires_grad]
        in_optimizer = {p for b in flat_optimizer.buckets for p in b.params}
        for p in trainable:
            if p not in in_optimizer:
                raise ValueError(f"parameter {names[p]!r} of the module is not in the FlatOSS: build the FlatOSS "
                                 f"over this module's parameters")
        for p in in_optimizer - set(trainable):
            raise ValueError(f"the FlatOSS holds a parameter of shape {tuple(p.shape)} that is not a trainable "
                             f"parameter of this module ({names.get(p, 'not in the module')})")
        self.module, self.optimizer = module, flat_optimizer
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        self.world_size = comm.world_size()
        comm.assert_same_across_ranks(list(module.named_parameters()) + list(module.named_buffers()))
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                comm.broadcast(t, src=0)

        # The order backward completes the buckets: the one whose earliest param comes latest goes first.
        # It depends on the model only, so every rank launches the same collectives in the same order.
        position = {p: i for i, p in enumerate(trainable)}
        self._buckets = sorted(flat_optimizer.buckets, key=lambda b: -min(position[p] for p in b.params))
        self._index_of = {p: i for i, b in enumerate(self._buckets) for p in b.params}
        self._ready = [0] * len(self._buckets)
        self._next = 0
        self._in_flight = []  # (bucket, its reduce-scattered chunk, the flat input kept alive, handle)
        self._finish_queued = False
        flat_optimizer.reduce_in_step = False
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers:
            with torch.no_grad():
                for b in self.module.buffers():
                    comm.broadcast(b, src=0)
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._ready = [0] * len(self._buckets)
            self._next = 0
            for p in set(self._index_of) - _params_reached_from(out):
                self._ready[self._index_of[p]] += 1  # no gradient will come: it counts as a zero one
        return out

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.require_backward_grad_sync:
            return  # inside no_sync(): the full gradients accumulate locally
        if not self._finish_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._finish_queued = True
        self._ready[self._index_of[p]] += 1
        self._launch_ready_buckets()

    # --8<-- [start:launch]
    def _launch_ready_buckets(self) -> None:
        self._retire(wait=False)  # inputs of reduce-scatters already done can go now, not at the end
        while self._next < len(self._buckets) and \
                self._ready[self._next] == len(self._buckets[self._next].params):
            bucket = self._buckets[self._next]
            # BEGIN EXERCISE 4.3: reduce-scatter the bucket's averaged gradients (async), free the full grads
            flat = bucket.flat_grad(1.0 / self.world_size)
            chunk = torch.empty_like(bucket.shard)
            handle = comm.reduce_scatter(chunk, flat, async_op=True, tag=f"bucket{self._next}")
            for p in bucket.params:
                p.grad = None  # this rank's chunk of the sum is on its way; the rest is the other ranks' business
            self._in_flight.append((bucket, chunk, flat, handle))
            # END EXERCISE
            self._next += 1
    # --8<-- [end:launch]

    def _retire(self, wait: bool) -> None:
        """Hand finished reduce-scatters to the optimizer and drop their inputs (all of them, if `wait`)."""
        pending = []
        for bucket, chunk, flat, handle in self._in_flight:
            if not wait and not handle.is_completed():
                pending.append((bucket, chunk, flat, handle))
                continue
            handle.wait()
            if bucket.shard.grad is None:
                bucket.shard.grad = chunk
            else:  # two synced backward passes without zero_grad(): gradients add up, as in DDP
                bucket.shard.grad.add_(chunk)
        self._in_flight = pending

    def _finish(self) -> None:
        """End of backward: every bucket must have gone out; wait for them all."""
        self._finish_queued = False
        if self._next < len(self._buckets):
            names = {p: n for n, p in self.module.named_parameters()}
            missing = [names[p] for b in self._buckets[self._next:] for p in b.params if p.grad is None]
            raise RuntimeError(f"FlatShardedDataParallel: these parameters are reached from the output but got "
                               f"no gradient in this backward pass, so their buckets were never reduced: {missing}")
        self._retire(wait=True)

    # Accumulate full gradients locally; the next synced backward reduce-scatters the sum. The switch
    # is the same attribute as chapter 1's, so its context manager serves here unchanged.
    no_sync = DistributedDataParallel.no_sync


def demo(steps: int = 3) -> dict:
    """A few ZeRO-2 steps of a tiny GPT on this rank: the losses, and the bytes it holds and sends."""
    from minifsdp.models import TinyGPT, gpt_batch

    model = TinyGPT(seed=comm.rank())
    opt = FlatOSS(model.parameters(), optim=torch.optim.AdamW, bucket_cap_mb=0.05, lr=3e-3, weight_decay=0.1)
    model = FlatShardedDataParallel(model, opt)
    n, r = comm.world_size(), comm.rank()
    losses = []
    with comm.counting() as counter:
        for step in range(steps):
            x, y = (t[4 * r: 4 * r + 4] for t in gpt_batch(model.module.config, step, 4 * n))  # 4 samples a rank
            loss = model(x, y)
            loss.backward()
            grad_bytes = sum(b.shard.grad.numel() * b.shard.element_size() for b in opt.buckets)
            opt.step()
            opt.zero_grad()
            losses.append(round(loss.item(), 4))
    return {"rank": r, "losses": losses, "buckets": len(opt.buckets), "grad_bytes": grad_bytes,
            "optim_bytes": sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()),
            "bytes_per_step": counter.total() / steps}
