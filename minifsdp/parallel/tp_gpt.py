"""Chapter 12: TinyGPT (models.py) split the Megatron way over a tensor-parallel group, with or without sequence
parallelism, built from a TinyGPT so that it starts from exactly its weights.

    tp = init_mesh((t,), ("tp",)).get_group("tp")
    model = TensorParallelGPT.from_gpt(TinyGPT(config, seed=0), group=tp, sequence_parallel=True)
    loss = model(idx, targets)              # every rank of the group: the same whole batch
    loss.backward()
    model.allreduce_sequence_parallel_grads()   # sequence parallel only, before every optimizer step
    optimizer.step()

Where everything lives, sequence first ([s, b, h]; t ranks; r this rank):

    wte         VocabParallelEmbedding: vocabulary rows [r V/t, (r+1) V/t); g
    wpe         replicated; added to the whole [s, b, h] (so its gradient is whole on every rank)
    per block   ln_1        replicated
                attn.qkv    ColumnParallelLinear, stride 3: rank r's heads' q rows, k rows and v rows (TinyGPT stacks
                            all the q rows, then all k, then all v; a contiguous cut would mix them)
                attention   n_head/t whole heads per rank, no communication
                attn.proj   RowParallelLinear (g after it)
                ln_2        replicated
                fc          ColumnParallelLinear (4h/t features)
                fc_proj     RowParallelLinear (g after it)
    ln_f        replicated
    lm_head     tied to wte (Megatron's parallel_lm_logits): a column-parallel matmul with wte's shard, giving
                vocab-parallel logits [s, b, V/t], which are never gathered: vocab_parallel_cross_entropy takes them

Sequence parallelism moves the replicated parts onto token shards: after the embedding, the residual stream is
[s/t, b, h] on each rank (scatter_to_sequence_parallel_region), LayerNorms and residual adds run on it, every
column layer all-gathers its input (qkv, fc, the lm head) and every row layer reduce-scatters its output:

    wte (g) + wpe --scatter--> [s/t] ln_1 --all-gather--> qkv . attention . proj --reduce-scatter--> [s/t] + x
                               [s/t] ln_2 --all-gather--> fc . gelu . fc_proj --reduce-scatter--> [s/t] + x
                               [s/t] ln_f --all-gather--> lm head --> logits [s, b, V/t] --> loss

(Megatron-LM can also fuse the embedding's all-reduce and the scatter into one reduce-scatter; the two steps here
show each mapping once.) The LayerNorms' weights and the row layers' biases, replicated, then see only their
rank's tokens: their gradients are partial sums, to be summed over the group by
`model.allreduce_sequence_parallel_grads()` after backward. TinyGPT has no dropout; it would sit on the token shards
too, each rank drawing different masks for its different tokens.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from minifsdp.distributed import comm
from minifsdp.models import Block, CausalSelfAttention, TinyGPT
from minifsdp.parallel.mappings import (divide, full_tensor, gather_from_tensor_model_parallel_region,
                                        mark_sequence_parallel, scatter_to_sequence_parallel_region)
from minifsdp.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                               allreduce_sequence_parallel_grads, column_parallel_linear)
from minifsdp.parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy


class ParallelAttention(nn.Module):
    """CausalSelfAttention on this rank's n_head/t heads: qkv column-parallel, proj row-parallel."""

    def __init__(self, attn: CausalSelfAttention, *, group, sequence_parallel: bool, async_grad_allreduce: bool,
                 name: str):
        super().__init__()
        t = comm.world_size(group)
        self.n_head = divide(attn.n_head, t, f"TensorParallelGPT {name}: n_head (each rank computes whole heads)")
        options = dict(group=group, sequence_parallel=sequence_parallel)
        self.qkv = ColumnParallelLinear.from_full(attn.qkv, stride=3, async_grad_allreduce=async_grad_allreduce,
                                                  name=f"{name}.qkv", **options)
        self.proj = RowParallelLinear.from_full(attn.proj, name=f"{name}.proj", **options)

    def forward(self, x):
        qkv = self.qkv(x)  # [s, b, 3 h/t]: this rank's heads' q, then k, then v
        s, b = qkv.shape[:2]
        q, k, v = qkv.split(qkv.shape[-1] // 3, dim=-1)
        q, k, v = (u.view(s, b, self.n_head, -1).permute(1, 2, 0, 3) for u in (q, k, v))  # [b, heads, s, d]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.permute(2, 0, 1, 3).reshape(s, b, -1))


class ParallelBlock(nn.Module):
    """A TinyGPT Block: LayerNorms replicated, attention and MLP each a column layer then a row layer."""

    def __init__(self, block: Block, *, group, sequence_parallel: bool, async_grad_allreduce: bool, name: str):
        super().__init__()
        options = dict(group=group, sequence_parallel=sequence_parallel)
        self.ln_1, self.ln_2 = copy.deepcopy(block.ln_1), copy.deepcopy(block.ln_2)
        self.attn = ParallelAttention(block.attn, async_grad_allreduce=async_grad_allreduce, name=f"{name}.attn",
                                      **options)
        self.fc = ColumnParallelLinear.from_full(block.fc, async_grad_allreduce=async_grad_allreduce,
                                                 name=f"{name}.fc", **options)
        self.fc_proj = RowParallelLinear.from_full(block.fc_proj, name=f"{name}.fc_proj", **options)
        if sequence_parallel:
            mark_sequence_parallel(self.ln_1)
            mark_sequence_parallel(self.ln_2)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


# --8<-- [start:model]
class TensorParallelGPT(nn.Module):
    """TinyGPT over the tensor-parallel `group`, starting from `gpt`'s weights
    (every rank passes the same TinyGPT).

    forward(idx, targets) takes the whole [b, s] batch on every rank and returns
    the mean loss; without targets, the vocab-parallel logits [s, b, V/t]
    (gather_logits turns them into TinyGPT's [b, s, V]).
    full_state_dict() / full_grads(): the parameters / gradients put back
    together under TinyGPT's names."""

    def __init__(self, gpt: TinyGPT, *, group=None,
                 sequence_parallel: bool = False,
                 async_grad_allreduce: bool = True):
        super().__init__()
        self.config, self.group = gpt.config, group
        self.sequence_parallel = sequence_parallel
        self.async_grad_allreduce = async_grad_allreduce
        options = dict(group=group, sequence_parallel=sequence_parallel,
                       async_grad_allreduce=async_grad_allreduce)
        self.wte = VocabParallelEmbedding.from_full(gpt.wte, group=group)
        self.wpe = copy.deepcopy(gpt.wpe)
        self.blocks = nn.ModuleList(
            ParallelBlock(block, name=f"blocks.{i}", **options)
            for i, block in enumerate(gpt.blocks))
        self.ln_f = copy.deepcopy(gpt.ln_f)
        if sequence_parallel:
            mark_sequence_parallel(self.ln_f)
        self.tied = gpt.lm_head.weight is gpt.wte.weight
        if not self.tied:
            self.lm_head = ColumnParallelLinear.from_full(
                gpt.lm_head, name="lm_head", **options)

    @classmethod
    def from_gpt(cls, gpt: TinyGPT, *, group=None,
                 sequence_parallel: bool = False,
                 async_grad_allreduce: bool = True) -> TensorParallelGPT:
        return cls(gpt, group=group, sequence_parallel=sequence_parallel,
                   async_grad_allreduce=async_grad_allreduce)

    # --8<-- [start:tp_forward]
    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        s = idx.shape[1]
        # [s, b, h]
        x = (self.wte(idx.t())
             + self.wpe(torch.arange(s, device=idx.device)).unsqueeze(1))
        if self.sequence_parallel:
            # [s/t, b, h] from here on
            x = scatter_to_sequence_parallel_region(x, self.group)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_logits(self.ln_f(x))  # [s, b, V/t]
        if targets is None:
            return logits
        loss = vocab_parallel_cross_entropy(logits, targets.t(), self.group)
        return loss.mean()
    # --8<-- [end:tp_forward]

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Megatron's parallel_lm_logits: the output layer shares the
        embedding's vocabulary shard, a column-parallel matmul (f, or the
        sequence all-gather, on its input), so its logits are vocab-parallel."""
        if not self.tied:
            return self.lm_head(x)
        return column_parallel_linear(
            x, self.wte.weight, group=self.group,
            sequence_parallel=self.sequence_parallel,
            async_grad_allreduce=self.async_grad_allreduce, name="lm_head")
# --8<-- [end:model]

    def allreduce_sequence_parallel_grads(self) -> None:
        """Under sequence parallelism, call after backward, before the optimizer steps (see the module docstring)."""
        allreduce_sequence_parallel_grads(self, self.group)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel [s, b, V/t] logits as TinyGPT's [b, s, V] (an all-gather: for checking, not training)."""
        return gather_from_tensor_model_parallel_region(logits, self.group).transpose(0, 1)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, under TinyGPT's state_dict names (the tied lm_head.weight included)."""
        return self._full(lambda p: p)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient whole, under TinyGPT's names (None where there is none)."""
        return self._full(lambda p: p.grad)

    def _full(self, of) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.named_parameters():
            local = of(p)
            out[name] = None if local is None else full_tensor(local, p, self.group)
        if self.tied:
            out["lm_head.weight"] = out["wte.weight"]
        return out
