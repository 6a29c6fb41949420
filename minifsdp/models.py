"""Models for the chapters and tests: a tiny GPT and a toy model built to break sharding code.

Every model is deterministic from a seed, and so is its data: `gpt_batch(config, step, ...)` gives the
same global batch on every rank, and each rank takes its own slice of it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    tie_weights: bool = True  # share the token embedding with the output projection (as GPT-2 does)


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head = c.n_head
        # No bias: a key bias adds the same amount to every score in a row, which softmax ignores, so its
        # gradient would be pure rounding noise -- and Adam would blow that noise up into lr-sized steps.
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd, bias=False)
        self.proj = nn.Linear(c.n_embd, c.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # is_causal instead of a registered mask: no buffer, so nothing but parameters to synchronise
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


# --8<-- [start:init_weights]
def init_weights(m: nn.Module) -> None:
    """GPT-2's init of the parameters directly in `m`: small weights (so the first logits are near zero and
    the loss starts near ln(vocab)), zero biases, LayerNorms at one and zero.

    Each tensor draws from a generator seeded by (model seed, module name), not from torch's global
    generator: its values then depend on nothing else -- not on the order modules are initialised in,
    nor on what else was initialised before. That is what lets FSDP build the model on the meta device
    and initialise it unit by unit, innermost units first, and still get exactly the bits of an eager
    TinyGPT(seed=...)."""
    name = getattr(m, "_init_name", None)
    if name is None:  # not a TinyGPT module, or one whose weight is another's
        return
    with torch.no_grad():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            key = hashlib.sha256(f"{m._init_seed}/{name}".encode()).digest()
            g = torch.Generator(m.weight.device).manual_seed(int.from_bytes(key[:8], "little") >> 1)
            m.weight.normal_(mean=0.0, std=0.02, generator=g)
        if isinstance(m, nn.Linear) and m.bias is not None:
            m.bias.zero_()
        if isinstance(m, nn.LayerNorm):
            m.reset_parameters()
# --8<-- [end:init_weights]


class Block(nn.Module):
    """One transformer block: the natural unit to shard, prefetch and checkpoint."""

    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd)
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.fc_proj = nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """A small GPT-2. Built on the meta device (`with torch.device("meta"): TinyGPT()`) it holds no memory
    until FSDP materialises it unit by unit, each unit with `init_weights` (chapter 9), to the same bits."""

    def __init__(self, config: GPTConfig | None = None, seed: int = 0):
        super().__init__()
        self.config = c = config or GPTConfig()
        torch.manual_seed(seed)  # for whoever draws from torch's generator next (init_weights does not)
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        for name, m in self.named_modules():  # what init_weights needs to know, kept on the module itself
            m._init_name, m._init_seed = name, seed
        if c.tie_weights:
            self.lm_head.weight = self.wte.weight
            self.lm_head._init_name = None  # its weight is wte's, initialised as wte's
        if not any(p.is_meta for p in self.parameters()):
            for m in self.modules():
                init_weights(m)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_batch(config: GPTConfig, step: int, batch_size: int, seed: int = 1234, device="cpu"):
    """A learnable synthetic language: each sequence counts up by a fixed stride, mod vocab.

    The same (step, seed) gives the same global batch everywhere, so one process on the whole batch
    and N ranks on its slices see exactly the same data.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, config.vocab_size, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    seq = (start + stride * torch.arange(config.block_size + 1)) % config.vocab_size
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


class ToyModel(nn.Module):
    """Small, but with everything that trips up data-parallel code.

    - odd shapes (7x15, 16x17, a bias of 17): nothing divides evenly by 2, 3 or 4 ranks;
    - a tied weight: `tied` is used twice in forward, so its gradient is the sum of two uses;
    - a frozen layer (requires_grad=False), which must never be reduced or stepped;
    - `extra`, applied only to the samples where `mask` is True: when a rank's slice has none, the
      parameter gets no gradient on that rank (used elsewhere), and when the whole batch has none it
      gets no gradient anywhere (unused everywhere).
    """

    def __init__(self, seed: int = 0, d_in: int = 7):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(d_in, 15)
        self.frozen = nn.Linear(15, 16)
        self.frozen.requires_grad_(False)
        self.tied = nn.Linear(16, 16, bias=False)
        self.extra = nn.Linear(16, 16)
        self.out = nn.Linear(16, 17)
        self.head = nn.Linear(17, 1, bias=False)

    def forward(self, x, mask=None):
        h = torch.tanh(self.frozen(torch.tanh(self.inp(x))))
        h = torch.tanh(self.tied(h))
        if mask is None:
            h = h + torch.tanh(self.extra(h))
        elif mask.any():  # otherwise `extra` stays out of the autograd graph altogether
            h = h + mask[:, None] * torch.tanh(self.extra(h))
        h = torch.tanh(self.tied(h))  # second use of the same weight
        return self.head(torch.tanh(self.out(h))).squeeze(-1)


def toy_batch(step: int, batch_size: int, seed: int = 99, d_in: int = 7, device="cpu"):
    """(x, y, mask). The mask cycles: every sample; only the first quarter of the batch (so only the
    first ranks use `extra`); no sample at all (no rank uses it)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(batch_size, d_in, generator=g)
    y = torch.randn(batch_size, generator=g)
    mask = torch.zeros(batch_size, dtype=torch.bool)
    mask[: {0: batch_size, 1: max(1, batch_size // 4), 2: 0}[step % 3]] = True
    return x.to(device), y.to(device), mask.to(device)


def count_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Ψ: distinct parameters (a tied weight counts once, as in model.parameters())."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
