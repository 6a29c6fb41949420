"""Chapter 12: the vocabulary split across the t ranks of a tensor-parallel group (Megatron-LM).

VocabParallelEmbedding holds rows [r V/t, (r+1) V/t) of the embedding (a masked lookup, then g), the output layer
shares that shard and produces vocab-parallel logits, and vocab_parallel_cross_entropy computes the loss from them
without ever gathering the s*b*V logits: it needs three all-reduces of s*b numbers (the max, the target's logit, the
sum of exponentials). The vocabulary must divide by t, as in Megatron-LM.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minifsdp.distributed import comm
from minifsdp.parallel.mappings import _mark_split, divide, reduce_from_tensor_model_parallel_region, shard_of
from minifsdp.parallel.tensor_parallel import _full_init


# --8<-- [start:vocab_embedding]
class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows are split by vocabulary range: rank r holds the
    vectors of tokens [r V/t, (r+1) V/t). Each rank looks up the tokens it
    holds, writes zeros for the others, and g (an all-reduce) adds the t
    results: every token's vector comes from exactly one rank. init_method: as
    ColumnParallelLinear's (default nn.Embedding's, N(0, 1));
    `from_full(embedding)` starts from an nn.Embedding's weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group=None,
                 init_method=None):
        super().__init__()
        t = comm.world_size(group)
        per_rank = divide(num_embeddings, t,
                          f"VocabParallelEmbedding({num_embeddings}, "
                          f"{embedding_dim}): num_embeddings (the vocabulary)")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group = group
        self.vocab_start_index = comm.rank(group) * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        full = _full_init((num_embeddings, embedding_dim),
                          init_method or nn.init.normal_)
        self.weight = nn.Parameter(shard_of(full, 0, comm.rank(group), t))
        _mark_split(self.weight, 0)

    @classmethod
    def from_full(cls, embedding: nn.Embedding, *,
                  group=None) -> VocabParallelEmbedding:
        return cls(embedding.num_embeddings, embedding.embedding_dim,
                   group=group, init_method=lambda w: w.copy_(embedding.weight))

    # --8<-- [start:vocab_lookup]
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        elsewhere = ((input_ids < self.vocab_start_index)
                     | (input_ids >= self.vocab_end_index))
        # any row: zeroed just below
        local_ids = (input_ids - self.vocab_start_index).masked_fill(
            elsewhere, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(
            elsewhere.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.group)
    # --8<-- [end:vocab_lookup]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, this rank: "
                f"rows [{self.vocab_start_index}, {self.vocab_end_index})")
# --8<-- [end:vocab_embedding]


# --8<-- [start:cross_entropy]
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """loss = log sum_v exp(z_v) - z_target, for logits z split by vocabulary
    across the group.

    Each rank holds V/t logits of every token; three all-reduces of one number
    per token replace an all-gather of V/t per token: the max (so that the
    exponentials cannot overflow), the target's logit (one rank holds it, the
    others add zero), and the sum of the exponentials. Backward needs no
    communication: dL/dz = softmax(z) - onehot(target), and each rank computes
    it for its own V/t columns from what forward kept."""

    # --8<-- [start:ce_forward]
    @staticmethod
    def forward(ctx, logits, target, group):
        t = comm.world_size(group)
        # BEGIN EXERCISE 12.3: vocab-parallel loss: three all-reduces per token
        logits_max = logits.max(dim=-1).values
        if t > 1:
            comm.all_reduce(logits_max, op=comm.ReduceOp.MAX, group=group,
                            tag="cross entropy max")
        shifted = logits - logits_max.unsqueeze(-1)
        per_rank = logits.shape[-1]
        start = comm.rank(group) * per_rank
        elsewhere = (target < start) | (target >= start + per_rank)
        local_target = (target - start).masked_fill(elsewhere, 0)
        target_logit = (shifted.gather(-1, local_target.unsqueeze(-1))
                        .squeeze(-1).masked_fill(elsewhere, 0.0))
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if t > 1:
            comm.all_reduce(target_logit, group=group,
                            tag="cross entropy target logit")
            comm.all_reduce(sum_exp, group=group,
                            tag="cross entropy sum of exp")
        loss = sum_exp.log() - target_logit
        # END EXERCISE
        # exp becomes the softmax
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), elsewhere,
                              local_target)
        return loss
    # --8<-- [end:ce_forward]

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, elsewhere, local_target = ctx.saved_tensors
        grad = softmax.clone()
        # minus one at the target's column, on the one rank that holds it
        grad.scatter_add_(-1, local_target.unsqueeze(-1),
                          -(~elsewhere).to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor,
                                 target: torch.Tensor,
                                 group=None) -> torch.Tensor:
    """The cross-entropy of each token (shape of `target`, as Megatron's: take
    the mean yourself) from this rank's [..., V/t] slice of the logits, rank r
    holding vocabulary entries [r V/t, (r+1) V/t)."""
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target,
                                            group)
# --8<-- [end:cross_entropy]
