"""Chapter 9: what FSDP adds for real training -- accumulation without communication (no_sync), clipping
the norm of sharded gradients, deferred initialisation from the meta device, and a forward recomputed
inside backward (activation checkpointing, checkpointing.py).

TrainingUnit is chapter 8's unit with these; each is also a function of what it needs (the units, a
FlatParameter, the modules a unit owns), which the unit calls.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from minifsdp.distributed import comm
from minifsdp.fsdp.flat_param import FlatParameter
from minifsdp.fsdp.precision import MixedPrecisionUnit
from minifsdp.fsdp.runtime import TrainingState
from minifsdp.fsdp.wrap import modules_not_in_units, move_own_tensors
from minifsdp.zero.clip import clip_sharded_grad_norm_


class TrainingUnit(MixedPrecisionUnit):
    """Chapter 8's unit, with no_sync(), clip_grad_norm_() and deferred initialisation.

    param_init_fn, device_id: a module built on the meta device is materialised on device_id (default: this
                              rank's device) unit by unit, each module initialised by param_init_fn(module)
                              (default: its reset_parameters()); with device_id, each unit's own tensors are
                              moved there.
    """

    def __init__(self, module: nn.Module, *, param_init_fn=None,
                 device_id: torch.device | int | None = None, **options):
        self.param_init_fn, self.device_id = param_init_fn, device_id
        # built on the meta device? (not a module: refused by FSDPUnit)
        self.deferred = isinstance(module, nn.Module) and any(
            t.is_meta for t in [*module.parameters(), *module.buffers()])
        # False inside no_sync()
        self.requires_gradient_sync = True
        super().__init__(module, **options)

    def _child_options(self) -> dict:
        # a meta module's units broadcast what they materialise
        return {**super()._child_options(),
                "param_init_fn": self.param_init_fn, "device_id": self.device_id,
                "sync_module_states": self.sync_module_states and self.deferred}

    def _compute_device(self) -> torch.device:
        # a torch.device, or a GPU's index (0 is a GPU, not "unset")
        if isinstance(self.device_id, int):
            return torch.device("cuda", self.device_id)
        return self.device_id or super()._compute_device()

    def _before_flatten(self) -> None:
        # this unit's own parameters come to life now, and are sharded at once
        if self.deferred:
            materialize(modules_not_in_units(self.module), self.param_init_fn,
                        self.device, broadcast=self.sync_module_states,
                        group=self.process_group)
        # the tensors this unit owns go to its device (nested units moved
        # theirs)
        if self.device_id is not None:
            move_own_tensors(self.module, self.device)
        super()._before_flatten()

    def _flatten_own_parameters(self) -> list[FlatParameter]:
        flats = super()._flatten_own_parameters()
        for flat in flats:
            flat.unsharded_grad = None  # full gradients no_sync() keeps
        # HSDP: the replicas start from the same shards too
        if (self.replicate_group is not None and self.deferred
                and self.sync_module_states):
            comm.broadcast_tensors([flat.param.data for flat in flats],
                                   src=0, group=self.replicate_group)
        return flats

    # --8<-- [start:recompute]
    def pre_forward(self, args, kwargs):
        # a forward recomputed inside this unit's backward (activation
        # checkpointing, checkpoint(FSDP(m))): the parameters are there already
        if self.training_state in (TrainingState.PRE_BACKWARD,
                                   TrainingState.POST_BACKWARD):
            return args, kwargs
        return super().pre_forward(args, kwargs)

    def post_forward(self, out):
        # ... and they stay for the backward, whose hooks are set already
        if self.training_state is not TrainingState.FORWARD:
            return out
        return super().post_forward(out)
    # --8<-- [end:recompute]

    # --8<-- [start:unit_no_sync]
    def no_sync(self):
        """Backward passes inside the block send nothing; the first one after
        it reduce-scatters the sum."""
        return no_sync(self.units())

    def _accumulate_unsharded(self, flat: FlatParameter) -> bool:
        if self.requires_gradient_sync and flat.unsharded_grad is None:
            return False
        if not accumulate_unsharded(flat, self.requires_gradient_sync):
            return False
        self._reshard([flat])  # inside the block: kept, not sent
        return True
    # --8<-- [end:unit_no_sync]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip as torch.nn.utils.clip_grad_norm_ would on the whole model's gradients; returns the norm."""
        if not self.is_root:
            raise RuntimeError("clip_grad_norm_() clips the whole model: call it on the root unit")
        flats = [flat for unit in self.units() for flat in unit.flat_params]
        return clip_grad_norm_(flats, max_norm, norm_type, group=self.process_group)


# --8<-- [start:materialize]
def materialize(modules: list[nn.Module], param_init_fn, device: torch.device,
                broadcast: bool, group=None) -> None:
    """Deferred init: give memory to the meta parameters and buffers of
    `modules` (what one unit owns), and initialise them with
    param_init_fn(module) (default: module.reset_parameters()) for each module.
    Units are built innermost first and each shards its parameters right after,
    so a rank never holds more than one unit in full: a model larger than one
    rank's memory can be built."""
    # --8<-- [start:materialize_core]
    # id(meta tensor) -> (meta tensor, its real replacement): a tied one is
    # replaced once
    fresh = {}
    for m in modules:
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None and t.is_meta:
                    if id(t) not in fresh:
                        real = torch.empty_like(t, device=device)
                        if isinstance(t, nn.Parameter):
                            real = nn.Parameter(
                                real, requires_grad=t.requires_grad)
                        fresh[id(t)] = (t, real)
                    table[name] = fresh[id(t)][1]
    for m in modules:
        if param_init_fn is not None:
            param_init_fn(m)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()
    # as sync_module_states does for a model built eagerly: rank 0's values
    # everywhere
    if broadcast:
        comm.broadcast_tensors([real for _, real in fresh.values()], src=0,
                               group=group)
    # --8<-- [end:materialize_core]
# --8<-- [end:materialize]


# --8<-- [start:no_sync]
@contextlib.contextmanager
def no_sync(units: list):
    """Backward passes inside the block send nothing: every unit keeps its
    full flat gradient and adds the next one to it. The first backward after
    the block adds them in and reduce-scatters once. The FSDP paper's trade:
    one reduce-scatter per unit instead of one per micro-batch, for 4Ψ of
    unsharded gradients (DDP's amount) held between the micro-batches."""
    before = [u.requires_gradient_sync for u in units]
    for u in units:
        u.requires_gradient_sync = False
    try:
        yield
    finally:
        for u, b in zip(units, before):
            u.requires_gradient_sync = b


# --8<-- [start:accumulate]
def accumulate_unsharded(flat: FlatParameter, sync_gradients: bool) -> bool:
    """Inside no_sync(): keep the full gradient (True: nothing to send now).
    Outside: fold in what no_sync kept (False: send the sum)."""
    full_grad = flat.param.grad
    # BEGIN EXERCISE 9.1: no_sync: keep and add up full gradients; then fold in
    if not sync_gradients:
        flat.param.grad = None
        flat.unsharded_grad = (full_grad if flat.unsharded_grad is None
                               else flat.unsharded_grad.add_(full_grad))
        return True
    if flat.unsharded_grad is not None:
        # the same sum DDP's no_sync makes, before averaging
        full_grad.add_(flat.unsharded_grad)
        flat.unsharded_grad = None
    return False
    # END EXERCISE
# --8<-- [end:accumulate]
# --8<-- [end:no_sync]


# --8<-- [start:clip]
def clip_grad_norm_(flat_params: list[FlatParameter], max_norm: float,
                    norm_type: float = 2.0, group=None) -> torch.Tensor:
    """Scale every gradient so that the norm of the whole model's gradient is
    at most `max_norm`, as torch.nn.utils.clip_grad_norm_ would on the full
    gradients; returns that norm (before clipping). Each rank holds a disjoint
    shard of every flat gradient: see zero/clip.py."""
    grads = [flat.param.grad for flat in flat_params
             if flat.param.grad is not None and flat.uses_sharded_strategy]
    # NO_SHARD: every rank holds the same whole gradient, so only rank 0
    # counts it in the norm; all scale it
    replicated = [flat.param.grad for flat in flat_params
                  if flat.param.grad is not None
                  and not flat.uses_sharded_strategy]
    counted = replicated if comm.rank(group) == 0 else []
    return clip_sharded_grad_norm_(grads + counted, max_norm, norm_type,
                                   group=group, scaled=grads + replicated)
# --8<-- [end:clip]
