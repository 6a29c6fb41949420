"""Chapter 8: mixed precision and CPU offload in FSDP -- a FlatParameter that casts, a unit that uses it.

    MixedPrecisionUnit(TinyGPT(), auto_wrap_policy=...,
                       mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), cpu_offload=CPUOffload(True))

The fp32 shard stays the master the optimizer steps. Each all-gather sends its param_dtype cast -- cast
*before* the collective, so the bytes on the wire are param_dtype's and the full parameters half the size
in bf16 -- and each flat gradient is averaged in reduce_dtype, then lands on the shard as fp32. With
offload the shard (so its gradient and its optimizer state) lives in host memory: each unshard copies it
to the device first, each gradient shard is copied back. The policies, the loss scaler and the checks
shared with DDP are in minifsdp/mixed_precision.py.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from minifsdp.distributed import comm
from minifsdp.fsdp.flat_param import FlatParameter, ShardState, _free_storage
from minifsdp.fsdp.prefetch import PrefetchingUnit
from minifsdp.fsdp.streams import side_stream
from minifsdp.fsdp.wrap import modules_not_in_units
from minifsdp.mixed_precision import (CPUOffload, MixedPrecision, cast_buffers, cast_inputs, check_master_dtype,
                                      keep_full_precision, require_policy, scaled_losses, warn_if_unscaled)


class MixedPrecisionFlatParameter(FlatParameter):
    """A FlatParameter whose full parameters are a param_dtype cast of its
    fp32 shard, whose gradients are averaged in reduce_dtype, and whose shard
    may live in host memory (offload)."""

    # --8<-- [start:precision]
    def __init__(self, places, requires_grad: bool = True, group=None,
                 replicate_group=None, *, param_dtype=None, reduce_dtype=None,
                 offload: bool = False, device: torch.device | None = None):
        super().__init__(places, requires_grad, group, replicate_group)
        self.param_dtype = param_dtype or self._shard.dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.offload = offload
        device = device or self._full.device
        # the all-gather's output
        if (self._full.dtype, self._full.device) != (self.param_dtype, device):
            self._full = torch.empty(self._full.numel(),
                                     dtype=self.param_dtype, device=device)
            _free_storage(self._full)
        if offload:
            # a copy even on a CPU machine: one code path
            self._shard = self._shard.to("cpu", copy=True)
            if torch.cuda.is_available():
                # so the copies to the GPU can run asynchronously
                self._shard = self._shard.pin_memory()
            self.param.data = self._shard
            # a model moved after wrapping is caught (refuse_moved_shards)
            self.param._offloaded = True
            self._set_views(use_full=False)

    # --8<-- [start:cast]
    def all_gather_input(self) -> torch.Tensor:
        if not self.offload and self.param_dtype == self._shard.dtype:
            return self._shard
        return self._cast_shard()

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

    def reduce_scatter_grad(self, full_grad: torch.Tensor):
        """As FlatParameter's, in reduce_dtype: e.g. bf16 gradients averaged in
        fp32 (a copy, sent instead of full_grad)."""
        if full_grad.dtype != self.reduce_dtype:
            full_grad = full_grad.to(self.reduce_dtype)
        return super().reduce_scatter_grad(full_grad)
    # --8<-- [end:cast]
    # --8<-- [end:precision]

    # --8<-- [start:grad_offload]
    # (event, host copy, gradient handed out) while a copy to the host is in
    # flight
    _grad_offload = None

    def grad_for_optimizer(self, grad_shard: torch.Tensor,
                           read_now: bool = False) -> torch.Tensor:
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
        if not self.offload:
            return super().grad_for_optimizer(grad_shard, read_now)
        # (the full gradient stays until the copy has read its shard)
        self.reduce_input = None
        self.wait_grad_offload()  # at most one copy in flight per FlatParameter
        asynchronous = grad_shard.is_cuda and not read_now
        # after_compute: the compute stream is where the reduce-scatter's
        # completion was waited for
        with side_stream("reduce_scatter", grad_shard, after_compute=True):
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


class MixedPrecisionUnit(PrefetchingUnit):
    """Chapter 7's unit, computing in mixed precision and, on request, keeping its shards in host memory.

    mixed_precision: MixedPrecision(param_dtype, reduce_dtype, buffer_dtype); with an auto_wrap_policy, every
                     module of its _module_classes_to_ignore (BatchNorm by default) becomes a unit of its own,
                     in fp32, as in PyTorch's FSDP1.
    cpu_offload:     CPUOffload(offload_params=True): shards, gradients and optimizer state in host memory.
    """

    def __init__(self, module, *, mixed_precision: MixedPrecision | None = None,
                 cpu_offload: CPUOffload | None = None, **options):
        # (FairScale's mixed_precision=True is named)
        require_policy(mixed_precision)
        self.mixed_precision, self.cpu_offload = mixed_precision, cpu_offload
        super().__init__(module, **options)

    def _child_options(self) -> dict:
        return {**super()._child_options(),
                "mixed_precision": self.mixed_precision,
                "cpu_offload": self.cpu_offload}

    # --8<-- [start:fp32_units]
    def _full_precision_classes(self) -> tuple:
        mp = self.mixed_precision
        return tuple(mp._module_classes_to_ignore) if mp else ()

    def _wrap_children(self, module: nn.Module, policy) -> None:
        # the policy's classes to ignore become units of their own, wherever
        # they are (FSDP1's _or_policy with _wrap_module_cls_individually)
        classes = self._full_precision_classes()
        if classes:
            policy = _OrClasses(policy, classes)
        super()._wrap_children(module, policy)

    def _wrap_child(self, child: nn.Module) -> nn.Module:
        if not isinstance(child, self._full_precision_classes()):
            return super()._wrap_child(child)
        keep_full_precision(child)
        return type(self)(child, **{**self._child_options(),
                                    "mixed_precision": None})
    # --8<-- [end:fp32_units]

    def _before_flatten(self) -> None:
        super()._before_flatten()
        check_master_dtype(self.mixed_precision, self.module.named_parameters())
        # (a nested unit cast its own, by its own policy)
        for m in modules_not_in_units(self.module):
            cast_buffers(m, self.mixed_precision, recurse=False)

    def _make_flat_param(self, places, requires_grad: bool) -> FlatParameter:
        mp = self.mixed_precision
        return MixedPrecisionFlatParameter(
            places, requires_grad, group=self.process_group,
            replicate_group=self.replicate_group,
            param_dtype=mp and mp.param_dtype,
            reduce_dtype=mp and mp.reduce_dtype,
            offload=bool(self.cpu_offload and self.cpu_offload.offload_params),
            device=self.device)

    def _root_pre_forward(self, args, kwargs):
        args, kwargs = super()._root_pre_forward(args, kwargs)
        refuse_moved_shards(self)
        # fp16 without a loss scaler is warned about (finish_backward)
        self._scaled_before_forward = scaled_losses()
        return cast_inputs(self.mixed_precision, args, kwargs)

    def finish_backward(self) -> None:
        super().finish_backward()
        warn_if_unscaled(self.mixed_precision, self._scaled_before_forward)


class _OrClasses:
    """A policy that also wraps every module of `classes`, and looks inside every subtree to find them."""

    def __init__(self, policy, classes: tuple):
        self.policy, self.classes = policy, classes

    def recurse(self, module: nn.Module, nonwrapped_numel: int) -> bool:
        return True

    def __call__(self, module: nn.Module, unowned_numel: int) -> bool:
        return isinstance(module, self.classes) or self.policy(module, unowned_numel)


# --8<-- [start:refuse_moved]
def refuse_moved_shards(root) -> None:
    """At every root forward: an offloaded shard must still be in host memory
    (model.cuda() moves it)."""
    for u in root.units():
        for i, flat in enumerate(u.flat_params):
            # what module.to() moved (or replaced)
            held = u._parameters[f"flat_param_{i}"]
            if getattr(flat, "offload", False) and held.device.type != "cpu":
                raise RuntimeError(
                    f"cpu_offload keeps the sharded parameters in host "
                    f"memory, where the optimizer steps them, but unit "
                    f"{u.unit_name!r} holds its shard on {held.device}: the "
                    f"model was moved after wrapping. Do not move an "
                    f"offloaded model (FSDP brings each unit to the device "
                    f"itself)")
# --8<-- [end:refuse_moved]
