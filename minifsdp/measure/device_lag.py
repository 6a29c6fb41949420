"""Chapter 13: a GPU as far behind the CPU as it can be, for the simulator -- FSDP's rate limiter (chapter 7) with
frees that take effect only when the CPU waits for the device.

On meta tensors, as on CPU ranks, a free is immediate; on a GPU the caching allocator may reuse a freed buffer only
once the kernels queued before the free have run. `DeviceLag` makes the difference visible to the meter: the worst
case, the one limit_all_gathers bounds. The simulator (simulate.py) installs it with Spec(device_lag=True).
"""

from __future__ import annotations

import torch

from minifsdp.fsdp.prefetch import AllGatherLimiter
from minifsdp.measure.meter import MemoryMeter


# --8<-- [start:device_lag]
class _HeldUntilSynced:
    """A freed buffer's memory as the device still holds it: released when the
    CPU waits for the device."""

    def __init__(self, memory: torch.Tensor):
        self.memory = memory

    def synchronize(self) -> None:
        self.memory = None


class DeviceLag(AllGatherLimiter):
    """FSDP's rate limiter (chapter 7) with a GPU as far behind the CPU as it
    can be.

    On a GPU, reshard() frees a unit's full parameters in the CPU's program
    order, but the caching allocator may hand the memory out again only once the
    GPU has run the kernels queued before the free (the buffer was
    record_stream'ed). A CPU far ahead keeps issuing all-gathers into new memory
    meanwhile. On the meta device (and on the CPU) a free is immediate, so the
    simulator would never see it; this limiter makes it visible: each free
    leaves a meta tensor of the buffer's size -- memory the allocator cannot
    reuse yet, counted under "unsharded" -- until the CPU waits for that free.
    With limit_all_gathers, the CPU waits for the oldest free before an
    all-gather once `limit` (2) are pending; without, it never waits: the worst
    case, a device that has run nothing yet, until the CPU synchronises
    (`synchronize_all`, which the simulator calls after forward and after
    backward, where a training loop reads the loss or the optimizer waits for
    the gradients)."""

    def __init__(self, meter: MemoryMeter, limit: float = 2):
        super().__init__(limit=limit)
        self.meter = meter

    def freed(self, buffer: torch.Tensor) -> None:
        held = torch.empty(buffer.numel(), dtype=buffer.dtype,
                           device=buffer.device)
        self.meter.watch([held], "unsharded")
        self.pending.append(_HeldUntilSynced(held))

    def synchronize_all(self) -> None:
        while self.pending:
            self.pending.popleft().synchronize()
# --8<-- [end:device_lag]
