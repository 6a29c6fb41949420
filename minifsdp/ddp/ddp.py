"""Chapter 1: collectives, and DistributedDataParallel from scratch.

Data parallelism in one sentence: every rank holds the whole model, runs forward and backward on its own
slice of the batch, and before the optimizer steps the gradients are averaged across ranks, so every
replica takes the same step and they stay identical.

    model = DistributedDataParallel(TinyGPT(), bucket_cap_mb=25)
    loss = model(x, y); loss.backward()       # gradients are averaged when backward() returns
    optimizer.step()

Averaging is one all-reduce. Done naively (after backward, one collective per parameter) the network
sits idle during backward and then the GPU sits idle during the network. So, as torch's DDP does:
- parameters are grouped into *buckets* of about `bucket_cap_mb`, in reverse order of registration
  (roughly the order their gradients are produced by backward);
- a hook on each parameter notices its gradient is ready; when a bucket is complete its all-reduce is
  launched asynchronously, and backward carries on computing the earlier layers meanwhile (overlap);
- when backward finishes, we wait for the outstanding all-reduces and copy the averages back into .grad.

naive.py is the same average without these improvements: one blocking all-reduce per gradient, once
backward is over.
"""

from __future__ import annotations

import contextlib
import enum

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from minifsdp.distributed import comm
from minifsdp.mixed_precision import MixedPrecision, ReplicaPrecision


class GradSync(enum.Enum):
    """What the backward of the last forward does with the gradients. The
    forward decides, from require_backward_grad_sync, as torch's DDP does."""
    AVERAGE = "average"  # the hooks launch the buckets' all-reduces
    LOCAL = "local"      # no_sync() or no grad: they accumulate on this rank


