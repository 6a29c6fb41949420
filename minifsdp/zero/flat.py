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
about that size, in reverse registration order (the order backward produces gradients). A group whose
parameters mix dtypes (fp32 and fp64, say) gets one flat buffer, and buckets, per dtype, as DDP's buckets
hold one dtype each: every element then travels, and is stepped, in its own dtype. Inside a bucket
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

Checkpoints of this layout (a rank's own shard, or a plain torch optimizer's full state) are in
flat_state.py.
"""

from __future__ import annotations

import enum
import math

import torch
import torch.nn as nn

from minifsdp.ddp.ddp import _pack, check_bucket_cap_mb
from minifsdp.distributed import comm
from minifsdp.zero.clip import clip_sharded_grad_norm_
from minifsdp.zero.flat_state import FlatStateDict
from minifsdp.zero.oss import require_optimizer_class, wire_dtype

# --8<-- [start:layout]
# Each param starts on a 64-byte boundary, as it would in a tensor of its own:
# CPU matrix kernels take another code path (so round differently) for
# unaligned data, and the params must compute as DDP's do.
ALIGN_BYTES = 64


def flat_layout(numels: list[int], world_size: int,
                align: int = 1) -> tuple[list[int], int]:
    """Tensors of `numels` elements end to end in one flat buffer: where each
    starts (on a multiple of `align` elements), and the buffer's size, padded
    to N equal chunks (and to `align`, so that a buffer laid out after this
    one starts aligned too). The one flattening rule of every flat design
    here: FlatOSS's buckets, and FSDP's FlatParameter (chapter 5)."""
    offsets, end = [], 0
    for numel in numels:
        offsets.append(-(-end // align) * align)
        end = offsets[-1] + numel
    # a multiple of N, and the next buffer starts aligned
    unit = math.lcm(align, world_size)
    return offsets, -(-end // unit) * unit


def _layout(params: list[nn.Parameter],
            world_size: int) -> tuple[list[int], int]:
    """Where each param starts in its bucket, and the bucket's padded size
    (N equal chunks, aligned)."""
    align = max(1, ALIGN_BYTES // params[0].element_size())
    return flat_layout([p.numel() for p in params], world_size, align)
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

    def flat_grad(self, scale: float, dtype: torch.dtype | None = None, release: bool = False) -> torch.Tensor:
        """The bucket's gradients in its flat layout (in `dtype`, default the params'), times `scale`; zeros
        for padding and missing grads. release=True drops each .grad once copied (ZeRO-2: the flat copy is
        all that is sent), so the bucket's gradients are never held twice."""
        out = torch.zeros_like(self.flat, dtype=dtype)
        for p, start in zip(self.params, self.offsets):
            if p.grad is not None:
                out[start: start + p.numel()].copy_(p.grad.reshape(-1))
            if release:
                p.grad = None
        # x * (1/N) before the sum, as torch's DDP does: the same rounding, so the same bits (ddp.py).
        return out.mul_(scale)


class GradReduction(enum.Enum):
    """Who reduce-scatters the gradients into this rank's slices, and whether
    that has happened for this step."""
    IN_STEP = "step() reduce-scatters them"          # FlatOSS alone
    DONE = "reduce-scattered for this step"          # by clip_grad_norm
    IN_BACKWARD = "backward reduce-scatters them"    # FlatShardedDataParallel


