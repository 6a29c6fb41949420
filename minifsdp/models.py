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
    """GPT-2's init of the parameters directly in `m`: small weights (so the
    first logits are near zero and the loss starts near ln(vocab)), zero
    biases, LayerNorms at one and zero.

    Each tensor draws from a generator seeded by (model seed, module name),
    not from torch's global generator: its values then depend on nothing
    else -- not on the order modules are initialised in, nor on what else was
    initialised before. That is what lets FSDP build the model on the meta
    device and initialise it unit by unit, innermost units first, and still
    get exactly the bits of an eager TinyGPT(seed=...)."""
    name = getattr(m, "_init_name", None)
    if name is None:  # not a TinyGPT module, or one whose weight is another's
        return
    with torch.no_grad():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            key = hashlib.sha256(f"{m._init_seed}/{name}".encode()).digest()
            seed = int.from_bytes(key[:8], "little") >> 1
            g = torch.Generator(m.weight.device).manual_seed(seed)
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


# -- chapter 13: a Llama-style model at the published sizes -------------------------------------------------------
# --8<-- [start:llama]
@dataclass
class LlamaConfig:
    """The shapes of a decoder-only transformer, Llama's by default (RMSNorm, rotary positions, SwiGLU MLP,
    untied embedding and output head, no biases). The switches at the end describe GPT-3's kind instead
    (LayerNorm, learned positions, a 4x GELU MLP with biases, the head tied to the embedding)."""
    dim: int = 256
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention: fewer key/value heads (Llama-2 70B: 8)
    ffn_hidden: int = 688          # SwiGLU's hidden size (Llama: about 8/3 dim, rounded up to a multiple of 256)
    vocab_size: int = 512
    max_seq_len: int = 4096
    mlp: str = "swiglu"            # or "gelu": fc (dim -> ffn_hidden), GELU, proj back
    norm: str = "rmsnorm"          # or "layernorm"
    bias: bool = False
    tie_embeddings: bool = False
    learned_positions: bool = False  # False: rotary positions (no parameters)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


# The published shapes. Llama-2 (Touvron et al. 2023, table of model shapes; the checkpoints' parameter counts),
# TinyLlama-1.1B (Llama-2's architecture at 1B; Zhang et al. 2024) and GPT-3 175B (Brown et al. 2020, table 2.1).
LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "1b": LlamaConfig(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_hidden=5632, vocab_size=32000,
                      max_seq_len=2048),
    "7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, ffn_hidden=11008, vocab_size=32000),
    "13b": LlamaConfig(dim=5120, n_layers=40, n_heads=40, ffn_hidden=13824, vocab_size=32000),
    "70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, vocab_size=32000),
    "175b": LlamaConfig(dim=12288, n_layers=96, n_heads=96, ffn_hidden=4 * 12288, vocab_size=50257, max_seq_len=2048,
                        mlp="gelu", norm="layernorm", bias=True, tie_embeddings=True, learned_positions=True),
}
# What the published checkpoints hold (Llama-2-{7,13,70}b, TinyLlama-1.1B: exact) and GPT-3's table (175.0B,
# rounded: the shape above, with GPT-2's vocabulary of 50,257, holds 174.6B).
PUBLISHED_PARAMS = {"1b": 1_100_048_384, "7b": 6_738_415_616, "13b": 13_015_864_320, "70b": 68_976_648_192,
                    "175b": 175.0e9}


def llama_param_count(c: LlamaConfig) -> int:
    """Ψ from the shapes alone (no model built): what LlamaConfig's model holds, a tied head counted once."""
    hd = c.head_dim
    attn = c.dim * c.n_heads * hd * 2 + c.dim * c.kv_heads * hd * 2
    attn_bias = (c.n_heads * hd + 2 * c.kv_heads * hd + c.dim) if c.bias else 0
    if c.mlp == "swiglu":
        mlp, mlp_bias = 3 * c.dim * c.ffn_hidden, (2 * c.ffn_hidden + c.dim) if c.bias else 0
    else:
        mlp, mlp_bias = 2 * c.dim * c.ffn_hidden, (c.ffn_hidden + c.dim) if c.bias else 0
    norm = c.dim * (2 if c.norm == "layernorm" else 1)
    layer = attn + attn_bias + mlp + mlp_bias + 2 * norm
    embeddings = c.vocab_size * c.dim * (1 if c.tie_embeddings else 2)
    if c.learned_positions:
        embeddings += c.max_seq_len * c.dim
    return c.n_layers * layer + embeddings + norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self):  # (deferred init, chapter 9)
        nn.init.ones_(self.weight)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(c: LlamaConfig) -> nn.Module:
    return RMSNorm(c.dim) if c.norm == "rmsnorm" else nn.LayerNorm(c.dim)


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of (batch, heads, seq, head_dim): each pair of channels (i, i + d/2) turned
    by an angle proportional to the position. Computed on the fly: no buffers, nothing to synchronise."""
    T, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).to(x.dtype) for f in (torch.cos, torch.sin))
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v, causal, by a flash kernel: it saves q, k, v, the output and one logsumexp
    per row for backward, never the seq x seq scores. On the meta device F.scaled_dot_product_attention takes
    its math path, which does build the scores (2 GB a layer at 4,096 tokens): a GPU would not. So on the CPU
    and on meta the CPU flash kernel is called by name; both then run, and save, the same."""
    if q.device.type in ("cpu", "meta"):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class LlamaAttention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        hd = c.head_dim
        self.wq = nn.Linear(c.dim, c.n_heads * hd, bias=c.bias)
        self.wk = nn.Linear(c.dim, c.kv_heads * hd, bias=c.bias)
        self.wv = nn.Linear(c.dim, c.kv_heads * hd, bias=c.bias)
        self.wo = nn.Linear(c.n_heads * hd, c.dim, bias=c.bias)

    def forward(self, x):
        B, T, _ = x.shape
        c = self.c
        q = self.wq(x).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        if not c.learned_positions:
            q, k = rotary(q), rotary(k)
        if c.kv_heads != c.n_heads:  # grouped-query attention: each key/value head serves n_heads/kv_heads
            k, v = (t.repeat_interleave(c.n_heads // c.kv_heads, dim=1) for t in (k, v))
        y = causal_attention(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(B, T, c.n_heads * c.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.swiglu = c.mlp == "swiglu"
        self.w1 = nn.Linear(c.dim, c.ffn_hidden, bias=c.bias)  # (GPT-3: fc)
        self.w2 = nn.Linear(c.ffn_hidden, c.dim, bias=c.bias)  # (GPT-3: proj)
        if self.swiglu:
            self.w3 = nn.Linear(c.dim, c.ffn_hidden, bias=c.bias)

    def forward(self, x):
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class LlamaBlock(nn.Module):
    """One decoder layer: the FSDP unit, and what activation checkpointing recomputes."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attention_norm, self.attention = _norm(c), LlamaAttention(c)
        self.ffn_norm, self.feed_forward = _norm(c), LlamaMLP(c)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """A Llama-style decoder (GPT-3's kind with the config's switches). Built on the meta device
    (`with torch.device("meta"): Llama(LLAMA_CONFIGS["70b"])`) it holds no memory at all: chapter 13 wraps
    it, as rank 0 of N, to measure what a rank of a real job would hold. (Activation checkpointing per
    layer: chapter 9's checkpoint_module on each of `layers`.)"""

    def __init__(self, config: LlamaConfig | None = None, seed: int = 0):
        super().__init__()
        self.config = c = config or LlamaConfig()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        if c.learned_positions:
            self.pos_embeddings = nn.Embedding(c.max_seq_len, c.dim)
        self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c.n_layers))
        self.norm = _norm(c)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if not any(p.is_meta for p in self.parameters()):  # small weights: the first loss near ln(vocab)
            with torch.no_grad():
                for name, p in self.named_parameters():
                    if p.dim() == 2:
                        p.normal_(0.0, 0.02)
                    elif "norm" not in name:
                        p.zero_()

    def forward(self, idx, targets=None):
        x = self.tok_embeddings(idx)
        if self.config.learned_positions:
            x = x + self.pos_embeddings(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
# --8<-- [end:llama]
