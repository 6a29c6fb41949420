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

unshard(async_op=True) only *starts* the all-gather and returns: a prefetch (chapter 7); wait_unshard()
-- which the next unshard() calls -- waits for it and only then makes the views. On a GPU the all-gather
runs on a stream of its own, so it does not queue behind the compute already issued.

So a FlatParameter is always in one of three states (`state`, as in PyTorch's FSDP2):
    SHARDED     only the shard holds memory; the originals are empty tensors
    UNSHARDING  the all-gather is in flight into the allocated buffer; the originals are still empty
    UNSHARDED   the buffer holds the full parameters; the originals are views into it
unshard() goes SHARDED -> UNSHARDING, wait_unshard() UNSHARDING -> UNSHARDED, reshard() back to SHARDED
(waiting first if the network is still writing into the buffer).

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


# --8<-- [start:streams]
_side_streams: dict = {}


@contextlib.contextmanager
def _side_stream(kind: str, tensor: torch.Tensor, after_compute: bool):
    """On a GPU, run the block on a stream of its own (one for all-gathers, one
    for reduce-scatters); a later wait() on the compute stream joins them again.
    On the CPU there are no streams: the collective is simply asynchronous.

    after_compute: first wait for everything the compute stream has issued so
    far. A reduce-scatter must (its gradient is being computed there); an
    all-gather must not -- that wait would put the next unit's all-gather behind
    this unit's compute, and no prefetch could overlap (sync_all_gathers
    instead)."""
    if not tensor.is_cuda:
        yield
        return
    stream = _stream(kind, tensor.device)
    if after_compute:
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
    with torch.cuda.stream(stream):
        yield


def _stream(kind: str, device: torch.device):
    if (kind, device) not in _side_streams:
        _side_streams[(kind, device)] = torch.cuda.Stream(device)
    return _side_streams[(kind, device)]


def sync_all_gathers(device: torch.device) -> None:
    """The all-gather stream catches up with the compute stream, at every root
    forward and before every gather outside training (summon_full_params): the
    shards it sends were last written there (by the optimizer, or the user).
    Always -- the stream is made here if no all-gather has made it yet, so even
    the first all-gather cannot read a shard the compute stream is still
    writing."""
    if device.type == "cuda":
        _stream("all_gather", device).wait_stream(
            torch.cuda.current_stream(device))
# --8<-- [end:streams]


# --8<-- [start:state]
class ShardState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "all-gather in flight"
    UNSHARDED = "unsharded"
# --8<-- [end:state]


class FlatParameter:
    """The parameters of one unit as one sharded flat tensor. `param` is what the optimizer steps.

    places: (module, attribute name) of each original parameter; a tied parameter appears at several
            places but is stored once (its places all get the same view).
    group:  the process group the unit is sharded over (default: every rank).
    shard:  False for PyTorch's NO_SHARD: every rank keeps the whole unit, unsharded for good, and the
            gradients are all-reduced as under DDP -- the same runtime, with N = 1 as far as the layout goes.
    """

    # --8<-- [start:init]
    def __init__(self, places: list[tuple[nn.Module, str]],
                 requires_grad: bool = True, group=None,
                 shard: bool = True, replicate_group=None):
        self.group, self.sharded = group, shard
        # HYBRID_SHARD: the ranks that hold this same shard (chapter 11)
        self.replicate_group = replicate_group
        self.rank, self.world_size = (
            (comm.rank(group), comm.world_size(group)) if shard else (0, 1))
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
        # the all-gather in flight (UNSHARDING)
        self._unshard_handle = None
        # FullyShardedDataParallel's rate limiter, if any
        self.limiter = None
        # the unit's name, for the byte counter's tags
        self.name = ""
        # see FullyShardedDataParallel._pre_backward
        self.saved_grad = None
        # the autograd node of the views' split (_set_views)
        self.concat_node = None
        # forwards with gradients since the last backward (fsdp.py)
        self.grad_forwards = 0
        # full gradients kept by no_sync() (chapter 9)
        self.unsharded_grad = None
        # chapter 8 (use_precision) may lower these
        self.param_dtype = self.reduce_dtype = self._shard.dtype
        # chapter 8: the shard lives in host memory
        self.offload = False
        # what an all-gather in flight is sending
        self._all_gather_input = None
        # what a reduce-scatter in flight is sending
        self.reduce_input = None
        # the originals live on only as views
        for module, name in places:
            delattr(module, name)
        for p in params:
            # and an old reference holds nothing
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        # an optimizer still holding one is caught (api.py)
        self._originals = [weakref.ref(p) for p in params]
        self._set_views(use_full=False)
        # NO_SHARD: the one shard is the whole unit, and the views point into
        # it for good
        if not self.sharded:
            self._full = self.param.data = self._shard
            self._set_views(use_full=True)
            self.state = ShardState.UNSHARDED
    # --8<-- [end:init]

    # --8<-- [start:unshard]
    def unshard(self, async_op: bool = False) -> None:
        """All-gather the full parameters and point every original parameter
        at its view into them. async_op=True: only start the all-gather (a
        prefetch); wait_unshard() finishes it."""
        # NO_SHARD: nothing to gather; but the optimizer wrote the buffer in
        # place since the views were cut, and autograd refuses views of a
        # split then
        if not self.sharded:
            self._set_views(use_full=True)
            return
        if self.state is ShardState.SHARDED:
            if self.limiter is not None:
                self.limiter.before_all_gather()
            with _side_stream("all_gather", self._full, after_compute=False):
                # BEGIN EXERCISE 5.3: reallocate the full buffer, all-gather into it
                # memory of the all-gather stream, the buffer's writer
                _alloc_storage(self._full)
                plain = not self.offload and self.param_dtype == self._shard.dtype
                self._all_gather_input = (
                    self._shard if plain else self._cast_shard())  # chapter 8
                self._unshard_handle = comm.all_gather(
                    self._full, self._all_gather_input, async_op=True,
                    tag=f"unshard {self.name}", group=self.group)
                # END EXERCISE
            self.state = ShardState.UNSHARDING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
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
        # (NO_SHARD: never sharded, nothing to free)
        if self.state is ShardState.SHARDED or not self.sharded:
            return
        # never free a buffer the network is still writing into
        if self.state is ShardState.UNSHARDING:
            self._unshard_handle.wait()
            self._unshard_handle = self._all_gather_input = None
        self.param.data = self._shard
        if self._full.is_cuda:
            # The compute stream may still be reading it (the CPU runs ahead):
            # the allocator must not hand this memory to the next all-gather
            # before the compute stream gets past this point.
            self._full.record_stream(torch.cuda.current_stream())
        _free_storage(self._full)
        self._set_views(use_full=False)
        self.state = ShardState.SHARDED
        if self.limiter is not None:
            self.limiter.freed(self._full)
    # --8<-- [end:reshard]

    # --8<-- [start:free_before_concat]
    def free_before_concat(self) -> None:
        """Free the full parameters' memory inside backward, just before autograd concatenates their gradients
        into the flat gradient (the split's backward, concat_node): no node that reads them is left, and the
        concatenation needs a flat gradient's worth of memory. The parameter keeps its full shape until
        reshard(), which follows as soon as the flat gradient is complete: autograd checks that gradient
        against it, and reads nothing else of it."""
        if not self.sharded or self.state is not ShardState.UNSHARDED:  # (NO_SHARD: the buffer is the shard)
            return
        if self._full.is_cuda:  # as in reshard(): the compute stream may still be reading it
            self._full.record_stream(torch.cuda.current_stream())
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

    # --8<-- [start:write_back]
    def write_back_shard(self) -> None:
        """Copy this rank's slice of the (edited) full parameters back into its shard."""
        start = self.rank * self.shard_numel
        with torch.no_grad():
            self._shard.copy_(self._full[start: start + self.shard_numel])
    # --8<-- [end:write_back]

    # --8<-- [start:reduce_scatter_grad]
    def reduce_scatter_grad(self, full_grad: torch.Tensor):
        """Start averaging the flat gradient across ranks; returns (async
        handle, this rank's shard of it). The tensor being sent -- `full_grad`
        itself, scaled by 1/N in place, unless chapter 8 casts it to
        reduce_dtype first -- is left in self.reduce_input: it must stay alive
        until the handle is waited on."""
        if full_grad.dtype != self.reduce_dtype:
            # chapter 8: e.g. bf16 gradients averaged in fp32
            full_grad = full_grad.to(self.reduce_dtype)
        self.reduce_input = full_grad
        # on a GPU: off the compute stream
        with _side_stream("reduce_scatter", full_grad, after_compute=True):
            # NO_SHARD: every rank keeps the whole average, as under DDP
            if not self.sharded:
                full_grad.mul_(1.0 / comm.world_size(self.group))
                return comm.all_reduce(full_grad, async_op=True,
                                       tag=f"all_reduce {self.name}",
                                       group=self.group), full_grad
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
            # HYBRID_SHARD: then average the shard across the replicas
            if self.replicate_group is not None:
                handle.wait()
                grad_shard.mul_(1.0 / comm.world_size(self.replicate_group))
                handle = comm.all_reduce(grad_shard, async_op=True,
                                         tag=f"all_reduce {self.name}",
                                         group=self.replicate_group)
        return handle, grad_shard
    # --8<-- [end:reduce_scatter_grad]

    # -- chapter 8: mixed precision and CPU offload -------------------------------------------------------
    # --8<-- [start:precision]
    def use_precision(self, param_dtype: torch.dtype | None,
                      reduce_dtype: torch.dtype | None,
                      offload: bool, device: torch.device) -> None:
        """Compute in param_dtype and average gradients in reduce_dtype; the
        shard stays the fp32 master. offload: the shard -- and so its gradient
        and its optimizer state -- lives in host memory; only the full
        parameters (and the activations) are on `device`."""
        if not self.sharded and (
                offload or {param_dtype, reduce_dtype} - {None, self._shard.dtype}):
            raise NotImplementedError(
                "sharding_strategy=NO_SHARD keeps the whole unit in its own "
                "dtype on every rank: mixed_precision and cpu_offload work "
                "with the sharded strategies (FULL_SHARD, SHARD_GRAD_OP) only")
        self.param_dtype = param_dtype or self._shard.dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        # the all-gather's output
        if (self._full.dtype, self._full.device) != (self.param_dtype, device):
            self._full = torch.empty(self._full.numel(),
                                     dtype=self.param_dtype, device=device)
            _free_storage(self._full)
        if offload:
            self.offload = True
            # a copy even on a CPU machine: one code path
            self._shard = self._shard.to("cpu", copy=True)
            if torch.cuda.is_available():
                # so the copies to the GPU can run asynchronously
                self._shard = self._shard.pin_memory()
            self.param.data = self._shard
            # a model moved after wrapping is caught (api.py)
            self.param._offloaded = True
            self._set_views(use_full=False)

    def _cast_shard(self) -> torch.Tensor:
        """What this rank sends to the all-gather: its shard, brought to the
        device (offload) and cast to param_dtype -- *before* the collective,
        so the bytes on the wire are param_dtype's."""
        # BEGIN EXERCISE 8.1: master shard to device (offload), cast to param_dtype
        shard = self._shard
        # fp32 over PCIe, then the cast on the device (as PyTorch FSDP does)
        if self.offload:
            shard = comm.copy_to(shard, self._full.device, "host_to_device")
        if shard.dtype != self.param_dtype:
            shard = shard.to(self.param_dtype)
        return shard
        # END EXERCISE

    # --8<-- [start:grad_offload]
    # (event, host copy, gradient handed out) while a copy to the host is in
    # flight
    _grad_offload = None

    def grad_for_optimizer(self, grad_shard: torch.Tensor) -> torch.Tensor:
        """The averaged gradient shard as the optimizer needs it: fp32, where
        the master shard lives.

        Offload: the shard crosses to the host in reduce_dtype (half the bytes
        in bf16) and is cast there. On a GPU that copy must not stall
        backward: it is queued on the reduce-scatter stream, behind the
        reduce-scatter that made the shard, into pinned memory, and the CPU
        waits for it only when backward ends (wait_grad_offload) -- before
        anything (the optimizer, clipping, a loss scaler) can read it. Except
        when a gradient from an earlier backward is to be added to it now
        (accumulation): the CPU needs the values at once, so it waits at once,
        as PyTorch's FSDP does."""
        # (sharded: a view into the full gradient -- copied out, so that the
        # full one can go)
        if not self.offload:
            return grad_shard.to(self._shard.dtype, copy=self.sharded)
        self.wait_grad_offload()  # at most one copy in flight per FlatParameter
        asynchronous = grad_shard.is_cuda and self.saved_grad is None
        # after_compute: the compute stream is where the reduce-scatter's
        # completion was waited for
        with _side_stream("reduce_scatter", grad_shard, after_compute=True):
            # the full gradient it is a view into was made on the compute
            # stream: keep its memory until this stream has copied it
            if asynchronous:
                grad_shard.record_stream(torch.cuda.current_stream())
            host = comm.copy_to(grad_shard, self._shard.device,
                                "device_to_host", non_blocking=asynchronous)
            if not asynchronous:
                return host.to(self._shard.dtype)
            event = torch.cuda.Event()
            event.record()
        # the gradient the optimizer gets: the host copy itself when no cast is
        # needed, else a tensor the cast fills once the copy has landed
        grad = (host if host.dtype == self._shard.dtype
                else torch.empty_like(host, dtype=self._shard.dtype))
        self._grad_offload = (event, host, grad)
        # end of backward, whatever the caller does next: the autograd engine
        # runs this before backward returns
        torch.autograd.Variable._execution_engine.queue_callback(
            self.wait_grad_offload)
        return grad

    def wait_grad_offload(self) -> None:
        """Block until the gradient shard copied to the host (asynchronously,
        on a GPU) has landed, and cast it. Runs at the end of every backward
        that started such a copy; nothing to do otherwise."""
        if self._grad_offload is not None:
            event, host, grad = self._grad_offload
            self._grad_offload = None
            event.synchronize()
            if grad is not host:
                grad.copy_(host)
    # --8<-- [end:grad_offload]

    @contextlib.contextmanager
    def full_precision(self):
        """Inside: unshard() gathers the fp32 masters, not their param_dtype
        cast (state dicts, summon)."""
        if self.param_dtype == self._shard.dtype:
            yield
            return
        if self.state is not ShardState.SHARDED:
            raise RuntimeError("summon_full_params() gathers the fp32 masters, "
                               f"but this unit holds its {self.param_dtype} "
                               "parameters now (inside forward or backward): "
                               "call it outside a training step")
        low = self._full, self.param_dtype
        self._full = torch.empty(self._full.numel(), dtype=self._shard.dtype,
                                 device=self._full.device)
        self.param_dtype = self._shard.dtype
        try:
            yield
        finally:
            self.reshard()
            self._full, self.param_dtype = low
    # --8<-- [end:precision]

    @property
    def is_unsharded(self) -> bool:
        """Whether the full buffer holds (or is receiving) memory: any state but SHARDED."""
        return self.state is not ShardState.SHARDED