class FlatOSS(FlatStateDict, torch.optim.Optimizer):
    """ZeRO-1, flat: each rank owns a contiguous 1/N of every bucket and keeps optimizer state for it only.

    params:                as for any torch optimizer (param groups work; an LR scheduler drives param_groups).
    optim:                 the optimizer class that steps this rank's slices, e.g. torch.optim.AdamW.
    group:                 the ranks the slices are spread over (default: all of them).
    broadcast_buffer_size: OSS's argument (FairScale's name): here the bucket size in elements, if > 0; give
                           it or bucket_cap_mb, not both.
    broadcast_fp16:        all-gather the updated parameters in fp16, half the bytes; every replica, this
                           rank's included, then holds the fp16-rounded values, so they stay identical.
    bucket_cap_mb:         None: one bucket per param group; else buckets of about this size (ZeRO-2 needs them).
    **defaults:            the optimizer's hyper-parameters (lr=..., weight_decay=...).

    An optimizer, not a model wrapper: it sees the parameters it is given, and nothing else.
    - Every parameter it is given is identical on every rank from construction on: rank 0's values are
      broadcast then (frozen ones too), and each step all-gathers the updated slices.
    - The model's buffers, and parameters not given to it, it never sees. Used without a wrapper, making
      them rank 0's is the caller's job: `comm.sync_from_rank0(model.named_buffers())` once, and again
      whenever they change in forward (BatchNorm statistics), as DDP's broadcast_buffers does. Or wrap the
      model in FlatShardedDataParallel, which does both.
    - Do not wrap the model in DDP: step() averages the gradients itself (reduce-scatter).
    - The layout holds the parameters that require grad at construction. After freezing or unfreezing
      some, call refresh_trainable() on every rank before the next forward; step() refuses a stale layout.
    """

    def __init__(self, params, optim=torch.optim.SGD, group=None, broadcast_buffer_size: int = -1,
                 broadcast_fp16: bool = False, bucket_cap_mb: float | None = None, **defaults):
        comm.require_process_group()
        require_optimizer_class(optim, "FlatOSS")
        check_bucket_cap_mb(bucket_cap_mb, allow_none=True)
        if broadcast_buffer_size > 0 and bucket_cap_mb is not None:
            raise ValueError("give the bucket size once: broadcast_buffer_size (elements) or bucket_cap_mb")
        self.buckets: list[FlatBucket] | None = None  # add_param_group is allowed until the layout exists
        super().__init__(params, defaults)
        self.group = group
        self.world_size, self.rank = comm.world_size(group), comm.rank(group)
        if broadcast_buffer_size > 0:
            bucket_cap_mb = broadcast_buffer_size * self.param_groups[0]["params"][0].element_size() / 2 ** 20
        self.bucket_cap_mb, self.broadcast_fp16 = bucket_cap_mb, broadcast_fp16
        self.optim_class, self._defaults = optim, defaults
        self.grad_reduction = GradReduction.IN_STEP  # (see reduce_in_backward)
        self._consolidated = None    # the full state consolidate_state_dict() kept, until the next step
        self._parked = {}            # the state of given parameters that are not laid out (frozen since)

        # The layout must be identical on every rank, or the collectives would mix up slices.
        comm.assert_same_across_ranks([(f"param_groups[{g}][{i}]", p) for g, pg in enumerate(self.param_groups)
                                       for i, p in enumerate(pg["params"])], group=group)
        self._lay_out()
        frozen = list(dict.fromkeys(p for pg in self.param_groups for p in pg["params"] if p not in self._laid_out))
        comm.broadcast_tensors(self._buffers + frozen, src=0, group=group)
        self._build_local()

    def _lay_out(self) -> None:
        """Lay the trainable parameters end to end in flat buffers, bucket by bucket; each becomes a view."""
        # --8<-- [start:buffers]
        cap = (math.inf if self.bucket_cap_mb is None
               else self.bucket_cap_mb * 1024 * 1024)
        self.buckets, self._buffers = [], []
        for g, param_group in enumerate(self.param_groups):
            # Frozen params are never communicated; a param listed twice is
            # laid out once.
            trainable = list(dict.fromkeys(p for p in param_group["params"]
                                           if p.requires_grad))
            # Reverse registration order, registration order inside a bucket,
            # one dtype per bucket: as ddp.py packs its buckets.
            groups = [b[::-1] for b in _pack(trainable[::-1], cap)]
            # one flat buffer per dtype (and device) of the group
            for kind in dict.fromkeys((b[0].dtype, b[0].device) for b in groups):
                self._lay_out_buffer(g, [b for b in groups
                                         if (b[0].dtype, b[0].device) == kind])
        if not self.buckets:
            raise ValueError("FlatOSS got no trainable parameters")
        self._laid_out = {p for b in self.buckets for p in b.params}

    def _lay_out_buffer(self, g: int, groups: list[list[nn.Parameter]]) -> None:
        """One flat buffer for these buckets of group g (of one dtype)."""
        layouts = [_layout(b, self.world_size) for b in groups]
        buffer = torch.zeros(sum(size for _, size in layouts),
                             dtype=groups[0][0].dtype,
                             device=groups[0][0].device)
        self._buffers.append(buffer)
        start = 0
        for bucket_params, (offsets, size) in zip(groups, layouts):
            bucket = FlatBucket(g, bucket_params, offsets,
                                buffer[start: start + size], self.rank,
                                self.world_size)
            for p, offset in zip(bucket_params, bucket.offsets):
                view = bucket.flat[offset: offset + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view  # the param now lives in the flat buffer
            self.buckets.append(bucket)
            start += size
        # --8<-- [end:buffers]

    def _build_local(self) -> None:
        """The local optimizer, over this rank's slices: one tensor per bucket, with its group's hyper-parameters."""
        self._local = self.optim_class([dict(self._hyper(b.group), params=[b.shard]) for b in self.buckets],
                                       **self._defaults)
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

    # -- a change of trainable parameters ------------------------------------------------------------------
    def refresh_trainable(self) -> None:
        """Lay the parameters out again after some were frozen or unfrozen: on every rank, before the next
        forward. The state moves with its parameters: it is cut per parameter (consolidated_state_dict) and
        back into the new slices; a parameter frozen now keeps its state aside until it is unfrozen."""
        if self._trainable() == self._laid_out:
            return
        state = self.consolidated_state_dict()
        for p in self._laid_out:
            p.data = p.data.clone()  # out of the old flat buffer, which goes
        self._lay_out()
        self._build_local()
        self._load_consolidated(state)

    def _trainable(self) -> set:
        return {p for group in self.param_groups for p in group["params"] if p.requires_grad}

    def _check_layout(self) -> None:
        if self._trainable() == self._laid_out:
            return
        changed = [f"param_groups[{g}][{i}] {tuple(p.shape)} ({'unfrozen' if p.requires_grad else 'frozen'})"
                   for g, pg in enumerate(self.param_groups) for i, p in enumerate(pg["params"])
                   if p.requires_grad != (p in self._laid_out)]
        raise RuntimeError(f"FlatOSS: parameters were frozen or unfrozen since they were laid out ({changed}); "
                           f"call refresh_trainable() on every rank before the forward (or let "
                           f"FlatShardedDataParallel do it: auto_refresh_trainable=True)")

    def _hyper(self, g: int) -> dict:
        return {k: v for k, v in self.param_groups[g].items() if k != "params"}

    # --8<-- [start:step]
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # a parameter frozen since would be stepped, one unfrozen since would not
        self._check_layout()
        # Our param_groups are the ones an LR scheduler writes to; the local
        # optimizer must follow them.
        for b, local_group in zip(self.buckets, self._local.param_groups):
            local_group.update(self._hyper(b.group))
        # --8<-- [start:step_core]
        # BEGIN EXERCISE 3.3: reduce-scatter the grads, step the shards, all-gather
        for b in self.buckets:
            if self.grad_reduction is GradReduction.IN_STEP:
                if b.shard.grad is None:
                    b.shard.grad = torch.empty_like(b.shard)
                comm.reduce_scatter(b.shard.grad,
                                    b.flat_grad(1.0 / self.world_size),
                                    tag="grads", group=self.group)
            elif b.shard.grad is None:
                # no backward since zero_grad(): a zero gradient
                b.shard.grad = torch.zeros_like(b.shard)
        self._local.step()
        for b in self.buckets:
            if self.broadcast_fp16:
                self._all_gather_in_fp16(b)
            else:
                # in place (the input is chunk `rank` of the output), as NCCL
                # allows and llm.c does: no copy
                comm.all_gather(b.flat, b.shard, tag="params", group=self.group)
        # END EXERCISE
        # --8<-- [end:step_core]
        self._consolidated = None
        self._forget_reduction()
        return loss
    # --8<-- [end:step]

    def _forget_reduction(self) -> None:
        """The gradients reduced for this step are used up: the next step
        reduces its own (unless backward does)."""
        if self.grad_reduction is GradReduction.DONE:
            self.grad_reduction = GradReduction.IN_STEP

    def reduce_in_backward(self) -> None:
        """Leave the reduce-scatter to backward (FlatShardedDataParallel's hooks): step() only steps and
        all-gathers, and the gradients land in the slices' .grad as each bucket is sent."""
        if self.grad_reduction is GradReduction.IN_BACKWARD:
            raise ValueError("this FlatOSS already belongs to a FlatShardedDataParallel")
        self.grad_reduction = GradReduction.IN_BACKWARD

    def _all_gather_in_fp16(self, b: FlatBucket) -> None:
        """broadcast_fp16: the slices travel in fp16 (a 16-bit bucket as it is: oss.py's wire_dtype), and every
        rank, this one too, takes the rounded values."""
        wire = torch.empty(b.flat.numel(), dtype=wire_dtype(b.flat.dtype, True), device=b.flat.device)
        comm.all_gather(wire, b.shard.to(wire.dtype), tag="params", group=self.group)
        b.flat.copy_(wire)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._local.zero_grad(set_to_none=set_to_none)
        self._forget_reduction()

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0, filter_params_fn=None) -> torch.Tensor:
        """Clip the averaged gradients as torch's clip_grad_norm_ would, and return their total norm (OSS's
        method, zero/clip.py). Used alone, FlatOSS averages the gradients in step(): here it does so first,
        and step() then does not again."""
        if filter_params_fn is not None:
            raise NotImplementedError("FlatOSS.clip_grad_norm(filter_params_fn=...): this rank's gradients are "
                                      "slices of flat buckets that cut through parameters, so there are no "
                                      "parameters to filter (OSS keeps whole parameters: use it for that)")
        if self.grad_reduction is GradReduction.IN_STEP:
            for b in self.buckets:
                b.shard.grad = torch.empty_like(b.shard) if b.shard.grad is None else b.shard.grad
                comm.reduce_scatter(b.shard.grad, b.flat_grad(1.0 / self.world_size), tag="grads", group=self.group)
            self.grad_reduction = GradReduction.DONE
        grads = [b.shard.grad for b in self.buckets if b.shard.grad is not None]
        return clip_sharded_grad_norm_(grads, max_norm, norm_type, group=self.group)

    clip_grad_norm_ = clip_grad_norm  # torch's spelling
