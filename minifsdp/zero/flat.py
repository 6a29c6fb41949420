"""Chapter 3, the flat design: ZeRO-1 laid out as the ZeRO paper and llm.c do (ZeRO-2 on it: flat_sdp.py).

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

ZeRO-2 (FlatShardedDataParallel, flat_sdp.py): the reduce-scatter moves into backward, bucket by bucket,
as DDP's all-reduce does; once a bucket is sent, its params' full .grad is freed, so a rank ends backward
holding only the gradients of its slice (4Ψ/N instead of 4Ψ). step() then only steps and all-gathers.

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

Run it on 2 CPU ranks (`demo` in flat_sdp.py: a tiny GPT, 3 steps of ZeRO-2 with AdamW):

    python -c "from minifsdp import launch; from minifsdp.zero.flat_sdp import demo; print(launch(demo, world_size=2))"
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from minifsdp.ddp.ddp import _pack, check_bucket_cap_mb
from minifsdp.distributed import comm
from minifsdp.zero.oss import require_optimizer_class

# --8<-- [start:layout]
# Each param starts on a 64-byte boundary, as it would in a tensor of its own: CPU matrix kernels take
# another code path (so round differently) for unaligned data, and the params must compute as DDP's do.
ALIGN_BYTES = 64


def flat_layout(numels: list[int], world_size: int, align: int = 1) -> tuple[list[int], int]:
    """Tensors of `numels` elements end to end in one flat buffer: where each starts (on a multiple of
    `align` elements), and the buffer's size, padded to N equal chunks (and to `align`, so that a buffer
    laid out after this one starts aligned too). The one flattening rule of every flat design here:
    FlatOSS's buckets, and FSDP's FlatParameter (chapter 5)."""
    offsets, end = [], 0
    for numel in numels:
        offsets.append(-(-end // align) * align)
        end = offsets[-1] + numel
    unit = math.lcm(align, world_size)  # a multiple of N, and the next buffer starts aligned
    return offsets, -(-end // unit) * unit


def _layout(params: list[nn.Parameter], world_size: int) -> tuple[list[int], int]:
    """Where each param starts in its bucket, and the bucket's padded size (N equal chunks, aligned)."""
    return flat_layout([p.numel() for p in params], world_size, max(1, ALIGN_BYTES // params[0].element_size()))
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
    group:         the ranks the slices are spread over (FairScale's name; default: all of them).
    **defaults:    the optimizer's hyper-parameters (lr=..., weight_decay=...).

    Do not wrap the model in DDP: step() averages the gradients itself (reduce-scatter), and rank 0's
    values of the parameters it is given -- frozen ones too -- are broadcast at construction so that every
    replica starts the same. An optimizer never sees the model's buffers: used alone, FlatOSS leaves them
    to the caller (`comm.sync_from_rank0(model.named_buffers())`); FlatShardedDataParallel syncs them.
    """

    def __init__(self, params, optim=torch.optim.SGD, bucket_cap_mb: float | None = None, group=None, **defaults):
        comm.require_process_group()
        require_optimizer_class(optim, "FlatOSS")
        check_bucket_cap_mb(bucket_cap_mb, allow_none=True)
        self.buckets: list[FlatBucket] | None = None  # add_param_group is allowed until the layout exists
        super().__init__(params, defaults)
        self.group = group
        self.world_size, self.rank = comm.world_size(group), comm.rank(group)
        self.bucket_cap_mb = bucket_cap_mb
        # FlatShardedDataParallel turns this off: it reduce-scatters during backward, into the shards' .grad.
        self.reduce_in_step = True

        # The layout must be identical on every rank, or the collectives would mix up slices.
        comm.assert_same_across_ranks([(f"param_groups[{g}][{i}]", p) for g, pg in enumerate(self.param_groups)
                                       for i, p in enumerate(pg["params"])], group=group)
        # --8<-- [start:buffers]
        cap = math.inf if bucket_cap_mb is None else bucket_cap_mb * 1024 * 1024
        self.buckets, self._buffers = [], []
        for g, param_group in enumerate(self.param_groups):
            # Frozen params are never communicated; a param listed twice is laid out once.
            trainable = list(dict.fromkeys(p for p in param_group["params"] if p.requires_grad))
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
        laid_out = {p for b in self.buckets for p in b.params}
        frozen = list(dict.fromkeys(p for pg in self.param_groups for p in pg["params"] if p not in laid_out))
        comm.broadcast_tensors(self._buffers + frozen, src=0, group=group)

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
                comm.reduce_scatter(b.shard.grad, b.flat_grad(1.0 / self.world_size), tag="grads", group=self.group)
            elif b.shard.grad is None:
                b.shard.grad = torch.zeros_like(b.shard)  # no backward since zero_grad(): a zero gradient
        self._local.step()
        for b in self.buckets:
            # In place (the input is chunk `rank` of the output), as NCCL allows and llm.c does: no copy.
            comm.all_gather(b.flat, b.shard, tag="params", group=self.group)
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
                    comm.all_gather(full, value.contiguous(), tag="state", group=self.group)
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
