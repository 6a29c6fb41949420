"""Chapter 11: the fully_shard runtime -- each module's state, the four hooks around its forward and backward,
and the root's.

fully_shard (fully_shard.py) gives each module an FSDPState and registers its forward hooks. Chapter 6's
runtime, with the same idea at each hook, and the same names:

    pre_forward    unshard (all-gather; copy-out), then start the all-gathers of the modules listed with
                   set_modules_to_forward_prefetch; the root (the outermost, found at the first forward)
                   also starts the step: a new forward order
    post_forward   reshard, unless reshard_after_forward=False or this is the root (the root's parameters are
                   the first backward needs); a hook on each output runs pre_backward when its gradient comes
    pre_backward   unshard again, and start the all-gather of the module that ran forward just before this
                   one, which backward needs next (or those listed with set_modules_to_backward_prefetch)
    post_backward  once the gradients of the module's inputs are computed (_PostBackward wraps the inputs),
                   all of its parameters' gradients are in: reduce-scatter them, reshard
    finish_backward  the root's callback at the end of backward (RootState): finish every module whose
                   post_backward did not run (the root, fed token ids, has no input that needs a gradient),
                   reshard everything, and every module is IDLE again

Each module moves through chapter 6's TrainingState: IDLE -> FORWARD -> IDLE in forward, then PRE_BACKWARD
-> POST_BACKWARD in backward, and IDLE again when the backward finishes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from minifsdp.fsdp.flat_param import ShardState
from minifsdp.fsdp.streams import sync_all_gathers
from minifsdp.fsdp.runtime import TrainingState
from minifsdp.fsdp2.param import FSDPParam, FSDPParamGroup

if TYPE_CHECKING:  # (fully_shard.py imports this module)
    from minifsdp.fsdp2.fully_shard import MixedPrecisionPolicy


# --8<-- [start:post_backward_fn]
class _PostBackward(torch.autograd.Function):
    """Wraps a module's inputs: its backward runs once their gradients are
    computed, that is once the module's own backward is done, and all of its
    parameters' gradients are in."""

    @staticmethod
    def forward(ctx, state, *inputs):
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.state.post_backward()
        return (None,) + grads
# --8<-- [end:post_backward_fn]


