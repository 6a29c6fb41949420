"""Chapter 1: data parallelism at its plainest, the version ddp.py improves on.

Every replica starts from rank 0's weights; when backward is over, each gradient is averaged by a
blocking all-reduce of its own. That is all DDP has to do. ddp.py's DistributedDataParallel does the same
sums with named improvements: buckets (a few large calls instead of one per parameter), each launched
asynchronously while backward goes on, in the order gradients really arrive, and no_sync().

    model = NaiveDDP(TinyGPT())
    model(x, y).backward()        # every .grad is the average when backward() returns
    optimizer.step()
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp.distributed import comm


# --8<-- [start:naive]
class NaiveDDP(nn.Module):
    """One blocking all-reduce per gradient, once backward is over.

    find_unused_parameters: as in torch's DDP, for a model some of whose
    parameters may get no gradient on some ranks: one more all-reduce says
    which were used somewhere (those get the average; the rest stay None).
    """

    def __init__(self, module: nn.Module, process_group=None,
                 find_unused_parameters: bool = False):
        super().__init__()
        self.module, self.process_group = module, process_group
        self.find_unused_parameters = find_unused_parameters
        # every replica starts from rank 0's weights
        state = list(module.named_parameters()) + list(module.named_buffers())
        comm.sync_from_rank0(state, process_group)
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._queued = False
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._queue_average)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # --8<-- [start:average]
    def _queue_average(self, p: nn.Parameter) -> None:
        if not self._queued:  # once per backward: average when it is over
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(self._average_gradients)
            self._queued = True

    def _average_gradients(self) -> None:
        self._queued = False
        used = [p.grad is not None for p in self._params]
        if self.find_unused_parameters:  # used on any rank: averaged
            flags = torch.tensor(used, dtype=torch.float32,
                                 device=self._params[0].device)
            comm.all_reduce(flags, group=self.process_group)
            used = (flags > 0).tolist()
        n = comm.world_size(self.process_group)
        for p, used_somewhere in zip(self._params, used):
            if not used_somewhere:
                continue
            if p.grad is None:  # unused here, used elsewhere
                p.grad = torch.zeros_like(p)
            # as torch's DDP averages: times 1/N first, then the sum
            comm.all_reduce(p.grad.mul_(1.0 / n), group=self.process_group)
    # --8<-- [end:average]
# --8<-- [end:naive]
