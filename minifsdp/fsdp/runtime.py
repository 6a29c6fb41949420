"""Chapter 6: the FSDP runtime -- units, and the hooks that unshard and reshard them around compute.

    model = FSDPUnit(TinyGPT(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)     # built AFTER wrapping: over the shards
    model(x, y).backward(); optimizer.step()

Every unit owns the parameters of its subtree that no nested unit owns, as one FlatParameter (chapter 5):
one all-gather and one reduce-scatter per unit. The outermost unit is the root. Per unit and step:
    forward:   unshard -> compute -> reshard (not the root, nor under reshard_after_forward=False)
    backward:  unshard again -> compute -> free the full parameters just before autograd concatenates
               their gradients -> reduce-scatter the flat gradient (asynchronously) -> reshard
    end:       the root waits for the reduce-scatters in flight; `.grad` of each flat parameter is this
               rank's shard of the averaged gradient, the shape the optimizer steps.
Each unit's place in the step is one TrainingState; what the root keeps for the whole model during a step
is one RootState, which every unit shares.

FullyShardedDataParallel (fsdp1/) is this class plus chapters 7-9 (prefetch.py, precision.py,
training.py), each a subclass adding one idea through the methods whose docstrings name it, and PyTorch
FSDP1's surface. Measurement is not called from here: the runtime announces compute spans as events.
"""

from __future__ import annotations

import enum

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from minifsdp import events
from minifsdp.distributed import comm
from minifsdp.distributed.launch import current_device
from minifsdp.fsdp.flat_param import FlatParameter
from minifsdp.fsdp.streams import sync_all_gathers
from minifsdp.fsdp.wrap import (check_wrappable, is_unit, named_modules_not_in_units, named_units,
                                refuse_stale_optimizers, unowned_named_tensors, wrap_children)


# --8<-- [start:training_state]
class TrainingState(enum.Enum):
    """Where a unit is in the step. Both runtimes (chapter 6's units and
    chapter 11's fully_shard modules) move through the same four states."""
    IDLE = "idle"                    # between steps, or not yet reached
    FORWARD = "forward"              # inside its forward
    PRE_BACKWARD = "pre-backward"    # backward has reached it: unsharded again
    POST_BACKWARD = "post-backward"  # its gradient is complete and on its way
# --8<-- [end:training_state]


# --8<-- [start:root_state]
class RootState:
    """What the root keeps for every unit of its model during a step: one
    object, which every unit shares (chapter 7 adds the order units run in)."""

    def __init__(self, root: nn.Module):
        self.root = root
        # reduce-scatters in flight: (flat, handle, its shard, the full grad)
        self.pending = []
        # gradient shards of an earlier backward, set aside (pre_backward)
        self.saved_grad_shards = {}
        self.callback_queued = False
        self.optimizers_checked = False

    def retire_finished(self, wait: bool = False) -> None:
        """Hand over the gradient shards of finished reduce-scatters (all of
        them, with wait), and let their full gradients go."""
        still_pending = []
        # full_grad: kept alive until sent
        for flat, handle, grad_shard, full_grad in self.pending:
            if not (wait or handle.is_completed()):
                still_pending.append((flat, handle, grad_shard, full_grad))
                continue
            handle.wait()
            # two backward passes without zero_grad(): they add up, as for
            # any parameter
            saved = self.saved_grad_shards.pop(flat, None)
            # copied out: the full gradient goes now
            grad = flat.grad_for_optimizer(grad_shard,
                                           read_now=saved is not None)
            flat.param.grad = grad if saved is None else saved + grad
        self.pending = still_pending
# --8<-- [end:root_state]


