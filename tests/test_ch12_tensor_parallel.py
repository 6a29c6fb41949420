"""Chapter 12: Megatron tensor parallelism and sequence parallelism (minifsdp.parallel), at t = 1, 2 and 4 ranks,
proven against one process's TinyGPT and against torch's own tensor parallelism.

Every rank of the tensor-parallel group sees the same whole batch. The model: TinyGPT(n_head=4, n_embd=32,
vocab_size=96, n_layer=2, block_size=16) with its tied embedding; batches of b = 4 sequences of s = 16 tokens.

Tolerances, and why (fp32 everywhere; measured values are the largest over ranks and cases):
- Against one process (TinyGPT): the first step's loss is bit-identical at every t, with or without sequence
  parallelism. The gathered logits: within 1e-6 (measured 0 at t = 1, 1.2e-7 at t = 2 and 4). The gathered
  gradients: within 1e-6 (measured 3.7e-8 at t = 1, 6.0e-8 at t = 2, 7.5e-8 at t = 4). The losses of the later
  steps and the parameters after STEPS = 3 steps: within 1e-5 (measured: SGD with momentum 1.2e-8 and equal
  losses; AdamW 5.4e-7 at t = 1, 9.4e-7 at t = 2, 6.7e-7 at t = 4, losses one ulp apart, 4.8e-7). Not bit-exact,
  even at t = 1: the layers run sequence-first ([s, b, h], Megatron's layout), so each weight gradient sums its
  b*s token contributions in another order than TinyGPT's [b, s, h]; for t > 1 the all-reduces add the ranks'
  partial sums in ring order, and a row layer adds its bias after the sum instead of inside the matmul. AdamW
  divides by sqrt(v) and so turns an ulp of gradient into more.
- Against torch's tensor parallelism (parallelize_module with ColwiseParallel / RowwiseParallel /
  SequenceParallel, a vocab-parallel embedding and loss_parallel), the same plan on a copy of the same TinyGPT:
  losses and parameters after STEPS steps within 1e-5 (measured: losses one ulp apart at most, 4.8e-7;
  parameters 5.0e-7 with AdamW, 1.2e-7 with SGD). Not bit-exact either: torch's layers run batch-first
  ([b, s, h]), DTensor reduces its LayerNorm gradients under sequence parallelism, and loss_parallel computes the
  loss with other kernels.
- Synchronous against asynchronous input-gradient reduction (ColumnParallelLinear): bit-identical, by design (the
  async path computes the same matmuls in the same orientation as autograd does for F.linear). Measured: 0.0.
- The layers on their own (ColumnParallelLinear with gather_output=True, then RowParallelLinear with
  input_is_parallel=False, against two nn.Linear; vocab_parallel_cross_entropy against F.cross_entropy): within
  1e-6 (measured 1.2e-7 for the outputs, 1.5e-8 for the gradients; the per-token losses bit-identical).
- Bytes and memory: exact (integers).
- Sequence parallelism without allreduce_sequence_parallel_grads: the LayerNorms' gradients are off by more than
  1e-3 (measured 2.1e-3 at t = 2, 2.5e-3 at t = 4): the sum over the group is not optional.

How torch's version is set up: ColwiseParallel cuts a weight into contiguous row blocks, but TinyGPT's qkv weight
stacks all q rows, then all k, then all v; the torch copy's qkv rows are permuted to rank-major order
[q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (minifsdp does the same with stride=3 instead), and its attention
(LocalHeadsAttention below) infers the number of local heads from the width of its local qkv output. The embedding
is RowwiseParallel (vocabulary rows), the tied lm_head ColwiseParallel with a Shard(-1) output for loss_parallel,
re-tied after parallelize_module; under sequence parallelism the LayerNorms are SequenceParallel, the column layers
take Shard(1) inputs and the row layers give Shard(1) outputs, and the embedding's output is redistributed from
Replicate to Shard(1).

Bytes per training step, on the "tp" group, for S = b*s*h*4 bytes of activations, P = b*s*4 bytes (one number per
token), G = (6L + 2)*h*4 bytes (the sequence-parallel LayerNorms and row biases), L blocks, and the ring factor
rho = (t-1)/t (minifsdp's counter: an all-reduce sends 2*rho*size, an all-gather or reduce-scatter rho*size):
    tensor parallel    all_reduce      2 rho (S (4L + 2) + 3P)     per block 2 forward (g) and 2 backward (the
                                                                  column layers' input gradients); the embedding's
                                                                  g; the lm head's input gradient; the loss's 3
    + sequence par.    all_reduce      2 rho (S + 3P + G)         the embedding's g, the loss, the SP gradients
                       all_gather      rho S (6L + 3)             per block 2 forward, 2 re-gathers of the column
                                                                  layers' saved inputs in backward, 2 as the
                                                                  reduce-scatters' backward; the lm head's 2; the
                                                                  embedding scatter's backward
                       reduce_scatter  rho S (4L + 1)             per block 2 forward, 2 backward; the lm head's
A block's four all-reduces become reduce-scatters and all-gathers of the same total bytes (8 rho S), plus two
re-gathers in backward, the price of keeping only s/t tokens of each column layer's input for backward
(Megatron's choice). Measured, b = 4, s = 16, h = 32, L = 2: 82,688 bytes tensor parallel and 109,056 with
sequence parallelism at t = 2; 124,032 and 163,584 at t = 4 -- the formula's numbers exactly.

Memory per rank: the parameters split over t (embedding, qkv, proj and fc weights, fc's bias) take 1/t, the
replicated ones (wpe, LayerNorms, row biases: 960 numbers) all; measured with MemoryMeter, 115,456 / 59,648 /
31,744 bytes at t = 1 / 2 / 4. Activations saved for backward (torch.autograd.graph.saved_tensors_hooks, each
storage counted once, parameters excluded), by the module that saved them: under sequence parallelism what the
LayerNorms and the column layers save (ln_1, ln_2, ln_f: input, mean, rstd; qkv, fc, the lm head: their input,
the LayerNorm's output) is exactly 1/t of what it is without -- measured 84,480 bytes -> 42,240 at t = 2 and
21,120 at t = 4, ratio 1/2 and 1/4 -- and everything else (attention, gelu, the row layers' inputs, the loss,
already split by t) is the same. The whole forward's saved bytes: 197,376 -> 155,136 at t = 2, 141,568 -> 78,208
at t = 4.

One launch per world size computes every case; each rank returns what it measured.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minifsdp import MemoryMeter, comm, launch
from minifsdp.distributed.mesh import init_mesh
from minifsdp.measure.timeline import Timeline
from minifsdp.models import GPTConfig, TinyGPT, count_params, gpt_batch
from minifsdp.parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelGPT, VocabParallelEmbedding,
                               full_tensor, vocab_parallel_cross_entropy)
from minifsdp.parallel.mappings import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region
from minifsdp.parallel.tp_gpt import ParallelBlock
from minifsdp.reports.parallel.tp import is_sp_region, saved_for_backward
from minifsdp.train import OPTIMIZERS, max_abs_diff
from per_world_size import PerWorldSize

WORLD_SIZES = (1, 2, 4)
CONFIG = GPTConfig(n_head=4, n_embd=32, vocab_size=96, n_layer=2, block_size=16)
B, STEPS = 4, 3
S = B * CONFIG.block_size * CONFIG.n_embd * 4       # bytes of one [s, b, h] activation
P = B * CONFIG.block_size * 4                       # bytes of one number per token
L, H = CONFIG.n_layer, CONFIG.n_embd
G = (6 * L + 2) * H * 4                             # bytes of the sequence-parallel parameters' gradients
GRAD_ATOL, LOGITS_ATOL, PARAM_ATOL = 1e-6, 1e-6, 1e-5


def data(step):
    return gpt_batch(CONFIG, step, B)  # the whole batch, on every rank


def tp_group():
    """Every rank, as a group of its own named "tp" in the byte counter (a 1-D mesh over the world would hand back
    the world group itself, counted as "world")."""
    group = dist.new_group(list(range(dist.get_world_size())))
    comm.name_group(group, "tp")
    return group


# -- minifsdp against one process --------------------------------------------------------------------------------------
def reference_run(opt_name):
    """TinyGPT in this process alone: first-step loss, logits and gradients; losses and parameters after STEPS."""
    model = TinyGPT(CONFIG, seed=0)
    opt = OPTIMIZERS[opt_name](model.parameters())
    out = {"losses": []}
    for step in range(STEPS):
        x, y = data(step)
        loss = model(x, y)
        loss.backward()
        if step == 0:
            out["logits"] = model(x).detach()
            out["grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
            out["grads"]["lm_head.weight"] = out["grads"]["wte.weight"]
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach())
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def tp_run(group, opt_name, sequence_parallel, async_grad_allreduce=True, sync_sp_grads=True):
    model = TensorParallelGPT.from_gpt(TinyGPT(CONFIG, seed=0), group=group, sequence_parallel=sequence_parallel,
                                       async_grad_allreduce=async_grad_allreduce)
    opt = OPTIMIZERS[opt_name](model.parameters())
    out = {"losses": []}
    for step in range(STEPS):
        x, y = data(step)
        loss = model(x, y)
        loss.backward()
        if sync_sp_grads:
            model.allreduce_sequence_parallel_grads()
        if step == 0:
            out["logits"] = model.gather_logits(model(x)).detach()
            out["grads"] = model.full_grads()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach())
    out["params"] = model.full_state_dict()
    return out


def compare(ours, ref):
    return {"loss0": (ours["losses"][0] - ref["losses"][0]).abs().item(),
            "losses": (torch.stack(ours["losses"]) - torch.stack(ref["losses"])).abs().max().item(),
            "logits": (ours["logits"] - ref["logits"]).abs().max().item(),
            "grads": max_abs_diff(ours["grads"], ref["grads"]),
            "params": max_abs_diff(ours["params"], ref["params"])}


# -- torch's tensor parallelism, the second oracle ---------------------------------------------------------------------
class LocalHeadsAttention(nn.Module):
    """TinyGPT's attention for torch's ColwiseParallel: the number of heads is read off the local qkv output
    (n_head/t of them on each rank), whose q, k and v are this rank's heads' (rows permuted, see qkv_rank_major)."""

    def __init__(self, attn):
        super().__init__()
        self.qkv, self.proj, self.head_dim = attn.qkv, attn.proj, attn.qkv.in_features // attn.n_head

    def forward(self, x):
        b, s = x.shape[:2]
        qkv = self.qkv(x)
        width = qkv.shape[-1] // 3
        q, k, v = (u.view(b, s, width // self.head_dim, self.head_dim).transpose(1, 2) for u in qkv.split(width, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, width))


def qkv_rank_major(weight, t):
    """[q; k; v] rows -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: contiguous blocks of rows per rank."""
    return weight.view(3, t, -1, weight.shape[-1]).transpose(0, 1).reshape(weight.shape)


def qkv_stacked(weight, t):
    """The inverse of qkv_rank_major."""
    return weight.view(t, 3, -1, weight.shape[-1]).transpose(0, 1).reshape(weight.shape)


def torch_parallelize(mesh, sequence_parallel):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    gpt, t = TinyGPT(CONFIG, seed=0), mesh.size()
    with torch.no_grad():
        for block in gpt.blocks:
            block.attn.qkv.weight.copy_(qkv_rank_major(block.attn.qkv.weight, t))
            block.attn = LocalHeadsAttention(block.attn)
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    for i in range(CONFIG.n_layer):
        for column in ("attn.qkv", "fc"):
            plan[f"blocks.{i}.{column}"] = ColwiseParallel(input_layouts=seq)
        for row in ("attn.proj", "fc_proj"):
            plan[f"blocks.{i}.{row}"] = RowwiseParallel(output_layouts=seq)
        if sequence_parallel:
            plan[f"blocks.{i}.ln_1"] = plan[f"blocks.{i}.ln_2"] = SequenceParallel()
    if sequence_parallel:
        plan["ln_f"] = SequenceParallel()
    parallelize_module(gpt, mesh, plan)
    gpt.lm_head.weight = gpt.wte.weight  # each style distributed its own copy: tie them again
    return gpt


def torch_loss(gpt, mesh, sequence_parallel, x, y):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    h = gpt.wte(x) + gpt.wpe(torch.arange(x.shape[1]))
    if sequence_parallel:
        h = DTensor.from_local(h, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()
    for block in gpt.blocks:
        h = block(h)
    return F.cross_entropy(gpt.lm_head(gpt.ln_f(h)).flatten(0, 1), y.flatten())  # (under loss_parallel)


def torch_tp_run(opt_name, sequence_parallel):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_mesh((dist.get_world_size(),), ("tp",))
    gpt = torch_parallelize(mesh, sequence_parallel)
    opt = OPTIMIZERS[opt_name](gpt.parameters())
    losses = []
    for step in range(STEPS):
        with loss_parallel():
            loss = torch_loss(gpt, mesh, sequence_parallel, *data(step))
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().detach() if isinstance(loss, DTensor) else loss.detach())
    params = {}
    for k, v in gpt.state_dict().items():
        v = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        params[k] = qkv_stacked(v, mesh.size()) if k.endswith("attn.qkv.weight") else v
    return {"losses": losses, "params": params}


# -- the mechanism: which collectives, how many bytes ------------------------------------------------------------------
def block_collectives(group, sequence_parallel, async_grad_allreduce):
    """One tensor-parallel block's forward and backward on an [s, b, h] input (under sequence parallelism this
    rank's s/t tokens): the (kind, tag, bytes) of every collective, in order."""
    torch.manual_seed(0)
    block = ParallelBlock(TinyGPT(CONFIG, seed=0).blocks[0], group=group, sequence_parallel=sequence_parallel,
                          async_grad_allreduce=async_grad_allreduce, name="blocks.0")
    t = comm.world_size(group)
    x = torch.randn(CONFIG.block_size // (t if sequence_parallel else 1), B, H, requires_grad=True)
    with comm.counting(record=True) as fwd:
        out = block(x)
    with comm.counting(record=True) as bwd:
        out.pow(2).sum().backward()
    return {phase: [(e.kind, e.tag, e.nbytes) for e in c.events] for phase, c in (("forward", fwd), ("backward", bwd))}


def step_bytes(group, sequence_parallel):
    """Bytes sent per kind on the "tp" group in one training step (forward, backward, SP gradient sync)."""
    model = TensorParallelGPT.from_gpt(TinyGPT(CONFIG, seed=0), group=group, sequence_parallel=sequence_parallel)
    x, y = data(0)
    with comm.counting() as counter:
        model(x, y).backward()
        model.allreduce_sequence_parallel_grads()
    return {"by_group": {g: dict(kinds) for g, kinds in counter.by_group.items()}, "calls": dict(counter.calls)}


# -- memory ------------------------------------------------------------------------------------------------------------
def param_memory(group):
    model = TensorParallelGPT.from_gpt(TinyGPT(CONFIG, seed=0), group=group)
    meter = MemoryMeter(model)
    split = sum(p.numel() for p in model.parameters() if getattr(p, "tensor_model_parallel", False))
    replicated = sum(p.numel() for p in model.parameters() if not getattr(p, "tensor_model_parallel", False))
    out = {"measured": meter.live()["params"], "split_local": split, "replicated": replicated,
           "full": count_params(TinyGPT(CONFIG, seed=0))}
    meter.close()
    return out


def saved_activation_bytes(group, sequence_parallel):
    """Bytes saved for backward by one forward, by the module that saved them (the lm head counted as one)."""
    model = TensorParallelGPT.from_gpt(TinyGPT(CONFIG, seed=0), group=group, sequence_parallel=sequence_parallel)
    return saved_for_backward(model, *data(0))


# -- the overlap, on a timeline ----------------------------------------------------------------------------------------
def overlap_order(group, sequence_parallel):
    """For each column layer's backward: was its input gradient's collective issued before its weight-gradient
    matmul started, and waited for only after it ended? (Order of events, not durations.)"""
    model = TensorParallelGPT.from_gpt(TinyGPT(CONFIG, seed=0), group=group, sequence_parallel=sequence_parallel)
    x, y = data(0)
    loss = model(x, y)
    with Timeline() as tl:
        loss.backward()
    spans = tl.spans()
    waits_done = {w.tag: w.end - tl.origin for w in tl.counter.waits}
    out = {}
    for s in spans:
        if s.lane == "compute" and s.name.endswith(" weight gradient"):
            layer = s.name[len("backward "): -len(" weight gradient")]
            tag = f"backward {layer} input gradient"
            issued = [c.start for c in spans if c.lane not in ("compute", "wait") and c.name == tag]
            out[layer] = {"issued_before": bool(issued) and issued[0] <= s.start,
                          "waited_after": tag not in waits_done or waits_done[tag] >= s.end}
    return out


# -- the layers on their own, the options TensorParallelGPT does not use ----------------------------------------------
def layers(group):
    """Column(gather_output=True) then Row(input_is_parallel=False) against two nn.Linear; the vocab-parallel loss
    against F.cross_entropy on random logits; a layer initialised by itself against the same init of the whole."""
    g = torch.Generator().manual_seed(7)
    fc1, fc2 = nn.Linear(8, 12), nn.Linear(12, 8)
    x = torch.randn(5, 3, 8, generator=g, requires_grad=True)
    column = ColumnParallelLinear.from_full(fc1, gather_output=True, group=group)
    row = RowParallelLinear.from_full(fc2, input_is_parallel=False, group=group)
    out = row(torch.tanh(column(x)))
    out.pow(2).mean().backward()
    grad_x, x.grad = x.grad, None
    ref = fc2(torch.tanh(fc1(x)))
    ref.pow(2).mean().backward()
    result = {"linear_out": (out - ref).abs().max().item(), "linear_grad_x": (grad_x - x.grad).abs().max().item(),
              "linear_grads": max(
                  (full_tensor(p.grad, p, group) - q.grad).abs().max().item()
                  for p, q in ((column.weight, fc1.weight), (column.bias, fc1.bias), (row.weight, fc2.weight),
                               (row.bias, fc2.bias)))}
    logits = torch.randn(6, 2, 96, generator=g, requires_grad=True)
    target = torch.randint(0, 96, (6, 2), generator=g)
    t, r = comm.world_size(group), comm.rank(group)
    local = logits.detach().chunk(t, dim=-1)[r].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group)
    loss.mean().backward()
    ref = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(6, 2)
    ref.mean().backward()
    result["ce_loss"] = (loss - ref).abs().max().item()
    result["ce_grad"] = (local.grad - logits.grad.chunk(t, dim=-1)[r]).abs().max().item()
    torch.manual_seed(3)
    layer = ColumnParallelLinear(8, 12, group=group)
    torch.manual_seed(3)
    result["own_init"] = torch.equal(full_tensor(layer.weight, layer.weight, group), nn.Linear(8, 12).weight)
    return result


