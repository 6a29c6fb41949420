"""Chapter 7: overlap -- prefetching the next unit's all-gather, and the rate limiter that bounds it.

    PrefetchingUnit(model, auto_wrap_policy=..., backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                    forward_prefetch=True, limit_all_gathers=True)

Communication can hide behind compute only if it is issued before the compute that should cover it. To
prefetch, a unit must know which unit comes next. The root records the order units run in during the
first step (ExecutionOrder); from the second step on:
    forward_prefetch=True:           a unit's forward first starts the next unit's all-gather, then computes.
    backward_prefetch=BACKWARD_PRE:  a unit's backward first starts the all-gather of the unit whose backward
                                     comes next, then computes -- so it is on the wire before this unit's
                                     reduce-scatter, and does not queue behind it.
    backward_prefetch=BACKWARD_POST: the same, but after this unit's gradient is computed, just before its
                                     reduce-scatter (one full-parameter buffer fewer while computing).
    limit_all_gathers=True:          on a GPU, the CPU may not run more than two frees ahead of the device.
This assumes a static graph: the same units in the same order every step. A unit the recorded order names
but the graph then does not use is freed at the end of forward, so a changing graph costs a wasted
all-gather, never a wrong value. Prefetching changes the order collectives are issued in, never a value.

PrefetchingUnit is chapter 6's FSDPUnit with these three options: it fills in the runtime's
`_prefetch_next` and wraps its `_start_unshard` and `_reshard` with the limiter.
"""

from __future__ import annotations

import collections
import enum

import torch

from minifsdp.fsdp.flat_param import ShardState
from minifsdp.fsdp.runtime import FSDPUnit, RootState, TrainingState


class BackwardPrefetch(enum.Enum):
    """When a unit's backward starts the all-gather of the unit whose backward comes next (None: never)."""
    BACKWARD_PRE = "pre"    # before this unit's backward compute
    BACKWARD_POST = "post"  # after it, before this unit's reduce-scatter


# --8<-- [start:order]
class ExecutionOrder:
    """The order units ran in, forward and backward, during the first step (kept
    by the root).

    order["forward"], order["backward"]: the units, each once, in the order they
    first ran. Complete once `recorded` is set, at the end of the first
    backward: from then on, a unit finds the one after it there."""

    def __init__(self):
        self.order = {"forward": [], "backward": []}
        self.recorded = False

    def record(self, direction: str, unit) -> None:
        if not self.recorded and unit not in self.order[direction]:
            self.order[direction].append(unit)
# --8<-- [end:order]


# --8<-- [start:limiter]
class AllGatherLimiter:
    """limit_all_gathers=True: the CPU may run at most `limit` frees ahead of
    the device.

    On a GPU, reshard() frees a buffer in the CPU's program order, but the
    device gets to that point only when the compute queued before it is done,
    and the allocator keeps the memory until then (reshard's record_stream). A
    CPU thread running far ahead would start -- and allocate a new full buffer
    for -- the all-gather of every unit before the device has freed any. So each
    free is marked with a CUDA event, and before a new all-gather the CPU waits
    for the oldest outstanding free once `limit` are pending. On the CPU,
    compute is synchronous: a free is done when reshard() returns, nothing is
    ever pending, and the limiter never waits.
    """

    # --8<-- [start:limiter_code]
    def __init__(self, limit: int = 2):
        self.limit, self.pending = limit, collections.deque()

    def freed(self, buffer: torch.Tensor) -> None:
        if buffer.is_cuda:
            event = torch.cuda.Event()
            event.record()
            self.pending.append(event)

    def before_all_gather(self) -> None:
        while len(self.pending) >= self.limit:
            self.pending.popleft().synchronize()
    # --8<-- [end:limiter_code]
# --8<-- [end:limiter]


class PrefetchState(RootState):
    """The root's state, plus the order units run in and the limiter."""

    def __init__(self, root):
        super().__init__(root)
        self.order = ExecutionOrder()
        self.limiter = None  # set by the root: limit_all_gathers


