"""A model whose parameters mix dtypes, and torch's DDP with a plain optimizer on it: the oracle of the
mixed-dtype tests of chapters 1, 3 and 4 (test_ch01_ddp, test_ch03_oss, test_ch03_flat, test_ch04_sdp,
test_ch04_flat).

Two mixes, each laid out so that some rank's OSS share starts with a parameter of one dtype and goes on
with one of the other (the greedy partition at N = 2 and 3): a broadcast flattened in the dtype of the
share's first parameter would round the fp64 one to fp32 on the receivers (1.000000000001 arrives as
1.0), or the fp32 one to bf16, while the owner keeps full precision.

    "fp64": Linear(6, 15) fp32, Linear(15, 13) fp64, Linear(13, 3) fp32
    "bf16": Linear(6, 15) bf16, Linear(15, 13) fp32, Linear(13, 3) bf16

Each rank builds its model from its own seed (the wrappers must make it rank 0's), and the global batch
of 12 divides by 2 and 3. Differences are read per dtype (diff_by_dtype): a tolerance fit for fp32 would
hide an fp64 parameter rounded to fp32. Every replica must end identical to rank 0's, bit for bit: that
is what a broadcast in the wrong dtype breaks, whatever the tolerance against torch.

Tolerances against torch's DDP, after 3 steps of SGD with momentum:
- EXACT wherever the same numbers are added in the same order: DDP and OSS at N = 2 and 3 (one dtype
  per bucket, laid out as torch's), SDP and the flat design at N = 2 (a + b = b + a).
- REORDERED at N = 3 for SDP and the flat design, whose buckets lay the gradients out otherwise, so gloo
  adds an element's three terms in another order: fp32 1e-6 (measured 2e-8), fp64 1e-9 (measured 1.3e-10:
  the fp32 layers' last bits reach the fp64 layer's gradients through the forward), bf16 2e-3.
- FLAT_BF16 for the flat design's bf16 parameters at any N: the CPU's bf16 kernels compute the tail of a
  tensor (its last numel % vector width elements) on another path than its body, rounding otherwise, and a
  parameter stepped inside a flat slice sits elsewhere than stepped alone: one bf16 ulp here and there
  (measured 2.4e-4). fp32 and fp64 take the same path either way, and stay exact at N = 2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

MIXES = {"fp64": (torch.float32, torch.float64, torch.float32),
         "bf16": (torch.bfloat16, torch.float32, torch.bfloat16)}
EXACT = {torch.float32: 0.0, torch.float64: 0.0, torch.bfloat16: 0.0}
REORDERED = {torch.float32: 1e-6, torch.float64: 1e-9, torch.bfloat16: 2e-3}
FLAT_BF16 = 2e-3
STEPS = 3
GLOBAL_BATCH = 12
SGD = {"lr": 0.05, "momentum": 0.9}


class MixedNet(nn.Module):
    def __init__(self, dtypes, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(6, 15, dtype=dtypes[0])
        self.b = nn.Linear(15, 13, dtype=dtypes[1])
        self.c = nn.Linear(13, 3, dtype=dtypes[2])

    def forward(self, x):
        for layer in (self.a, self.b):
            x = torch.tanh(layer(x.to(layer.weight.dtype)))
        return self.c(x.to(self.c.weight.dtype)).float()


def data(step: int):
    """This rank's slice of step `step`'s global batch."""
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    per = GLOBAL_BATCH // dist.get_world_size()
    r = dist.get_rank()
    return x[r * per: (r + 1) * per], y[r * per: (r + 1) * per]


def train_mixed(mix: str, build, steps: int = STEPS) -> dict:
    """build(net) -> (model to call, optimizer). Returns the parameters after `steps` SGD steps."""
    net = MixedNet(MIXES[mix], seed=dist.get_rank())
    model, optimizer = build(net)
    for step in range(steps):
        x, y = data(step)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def torch_ddp(net):
    return TorchDDP(net), torch.optim.SGD(net.parameters(), **SGD)


def diff_by_dtype(a: dict, b: dict) -> dict:
    """The largest |a - b| of each dtype's parameters (in fp64, where fp32's and bf16's are exact)."""
    out = {}
    for k, v in a.items():
        d = (v.double() - b[k].double()).abs().max().item()
        out[v.dtype] = max(out.get(v.dtype, 0.0), d)
    return out


def within(diffs: dict, atol: dict) -> bool:
    return all(d <= atol[dtype] for dtype, d in diffs.items())