class FSDPUnit(nn.Module):
    """ZeRO-3: every rank keeps 1/N of the parameters, gradients and optimizer state (16Ψ/N with AdamW).

    module:                built identically on every rank (rank 0's parameters and buffers are broadcast
                           before anything is sharded, unless sync_module_states=False).
    auto_wrap_policy:      which submodules become units of their own (wrap.py); None: one unit.
    reshard_after_forward: True (ZeRO-3) frees the full parameters after forward and gathers them again
                           in backward; False keeps them until backward (more memory, one all-gather fewer).
    process_group:         the ranks the parameters are sharded over (default: all of them).
    replicate_group:       ranks that hold the same shards, on other groups (HSDP, chapter 11).
    """

    _fsdp_unit = True  # the walks of wrap.py stop here: this module's subtree is this unit's
    root_state_class = RootState  # chapter 7's subclass records the order

    # --8<-- [start:init]
    def __init__(self, module: nn.Module, process_group=None,
                 auto_wrap_policy=None, reshard_after_forward: bool = True,
                 sync_module_states: bool = True, replicate_group=None):
        super().__init__()
        comm.require_process_group()
        check_wrappable(module, auto_wrap_policy)
        module._fsdp_wrapped = True
        self.process_group, self.replicate_group = (process_group,
                                                    replicate_group)
        self.reshard_after_forward = reshard_after_forward
        self.sync_module_states = sync_module_states
        self.training_state = TrainingState.IDLE
        # forwards with gradients since the last backward
        self.grad_forwards = 0
        if sync_module_states:
            # every rank starts from rank 0's weights and buffers, as under
            # DDP -- before anything is sharded (afterwards each rank's shard
            # is its own: so only what no unit wrapped by hand owns already)
            self._sync_from_rank0(unowned_named_tensors(module))
        if auto_wrap_policy is not None:
            self._wrap_children(module, auto_wrap_policy)
        self.module = module
        self.device = self._compute_device()
        self._before_flatten()
        self.flat_params = self._flatten_own_parameters()
        for i, flat in enumerate(self.flat_params):
            self.register_parameter(f"flat_param_{i}", flat.param)
            if flat.param.requires_grad:
                flat.param.register_post_accumulate_grad_hook(
                    lambda p, flat=flat: self.post_backward(flat))
        # The root is the outermost unit: built last, it gives every unit
        # inside it its one RootState (a plain object: no submodule links)
        self.root_state = self.root_state_class(self)
        for name, unit in self.named_units():
            unit.root_state, unit.unit_name = self.root_state, name or "(root)"
            for flat in unit.flat_params:
                flat.name = unit.unit_name
    # --8<-- [end:init]

    def _sync_from_rank0(self, named_tensors) -> None:
        """Rank 0's values on every rank of the group (and of the replicas)."""
        comm.sync_from_rank0(named_tensors, self.process_group)
        if self.replicate_group is not None:
            comm.sync_from_rank0(named_tensors, self.replicate_group)

    def _wrap_children(self, module: nn.Module, policy) -> None:
        """Make units of the submodules the policy picks, innermost first."""
        uses = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            uses.setdefault(p, []).append(name)
        wrap_children(module, policy, uses, self._wrap_child)

    def _wrap_child(self, child: nn.Module) -> nn.Module:
        """The unit for one submodule the policy picked: this class, these options."""
        return type(self)(child, **self._child_options())

    def _child_options(self) -> dict:
        """The arguments a nested unit is built with (each chapter adds its own)."""
        # (the root has synced the whole model before wrapping any of it)
        return dict(process_group=self.process_group,
                    replicate_group=self.replicate_group,
                    reshard_after_forward=self.reshard_after_forward,
                    sync_module_states=False)

    def _compute_device(self) -> torch.device:
        """Where this unit computes: this rank's device (chapter 9: device_id)."""
        return current_device()

    def _before_flatten(self) -> None:
        """A last look at the modules this unit owns before their parameters
        are flattened (chapter 8 casts buffers, chapter 9 materializes)."""

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
        return [self._make_flat_param(places[rg], rg)
                for rg in (True, False) if places[rg]]

    def _make_flat_param(self, places, requires_grad: bool) -> FlatParameter:
        """One FlatParameter over `places` (chapter 8: one that casts)."""
        return FlatParameter(places, requires_grad, group=self.process_group,
                             replicate_group=self.replicate_group)
    # --8<-- [end:flatten_own]

    def __getattr__(self, name: str):
        """Attributes of the wrapped module read through the wrapper (`model.blocks`), as in PyTorch."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def __getitem__(self, key):  # a wrapped nn.Sequential still indexes
        return self.module[key]

    @property
    def is_root(self) -> bool:
        return self.root_state.root is self

    # -- forward ------------------------------------------------------------------------------------------
    # --8<-- [start:unshard_compute]
    def forward(self, *args, **kwargs):
        args, kwargs = self.pre_forward(args, kwargs)
        # for a timeline, if one listens
        events.emit(events.COMPUTE_BEGIN, f"forward {self.unit_name}")
        out = self.module(*args, **kwargs)
        events.emit(events.COMPUTE_END, f"forward {self.unit_name}")
        return self.post_forward(out)

    def pre_forward(self, args, kwargs):
        """Unshard this unit (the root first prepares the step)."""
        if self.is_root:
            args, kwargs = self._root_pre_forward(args, kwargs)
        self.training_state = TrainingState.FORWARD
        # start our own all-gather (if not prefetched already) ...
        self._start_unshard()
        self._prefetch_next("forward")
        # ... and only now block, for it
        self._wait_for_unshard()
        return args, kwargs
    # --8<-- [end:unshard_compute]

    # --8<-- [start:post_forward]
    def post_forward(self, out):
        """Reshard -- unless a backward is coming and this is the root or a
        unit that keeps its parameters -- and hook the coming backward."""
        self.training_state = TrainingState.IDLE
        grads_coming = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in tree_leaves(out))
        # the root keeps its parameters: its backward is the first to run,
        # right after forward
        if not grads_coming or (self.reshard_after_forward and not self.is_root):
            self._reshard()
        if self.is_root:
            # the end of the step's forward: free whatever no backward will
            # use (an all-gather the forward did not need included)
            for unit in self.units()[1:]:
                if unit.reshard_after_forward or not grads_coming:
                    unit._reshard()
        if grads_coming:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self.pre_backward)
            self.grad_forwards += 1
            # the views this forward used
            for flat in self.flat_params:
                if flat.concat_node is not None and self.grad_forwards == 1:
                    flat.concat_node.register_prehook(
                        lambda grad_outputs, flat=flat: self._before_concat(flat))
        return out
    # --8<-- [end:post_forward]

    def _root_pre_forward(self, args, kwargs):
        """The root, before the step's forward: what holds for the whole step."""
        # the first forward: an optimizer built before wrapping?
        if not self.root_state.optimizers_checked:
            refuse_stale_optimizers(self)
            self.root_state.optimizers_checked = True
        # on a GPU, every unit's all-gathers run on one side stream, which
        # must see what the optimizer wrote (chapter 7)
        sync_all_gathers(self.device)
        return args, kwargs

    def _start_unshard(self) -> None:
        """Start the all-gathers of this unit's flat parameters (if not
        started already)."""
        for flat in self.flat_params:
            flat.unshard(async_op=True)

    def _wait_for_unshard(self) -> None:
        """Block until this unit's all-gathers are done, and show the views."""
        for flat in self.flat_params:
            flat.wait_for_unshard()

    def _prefetch_next(self, phase: str) -> None:
        """Chapter 7 starts the next unit's all-gather here, in `phase`; this
        chapter gathers each unit only when it computes."""

    def _reshard(self, flats=None) -> None:
        """Free the full parameters of `flats` (default: all of this unit's)."""
        for flat in self.flat_params if flats is None else flats:
            flat.reshard()

    # -- backward -----------------------------------------------------------------------------------------
    # --8<-- [start:pre_backward]
    def pre_backward(self, grad):
        """The gradient of this unit's output has arrived: its own backward is
        next (once per backward, however many outputs it has)."""
        if self.training_state is not TrainingState.IDLE:
            return grad
        self.training_state = TrainingState.PRE_BACKWARD
        state = self.root_state
        # BEGIN EXERCISE 6.2: end backward once; gather this unit
        if not state.callback_queued:
            state.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(
                state.root.finish_backward)
        self._start_unshard()
        # END EXERCISE
        self._prefetch_next("backward")
        self._wait_for_unshard()
        for flat in self.flat_params:
            # a gradient shard left from an earlier backward cannot take the
            # full-size gradient autograd is about to produce: set it aside,
            # add it back once this one is reduced
            if flat.param.grad is not None:
                state.saved_grad_shards[flat] = flat.param.grad
                flat.param.grad = None
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
        if self.grad_forwards == 1:
            flat.free_before_concat()
        self.root_state.retire_finished(wait=True)
    # --8<-- [end:before_concat]

    # --8<-- [start:post_backward]
    def post_backward(self, flat: FlatParameter) -> None:
        """The flat gradient is complete: average it across ranks (async) and
        free the full parameters."""
        self.training_state = TrainingState.POST_BACKWARD
        events.emit(events.COMPUTE_END, f"backward {self.unit_name}")
        self._prefetch_next("post_backward")
        if self._accumulate_unsharded(flat):
            return
        # BEGIN EXERCISE 6.1: reduce-scatter the flat gradient, queue it, reshard
        full_grad = flat.param.grad
        flat.param.grad = None
        handle, grad_shard = flat.reduce_scatter_grad(full_grad)
        self.root_state.pending.append((flat, handle, grad_shard, full_grad))
        self._reshard([flat])
        # free the full gradients already sent
        self.root_state.retire_finished()
        # END EXERCISE

    def _accumulate_unsharded(self, flat: FlatParameter) -> bool:
        """Chapter 9's no_sync() keeps the full gradient here instead of
        sending it (True); this chapter always sends it."""
        return False
    # --8<-- [end:post_backward]

    # --8<-- [start:finish_backward]
    def finish_backward(self) -> None:
        """End of backward (the root's callback): wait for the reduce-scatters,
        hand the shards to the optimizer, reshard every unit."""
        root = self.root_state
        root.retire_finished(wait=True)
        for unit in self.units():
            # a unit without gradients never ended
            events.emit(events.COMPUTE_END, f"backward {unit.unit_name}")
            unit.training_state = TrainingState.IDLE
            unit.grad_forwards = 0
            # the root, and any unit whose parameters got no gradient
            unit._reshard()
            for flat in unit.flat_params:
                # no reduce-scatter came to add to the gradient set aside (no
                # gradient this time): it goes back -- onto the shard, so only
                # once the unit is resharded
                if flat in root.saved_grad_shards:
                    flat.param.grad = root.saved_grad_shards.pop(flat)
        root.callback_queued = False
    # --8<-- [end:finish_backward]

    def units(self) -> list["FSDPUnit"]:
        return [u for u in self.modules() if is_unit(u)]

    def named_units(self) -> list[tuple[str, "FSDPUnit"]]:
        """(name of the wrapped module as before wrapping, unit) for every unit; the root is ''."""
        return named_units(self)
