"""Chapter 7: what prefetching is told, the order it follows, and the rate limiter (the runtime, fsdp.py,
uses all three).

    FullyShardedDataParallel(model, backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True,
                             limit_all_gathers=True)

To prefetch, a unit must know which unit comes next. The root records the order units run in during the
first step (ExecutionOrder); from the second step on, a unit starts the next one's all-gather early. This
assumes a static graph: the same units in the same order every step. A unit the recorded order names but
the graph then does not use is freed at the end of forward, so a changing graph costs a wasted all-gather,
never a wrong value.
"""

from __future__ import annotations

import collections
import enum

import torch


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
# --8<-- [end:limiter]


BACKWARD_PRE, BACKWARD_POST = BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST
