"""The parity matrix's models (reports/parity.py): small models built to trip data-parallel code up.

Each is tens to a hundred-odd parameters, built from a seed, with its blocks in classes of their own so that
ModuleWrapPolicy(model.blocks) nests units by class, and a threshold that makes SizeBasedWrapPolicy nest
them (differently, where the model allows it). batch(step) is the global batch: (inputs..., target).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4

def _randn(step: int, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 + step), dtype=dtype)


class _Seeded(nn.Module):
    def __init__(self, seed):
        super().__init__()
        # the CPU generator the layers draw from; torch.manual_seed would also queue a seed for CUDA, recording
        # a stack trace each time (milliseconds, for each of the ~200 models a launch builds)
        torch.default_generator.manual_seed(seed)


class _Chain(_Seeded):
    """first -> second -> out, fitted to random targets: the shape most of the models share."""
    d_in, d_out, dtype = 5, 1, torch.float32

    def forward(self, x):
        return self.out(self.second(self.first(x)))

    @classmethod
    def batch(cls, step):
        return (_randn(step, GLOBAL_BATCH, cls.d_in, dtype=cls.dtype),
                _randn(-step, GLOBAL_BATCH, cls.d_out, dtype=cls.dtype))


class _TanhLinear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class OddBlock(_TanhLinear):
    def __init__(self, d_in, d_out):
        super().__init__(d_in, d_out)
        self.gain = nn.Parameter(torch.rand(()) + 0.5)  # 0-dim
        self.shift = nn.Parameter(torch.rand(1) - 0.5)  # one element

    def forward(self, x):
        return torch.tanh(self.lin(x) * self.gain + self.shift)


class OddShapes(_Chain):
    """35, 7, 21 and 3 elements, a 0-dim and a 1-element parameter: no size divides by 2, 3 or 4."""
    blocks, min_num_params = (OddBlock,), 40  # by size: `first.lin` (42) alone, a level below the class

    def __init__(self, seed):
        super().__init__(seed)
        self.first, self.second, self.out = OddBlock(5, 7), OddBlock(7, 3), nn.Linear(3, 1)


class TiedBlock(_TanhLinear):
    def forward(self, x):
        return x + super().forward(x)


class Tied(_Seeded):
    """The output head is the embedding's weight, transposed: one parameter, two uses, two names."""
    blocks, min_num_params = (TiedBlock,), 70  # by size: the two blocks together; never the tied pair apart

    def __init__(self, seed, vocab=11, d=6):
        super().__init__(seed)
        self.emb = nn.Embedding(vocab, d)
        self.blocks_ = nn.Sequential(TiedBlock(d, d), TiedBlock(d, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.blocks_(self.emb(tokens)))

    @staticmethod
    def batch(step):
        g = torch.Generator().manual_seed(2000 + step)
        return torch.randint(0, 11, (GLOBAL_BATCH,), generator=g), torch.randint(0, 11, (GLOBAL_BATCH,), generator=g)

    @staticmethod
    def loss(out, target):
        return F.cross_entropy(out, target)


class PartlyFrozen(_TanhLinear):
    def __init__(self, d_in, d_out):
        super().__init__(d_in, d_out)
        self.lin.weight.requires_grad_(False)  # the bias trains, the weight does not


class FrozenBlock(_TanhLinear):
    def __init__(self, d_in, d_out):
        super().__init__(d_in, d_out)
        self.requires_grad_(False)


class Frozen(_Chain):
    """Frozen parameters, and a block with nothing to train in the middle: as a unit of its own it has no
    gradient to reduce, yet the gradient of its input must pass through it."""
    blocks, min_num_params = (PartlyFrozen, FrozenBlock), 40  # by size: the frozen Linear (42) alone
    d_out = 2

    def __init__(self, seed):
        super().__init__(seed)
        self.first, self.second, self.out = PartlyFrozen(5, 6), FrozenBlock(6, 6), nn.Linear(6, 2)


class GatedBlock(_TanhLinear):
    def __init__(self, d):
        super().__init__(d, d)
        self.extra = nn.Linear(d, d)

    def forward(self, x, mask):
        h = super().forward(x)
        if mask.any():  # else `extra` stays out of the autograd graph on this rank
            h = h + mask[:, None] * torch.tanh(self.extra(h))
        return h


class Unused(_Seeded):
    """`extra` is used by every rank in step 0, by rank 0 alone in step 1, by no rank in step 2. (Its block
    runs every step: a unit must take part in every forward, see chapter 6.)"""
    blocks, min_num_params = (GatedBlock,), 60  # by size: the same unit as by class (`extra` alone may not be one)
    find_unused = True

    def __init__(self, seed):
        super().__init__(seed)
        self.inp, self.gated, self.out = nn.Linear(4, 6), GatedBlock(6), nn.Linear(6, 1)

    def forward(self, x, mask):
        return self.out(self.gated(torch.tanh(self.inp(x)), mask))

    @staticmethod
    def batch(step):
        mask = torch.zeros(GLOBAL_BATCH, dtype=torch.bool)
        mask[: (GLOBAL_BATCH, GLOBAL_BATCH // 4, 0)[step % 3]] = True
        return _randn(step, GLOBAL_BATCH, 4), mask, _randn(-step, GLOBAL_BATCH, 1)


class NormBlock(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        # No bias before BatchNorm (as usual): the mean it subtracts takes the bias with it, so the bias's exact
        # gradient is 0 and its computed one ~1e-8 of rounding noise -- which AdamW, dividing by its own
        # scale, would turn into steps of ~lr whose sign depends on the order of the sums.
        self.lin, self.bn = nn.Linear(d_in, d_out, bias=False), nn.BatchNorm1d(d_out)
        self.register_buffer("scale", torch.rand(d_out) + 0.5)  # random per seed: must come from rank 0

    def forward(self, x):
        return torch.relu(self.bn(self.lin(x))) * self.scale


class BatchNorm(_Chain):
    """BatchNorm's running statistics follow each rank's own batches; a registered buffer scales the output."""
    blocks, min_num_params = (NormBlock,), 30  # by size: `first` (36) alone
    d_in = 4

    def __init__(self, seed):
        super().__init__(seed)
        self.first, self.second, self.out = NormBlock(4, 6), NormBlock(6, 3), nn.Linear(3, 1)


class SharedBlock(_TanhLinear):
    pass


class Reused(_Chain):
    """One block called twice in a forward: its unit is unsharded twice, its gradient is the sum of both uses."""
    blocks, min_num_params = (SharedBlock,), 30  # by size: the block's Linear, not the block
    d_in, d_out = 3, 2

    def __init__(self, seed):
        super().__init__(seed)
        self.first, self.shared, self.out = nn.Linear(3, 6), SharedBlock(6, 6), nn.Linear(6, 2)

    def forward(self, x):
        return self.out(self.shared(self.shared(self.first(x))))


class F64Block(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin, self.norm = nn.Linear(d_in, d_out), nn.LayerNorm(d_out)

    def forward(self, x):
        return torch.tanh(self.norm(self.lin(x)))


class Float64(_Chain):
    """Every parameter, and the data, in float64."""
    blocks, min_num_params = (F64Block,), 50  # by size: `first` (56) alone
    dtype = torch.float64

    def __init__(self, seed):
        super().__init__(seed)
        self.first, self.second, self.out = F64Block(5, 7), F64Block(7, 4), nn.Linear(4, 1)
        self.double()


MODELS: dict[str, type[nn.Module]] = {"odd_shapes": OddShapes, "tied": Tied, "frozen": Frozen, "unused": Unused,
                                      "batchnorm": BatchNorm, "reused": Reused, "float64": Float64}
def loss(model_cls, out, target):
    return model_cls.loss(out, target) if hasattr(model_cls, "loss") else F.mse_loss(out, target)