# -- how: the passes that sum, and the loss's three numbers per token -------------------------------------------------
def passes(group):
    """The collectives of each of f's and g's two passes, on their own (a [5, 3, 8] fp32 tensor), and of the
    vocab-parallel loss's forward and backward (6 x 2 tokens)."""
    out = {}
    for name, mapping in (("f", copy_to_tensor_model_parallel_region), ("g", reduce_from_tensor_model_parallel_region)):
        x = torch.randn(5, 3, 8, requires_grad=True)
        with comm.counting(record=True) as forward:
            y = mapping(x, group)
        with comm.counting(record=True) as backward:
            y.backward(torch.ones_like(y))
        for direction, counter in (("forward", forward), ("backward", backward)):
            out[(name, direction)] = [(e.kind, e.nbytes) for e in counter.events]
    t = comm.world_size(group)
    logits = torch.randn(6, 2, 96 // t, requires_grad=True)
    target = torch.randint(0, 96, (6, 2))
    with comm.counting(record=True) as forward:
        loss = vocab_parallel_cross_entropy(logits, target, group)
    with comm.counting(record=True) as backward:
        loss.sum().backward()
    out[("loss", "forward")] = [(e.kind, e.nbytes) for e in forward.events]
    out[("loss", "backward")] = [(e.kind, e.nbytes) for e in backward.events]
    return out


# -- clear errors ------------------------------------------------------------------------------------------------------
def raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test looks at which, and at the message
        return type(e).__name__, str(e)
    return None


def errors(group):
    t = comm.world_size(group)
    odd = 4 * t + 1  # divides by no t > 1
    model = TensorParallelGPT.from_gpt(TinyGPT(CONFIG, seed=0), group=group, sequence_parallel=True)
    x, y = data(0)
    return {
        "column": raised(lambda: ColumnParallelLinear(8, odd, group=group)),
        "column_stride": raised(lambda: ColumnParallelLinear(8, 3 * t * 2 + 3, stride=3, group=group)),
        "row": raised(lambda: RowParallelLinear(odd, 8, group=group)),
        "vocab": raised(lambda: VocabParallelEmbedding(odd, 8, group=group)),
        "heads": raised(lambda: TensorParallelGPT.from_gpt(TinyGPT(GPTConfig(n_head=t + 1, n_embd=8 * (t + 1)), seed=0),
                                                            group=group)),
        "sequence": raised(lambda: model(x[:, :-1], y[:, :-1])),
    }


# -- every case of one world size --------------------------------------------------------------------------------------
def rank_cases():
    group = tp_group()
    out = {}
    for opt in ("sgd", "adamw"):
        ref = reference_run(opt)
        for sp in (False, True):
            ours = tp_run(group, opt, sp)
            out[("vs_single", opt, sp)] = compare(ours, ref)
            theirs = torch_tp_run(opt, sp)
            out[("vs_torch", opt, sp)] = {
                "losses": (torch.stack(ours["losses"]) - torch.stack(theirs["losses"])).abs().max().item(),
                "params": max_abs_diff(ours["params"], theirs["params"])}
    for sp in (False, True):
        sync, asynchronous = (tp_run(group, "sgd", sp, async_grad_allreduce=a) for a in (False, True))
        out[("sync_vs_async", sp)] = {k: compare(sync, asynchronous)[k] for k in ("losses", "grads", "params")}
        for a in (False, True):
            out[("block", sp, a)] = block_collectives(group, sp, a)
        out[("bytes", sp)] = step_bytes(group, sp)
        out[("saved", sp)] = saved_activation_bytes(group, sp)
        out[("overlap", sp)] = overlap_order(group, sp)
    unsynced = tp_run(group, "sgd", True, sync_sp_grads=False)
    out["unsynced_ln_grads"] = max((unsynced["grads"][k] - ref_grads).abs().max().item()
                                   for k, ref_grads in reference_run("sgd")["grads"].items() if ".ln_" in k)
    out["params"] = param_memory(group)
    out["errors"] = errors(group)
    out["layers"] = layers(group)
    out["passes"] = passes(group)
    # the pieces put back together are TinyGPT's own weights
    model = TensorParallelGPT.from_gpt(TinyGPT(CONFIG, seed=0), group=group)
    out["initial"] = max_abs_diff(model.full_state_dict(), TinyGPT(CONFIG, seed=0).state_dict())
    out["local_qkv_is_own_heads"] = torch.equal(
        model.blocks[0].attn.qkv.weight,
        torch.cat([w.chunk(comm.world_size(group))[comm.rank(group)]
                   for w in TinyGPT(CONFIG, seed=0).blocks[0].attn.qkv.weight.detach().chunk(3)]))
    out["full_tensor_of_replicated"] = torch.equal(full_tensor(model.wpe.weight, model.wpe.weight, group),
                                                   model.wpe.weight)
    return out


@pytest.fixture(scope="module")
def ranks():
    return PerWorldSize(lambda t: launch(rank_cases, world_size=t, device="cpu"), WORLD_SIZES)


def each_rank(ranks, t, key):
    return [ranks[t][r][key] for r in range(t)]


def rho(t):
    return (t - 1) / t


# -- the tests ---------------------------------------------------------------------------------------------------------
@pytest.mark.exercise("12.1", "12.3")
@pytest.mark.parametrize("t", WORLD_SIZES)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_equals_one_process(ranks, t, sp, opt):
    for d in each_rank(ranks, t, ("vs_single", opt, sp)):
        assert d["loss0"] == 0.0
        assert d["logits"] <= LOGITS_ATOL
        assert d["grads"] <= GRAD_ATOL
        assert d["losses"] <= PARAM_ATOL and d["params"] <= PARAM_ATOL


@pytest.mark.exercise("12.1", "12.3")
@pytest.mark.parametrize("t", WORLD_SIZES)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_equals_torch_tensor_parallel(ranks, t, sp, opt):
    for d in each_rank(ranks, t, ("vs_torch", opt, sp)):
        assert d["losses"] <= PARAM_ATOL
        assert d["params"] <= PARAM_ATOL


@pytest.mark.parametrize("t", WORLD_SIZES)
def test_built_from_tinygpt_weights(ranks, t):
    for r in range(t):
        assert ranks[t][r]["initial"] == 0.0
        assert ranks[t][r]["local_qkv_is_own_heads"]  # rank r's q, k and v rows of its own heads (stride 3)
        assert ranks[t][r]["full_tensor_of_replicated"]


@pytest.mark.exercise("12.1", "12.3")
@pytest.mark.parametrize("t", WORLD_SIZES)
def test_sequence_parallel_grads_must_be_summed(ranks, t):
    for d in each_rank(ranks, t, "unsynced_ln_grads"):
        if t == 1:
            assert d <= GRAD_ATOL
        else:  # each rank saw s/t tokens: its LayerNorm gradients are partial sums until summed over the group
            assert d > 1e-3


@pytest.mark.exercise("12.1", "12.3")
@pytest.mark.parametrize("t", WORLD_SIZES)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_async_input_grad_reduction_same_bits_as_sync(ranks, t, sp):
    for d in each_rank(ranks, t, ("sync_vs_async", sp)):
        assert d == {"losses": 0.0, "grads": 0.0, "params": 0.0}


def _collectives(events):
    """[(kind, [tag,] bytes), ...] in words: "all_reduce of 480 B, ...", or "nothing"."""
    if not events:
        return "nothing"
    return ", ".join(f"{e[0]} of {e[-1]:,.0f} B" + (f" ({e[1]})" if len(e) == 3 else "") for e in events)


def _bytes(by_kind):
    return ", ".join(f"{k} {b:,.0f} B" for k, b in sorted(by_kind.items())) or "nothing"


@pytest.mark.mechanism
@pytest.mark.exercise("12.1")
@pytest.mark.parametrize("t", WORLD_SIZES)
def test_f_and_g_sum_in_two_of_their_four_passes(ranks, t):
    """f backward and g forward each all-reduce the whole tensor (480 bytes: 2 x 480 (t-1)/t on the wire), through
    comm; f forward and g backward send nothing. At t = 1 nothing at all."""
    size = 5 * 3 * 8 * 4
    for r, d in enumerate(each_rank(ranks, t, "passes")):
        summed = [] if t == 1 else [("all_reduce", 2 * rho(t) * size)]
        for mapping, direction in (("f", "forward"), ("g", "backward")):
            got = d[(mapping, direction)]
            assert got == [], (
                f"{mapping} {direction} on rank {r} of {t} issued {_collectives(got)}, expected nothing (exercise "
                f"12.1): in this pass the tensor is already what every rank needs")
        for mapping, direction in (("f", "backward"), ("g", "forward")):
            got = d[(mapping, direction)]
            assert got == summed, (
                f"{mapping} {direction} on rank {r} of {t} issued {_collectives(got)} through comm, expected "
                f"{_collectives(summed)} (exercise 12.1): this pass sums the ranks' parts of the whole {size:,} B "
                f"tensor; is the sum made in another pass, or with torch.distributed itself, around comm's counter?")


@pytest.mark.mechanism
@pytest.mark.exercise("12.3")
@pytest.mark.parametrize("t", WORLD_SIZES)
def test_vocab_parallel_loss_sends_three_numbers_per_token(ranks, t):
    """Three all-reduces of one fp32 number per token (the max, the target's logit, the sum of exponentials), 12
    tokens: 2 x 48 (t-1)/t bytes each -- not the V/t logits of each token -- and nothing in backward."""
    for r, d in enumerate(each_rank(ranks, t, "passes")):
        expected = [] if t == 1 else [("all_reduce", 2 * rho(t) * 12 * 4)] * 3
        got = d[("loss", "forward")]
        assert got == expected, (
            f"the vocab-parallel loss's forward on rank {r} of {t} issued {_collectives(got)}, expected "
            f"{_collectives(expected)} (exercise 12.3): three all-reduces of one fp32 number for each of the 12 tokens; "
            f"are the logits gathered, or a reduction made per rank or outside comm?")
        assert d[("loss", "backward")] == [], (
            f"the vocab-parallel loss's backward on rank {r} of {t} issued {_collectives(d[('loss', 'backward')])}, "
            f"expected nothing (exercise 12.3): each rank's columns of softmax - onehot need no other rank")


@pytest.mark.mechanism
@pytest.mark.exercise("12.1")
@pytest.mark.parametrize("t", WORLD_SIZES)
def test_f_and_g_collectives_of_a_block(ranks, t):
    """Without sequence parallelism and with the plain (synchronous) column path: g's two all-reduces forward, f's
    two backward, each of the whole [s, b, h] activation; nothing else."""
    for r, d in enumerate(each_rank(ranks, t, ("block", False, False))):
        for phase, pass_ in (("forward", "g forward"), ("backward", "f backward")):
            expected = [] if t == 1 else [("all_reduce", pass_, 2 * rho(t) * S)] * 2
            assert d[phase] == expected, (
                f"a block's {phase} on rank {r} of {t} issued {_collectives(d[phase])}, expected "
                f"{_collectives(expected)}: {pass_}'s two all-reduces of the whole activation and nothing else "
                f"(exercise 12.1)")


@pytest.mark.mechanism
@pytest.mark.exercise("12.1")
@pytest.mark.parametrize("t", WORLD_SIZES)
def test_async_block_collectives(ranks, t):
    """The asynchronous column layers do f's backward themselves: the same two all-reduces, tagged by layer."""
    for r, d in enumerate(each_rank(ranks, t, ("block", False, True))):
        expected = [] if t == 1 else [("all_reduce", "g forward", 2 * rho(t) * S)] * 2
        assert d["forward"] == expected, (
            f"a block's forward on rank {r} of {t} issued {_collectives(d['forward'])}, expected "
            f"{_collectives(expected)}: g forward's two all-reduces (exercise 12.1)")
        expected = [] if t == 1 else [
            ("all_reduce", "backward blocks.0.fc input gradient", 2 * rho(t) * S),
            ("all_reduce", "backward blocks.0.attn.qkv input gradient", 2 * rho(t) * S)]
        assert d["backward"] == expected, (
            f"a block's backward on rank {r} of {t} issued {_collectives(d['backward'])}, expected "
            f"{_collectives(expected)}: the column layers' input-gradient sums, and no second one from f backward "
            f"(exercise 12.1)")


@pytest.mark.parametrize("t", WORLD_SIZES)
@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_sequence_parallel_block_collectives(ranks, t, async_):
    """Sequence parallelism: each all-reduce becomes a reduce-scatter and an all-gather of the same total bytes
    (forward: all-gather before each column layer, reduce-scatter after each row layer; backward the transposes);
    the async column layers also all-gather their saved token shards again in backward."""
    for d in each_rank(ranks, t, ("block", True, async_)):
        if t == 1:
            assert d == {"forward": [], "backward": []}
            continue
        kinds = {phase: [kind for kind, _, _ in events] for phase, events in d.items()}
        assert kinds["forward"] == ["all_gather", "reduce_scatter"] * 2
        assert all(nbytes == rho(t) * S for events in d.values() for _, _, nbytes in events)
        regathers = 2 if async_ else 0
        assert sorted(kinds["backward"]) == ["all_gather"] * (2 + regathers) + ["reduce_scatter"] * 2
        assert sum(nbytes for _, _, nbytes in d["forward"]) == 2 * (2 * rho(t) * S)  # = g's two all-reduces


@pytest.mark.mechanism
@pytest.mark.exercise("12.1", "12.3")
@pytest.mark.parametrize("t", WORLD_SIZES)
def test_step_bytes_match_the_formula(ranks, t):
    for r in range(t):
        tp, sp = ranks[t][r][("bytes", False)], ranks[t][r][("bytes", True)]
        assert set(tp["by_group"]) <= {"tp"} and set(sp["by_group"]) <= {"tp"}, (  # everything on the tp group
            f"rank {r} of {t} sent on groups {sorted(set(tp['by_group']) | set(sp['by_group']))}, expected the "
            f"tensor-parallel group only (exercises 12.1, 12.3): is a sum made without the group it was given?")
        expected = {} if t == 1 else {"all_reduce": 2 * rho(t) * (S * (4 * L + 2) + 3 * P)}
        got = tp["by_group"].get("tp", {})
        assert got == expected, (
            f"a step of the TP GPT on rank {r} of {t} sent {_bytes(got)}, expected {_bytes(expected)}: f's and "
            f"g's two all-reduces per block of {S:,} B each, two more at the ends, and the loss's three of {P:,} B "
            f"(exercise 12.1 for f and g, 12.3 for the loss's)")
        expected = {} if t == 1 else {"all_reduce": 2 * rho(t) * (S + 3 * P + G),
                                      "all_gather": rho(t) * S * (6 * L + 3),
                                      "reduce_scatter": rho(t) * S * (4 * L + 1)}
        got = sp["by_group"].get("tp", {})
        assert got == expected, (
            f"a step of the sequence-parallel GPT on rank {r} of {t} sent {_bytes(got)}, expected "
            f"{_bytes(expected)} (exercises 12.1, 12.3)")
        if t > 1:
            assert tp["calls"] == {"all_reduce": 4 * L + 2 + 3}, (
                f"a step of the TP GPT on rank {r} of {t} issued {tp['calls']}, expected {4 * L + 5} all-reduces: "
                f"4 per block, 2 at the ends, 3 for the loss (exercises 12.1, 12.3)")


@pytest.mark.parametrize("t", WORLD_SIZES)
def test_parameter_memory_divided_by_t(ranks, t):
    full = TinyGPT(CONFIG, seed=0)
    replicated = sum(p.numel() for k, p in full.named_parameters()
                     if k.startswith(("wpe", "ln_f")) or ".ln_" in k or k.endswith(("proj.bias", "fc_proj.bias")))
    split = count_params(full) - replicated
    for d in each_rank(ranks, t, "params"):
        assert d["replicated"] == replicated and d["split_local"] * t == split
        assert d["measured"] == 4 * (split // t + replicated)


@pytest.mark.exercise("12.1", "12.3")
@pytest.mark.parametrize("t", WORLD_SIZES)
def test_sequence_parallel_divides_layernorm_activations_by_t(ranks, t):
    b, s = B, CONFIG.block_size
    # per block: ln_1's and ln_2's inputs, mean and rstd; qkv's and fc's inputs; then ln_f's and the lm head's
    region = L * (4 * S + 4 * b * s * 4) + (2 * S + 2 * b * s * 4)
    for r in range(t):
        tp, sp = ranks[t][r][("saved", False)], ranks[t][r][("saved", True)]
        assert tp.keys() == sp.keys()
        assert sum(v for k, v in tp.items() if is_sp_region(k)) == region
        for k in tp:
            if is_sp_region(k):
                assert sp[k] * t == tp[k], k
            else:
                assert sp[k] == tp[k], k  # attention, gelu, the row layers' inputs, the loss: split by t already


@pytest.mark.exercise("12.1")
@pytest.mark.parametrize("t", WORLD_SIZES)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_input_grad_reduction_issued_before_weight_grad(ranks, t, sp):
    layers = {f"blocks.{i}.{name}" for i in range(L) for name in ("attn.qkv", "fc")} | {"lm_head"}
    for d in each_rank(ranks, t, ("overlap", sp)):
        assert set(d) == layers  # every column layer's weight-gradient matmul is on the timeline
        for layer, order in d.items():
            assert order["waited_after"], layer
            assert order["issued_before"] == (t > 1), layer  # (t = 1: no collective at all)


@pytest.mark.exercise("12.1", "12.3")
@pytest.mark.parametrize("t", WORLD_SIZES)
def test_layers_on_their_own(ranks, t):
    for d in each_rank(ranks, t, "layers"):
        assert d["own_init"]  # rank r keeps its rows of the weight every rank drew whole
        assert max(v for k, v in d.items() if k != "own_init") <= GRAD_ATOL, d


@pytest.mark.parametrize("t", [2, 4])
def test_sizes_that_do_not_divide(ranks, t):
    for d in each_rank(ranks, t, "errors"):
        odd = 4 * t + 1
        for case, words in {"column": ["ColumnParallelLinear", "out_features", str(odd), f"t = {t}"],
                            "column_stride": ["stride 3", f"t = {t}"],
                            "row": ["RowParallelLinear", "in_features", str(odd), f"t = {t}"],
                            "vocab": ["VocabParallelEmbedding", "num_embeddings", str(odd), f"t = {t}"],
                            "heads": ["n_head", str(t + 1), f"t = {t}"],
                            "sequence": ["sequence length", "15"]}.items():
            kind, message = d[case]
            assert kind == "ValueError" and all(w in message for w in words), (case, message)
