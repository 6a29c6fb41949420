"""Chapter 6: the FSDP runtime -- units, and the hooks that unshard and reshard them around compute.

    model = FullyShardedDataParallel(TinyGPT(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)     # built AFTER wrapping: over the shards
    model(x, y).backward(); optimizer.step()

Units. `auto_wrap_policy` picks submodules (by class, or by parameter count) and wraps each in its own
FullyShardedDataParallel, innermost first; every unit owns the parameters of its subtree that no nested
unit owns, as one FlatParameter -- one all-gather and one reduce-scatter per unit (the PyTorch FSDP
notes' "communication group"). The outermost instance is the root.

One step, per unit:
    forward:   unshard (all-gather) -> compute -> reshard (free the full parameters again), except the
               root, whose parameters are needed first in backward anyway, and units built with
               reshard_after_forward=False (they keep them: ZeRO-2-like memory, one all-gather fewer).
    backward:  when the gradient of the unit's output arrives, unshard again -> compute -> just before
               autograd makes the flat gradient, free the full parameters and let the earlier units'
               full gradients go (their reduce-scatters waited for) -> when the flat gradient is
               complete, reduce-scatter it (asynchronously) and reshard.
    end:       before backward() returns, wait for the reduce-scatters still in flight and leave each
               rank's shard of the averaged gradient in `.grad` of the flat parameter, which is what the
               optimizer steps.

Overlap (chapter 7). Communication can hide behind compute only if it is issued before the compute that
should cover it. The order units run in is recorded during the first step; from the second on:
    forward_prefetch=True:           a unit's forward first starts the next unit's all-gather, then computes.
    backward_prefetch=BACKWARD_PRE:  a unit's backward first starts the all-gather of the unit whose backward
                                     comes next, then computes -- so it is on the wire before this unit's
                                     reduce-scatter, and does not queue behind it.
    backward_prefetch=BACKWARD_POST: the same, but after this unit's gradient is computed, just before its
                                     reduce-scatter (one full-parameter buffer fewer while computing).
    limit_all_gathers=True:          on a GPU, the CPU may not run more than two units ahead of the frees.
Prefetching changes the order collectives are issued in, never a value.

Parameters inside a unit that get no gradient in a step get a zero gradient in the flat one (so, unlike
DDP, momentum and weight decay still act on them); a whole unit must take part in every forward on every
rank that computes a loss.

The files of the package: flat_param.py (chapter 5: one unit's parameters as a sharded flat tensor),
wrap.py (which modules become units), this runtime (chapter 6), prefetch.py (chapter 7), training.py
(chapter 9: no_sync, clipping, deferred init), state_dict.py and optim_state_dict.py (state dicts, of the
model and of its optimizer). Measurement is not called from here: the runtime announces compute spans as
events (minifsdp/events.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from minifsdp import events
from minifsdp.ddp.ddp import require_module
from minifsdp.distributed import comm
from minifsdp.distributed.launch import current_device
from minifsdp.fsdp import api, state_dict, training
from minifsdp.fsdp import optim_state_dict as optim_state
from minifsdp.fsdp.flat_param import FlatParameter, sync_all_gathers
from minifsdp.fsdp.prefetch import AllGatherLimiter, BackwardPrefetch, ExecutionOrder
from minifsdp.fsdp.wrap import (as_policy, modules_not_in_units, move_own_tensors, named_modules_not_in_units,
                                named_units, unowned_named_tensors, with_full_precision_units, wrap_children)
from minifsdp.mixed_precision import (CPUOffload, MixedPrecision, cast_buffers, cast_inputs, check_master_dtype,
                                      keep_full_precision, require_policy, scaled_losses, warn_if_unscaled)


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3: every rank keeps 1/N of the parameters, gradients and optimizer state (16Ψ/N with AdamW).

    The arguments are PyTorch FSDP1's, in its order (api.py has the rest of its surface: state dict types,
    summon_full_params' arguments, fsdp_modules), so a script written for it runs with the import changed.

    sharding_strategy:     FULL_SHARD (default: ZeRO-3, the full parameters freed after forward and gathered
                           again in backward), SHARD_GRAD_OP (kept until backward: more memory, one
                           all-gather fewer) or NO_SHARD (nothing sharded, gradients all-reduced: DDP).
                           minifsdp's own spelling, reshard_after_forward=True/False, works too.
    ignored_modules:       modules left alone: not sharded, not synced, their gradients not averaged.
    sync_module_states:    broadcast rank 0's parameters and buffers before sharding (check the shapes
                           agree across ranks first). True by default, unlike PyTorch: ranks that built their
                           models from different seeds would otherwise shard different models, silently.
    param_init_fn, device_id: deferred initialisation (chapter 9): a module built on the meta device is
                           materialised on device_id (default: this rank's device) unit by unit, each
                           module initialised by param_init_fn(module) (default: its reset_parameters()).
    backward_prefetch, forward_prefetch, limit_all_gathers: overlap, chapter 7 (see the module docstring).
                           BACKWARD_PRE by default, as in PyTorch; chapter 6 passes None, to show the runtime
                           without overlap first. Prefetching changes when bytes move, never a value.
    mixed_precision, cpu_offload: chapter 8 (minifsdp/mixed_precision.py): compute in bf16/fp16 from fp32
                           master shards; keep the shards in host memory.
    process_group:         the ranks the parameters are sharded over (default: all of them); or
                           device_mesh, a one-dimensional DeviceMesh.
    use_orig_params, ignored_states: only PyTorch's defaults (False, None) -- minifsdp's optimizer steps the
                           flat shards; chapter 11's fully_shard shards each original parameter.
    """

    _fsdp_unit = True  # the walks of wrap.py stop here: this module's subtree is this unit's
    # Links from a unit to other units. nn.Module would register a module assigned
    # to an attribute as a submodule: modules(), state_dict() and units() of this
    # unit would then walk into the other one (a root pointing down, a unit
    # pointing up is a cycle). So they are kept as plain attributes.
    _LINKS = frozenset({"_root_unit", "_next_in_backward"})

    def __setattr__(self, name, value):
        if name in self._LINKS:
            self.__dict__[name] = value
        else:
            super().__setattr__(name, value)

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
        super().__init__()
        backward_prefetch = api.by_name(backward_prefetch, BackwardPrefetch,
                                        "backward_prefetch")
        # (FairScale's mixed_precision=True is named)
        require_policy(mixed_precision)
        shard, reshard_after_forward = api.resolve_sharding(
            sharding_strategy, reshard_after_forward)
        # (refuses what minifsdp lacks)
        api.resolve_group(None, None, use_orig_params, ignored_states)
        # chapter 11: shard within a group, replicate across groups
        if api.is_hybrid(sharding_strategy):
            process_group, self.replicate_group = api.resolve_hybrid(
                process_group, device_mesh)
        else:
            process_group = api.resolve_group(process_group, device_mesh,
                                              use_orig_params, ignored_states)
            self.replicate_group = None
        comm.require_process_group()
        # (units nested inside are allowed, unlike DDP)
        require_module(module, "FullyShardedDataParallel")
        if (isinstance(module, FullyShardedDataParallel)
                or getattr(module, "_fsdp_wrapped", False)):
            raise ValueError(f"{type(module).__name__} is already wrapped in "
                             "FullyShardedDataParallel; wrap each module once "
                             "(nested units come from auto_wrap_policy)")
        if auto_wrap_policy is not None and not callable(auto_wrap_policy):
            hint = (f" (for classes, ModuleWrapPolicy({auto_wrap_policy!r}))"
                    if isinstance(auto_wrap_policy, (set, list, tuple)) else "")
            raise TypeError(f"auto_wrap_policy must be a policy such as "
                            f"ModuleWrapPolicy({{Block}}) or "
                            f"SizeBasedWrapPolicy(min_num_params=...), got "
                            f"{auto_wrap_policy!r}{hint}")
        # PyTorch's policies work too
        auto_wrap_policy = auto_wrap_policy and as_policy(auto_wrap_policy)
        module._fsdp_wrapped = True
        # the walks of wrap.py step around these
        for ignored in ignored_modules or ():
            require_module(ignored, "ignored_modules")
            ignored._fsdp_ignored = True
        self.process_group, self.shard = process_group, shard
        self.reshard_after_forward = reshard_after_forward
        self._summoned = False  # inside summon_full_params (api.py)
        self._state_dict_type, self._state_dict_config = (
            api.StateDictType.FULL_STATE_DICT, api.FullStateDictConfig())
        self.backward_prefetch, self.forward_prefetch = (
            backward_prefetch, forward_prefetch)
        deferred = any(t.is_meta for t in
                       list(module.parameters()) + list(module.buffers()))
        if sync_module_states:
            # every rank starts from rank 0's weights and buffers, as under
            # DDP -- before anything is sharded (afterwards each rank's shard
            # is its own, not rank 0's: so only what no unit wrapped by hand
            # already owns)
            comm.sync_from_rank0(unowned_named_tensors(module), process_group)
            if self.replicate_group is not None:
                comm.sync_from_rank0(unowned_named_tensors(module),
                                     self.replicate_group)
        if auto_wrap_policy is not None:
            uses = {}
            for name, p in module.named_parameters(remove_duplicate=False):
                uses.setdefault(p, []).append(name)
            hybrid = self.replicate_group is not None
            options = dict(
                reshard_after_forward=reshard_after_forward,
                sharding_strategy=(sharding_strategy if hybrid
                                   else None if shard
                                   else api.ShardingStrategy.NO_SHARD),
                sync_module_states=sync_module_states and deferred,
                backward_prefetch=backward_prefetch,
                forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers,
                param_init_fn=param_init_fn, device_id=device_id,
                mixed_precision=mixed_precision,
                cpu_offload=cpu_offload,
                process_group=((process_group, self.replicate_group) if hybrid
                               else process_group))
            # chapter 8: modules of the policy's _module_classes_to_ignore
            # become units of their own, in fp32
            full_precision = (tuple(mixed_precision._module_classes_to_ignore)
                              if mixed_precision else ())
            if full_precision:
                auto_wrap_policy = with_full_precision_units(auto_wrap_policy,
                                                             full_precision)

            def unit(child):
                if isinstance(child, full_precision):
                    keep_full_precision(child)
                    return FullyShardedDataParallel(
                        child, **{**options, "mixed_precision": None})
                return FullyShardedDataParallel(child, **options)
            wrap_children(module, auto_wrap_policy, uses, unit)
        self.module = module
        # device_id: a torch.device, or a GPU's index (0 is a GPU, not "unset")
        device = (torch.device("cuda", device_id) if isinstance(device_id, int)
                  else device_id or current_device())
        self.device = device
        # chapter 9: this unit's own parameters come to life now, and are
        # sharded at once
        if deferred:
            training.materialize(list(modules_not_in_units(module)),
                                 param_init_fn, device,
                                 broadcast=sync_module_states,
                                 group=process_group)
        # the tensors this unit owns go to its device (nested units moved
        # theirs)
        if device_id is not None:
            move_own_tensors(module, device)
        self.mixed_precision = mixed_precision
        check_master_dtype(mixed_precision, module.named_parameters())
        # (a nested unit cast its own, by its own policy)
        for m in modules_not_in_units(module):
            cast_buffers(m, mixed_precision, recurse=False)
        self.flat_params = self._flatten_own_parameters()
        # replicas: the same shards
        if self.replicate_group is not None and deferred and sync_module_states:
            comm.broadcast_tensors([flat.param.data for flat in self.flat_params],
                                   src=0, group=self.replicate_group)
        # chapter 8: what the all-gathers send, what the gradients are
        # averaged in
        for flat in self.flat_params:
            flat.use_precision(
                mixed_precision and mixed_precision.param_dtype,
                mixed_precision and mixed_precision.reduce_dtype,
                offload=bool(cpu_offload and cpu_offload.offload_params),
                device=device)
        for i, flat in enumerate(self.flat_params):
            self.register_parameter(f"flat_param_{i}", flat.param)
            if flat.param.requires_grad:
                flat.param.register_post_accumulate_grad_hook(
                    lambda p, flat=flat: self._post_backward(flat))
        # The root is the outermost unit; it is built last and claims every
        # unit inside it (a link, never a submodule: _LINKS above)
        self._root_unit = self
        for unit in module.modules():
            if isinstance(unit, FullyShardedDataParallel):
                unit._root_unit = self
        # one per root
        self._limiter = AllGatherLimiter() if limit_all_gathers else None
        for name, unit in self.named_units():
            unit.unit_name = name or "(root)"
            for flat in unit.flat_params:
                flat.name, flat.limiter = unit.unit_name, self._limiter
        self._pending = []            # reduce-scatters in flight (root only)
        self._callback_queued = False  # root only
        self._backward_started = False
        # the unit whose backward comes next (chapter 7)
        self._next_in_backward = None
        # False inside no_sync()
        self._sync_gradients = True
        # chapter 8 (root only)
        self._scaled_before_forward = scaled_losses()
        # units in the order they ran (root only, chapter 7)
        self._order = ExecutionOrder()
        # root only (api.refuse_stale_optimizers)
        self._optimizers_checked = False
    # --8<-- [end:init]

    # --8<-- [start:flatten_own]
    def _flatten_own_parameters(self) -> list[FlatParameter]:
        """One FlatParameter for the trainable parameters this unit owns, one
        for the frozen ones."""
        places, dtypes = {True: [], False: []}, {}
        for prefix, m in named_modules_not_in_units(self.module):
            for name, p in m.named_parameters(recurse=False):
                places[p.requires_grad].append((m, name))
                dtypes.setdefault(p.dtype, []).append(prefix + name)
        # one flat tensor has one dtype: casting would silently change the
        # model
        if len(dtypes) > 1:
            held = "; ".join(f"{dtype}: {', '.join(names[:4])}"
                             f"{' ...' if len(names) > 4 else ''}"
                             for dtype, names in dtypes.items())
            raise ValueError(
                f"a unit flattens its parameters into one tensor of one "
                f"dtype, but the unit around {type(self.module).__name__} "
                f"holds several ({held}). Give the model one dtype, or put "
                f"the parameters of each dtype in units of their own "
                f"(auto_wrap_policy)")
        return [FlatParameter(places[rg], requires_grad=rg,
                              group=self.process_group, shard=self.shard,
                              replicate_group=self.replicate_group)
                for rg in (True, False) if places[rg]]
    # --8<-- [end:flatten_own]

    def __getattr__(self, name: str):
        """Attributes of the wrapped module read through the wrapper (`model.blocks`), as in PyTorch."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def __getitem__(self, key):  # a wrapped nn.Sequential still indexes
        return self.module[key]

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """Inside summon_full_params, the original parameters under their names before wrapping, as in PyTorch."""
        named = super().named_parameters(prefix, recurse, remove_duplicate)
        return api.names_before_wrapping(self, named, prefix) if self._summoned else named

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """Inside summon_full_params, under the names before wrapping too."""
        named = super().named_buffers(prefix, recurse, remove_duplicate)
        return api.names_before_wrapping(self, named, prefix) if self._summoned else named

    # -- forward ----------------------------------------------------------------------------------------------
    @property
    def is_root(self) -> bool:
        return self._root_unit is self

    # --8<-- [start:forward]
    def forward(self, *args, **kwargs):
        # its originals are registered parameters: the runtime could not set
        # its views
        if self._summoned:
            raise RuntimeError("forward inside summon_full_params(): leave the "
                               "block first (as in PyTorch, summon_full_params "
                               "is for use between steps)")
        root = self._root_unit
        root._order.record("forward", self)
        if self.is_root:
            # the first forward: an optimizer built before wrapping?
            if not self._optimizers_checked:
                api.refuse_stale_optimizers(self)
                self._optimizers_checked = True
            api.refuse_moved_offloaded_shards(self)
            # fp16 without a loss scaler is warned about
            self._scaled_before_forward = scaled_losses()
            args, kwargs = cast_inputs(self.mixed_precision, args, kwargs)
            # every unit's all-gathers: they run on this device's stream
            sync_all_gathers(self.device)
        for flat in self.flat_params:
            # start our own all-gather (if not prefetched already) ...
            flat.unshard(async_op=True)
        if self.forward_prefetch:
            # BEGIN EXERCISE 7.1: forward prefetch: start the next unit's all-gather
            # (filled in the first step; complete once `recorded`)
            order = root._order.order["forward"]
            if root._order.recorded and self in order[:-1]:
                # ... queue the next unit's behind it ...
                self._prefetch(order[order.index(self) + 1])
            # END EXERCISE
        for flat in self.flat_params:
            flat.wait_unshard()  # ... and only now block, for ours
        # for a timeline, if one listens
        events.emit(events.COMPUTE_BEGIN, f"forward {self.unit_name}")
        out = self.module(*args, **kwargs)
        events.emit(events.COMPUTE_END, f"forward {self.unit_name}")
        # a forward recomputed inside our backward (activation checkpointing):
        # our parameters stay for the backward, which has its hooks already
        if self._backward_started:
            return out
        grads_coming = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in tree_leaves(out))
        # the root keeps its parameters: its backward is the first to run,
        # right after forward
        if not grads_coming or (self.reshard_after_forward and not self.is_root):
            for flat in self.flat_params:
                flat.reshard()
        # a prefetch the forward did not use (the graph changed): let it go
        if self.is_root:
            for unit in self.units()[1:]:
                if unit.reshard_after_forward or not grads_coming:
                    for flat in unit.flat_params:
                        flat.reshard()
        if grads_coming:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
            for flat in self.flat_params:
                flat.grad_forwards += 1
                # the views this forward used
                if flat.concat_node is not None and flat.grad_forwards == 1:
                    flat.concat_node.register_prehook(
                        lambda grad_outputs, flat=flat: self._before_concat(flat))
        return out
    # --8<-- [end:forward]

    # --8<-- [start:prefetch]
    @staticmethod
    def _prefetch(unit) -> None:
        """Start the unit's all-gather now, without waiting: its own unshard()
        will find it on its way."""
        if unit is not None:
            for flat in unit.flat_params:
                flat.unshard(async_op=True)
    # --8<-- [end:prefetch]

    # -- backward ---------------------------------------------------------------------------------------------
    # --8<-- [start:pre_backward]
    def _pre_backward(self, grad):
        """The gradient of this unit's output has arrived: its own backward is
        next."""
        if not self._backward_started:
            self._backward_started = True
            root = self._root_unit
            root._order.record("backward", self)
            # BEGIN EXERCISE 6.2: queue _finish_backward once; start our all-gather
            if not root._callback_queued:
                root._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(
                    root._finish_backward)
            for flat in self.flat_params:
                flat.unshard(async_op=True)
            # END EXERCISE
            if self.backward_prefetch is not None:
                # BEGIN EXERCISE 7.2: backward prefetch: next unit in recorded order
                order = root._order.order["backward"]
                i = (order.index(self) + 1
                     if root._order.recorded and self in order else len(order))
                nxt = order[i] if i < len(order) else None
                # only a unit still to come: the root's backward starts first
                # and ends last, after every other's
                self._next_in_backward = (
                    None if nxt is None or nxt._backward_started else nxt)
                if self.backward_prefetch == BackwardPrefetch.BACKWARD_PRE:
                    # before we wait for our own and compute
                    self._prefetch(self._next_in_backward)
                # END EXERCISE
            for flat in self.flat_params:
                flat.wait_unshard()
                # a gradient shard left from an earlier backward
                # (accumulation) cannot take the full-size gradient autograd
                # is about to produce: set it aside, add it back at the end
                flat.saved_grad, flat.param.grad = flat.param.grad, None
            events.emit(events.COMPUTE_BEGIN, f"backward {self.unit_name}")
        return grad
    # --8<-- [end:pre_backward]

    # --8<-- [start:before_concat]
    def _before_concat(self, flat: FlatParameter) -> None:
        """Autograd is about to concatenate this unit's parameter gradients
        into its flat gradient, a new full-size tensor. Make room first: our
        full parameters go (no node still to run reads them -- unless a second
        forward fed this gradient: then they stay until reshard, as before),
        and the earlier units' full gradients, whose reduce-scatters have had
        our whole backward to finish: wait for them, and let the gradients go.
        (Not earlier: that would keep our compute from overlapping their
        reduce-scatters.)"""
        if flat.grad_forwards == 1:
            flat.free_before_concat()
        self._root_unit._retire_finished(wait=True)
    # --8<-- [end:before_concat]

    # --8<-- [start:post_backward]
    def _post_backward(self, flat: FlatParameter) -> None:
        """The flat gradient is complete: average it across ranks (async) and
        free the full parameters."""
        events.emit(events.COMPUTE_END, f"backward {self.unit_name}")
        # ahead of our reduce-scatter
        if self.backward_prefetch == BackwardPrefetch.BACKWARD_POST:
            # (found by _pre_backward) -- if its backward has not started since
            nxt = self._next_in_backward
            self._prefetch(None if nxt is None or nxt._backward_started else nxt)
        # no_sync() (chapter 9) in play
        if not self._sync_gradients or flat.unsharded_grad is not None:
            # inside the block: nothing is sent
            if training.accumulate_unsharded(flat, self._sync_gradients):
                return
        # BEGIN EXERCISE 6.1: reduce-scatter the flat gradient, queue it, reshard
        full_grad = flat.param.grad
        flat.param.grad = None
        handle, grad_shard = flat.reduce_scatter_grad(full_grad)
        self._root_unit._pending.append((flat, handle, grad_shard, full_grad))
        flat.reshard()
        self._root_unit._retire_finished()  # free the full gradients already sent
        # END EXERCISE
    # --8<-- [end:post_backward]

    # --8<-- [start:finish_backward]
    def _retire_finished(self, wait: bool = False) -> None:
        """Hand over the gradient shards of finished reduce-scatters, and let
        their full gradients go."""
        still_pending = []
        # full_grad: kept alive until sent
        for flat, handle, grad_shard, full_grad in self._pending:
            if not (wait or handle.is_completed()):
                still_pending.append((flat, handle, grad_shard, full_grad))
                continue
            handle.wait()
            # full_grad (or chapter 8's reduce_dtype copy)
            sent, flat.reduce_input = flat.reduce_input, None
            # chapter 8: fp32, where the shard lives
            grad_shard = flat.grad_for_optimizer(grad_shard)
            # the shard is copied out: the full gradient goes now
            if flat.sharded and not flat.offload:
                comm.release(sent)
            flat.param.grad = (grad_shard if flat.saved_grad is None
                               else flat.saved_grad + grad_shard)
            flat.saved_grad = None
        self._pending = still_pending

    def _finish_backward(self) -> None:
        """End of backward (root only): wait for the reduce-scatters, hand the
        shards to the optimizer."""
        self._retire_finished(wait=True)
        # the first step has shown the order: prefetching may use it
        self._order.recorded = True
        for unit in self.units():
            # a unit without gradients never ended
            events.emit(events.COMPUTE_END, f"backward {unit.unit_name}")
            unit._backward_started = False
            for flat in unit.flat_params:
                flat.grad_forwards = 0
                # the root, and any unit whose parameters got no gradient
                flat.reshard()
                # no reduce-scatter came to add to the gradient set aside
                # (no_sync, or no gradient this time): it goes back -- onto the
                # shard, so only once the unit is resharded
                if flat.saved_grad is not None:
                    flat.param.grad, flat.saved_grad = flat.saved_grad, None
        self._callback_queued = False
        warn_if_unscaled(self.mixed_precision, self._scaled_before_forward)
    # --8<-- [end:finish_backward]


    # -- utilities ---------------------------------------------------------------------------------------------
    # PyTorch's: FSDP.summon_full_params(model, writeback=True, rank0_only=False, ...) -- or model.summon_full_params()
    summon_full_params = api.static_or_bound(api.summon_full_params)
    state_dict_type = staticmethod(api.state_dict_type)
    fsdp_modules = staticmethod(api.fsdp_modules)
    # PyTorch's: FSDP.optim_state_dict(model, optim) -> by original name; FSDP.optim_state_dict_to_load(...)
    optim_state_dict = staticmethod(optim_state.optim_state_dict)
    optim_state_dict_to_load = staticmethod(optim_state.optim_state_dict_to_load)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Full, with the names the model had before wrapping (PyTorch's default); see state_dict_type()."""
        return api.state_dict(self, destination, prefix, keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return api.load_state_dict(self, state_dict, strict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded state dict, with the names the model had before wrapping (on every rank)."""
        return state_dict.full_state_dict(self)

    def load_full_state_dict(self, sd: dict[str, torch.Tensor], strict: bool = True):
        """Checked like nn.Module.load_state_dict (keys, and shapes always); returns (missing, unexpected)."""
        return state_dict.load_full_state_dict(self, sd, strict)

    # -- chapter 9 (training.py) ---------------------------------------------------------------------------------
    def no_sync(self):
        """Backward passes inside the block send nothing; the first one after it reduce-scatters the sum."""
        return training.no_sync(self.units())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip as torch.nn.utils.clip_grad_norm_ would on the whole model's gradients; returns the norm."""
        if not self.is_root:
            raise RuntimeError("clip_grad_norm_() clips the whole model: call it on the root unit")
        flats = [flat for unit in self.units() for flat in unit.flat_params]
        return training.clip_grad_norm_(flats, max_norm, norm_type, group=self.process_group)

    def units(self) -> list["FullyShardedDataParallel"]:
        return [u for u in self.modules() if isinstance(u, FullyShardedDataParallel)]

    def named_units(self) -> list[tuple[str, "FullyShardedDataParallel"]]:
        """(name of the wrapped module as before wrapping, unit) for every unit; the root is ''."""
        return named_units(self)


FSDP = FullyShardedDataParallel