class FSDPState:
    """What fully_shard adds to one module: its parameter group, its options, its place in the step."""

    def __init__(self, module: nn.Module, group: FSDPParamGroup, reshard_after_forward: bool,
                 mp: MixedPrecisionPolicy):
        self.module, self.group, self.mp = module, group, mp
        self.reshard_after_forward = reshard_after_forward
        self.requires_gradient_sync = self.reshard_after_backward = True
        # the modules whose all-gathers this one starts (FSDPModule's
        # set_modules_to_*_prefetch); backward's None: the implicit one
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] | None = None
        self.training_state = TrainingState.IDLE
        self.root: RootState | None = None  # set at the first forward

    @property
    def is_root(self) -> bool:
        return self.root is not None and self.root.state is self

    # --8<-- [start:hooks]
    def pre_forward(self, module, args, kwargs):
        if self.root is None:  # the first forward: this module is the root
            self.root = RootState(self)
        if self.is_root:
            self.root.pre_forward()
        # (a forward recomputed inside backward keeps the backward's state)
        if self.training_state is TrainingState.IDLE:
            self.training_state = TrainingState.FORWARD
        self.group.unshard(on_compute_stream=self.group.unshard_async_op)
        self.group.wait_for_unshard()
        for s in self.forward_prefetch:
            s.group.unshard(async_op=True,
                            on_compute_stream=s.group.unshard_async_op)
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            args, kwargs = tree_map(lambda t: _cast(t, self.mp.param_dtype),
                                    (args, kwargs))
        if torch.is_grad_enabled():
            self.root.forward_order.append(self)
            args, kwargs = _wrap_inputs(self, args, kwargs)
        return args, kwargs

    def post_forward(self, module, args, output):
        if self.training_state is TrainingState.FORWARD:
            self.training_state = TrainingState.IDLE
        if self.reshard_after_forward and not self.is_root:
            self.group.reshard()
        if self.mp.output_dtype is not None:
            output = tree_map(lambda t: _cast(t, self.mp.output_dtype), output)
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
        return output

    def _pre_backward_hook(self, grad):
        self.pre_backward()
        return grad

    def pre_backward(self) -> None:
        if self.training_state in (TrainingState.PRE_BACKWARD,
                                   TrainingState.POST_BACKWARD):
            return  # (once per backward: a later output's gradient)
        self.training_state = TrainingState.PRE_BACKWARD
        self.root.queue_finish_backward()
        self.group.unshard(on_compute_stream=self.group.unshard_async_op)
        self.group.wait_for_unshard()
        for s in self._backward_prefetch_targets():
            s.group.unshard(async_op=True,
                            on_compute_stream=s.group.unshard_async_op)

    def _backward_prefetch_targets(self) -> list[FSDPState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = self.root.forward_order
        # (a module run twice: its last)
        i = max((k for k, s in enumerate(order) if s is self), default=0)
        # the module that ran forward just before: backward's next
        return [order[i - 1]] if i > 0 else []

    def post_backward(self) -> None:
        if self.training_state is TrainingState.POST_BACKWARD:
            return
        self.training_state = TrainingState.POST_BACKWARD
        grads = self._grads_to_reduce(self.group.take_grads())
        # the parameters first: their memory goes before the reduce-scatter's
        if self.reshard_after_backward:
            self.group.reshard()
        self.group.reduce_scatter_grads(grads)
    # --8<-- [end:hooks]

    def _grads_to_reduce(self, grads: list[tuple[FSDPParam, torch.Tensor]]):
        """set_requires_gradient_sync(False): keep the unsharded gradients,
        added up, and send nothing. With sync on again, what was kept is
        added in first."""
        if not self.requires_gradient_sync:
            for p, g in grads:
                p.unsharded_grad = (g if p.unsharded_grad is None
                                    else p.unsharded_grad + g)
            return []
        grads = [(p, g if p.unsharded_grad is None else p.unsharded_grad + g)
                 for p, g in grads]
        grads += [(p, p.unsharded_grad) for p in self.group.params
                  if p.unsharded_grad is not None
                  and all(p is not q for q, _ in grads)]
        for p, _ in grads:
            p.unsharded_grad = None
        return grads


class RootState:
    """What only the root (the outermost fully_shard module) keeps: every
    module's state under it, the order their forwards ran in this step, and
    whether finish_backward is queued for this backward."""

    def __init__(self, state: FSDPState):
        self.state = state  # the root module's own
        self.states = [m._fsdp for m in state.module.modules()
                       if isinstance(getattr(m, "_fsdp", None), FSDPState)]
        self.forward_order: list[FSDPState] = []
        self.callback_queued = False
        for s in self.states:
            if s.root is not None:
                raise RuntimeError(
                    f"fully_shard: {type(s.module).__name__} ran forward under "
                    f"two roots; call the outermost module")
            s.root = self
            # parameters replaced since fully_shard (to_empty after a meta
            # build)
            for p in s.group.params:
                p.refresh_sharded()

    # --8<-- [start:root]
    def pre_forward(self) -> None:
        # on a GPU: the all-gathers read shards the compute stream last wrote
        sync_all_gathers(self.state.group.device)
        if torch.is_grad_enabled():
            self.forward_order.clear()  # a new step

    def queue_finish_backward(self) -> None:
        """Once per backward, from the first pre_backward: the autograd engine
        runs finish_backward when the backward is done."""
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(
                self.finish_backward)
            self.callback_queued = True

    def finish_backward(self) -> None:
        """Finish every module whose post_backward did not run (its inputs
        needed no gradient, or it was not used), make sure every parameter is
        sharded again, and every module IDLE."""
        for s in reversed(self.forward_order):
            if (s.training_state is TrainingState.PRE_BACKWARD
                    or s.group.state is ShardState.UNSHARDED):
                s.post_backward()
        for s in self.states:
            if s.reshard_after_backward:
                s.group.reshard()
            s.training_state = TrainingState.IDLE
        self.callback_queued = False
    # --8<-- [end:root]


def _cast(t, dtype):
    return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _tensors(tree) -> list[torch.Tensor]:
    out = []
    tree_map(lambda t: out.append(t) if isinstance(t, torch.Tensor) else None, tree)
    return out


def _wrap_inputs(state: FSDPState, args, kwargs):
    """Route the module's floating inputs that need a gradient through _PostBackward."""
    flat = [t for t in _tensors((args, kwargs)) if t.requires_grad]
    if not flat:
        return args, kwargs
    wrapped = dict(zip(map(id, flat), _PostBackward.apply(state, *flat)))
    return tree_map(lambda t: wrapped.get(id(t), t) if isinstance(t, torch.Tensor) else t, (args, kwargs))