class PrefetchingUnit(FSDPUnit):
    """Chapter 6's unit, which also starts the next unit's all-gather early.

    backward_prefetch: BACKWARD_PRE (the default, as in PyTorch), BACKWARD_POST or None.
    forward_prefetch:  start the next unit's all-gather before this one's forward compute.
    limit_all_gathers: on a GPU, at most two frees outstanding before a new all-gather.
    """

    root_state_class = PrefetchState

    def __init__(self, module, *,
                 backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
                 forward_prefetch: bool = False, limit_all_gathers: bool = True,
                 **options):
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        super().__init__(module, **options)
        # one per root (the root's is the one every unit shares)
        self.root_state.limiter = (AllGatherLimiter() if limit_all_gathers
                                   else None)

    def _child_options(self) -> dict:
        return {**super()._child_options(),
                "backward_prefetch": self.backward_prefetch,
                "forward_prefetch": self.forward_prefetch,
                "limit_all_gathers": self.limit_all_gathers}

    # --8<-- [start:prefetch]
    # --8<-- [start:prefetch_next]
    def _prefetch_next(self, phase: str) -> None:
        """Start the all-gather of the unit that computes next: in forward with
        forward_prefetch; in backward before (BACKWARD_PRE) or after
        (BACKWARD_POST) this unit's compute. Its own unshard() will find it on
        its way."""
        if phase == "forward" and self.forward_prefetch:
            nxt = self._next_in_forward()
        elif (phase, self.backward_prefetch) in (
                ("backward", BackwardPrefetch.BACKWARD_PRE),
                ("post_backward", BackwardPrefetch.BACKWARD_POST)):
            nxt = self._next_in_backward()
        else:
            return
        if nxt is not None:
            nxt._start_unshard()
    # --8<-- [end:prefetch_next]

    # --8<-- [start:next_units]
    def _next_in_forward(self) -> PrefetchingUnit | None:
        """The unit whose forward comes after ours, once the order is known."""
        # BEGIN EXERCISE 7.1: forward prefetch: the unit whose forward is next
        order = self.root_state.order
        units = order.order["forward"]
        if order.recorded and self in units[:-1]:
            return units[units.index(self) + 1]
        return None
        # END EXERCISE

    def _next_in_backward(self) -> PrefetchingUnit | None:
        """The unit whose backward comes after ours, if it is still to come."""
        # BEGIN EXERCISE 7.2: backward prefetch: next unit in recorded order
        order = self.root_state.order
        units = order.order["backward"]
        i = (units.index(self) + 1
             if order.recorded and self in units else len(units))
        nxt = units[i] if i < len(units) else None
        # only a unit still to come: the root's backward starts first and ends
        # last, after every other's
        if nxt is None or nxt.training_state is not TrainingState.IDLE:
            return None
        return nxt
        # END EXERCISE
    # --8<-- [end:next_units]
    # --8<-- [end:prefetch]

    # --8<-- [start:record]
    def pre_forward(self, args, kwargs):
        # the first step records the order units run in ...
        self.root_state.order.record("forward", self)
        return super().pre_forward(args, kwargs)

    def pre_backward(self, grad):
        if self.training_state is TrainingState.IDLE:
            self.root_state.order.record("backward", self)
        return super().pre_backward(grad)

    def finish_backward(self) -> None:
        super().finish_backward()
        # ... and from the second step on, prefetching may use it
        self.root_state.order.recorded = True
    # --8<-- [end:record]

    # --8<-- [start:limited]
    def _start_unshard(self) -> None:
        limiter = self.root_state.limiter
        for flat in self.flat_params:
            # a new all-gather, a new full buffer: not too far ahead
            if limiter is not None and flat.state is ShardState.SHARDED:
                limiter.before_all_gather()
            flat.unshard(async_op=True)

    def _reshard(self, flats=None) -> None:
        limiter = self.root_state.limiter
        for flat in self.flat_params if flats is None else flats:
            freed = flat.state is not ShardState.SHARDED
            flat.reshard()
            if limiter is not None and freed:
                limiter.freed(flat._full)
    # --8<-- [end:limited]


BACKWARD_PRE, BACKWARD_POST = BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST
