"""Chapter 13: compute -- a decoder-only transformer's shape, its parameters and its FLOPs.

The FLOPs of a token (forward + backward) are 6*params + 12*layers*d_model*seq_len (the PaLM / Megatron convention,
`model_flops_per_token`), at a stated peak times an achievable fraction (`GPU.efficiency`, cluster.py). Backward
costs twice the forward; activation checkpointing adds (part of) a forward. The shapes of the models the chapter
predicts for, and of those published runs used (published.py), are at the end.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer's shape: Llama (SwiGLU, RMSNorm, grouped-query attention, untied head) or
    GPT/MPT (a 4x GELU MLP, LayerNorm, tied head)."""
    name: str
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated_mlp: bool = True           # SwiGLU: three matrices; else two
    tied: bool = False               # the output head is the embedding matrix
    bias: bool = False               # biases in every linear and LayerNorm (MPT's benchmark models)
    learned_positions: bool = False  # a position embedding with one row per position (ditto)

    @property
    def kv_dim(self) -> int:
        return self.d_model // self.heads * self.kv_heads

    def block_matmuls(self) -> list[int]:
        """The weight matrices of a block (parameters each), in the order its forward multiplies by them."""
        d, kv, f = self.d_model, self.kv_dim, self.ffn
        mlp = [d * f, d * f, f * d] if self.gated_mlp else [d * f, f * d]  # (w1, w3, w2) or (up, down)
        return [d * d, d * kv, d * kv, d * d] + mlp  # q, k, v, o

    def block_params(self) -> int:
        d = self.d_model
        norms = 2 * d * (2 if self.bias else 1)
        biases = (2 * d + 2 * self.kv_dim + self.ffn * (2 if self.gated_mlp else 1) + d) if self.bias else 0
        return sum(self.block_matmuls()) + norms + biases

    def root_params(self, seq_len: int) -> int:
        """The parameters outside the blocks -- embeddings, final norm, head: FSDP's root unit."""
        d = self.d_model
        return (self.vocab * d * (1 if self.tied else 2) + d * (2 if self.bias else 1)
                + (seq_len * d if self.learned_positions else 0))

    def params(self, seq_len: int = 0) -> int:
        return self.layers * self.block_params() + self.root_params(seq_len)

    # --8<-- [start:flops]
    def model_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs of one token, the convention MFU is reported in
        (PaLM, Chowdhery et al. 2022, appendix B; Megatron-LM, Narayanan et al.
        2021; torchtitan's and llm-foundry's MFU): 6 per parameter
        (2 forward, 4 backward), plus the attention scores and values,
        12 * layers * d_model * seq_len -- counted as if no mask skipped half of
        them. Recomputation is not counted."""
        return 6 * self.params(seq_len) + 12 * self.layers * self.d_model * seq_len
    # --8<-- [end:flops]

    def block_forward_flops(self, seq_len: int) -> float:
        """FLOPs of one block's forward, per token: its matrices, then QK^T and AV (2 * 2 * seq_len * d)."""
        return 2 * sum(self.block_matmuls()) + 4 * seq_len * self.d_model

    def head_forward_flops(self) -> float:
        return 2 * self.vocab * self.d_model

    def recomputed_forward_flops(self, seq_len: int, ac: str) -> float:
        """FLOPs per token a block's backward spends recomputing its forward, by activation checkpointing:
        'none', 'full' (the whole forward), 'every_2nd' (every second block in full: half, on average) or
        'selective_op' (torchtitan's op policy: keep every op's output but every second matmul's, so the 2nd,
        4th and 6th matmuls of the forward run again: k, o and w3 of a Llama block)."""
        if ac == "none":
            return 0.0
        if ac == "full":
            return self.block_forward_flops(seq_len)
        if ac == "every_2nd":
            return 0.5 * self.block_forward_flops(seq_len)
        if ac == "selective_op":
            return 2 * sum(self.block_matmuls()[1::2])
        raise ValueError(f"ac must be 'none', 'full', 'every_2nd' or 'selective_op', not {ac!r}")


# Shapes from the models' papers and configs (Llama 2: Touvron et al. 2023; Llama 3: Meta's model card, and
# torchtitan's llama3_configs). 70B uses grouped-query attention (8 key/value heads).
LLAMA2_7B = Transformer("Llama-2 7B", 32, 4096, 32, 32, 11008, 32000)
LLAMA2_13B = Transformer("Llama-2 13B", 40, 5120, 40, 40, 13824, 32000)
LLAMA2_70B = Transformer("Llama-2 70B", 80, 8192, 64, 8, 28672, 32000)
LLAMA3_8B = Transformer("Llama-3 8B", 32, 4096, 32, 8, 14336, 128256)
LLAMA3_70B = Transformer("Llama-3 70B", 80, 8192, 64, 8, 28672, 128256)
# llm-foundry's MPT benchmark models (scripts/train/yamls/pretrain/mpt-*.yaml: d_model, n_layers,
# expansion_ratio 4, vocab 50368), with the biases and learned positions that make their parameter counts
# equal the NumParams column of the benchmark tables (tests/test_ch13_step_time.py checks it).
_MPT = dict(gated_mlp=False, tied=True, bias=True, learned_positions=True)
MPT_7B = Transformer("MPT 7B", 32, 4096, 32, 32, 4 * 4096, 50368, **_MPT)
MPT_13B = Transformer("MPT 13B", 40, 5120, 40, 40, 4 * 5120, 50368, **_MPT)
MPT_30B = Transformer("MPT 30B", 48, 7168, 56, 56, 4 * 7168, 50368, **_MPT)
MPT_70B = Transformer("MPT 70B", 80, 8192, 64, 64, 4 * 8192, 50368, **_MPT)
MODELS = {"7b": LLAMA2_7B, "13b": LLAMA2_13B, "70b": LLAMA2_70B, "llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}