class _Bucket:
    """Parameters whose gradients are all-reduced together as one flat tensor."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.ready = 0           # how many of `params` have their gradient for this backward
        self.handle = None       # the async all-reduce in flight
        self.flat = None         # ... and the tensor it reduces


class DistributedDataParallel(nn.Module):
    """Replicated data parallelism: torch.nn.parallel.DistributedDataParallel's behaviour, readably.

    module:                 built identically on every rank; rank 0's parameters and buffers are
                            broadcast at construction, so every replica starts from the same weights.
    bucket_cap_mb:          size of a gradient bucket; smaller buckets start communicating earlier,
                            bigger ones make fewer, more efficient calls.
    broadcast_buffers:      re-broadcast rank 0's buffers (e.g. BatchNorm statistics) before each forward.
    find_unused_parameters: set it when some parameters may get no gradient in a step; their buckets
                            would otherwise never complete, and we raise instead of waiting forever.
    mixed_precision:        chapter 8's MixedPrecision (mixed_precision.py's ReplicaPrecision): compute
                            with a param_dtype cast of the fp32 parameters, average in reduce_dtype.
    process_group:          the ranks that hold replicas (default: all of them); every collective goes to
                            this group only, so several data-parallel groups can train side by side.
    """

    # --8<-- [start:init]
    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0,
                 broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False,
                 mixed_precision: MixedPrecision | None = None,
                 process_group=None, *, init_sync: bool = True):
        super().__init__()
        comm.require_process_group()
        check_module(module, type(self).__name__)
        check_bucket_cap_mb(bucket_cap_mb)
        self.module = module
        self.process_group = process_group
        # how forward computes, and in what dtype buckets are averaged: as
        # built, unless chapter 8's mixed_precision casts them
        self.precision = ReplicaPrecision(mixed_precision, module)
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        # torch's public switch, which no_sync() turns off; each forward
        # decides from it what its backward does (at first: average)
        self.require_backward_grad_sync = True
        self.grad_sync = GradSync.AVERAGE
        self.world_size = comm.world_size(process_group)
        if init_sync:  # (torch's name; False trusts every rank to build the same)
            state = list(module.named_parameters()) + list(module.named_buffers())
            comm.sync_from_rank0(state, process_group)

        self._names = {p: n for n, p in module.named_parameters()}
        self._cap = int(bucket_cap_mb * 1024 * 1024)
        self._next = 0  # buckets launch strictly in order, the same on every rank
        self._finish_queued = False
        self._unused = set()
        self._hooks = []
        self._setup_buckets_and_hooks()

    def _setup_buckets_and_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        # frozen parameters never communicate
        params = [p for p in self.module.parameters() if p.requires_grad]
        # Until we have seen a backward pass, guess that gradients arrive in
        # reverse registration order (torch's guess too; like torch, keep
        # registration order inside each bucket).
        self._set_buckets(self._bucket_groups(params))
        # After the first backward, rebuild the buckets in the order gradients
        # really arrived, as torch does -- unless some parameters may be unused,
        # when that order can differ between ranks.
        self._rebuilt = self.find_unused_parameters or not self.rebuild_buckets
        self._arrivals = []
        hook = self._on_grad_ready
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in params]
    # --8<-- [end:init]

    rebuild_buckets = True

    def _bucket_groups(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        return [bucket[::-1] for bucket in _pack(params[::-1], self._cap)]

    def _set_buckets(self, groups: list[list[nn.Parameter]]) -> None:
        self._buckets = [self._new_bucket(g) for g in groups]
        self._bucket_of = {p: b for b in self._buckets for p in b.params}

    def _new_bucket(self, params: list[nn.Parameter]) -> _Bucket:
        """A bucket of these parameters (ZeRO-2's also names their owner)."""
        return _Bucket(params)

    # -- forward: prepare the bookkeeping for the coming backward ------------------------------------------
    # --8<-- [start:forward]
    def forward(self, *args, **kwargs):
        # torch's rule: buffers are re-broadcast only when the previous forward
        # led to a synced backward -- not after a forward under no_sync() or
        # no_grad, whose buffer updates each rank keeps.
        if self.broadcast_buffers and self.grad_sync is GradSync.AVERAGE:
            buffers = self.module.buffers()
            comm.broadcast_tensors(buffers, src=0, group=self.process_group)
        out = self.precision.forward(self.module, args, kwargs)
        # Whether the coming backward averages the gradients is decided now, as
        # in torch: no_sync() must surround the forward; around the backward
        # alone it changes nothing.
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        self.grad_sync = GradSync.AVERAGE if sync else GradSync.LOCAL
        if sync:
            for b in self._buckets:
                b.ready = 0
            self._next = 0
            self._unused = set()
            if self.find_unused_parameters:
                # Parameters the autograd graph cannot reach get no gradient:
                # count them ready now, so every rank still completes and
                # launches every bucket, in the same order.
                reached = _params_reached_from(out)
                self._unused = set(self._bucket_of) - reached
                for p in self._unused:
                    self._bucket_of[p].ready += 1
        return out
    # --8<-- [end:forward]

    # -- backward: hooks fire as gradients land ------------------------------------------------------------
    # --8<-- [start:hooks]
    # --8<-- [start:on_grad_ready]
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if self.grad_sync is GradSync.LOCAL:
            return  # its forward ran inside no_sync(): gradients accumulate locally
        if not self._finish_queued:
            # Runs once the whole backward pass is done, on the same thread,
            # before backward() returns.
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(self._finish)
            self._finish_queued = True
        if not self._rebuilt:
            self._arrivals.append(p)
        self._bucket_of[p].ready += 1
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        buckets = self._buckets
        while self._next < len(buckets) and \
                buckets[self._next].ready == len(buckets[self._next].params):
            self._launch(buckets[self._next])
            self._next += 1
    # --8<-- [end:on_grad_ready]

    # --8<-- [start:flatten]
    def _flatten(self, bucket: _Bucket, release: bool = False) -> torch.Tensor:
        """The bucket's gradients as one flat tensor, already multiplied by 1/N.
        release=True drops each .grad as soon as it is copied (ZeRO-2 needs them
        no more), so the bucket is never held twice."""
        # one dtype per bucket (_pack), as in torch (chapter 8 may average
        # in a lower precision)
        dtype = self.precision.reduce_dtype(bucket.params[0].dtype)
        size = sum(p.numel() for p in bucket.params)
        flat = torch.empty(size, dtype=dtype, device=bucket.params[0].device)
        offset = 0
        for p in bucket.params:
            piece = flat[offset: offset + p.numel()]
            if p.grad is None:
                piece.zero_()
            else:
                piece.copy_(p.grad.reshape(-1))
            offset += p.numel()
            if release:
                p.grad = None
        # Average by multiplying by 1/N before the sum, exactly as torch's DDP
        # does while filling its buckets: the same rounding, so the same bits.
        # (x * (1/3) and x / 3 can differ in the last bit.)
        return flat.mul_(1.0 / self.world_size)
    # --8<-- [end:flatten]

    # --8<-- [start:launch]
    def _launch(self, bucket: _Bucket) -> None:
        # BEGIN EXERCISE 1.2: average the bucket's gradients by an async all-reduce
        bucket.flat = self._flatten(bucket)
        bucket.handle = comm.all_reduce(bucket.flat, async_op=True,
                                        tag=f"bucket{self._next}",
                                        group=self.process_group)
        # END EXERCISE
    # --8<-- [end:launch]
    # --8<-- [end:hooks]

    # --8<-- [start:finish]
    # --8<-- [start:end_of_backward]
    def _finish(self) -> None:
        """End of backward: every bucket must have been launched; wait for them
        and write .grad back."""
        self._finish_queued = False
        self.precision.after_backward()  # (chapter 8: fp16 without a loss scaler)
        if self._next < len(self._buckets):
            self._unlaunched_buckets()
        self._finish_buckets()
        if not self._rebuilt:
            self._set_buckets(_pack(self._arrivals, self._cap))
            self._arrivals, self._rebuilt = [], True

    def _unlaunched_buckets(self) -> None:
        """Backward is over, and some bucket never completed: as torch's DDP,
        refuse, naming the parameters that got no gradient."""
        missing = [self._names[p] for b in self._buckets[self._next:]
                   for p in b.params if p.grad is None]
        raise RuntimeError(
            f"{type(self).__name__}: these parameters received no gradient "
            f"in this backward pass, so their buckets could never be "
            f"reduced: {missing}. If some parameters are legitimately "
            f"unused in a step, pass find_unused_parameters=True.")

    def _finish_buckets(self) -> None:
        globally_used = None
        if self.find_unused_parameters:
            globally_used = self._globally_used()
        for bucket in self._buckets:
            self._write_back(bucket, globally_used)
            bucket.handle = bucket.flat = None
    # --8<-- [end:end_of_backward]

    # --8<-- [start:write_back]
    def _write_back(self, bucket: _Bucket, globally_used: dict | None) -> None:
        # BEGIN EXERCISE 1.3: wait for the all-reduce, copy the averages into .grad
        bucket.handle.wait()
        offset = 0
        for p in bucket.params:
            average = bucket.flat[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is not None:
                p.grad.copy_(average)
            elif globally_used is None or globally_used[p]:
                # unused here, used elsewhere: it gets the average
                p.grad = average.to(p.dtype, copy=True)
        # END EXERCISE
        # copied out: free it now (comm.release says why not just drop it)
        comm.release(bucket.flat)
    # --8<-- [end:write_back]
    # --8<-- [end:finish]

    def _globally_used(self) -> dict:
        """Which parameters got a gradient on at least one rank (one small all-reduce, as torch does)."""
        params = list(self._bucket_of)
        used = torch.tensor([0.0 if p in self._unused else 1.0 for p in params], device=params[0].device)
        comm.all_reduce(used, tag="used_map", group=self.process_group)
        return {p: bool(u > 0) for p, u in zip(params, used)}

    # --8<-- [start:no_sync]
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) in the backward passes
        of the forwards run inside this block (the forward is where the decision
        is taken, as in torch)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous
    # --8<-- [end:no_sync]


DDP = DistributedDataParallel


def require_module(module, wrapper: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{wrapper} wraps a torch.nn.Module (the model), got a {type(module).__name__}: "
                        f"{str(module)[:60]!r}")


def check_module(module, wrapper: str) -> None:
    """A clear error, at construction, for what cannot be wrapped: not a module, or a model some data-parallel
    wrapper already owns (its gradients would be averaged twice, or its parameters are already shards)."""
    require_module(module, wrapper)
    for name, m in module.named_modules():
        replicated = isinstance(m, (DistributedDataParallel, torch.nn.parallel.DistributedDataParallel))
        sharded = getattr(type(m), "_fsdp_unit", False)
        if replicated or sharded:
            where = f"the model's submodule {name!r}" if name else "the model"
            raise ValueError(f"{wrapper}: {where} is already a {type(m).__name__}; wrap the plain model once "
                             f"(each wrapper averages or shards the gradients itself)")


def check_bucket_cap_mb(value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"bucket_cap_mb must be {'None or ' if allow_none else ''}a number of megabytes > 0, "
                         f"got {value!r}")


# --8<-- [start:pack]
def _pack(params: list[nn.Parameter],
          cap_bytes: float) -> list[list[nn.Parameter]]:
    """The buckets: `params`, in the order their gradients are expected, cut
    into groups of at most `cap_bytes` (a parameter larger than the cap alone)
    and of one dtype and device each, as torch's DDP buckets are; returned in
    the order they complete."""
    # BEGIN EXERCISE 1.4: the bucket policy: parameters under a byte cap
    groups, open_group, size = [], {}, {}
    for p in params:
        key, nbytes = (p.dtype, p.device), p.numel() * p.element_size()
        if key not in open_group or size[key] + nbytes > cap_bytes:
            # each dtype fills a bucket of its own
            open_group[key], size[key] = [], 0
            groups.append(open_group[key])
        open_group[key].append(p)
        size[key] += nbytes
    # in the order they complete, by their last parameter: of one dtype,
    # the order they were cut in
    position = {id(p): i for i, p in enumerate(params)}
    return sorted(groups, key=lambda group: position[id(group[-1])])
    # END EXERCISE
# --8<-- [end:pack]


def _params_reached_from(output) -> set:
    """Leaf parameters the autograd graph of `output` reaches (what torch's find_unused_parameters does)."""
    stack = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, found = set(), set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):  # an AccumulateGrad node: the end of the line for one leaf
            found.add(fn.variable)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found
