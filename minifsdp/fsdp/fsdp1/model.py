"""FullyShardedDataParallel: chapters 5-10's runtime behind PyTorch FSDP1's surface, so that a script written
for torch.distributed.fsdp runs with only its import changed:

    from minifsdp.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, StateDictType, ...

    model = FSDP(net, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, ignored_modules=[net.head])
    torch.save(model.state_dict(), "model.pt")               # full, with the original names: loads into `net`
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        shards = model.state_dict()                           # ShardedTensors: what each rank's shard holds
    osd = FSDP.optim_state_dict(model, optimizer)             # full, by original name (optim_state_dict.py)
    with FSDP.summon_full_params(model, writeback=False):
        ...

The runtime is TrainingUnit (fsdp/training.py): chapter 6's FSDPUnit, with chapter 7's prefetching,
chapter 8's mixed precision and offload, chapter 9's no_sync, clipping and deferred init. This class adds
FSDP1's arguments (arguments.py), its state dict types (state_dict_types.py, chapter 10's state_dict.py
underneath) and summon_full_params (summon.py). The enums of torch.distributed.fsdp are accepted too: they
are matched by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp.ddp.ddp import require_module
from minifsdp.fsdp import optim_state_dict as optim_state
from minifsdp.fsdp import state_dict as state_dicts
from minifsdp.fsdp.fsdp1 import state_dict_types, summon
from minifsdp.fsdp.fsdp1.arguments import (ReplicatedFlatParameter, ShardingStrategy, as_policy, by_name,
                                           refuse_unsupported, resolve_groups)
from minifsdp.fsdp.prefetch import BackwardPrefetch
from minifsdp.fsdp.training import TrainingUnit
from minifsdp.mixed_precision import CPUOffload, MixedPrecision


class FullyShardedDataParallel(TrainingUnit):
    """ZeRO-3: every rank keeps 1/N of the parameters, gradients and optimizer state (16Ψ/N with AdamW).

    The arguments are PyTorch FSDP1's, in its order, so a script written for it runs with the import changed.

    sharding_strategy:     FULL_SHARD (default: ZeRO-3, the full parameters freed after forward and gathered
                           again in backward), SHARD_GRAD_OP (kept until backward: more memory, one
                           all-gather fewer), NO_SHARD (nothing sharded, gradients all-reduced: DDP) or
                           HYBRID_SHARD (chapter 11). minifsdp's own spelling, reshard_after_forward=True/False,
                           works too.
    ignored_modules:       modules left alone: not sharded, not synced, their gradients not averaged.
    sync_module_states:    broadcast rank 0's parameters and buffers before sharding (check the shapes
                           agree across ranks first). True by default, unlike PyTorch: ranks that built their
                           models from different seeds would otherwise shard different models, silently.
    param_init_fn, device_id: deferred initialisation (chapter 9).
    backward_prefetch, forward_prefetch, limit_all_gathers: overlap, chapter 7. BACKWARD_PRE by default, as
                           in PyTorch; chapter 6 passes None, to show the runtime without overlap first.
    mixed_precision, cpu_offload: chapter 8.
    process_group:         the ranks the parameters are sharded over (default: all of them); or
                           device_mesh, a one-dimensional DeviceMesh (two-dimensional: HYBRID_SHARD's).
    use_orig_params, ignored_states: only PyTorch's defaults (False, None) -- minifsdp's optimizer steps the
                           flat shards; chapter 11's fully_shard shards each original parameter.
    """

    _summoned = False  # inside summon_full_params (summon.py)

    # --8<-- [start:init]
    def __init__(
        self, module: nn.Module, process_group=None, sharding_strategy=None,
        cpu_offload: CPUOffload | None = None, auto_wrap_policy=None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None, ignored_modules=None,
        param_init_fn=None, device_id: torch.device | int | None = None,
        sync_module_states: bool = True, forward_prefetch: bool = False,
        limit_all_gathers: bool = True, use_orig_params: bool = False,
        ignored_states=None, device_mesh=None, *,
        reshard_after_forward: bool | None = None,
    ):
        refuse_unsupported(use_orig_params, ignored_states)
        self.sharding_strategy = by_name(sharding_strategy, ShardingStrategy,
                                         "sharding_strategy")
        shard_group, replicate_group, reshard_after_forward = resolve_groups(
            self.sharding_strategy, reshard_after_forward, process_group,
            device_mesh)
        # the walks of wrap.py step around these
        for ignored in ignored_modules or ():
            require_module(ignored, "ignored_modules")
            ignored._fsdp_ignored = True
        self._state_dict_type = state_dict_types.StateDictType.FULL_STATE_DICT
        self._state_dict_config = state_dict_types.FullStateDictConfig()
        super().__init__(
            module, process_group=shard_group, replicate_group=replicate_group,
            auto_wrap_policy=auto_wrap_policy and as_policy(auto_wrap_policy),
            reshard_after_forward=reshard_after_forward,
            sync_module_states=sync_module_states,
            backward_prefetch=by_name(backward_prefetch, BackwardPrefetch,
                                      "backward_prefetch"),
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            mixed_precision=mixed_precision, cpu_offload=cpu_offload,
            param_init_fn=param_init_fn, device_id=device_id)
    # --8<-- [end:init]

    def _child_options(self) -> dict:
        """Nested units are built with FSDP1's arguments (HSDP's groups as a pair)."""
        options = super()._child_options()
        replicate_group = options.pop("replicate_group")
        if replicate_group is not None:
            options["process_group"] = (options["process_group"],
                                        replicate_group)
        return {**options, "sharding_strategy": self.sharding_strategy}

    def _make_flat_param(self, places, requires_grad: bool):
        if self.sharding_strategy is not ShardingStrategy.NO_SHARD:
            return super()._make_flat_param(places, requires_grad)
        if self.mixed_precision is not None or self.cpu_offload is not None:
            raise NotImplementedError(
                "sharding_strategy=NO_SHARD keeps the whole unit in its own "
                "dtype on every rank: mixed_precision and cpu_offload work "
                "with the sharded strategies (FULL_SHARD, SHARD_GRAD_OP) only")
        return ReplicatedFlatParameter(places, requires_grad,
                                       replicate_group=self.process_group)

    def forward(self, *args, **kwargs):
        # its originals are registered parameters: the runtime could not set
        # its views
        if self._summoned:
            raise RuntimeError("forward inside summon_full_params(): leave the "
                               "block first (as in PyTorch, summon_full_params "
                               "is for use between steps)")
        return super().forward(*args, **kwargs)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """Inside summon_full_params, the original parameters under their names before wrapping, as in PyTorch."""
        named = super().named_parameters(prefix, recurse, remove_duplicate)
        return summon.names_before_wrapping(self, named, prefix) if self._summoned else named

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """Inside summon_full_params, under the names before wrapping too."""
        named = super().named_buffers(prefix, recurse, remove_duplicate)
        return summon.names_before_wrapping(self, named, prefix) if self._summoned else named

    # PyTorch's: FSDP.summon_full_params(model, writeback=True, rank0_only=False, ...) -- or model.summon_full_params()
    summon_full_params = summon.static_or_bound(summon.summon_full_params)
    state_dict_type = staticmethod(state_dict_types.state_dict_type)
    fsdp_modules = staticmethod(summon.fsdp_modules)
    # PyTorch's: FSDP.optim_state_dict(model, optim) -> by original name; FSDP.optim_state_dict_to_load(...)
    optim_state_dict = staticmethod(optim_state.optim_state_dict)
    optim_state_dict_to_load = staticmethod(optim_state.optim_state_dict_to_load)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Full, with the names the model had before wrapping (PyTorch's default); see state_dict_type()."""
        return state_dict_types.state_dict(self, destination, prefix, keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return state_dict_types.load_state_dict(self, state_dict, strict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded state dict, with the names the model had before wrapping (on every rank)."""
        return state_dicts.full_state_dict(self)

    def load_full_state_dict(self, sd: dict[str, torch.Tensor], strict: bool = True):
        """Checked like nn.Module.load_state_dict (keys, and shapes always); returns (missing, unexpected)."""
        return state_dicts.load_full_state_dict(self, sd, strict)


FSDP = FullyShardedDataParallel
