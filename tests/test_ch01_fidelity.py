"""Chapter 1: DDP behaves as torch's DDP where a script relies on the details -- when buffers are
re-broadcast, and where no_sync() takes effect.

torch's rule, which ours follows: whether a backward averages the gradients is decided by the forward
(no_sync() must surround the forward; around the backward alone it changes nothing), and rank 0's buffers
are broadcast before a forward only if the previous forward led to a synced backward -- not after a
forward under no_sync() or no_grad. A BatchNorm model with a different batch on each rank makes any
difference in that rule visible in its running statistics. Two ranks: bit-exact against torch.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minifsdp import launch
from minifsdp.ddp import DistributedDataParallel

pytestmark = pytest.mark.exercise("1.2", "1.3")  # every test runs chapter 1's DDP

# (where no_sync() is: "none", "forward" (around the forward only), "backward" (around the backward
# only), "both"; then whether the forward runs with grad)
SCHEDULE = [("none", True), ("both", True), ("none", True), ("forward", True), ("none", True),
            ("backward", True), ("none", False), ("none", True)]


class BNNet(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 1)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.lin(x))))


def run(kind):
    net = BNNet(seed=dist.get_rank())
    model = DistributedDataParallel(net) if kind == "ours" else TorchDDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    r = dist.get_rank()
    grads, stats = [], []
    for step, (where, grad_mode) in enumerate(SCHEDULE):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + r)) + r  # ranks differ
        around_forward = model.no_sync() if where in ("forward", "both") else contextlib.nullcontext()
        around_backward = model.no_sync() if where in ("backward", "both") else contextlib.nullcontext()
        with around_forward, torch.set_grad_enabled(grad_mode):
            loss = model(x).pow(2).mean()
        if grad_mode:
            with around_backward:
                loss.backward()
            grads.append([p.grad.clone() for p in net.parameters()])
            if where == "none":
                opt.step()
                opt.zero_grad()
        stats.append((net.bn.running_mean.clone(), net.bn.running_var.clone()))
    return grads, stats, [p.detach().clone() for p in net.parameters()]


def both():
    return {kind: run(kind) for kind in ("torch", "ours")}


@pytest.fixture(scope="module")
def results():
    return launch(both, world_size=2)


def test_no_sync_is_decided_at_forward_as_in_torch(results):
    for res in results:
        for step, (theirs, ours) in enumerate(zip(res["torch"][0], res["ours"][0])):
            for a, b in zip(theirs, ours):
                assert torch.equal(a, b), (
                    f"after backward {step} ({SCHEDULE[step][0]!r} under no_sync()) the gradients differ from "
                    f"torch's DDP's by up to {(a - b).abs().max().item():.3e} (exercise 1.3): a synced backward "
                    f"averages what the .grad holds, the sum of every micro-batch since the last step, in place")


def test_buffers_are_broadcast_when_torch_broadcasts_them(results):
    for res in results:
        for step, (theirs, ours) in enumerate(zip(res["torch"][1], res["ours"][1])):
            assert torch.equal(theirs[0], ours[0]) and torch.equal(theirs[1], ours[1]), (
                f"step {step}: BatchNorm's running statistics differ from torch's DDP's (exercise 1.2): the "
                f"buffers are broadcast by the given forward; did a backward average with other gradients?")
    # the schedule does leave the ranks' statistics apart at some point (else the test would prove nothing)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(results[0]["ours"][1], results[1]["ours"][1]))


def test_same_parameters_as_torch(results):
    for res in results:
        diff = max((a - b).abs().max().item() for a, b in zip(res["torch"][2], res["ours"][2]))
        assert diff == 0.0, (
            f"after the schedule the weights differ from torch's DDP's by up to {diff:.3e} (exercises 1.2 and "
            f"1.3): each synced backward must average exactly as torch's does, and leave the average in .grad")
