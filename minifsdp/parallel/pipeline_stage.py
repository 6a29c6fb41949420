"""Chapter 12: pipeline parallelism's stages -- the model cut between its layers, and what one stage keeps.

Data parallelism gives every rank the whole model; tensor parallelism cuts every layer across ranks. Pipeline
parallelism cuts the model *between* layers: stage 0 holds the embeddings and the first blocks, stage 1 the
next blocks, ..., the last stage the final blocks, ln_f, the head and the loss. A rank holds only its stage's
parameters, gradients and optimizer state, and the only traffic is one activation (micro-batch x sequence x
hidden) forward across each stage boundary and its gradient backward: point to point, to a neighbour.

    modules = split_gpt(TinyGPT(config), num_stages=p, stage_indices=[rank])
    stage = PipelineStage(modules[0], stage_index=rank, num_stages=p, activation_shape=(b // m, T, h))

A stage runs one micro-batch at a time (`forward_one_chunk`, `backward_one_chunk`) and keeps, between a
micro-batch's forward and its backward, that micro-batch's input and output: the activations a schedule's order
decides how many of to hold (pipeline_orders.py). Running the stages in an order, and the messages between them,
is the schedules' (pipeline.py).

The tied embedding. TinyGPT's lm_head uses wte's weight. Cut into stages, the first stage owns wte and the last
lm_head, on different ranks: split_gpt gives the last a copy, started equal, and names both in the stage modules'
`tied_embedding`; the schedule sums their gradients after backward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minifsdp.distributed import comm
from minifsdp.distributed.launch import current_device


class GPTStageModule(nn.Module):
    """Stage `stage_index` of a TinyGPT cut into `num_stages` contiguous pieces: the embeddings on the first, an
    equal share of the blocks on each, ln_f and lm_head on the last. Parameter names are the whole model's
    ("blocks.5.fc.weight"), so a stage's state_dict is a slice of the model's."""

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int, head: nn.Linear | None = None):
        super().__init__()
        per = len(model.blocks) // num_stages
        self.stage_index, self.num_stages = stage_index, num_stages
        first, last = stage_index == 0, stage_index == num_stages - 1
        self.wte, self.wpe = (model.wte, model.wpe) if first else (None, None)
        mine = range(stage_index * per, (stage_index + 1) * per)
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in mine})  # keyed "5": names stay "blocks.5..."
        self.ln_f, self.lm_head = (model.ln_f, head or model.lm_head) if last else (None, None)
        self.tied_embedding = None  # the name of the parameter another rank holds a copy of (set by split_gpt)

    def forward(self, x):
        if self.wte is not None:  # token ids in
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is not None:  # logits out
            x = self.lm_head(self.ln_f(x))
        return x


def split_gpt(model: nn.Module, num_stages: int, stage_indices: list[int]) -> list[GPTStageModule]:
    """The stages `stage_indices` of `model` (a TinyGPT, built the same on every rank) cut into `num_stages`.

    The stage modules share the model's own submodules (no copy): what this rank does not hold is simply never
    referenced, and is freed with the model. A weight tied across ranks -- wte on the first stage, lm_head on the
    last, when one rank does not hold both -- becomes two parameters, started equal, each named by its stage's
    `tied_embedding`; the schedule sums their gradients after backward."""
    n = len(model.blocks)
    if num_stages < 1 or n % num_stages:
        raise ValueError(f"split_gpt: {n} blocks cannot be cut into {num_stages} stages of equal size; choose "
                         f"n_layer divisible by the number of stages (pipeline ranks x virtual stages)")
    bad = [s for s in stage_indices if not 0 <= s < num_stages]
    if bad:
        raise ValueError(f"split_gpt: stage indices {bad} outside 0 .. {num_stages - 1}")
    first, last = 0 in stage_indices, num_stages - 1 in stage_indices
    tied = model.lm_head.weight is model.wte.weight
    head = None
    if tied and last and not first:  # the copy: a head of its own, holding wte's values
        head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False,
                         device=model.wte.weight.device, dtype=model.wte.weight.dtype)
        head.weight = nn.Parameter(model.wte.weight.detach().clone())
    modules = [GPTStageModule(model, s, num_stages, head=head) for s in stage_indices]
    if tied and first != last:
        for m in modules:
            if m.wte is not None:
                m.tied_embedding = "wte.weight"
            if m.lm_head is not None:
                m.tied_embedding = "lm_head.weight"
    return modules


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """TinyGPT's loss on a micro-batch: cross-entropy, the mean over its tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# -- a stage: compute, and what it keeps between a micro-batch's forward and its backward -----------------------------
class PipelineStage:
    """One stage of a pipeline: `submodule` run as stage `stage_index` of `num_stages`, on rank
    stage_index % p of `group` (p ranks, default: the world; num_stages = p x virtual stages per rank).

    activation_shape: the shape of what crosses every boundary (micro-batch, sequence, hidden), the same each
    way; the receiver allocates it before the message arrives. Not needed when there is one stage.
    A submodule whose `tied_embedding` names one of its parameters (split_gpt sets it) has that parameter's
    gradient summed with the copy's on the other end of the pipeline after each step."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, group=None,
                 activation_shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32):
        comm.require_process_group()
        self.submodule, self.stage_index, self.num_stages, self.group = submodule, stage_index, num_stages, group
        self.num_ranks, self.rank = comm.world_size(group), comm.rank(group)
        if num_stages % self.num_ranks:
            raise ValueError(f"PipelineStage: {num_stages} stages on {self.num_ranks} ranks; every rank must hold "
                             f"the same number of stages")
        if stage_index % self.num_ranks != self.rank:
            raise ValueError(f"PipelineStage: stage {stage_index} of {num_stages} lives on rank "
                             f"{stage_index % self.num_ranks} of the pipeline (stage s on rank s % p), not on rank "
                             f"{self.rank}")
        if activation_shape is None and num_stages > 1:
            raise ValueError("PipelineStage: give activation_shape=(micro-batch, sequence, hidden), the shape of "
                             "what crosses a stage boundary, so receivers can allocate it in advance")
        self.activation_shape, self.dtype = activation_shape and tuple(activation_shape), dtype
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        params = list(submodule.parameters())
        self.device = params[0].device if params else current_device()
        tied = getattr(submodule, "tied_embedding", None)
        self.tied_embedding = submodule.get_parameter(tied) if tied else None
        self._saved: dict[int, tuple] = {}  # micro-batch -> (input, output or scaled loss), forward to backward

    def forward_one_chunk(self, microbatch: int, x: torch.Tensor, target=None, loss_fn=None, scale: float = 1.0):
        """Run one micro-batch forward; keep what its backward needs. The last stage applies the loss and
        returns it (unscaled, detached); the others return their output, to send on."""
        if not self.is_first:
            x.requires_grad_()  # a leaf: its .grad after backward is what the previous stage needs
        out = self.submodule(x)
        if self.is_last:
            loss = loss_fn(out, target)
            self._saved[microbatch] = (x, loss * scale)  # 1/m: the mean over micro-batches
            return loss.detach()
        if self.activation_shape is not None and tuple(out.shape) != self.activation_shape:
            raise ValueError(f"stage {self.stage_index} produced an activation of shape {tuple(out.shape)}, but "
                             f"its neighbour expects activation_shape={self.activation_shape}")
        self._saved[microbatch] = (x, out)
        return out

    def backward_one_chunk(self, microbatch: int, grad_output: torch.Tensor | None = None):
        """Backward one micro-batch from its output's gradient (the loss, on the last stage); the parameters'
        gradients accumulate. Returns the gradient of the stage's input (None on the first stage), and frees
        everything the micro-batch's forward kept."""
        x, out = self._saved.pop(microbatch)
        torch.autograd.backward(out, grad_output)
        return None if self.is_first else x.grad

