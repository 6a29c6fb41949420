"""Chapter 12's measurements: tensor parallelism (and sequence parallelism), the column layers' input-gradient
all-reduce behind their weight-gradient matmul, the pipeline schedules, and the parallelisms side by side on 4 ranks.

    python -m minifsdp parallel --parts tp --markdown chapters/generated/parallel_tp.md
    python -m minifsdp parallel --parts overlap --markdown chapters/generated/parallel_overlap.md --plot chapters/figures/tp_overlap.svg
    python -m minifsdp parallel --parts pp --markdown chapters/generated/parallel_pp.md --plot chapters/figures/pipeline_gantt.svg
    python -m minifsdp parallel --parts compare --markdown chapters/generated/parallel_compare.md

(`--markdown DIR` writes each part's table to DIR/parallel_<part>.md, `--markdown PREFIX` to PREFIX_<part>.md;
`--plot` likewise for the two parts that draw: DIR/tp_overlap.svg and DIR/pipeline_gantt.svg, or PREFIX_<part>.svg.)

- tp: TinyGPT over a tensor-parallel group of t = 1, 2, 4 ranks (one launch per t; the model and batch of the
  tensor-parallel tests), with and without sequence parallelism: each rank's parameter bytes (MemoryMeter) against
  4 (Psi_split / t + Psi_replicated); the bytes one training step sends on the group, counted, against the
  formulas of tests/test_ch12_tensor_parallel.py; the bytes forward saves for backward
  (torch.autograd.graph.saved_tensors_hooks), in the LayerNorm region -- what sequence parallelism divides by t --
  and elsewhere.
- overlap: TinyGPT (h = 256, 2 blocks, 2,048 tokens) over t = 2 ranks, one backward at a time on a Timeline, with
  f's synchronous all-reduce and with async_grad_allreduce (the column layer starts its input gradient's all-reduce,
  computes its weight gradient, then waits), median of 5 each, the paths taking turns: backward time, the column
  layers' matmuls, the all-reduces, the time held by them (in their call or their wait), the share of their time
  not held (hidden_fraction); both paths' gradients compared bit for bit; the two timelines of rank 0, one above the
  other.
- pp: GPipe, 1F1B and interleaved 1F1B (v = 2) on p = 4 ranks, m = 8 micro-batches, every forward made to last
  50 ms and every backward 100 ms (halved for the interleaved schedule's half-size stages; compute_time): the
  bubble each rank measured against (p - 1) / (v m + p - 1), the micro-batches each held at once, the activation
  bytes at their peak (MemoryMeter's "other"), the bytes each sent against the count of boundaries crossed; and
  the three timelines as a Gantt chart.
- compare: one GPT, 4 ranks, a global batch of 16 sequences, AdamW, under DDP, FSDP, TP + SP, 1F1B, DDP x TP + SP
  and 1F1B x DDP, all built in the same launch and stepped in turn, step by step: model-state bytes per rank
  (MemoryMeter's params + grads + optim after the optimizer step) against 16 bytes a parameter held, the peak of a
  step, the bytes sent per step in each group, the step time as a ratio to DDP's in the same step (the median over
  the steps), and the largest difference of any step's loss from DDP's.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from minifsdp import events
from minifsdp.ddp import DistributedDataParallel
from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch, rank_pool
from minifsdp.distributed.mesh import init_mesh
from minifsdp.fsdp import FullyShardedDataParallel, ModuleWrapPolicy
from minifsdp.measure.meter import MemoryMeter
from minifsdp.measure.pipeline_timeline import bubble_formula, bubble_fractions, in_flight_peak, pipeline_actions
from minifsdp.measure.timeline import Span, Timeline, hidden_fraction, lane_time
from minifsdp.models import Block, GPTConfig, TinyGPT, gpt_batch
from minifsdp.parallel import (ColumnParallelLinear, PipelineStage, Schedule1F1B, ScheduleGPipe,
                               ScheduleInterleaved1F1B, TensorParallelGPT, gpt_loss, split_gpt, stages_of_rank)
from minifsdp.parallel.compose import allreduce_gradients
from minifsdp.reports import style
from minifsdp.reports.format import fmt_bytes, md_table, md_tabs, write_report
from minifsdp.train import OPTIMIZERS

PARTS = ("tp", "overlap", "pp", "compare")
PLOTS = {"overlap": "tp_overlap.svg", "pp": "pipeline_gantt.svg"}  # the parts that draw, and their default file

# the tensor-parallel tests' model and batch (tests/test_ch12_tensor_parallel.py)
TP_CONFIG = GPTConfig(n_head=4, n_embd=32, vocab_size=96, n_layer=2, block_size=16)
TP_BATCH = 4
# the input gradient's all-reduce behind the weight gradient: b s = 2,048 tokens, wide enough that a column layer's
# weight-gradient matmul takes milliseconds on one CPU core, and about as long as gloo takes to all-reduce its input
# gradient (2 MiB) between two processes of one machine -- no simulated link needed
OVERLAP_CONFIG = GPTConfig(n_layer=2, n_embd=256, n_head=8, vocab_size=256, block_size=128)
OVERLAP_BATCH, OVERLAP_REPS = 16, 5
PATHS = {"synchronous": False, "async_grad_allreduce": True}  # TensorParallelGPT's async_grad_allreduce
# the pipeline tests' model, batch and delays (tests/test_ch12_pipeline.py)
PP_CONFIG = GPTConfig(n_layer=8, n_embd=16, n_head=2, block_size=8, vocab_size=96)
PP_BATCH, PP_RANKS, PP_MICRO, PP_VIRTUAL = 16, 4, 8, 2
COMPUTE_TIME = (0.050, 0.100)  # seconds a forward, a backward of a whole stage; /v for the interleaved stages
SCHEDULES = {"GPipe": (ScheduleGPipe, 1), "1F1B": (Schedule1F1B, 1), "interleaved 1F1B": (ScheduleInterleaved1F1B, 2)}
# the side-by-side comparison
COMPARE_CONFIG = GPTConfig(n_layer=8, n_embd=128, n_head=8, vocab_size=256, block_size=64)
COMPARE_BATCH, COMPARE_STEPS = 16, 16  # step 0 warms up, the last is metered, the others are timed
CONTENDERS = ("DDP", "FSDP", "TP + SP", "PP 1F1B", "DP x TP", "PP x DP")
LAYOUTS = {"DDP": "d = 4", "FSDP": "d = 4, a unit per block", "TP + SP": "t = 4", "PP 1F1B": "p = 4, m = 8",
           "DP x TP": "d = 2 x t = 2 (SP)", "PP x DP": "p = 2 (m = 4) x d = 2"}
GROUPS = ("dp", "tp", "pp")
ADAMW_BYTES = 16  # fp32 AdamW: parameter 4, gradient 4, two moments 8 (SPEC, "Measurement definitions")


def _is_replicated(name: str) -> bool:
    """TinyGPT's parameters that tensor parallelism keeps whole on every rank (the others are split over t)."""
    return name.startswith(("wpe", "ln_f")) or ".ln_" in name or name.endswith(("proj.bias", "fc_proj.bias"))


def split_and_replicated(config: GPTConfig) -> tuple[int, int]:
    """(Psi_split, Psi_replicated) of the whole TinyGPT, the tied embedding counted once."""
    named = dict(TinyGPT(config, seed=0).named_parameters())  # (a tied weight is listed once)
    replicated = sum(p.numel() for k, p in named.items() if _is_replicated(k))
    return sum(p.numel() for p in named.values()) - replicated, replicated


def _named_group(name: str):
    """Every rank, as a group of its own counted under `name` (the world group itself is counted as "world")."""
    group = dist.new_group(list(range(dist.get_world_size())))
    comm.name_group(group, name)
    return group


# -- tensor parallelism ------------------------------------------------------------------------------------------------
def tp_step_bytes_formula(config: GPTConfig, b: int, t: int, sequence_parallel: bool) -> dict[str, float]:
    """Bytes one rank sends on the tensor-parallel group in one training step (the derivation is in
    tests/test_ch12_tensor_parallel.py): S = b s h 4 bytes of activation, P = b s 4 (a number per token),
    G = (6L + 2) h 4 (the sequence-parallel parameters' gradients), rho = (t - 1)/t."""
    if t == 1:
        return {}
    rho, L = (t - 1) / t, config.n_layer
    S, P = b * config.block_size * config.n_embd * 4, b * config.block_size * 4
    if not sequence_parallel:
        return {"all_reduce": 2 * rho * (S * (4 * L + 2) + 3 * P)}
    G = (6 * L + 2) * config.n_embd * 4
    return {"all_reduce": 2 * rho * (S + 3 * P + G), "all_gather": rho * S * (6 * L + 3),
            "reduce_scatter": rho * S * (4 * L + 1)}


def ln_region_formula(config: GPTConfig, b: int) -> int:
    """Bytes the LayerNorm region saves without sequence parallelism: per block ln_1's and ln_2's inputs, means
    and rstds, qkv's and fc's inputs; then ln_f's and the lm head's. Sequence parallelism divides it by t."""
    S, per_token = b * config.block_size * config.n_embd * 4, b * config.block_size * 4
    return config.n_layer * (4 * S + 4 * per_token) + (2 * S + 2 * per_token)


def is_sp_region(name: str) -> bool:
    """The modules that run on token shards under sequence parallelism, and the column layers that save their
    inputs (the LayerNorms' outputs)."""
    return name.split(".")[-1] in ("ln_1", "ln_2", "ln_f", "qkv", "fc", "lm_head")


def saved_for_backward(model: TensorParallelGPT, x, y) -> dict[str, int]:
    """Bytes one forward saves for backward, by the module that saved them (each storage once, parameters left
    out; the lm head, a method, counted as a module of its own)."""
    stack, hooks = [""], []

    def leave(module, args, output):
        stack.pop()  # (and return None: a forward hook's result would replace the output)

    for name, m in model.named_modules():
        hooks.append(m.register_forward_pre_hook(lambda m, args, name=name: stack.append(name)))
        hooks.append(m.register_forward_hook(leave))
    lm_logits = model.lm_logits

    def lm_head(h):
        stack.append("lm_head")
        try:
            return lm_logits(h)
        finally:
            stack.pop()

    model.lm_logits = lm_head
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), (stack[-1], storage.nbytes()))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x, y)
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
        del model.lm_logits  # the method again
    out = defaultdict(int)
    for name, nbytes in saved.values():
        out[name] += nbytes
    return dict(out)


def tp_measure(config: GPTConfig = TP_CONFIG, b: int = TP_BATCH) -> dict:
    """On each rank of a tensor-parallel group of every rank: parameter bytes, bytes per step, saved bytes."""
    group = _named_group("tp")
    model = TensorParallelGPT.from_gpt(TinyGPT(config, seed=0), group=group)
    meter = MemoryMeter(model)
    out = {"t": comm.world_size(group), "param_bytes": meter.live()["params"]}
    meter.close()
    x, y = gpt_batch(config, 0, b)
    for sp in (False, True):
        model = TensorParallelGPT.from_gpt(TinyGPT(config, seed=0), group=group, sequence_parallel=sp)
        with comm.counting() as counter:
            model(x, y).backward()
            model.allreduce_sequence_parallel_grads()
        out[("bytes", sp)] = {g: dict(kinds) for g, kinds in counter.by_group.items()}
        model.zero_grad()
        saved = saved_for_backward(model, x, y)
        out[("saved", sp)] = sum(saved.values())
        out[("ln_region", sp)] = sum(v for k, v in saved.items() if is_sp_region(k))
    return out


def tp_results(world_sizes=(1, 2, 4), config: GPTConfig = TP_CONFIG, b: int = TP_BATCH) -> list[dict]:
    """A row per t: what the ranks measured (the largest over ranks) and the formulas."""
    split, replicated = split_and_replicated(config)
    rows = []
    for t in world_sizes:
        res = launch(tp_measure, world_size=t, kwargs=dict(config=config, b=b), device="cpu")
        row = {"t": t, "param_bytes": max(r["param_bytes"] for r in res),
               "param_theory": 4 * (split // t + replicated), "ln_region_theory": ln_region_formula(config, b)}
        for sp in (False, True):
            row[("bytes", sp)] = max(sum(r[("bytes", sp)].get("tp", {}).values()) for r in res)
            row[("bytes_off_tp", sp)] = max(sum(sum(k.values()) for g, k in r[("bytes", sp)].items() if g != "tp")
                                            for r in res)
            row[("bytes_theory", sp)] = sum(tp_step_bytes_formula(config, b, t, sp).values())
            row[("saved", sp)] = max(r[("saved", sp)] for r in res)
            row[("ln_region", sp)] = max(r[("ln_region", sp)] for r in res)
        rows.append(row)
    return rows


def tp_table(rows: list[dict], config: GPTConfig = TP_CONFIG, b: int = TP_BATCH) -> str:
    """Four short tables, each with the measured next to its formula (nine columns in one would scroll sideways
    in the docs' column, md_table)."""
    split, replicated = split_and_replicated(config)
    head = (f"**Tensor parallelism**, TinyGPT ({config.n_layer} blocks, h = {config.n_embd}, {config.n_head} heads, "
            f"vocabulary {config.vocab_size}; Ψ_split = {split:,}, Ψ_replicated = {replicated:,}), b = {b}, "
            f"s = {config.block_size}, fp32; per rank, the largest over the t ranks.")
    params = md_table(["t", "parameter bytes", "4·(Ψ_split/t + Ψ_replicated)"],
                      [[r["t"], f"{r['param_bytes']:,}", f"{r['param_theory']:,}"] for r in rows],
                      caption="Parameter bytes per rank")
    step = md_table(["t", "TP", "formula", "TP + SP", "formula"],
                    [[r["t"], *(f"{r[(k, sp)]:,.0f}" for sp in (False, True) for k in ("bytes", "bytes_theory"))]
                     for r in rows],
                    caption="Bytes per training step on the tp group, counted and by the formula")
    region = md_table(["t", "TP", "TP + SP", "ratio", "formula: region / t"],
                      [[r["t"], f"{r[('ln_region', False)]:,}", f"{r[('ln_region', True)]:,}",
                        f"1/{r[('ln_region', False)] / r[('ln_region', True)]:.3g}",
                        f"{r['ln_region_theory'] // r['t']:,}"] for r in rows],
                      caption="Activations saved for backward by one forward, bytes per rank, in the LayerNorm "
                              "region (ln_1, ln_2, ln_f and the column layers that keep their outputs)")
    rest = md_table(["t", "elsewhere, TP", "TP + SP", "all saved, TP", "TP + SP"],
                    [[r["t"], f"{r[('saved', False)] - r[('ln_region', False)]:,}",
                      f"{r[('saved', True)] - r[('ln_region', True)]:,}", f"{r[('saved', False)]:,}",
                      f"{r[('saved', True)]:,}"] for r in rows],
                    caption="… elsewhere, and in all, without and with sequence parallelism")
    return "\n\n".join([head, params, step, region, rest]) + "\n"


# -- the input gradient's all-reduce behind the weight gradient --------------------------------------------------------
def _is_input_gradient(tag: str) -> bool:
    """A column layer's input-gradient collective: f's backward all-reduce (the synchronous path) or the one the
    column layer starts itself (the async path)."""
    return tag == "f backward" or tag.endswith(" input gradient")


def _column_weights(model: TensorParallelGPT) -> dict:
    """Each column-parallel weight, and the name its layer goes by in the timeline (the tied head: "lm_head")."""
    weights = {m.weight: m.name for m in model.modules() if isinstance(m, ColumnParallelLinear)}
    if model.tied:
        weights[model.wte.weight] = "lm_head"
    return weights


def mark_column_matmuls(loss: torch.Tensor, weights: dict) -> None:
    """On the synchronous path autograd computes a column layer's two backward matmuls, dL/dx and dL/dW, in one
    node (F.linear's AddmmBackward0 or MmBackward0); f's all-reduce follows, in a node of its own. Announce each
    such node of `loss`'s graph to the timeline as "backward {layer} input + weight gradients" (the async path
    announces its weight-gradient matmul itself). The hooks go with the graph."""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nexts = [n for n, _ in node.next_functions if n is not None]
        todo.extend(nexts)
        if node.name() not in ("AddmmBackward0", "MmBackward0"):
            continue
        for n in nexts:  # the weight enters F.linear transposed: node -> TBackward0 -> AccumulateGrad(weight)
            leaves = [m for m, _ in n.next_functions if m is not None] if n.name() == "TBackward0" else []
            layer = next((weights[m.variable] for m in leaves if hasattr(m, "variable") and m.variable in weights),
                         None)
            if layer is not None:
                label = f"backward {layer} input + weight gradients"
                node.register_prehook(lambda grads, label=label: events.emit(events.COMPUTE_BEGIN, label))
                node.register_hook(lambda inputs, outputs, label=label: events.emit(events.COMPUTE_END, label))


def overlap_measure(config: GPTConfig = OVERLAP_CONFIG, b: int = OVERLAP_BATCH, reps: int = OVERLAP_REPS) -> dict:
    """On each rank of a tensor-parallel group of every rank: one TensorParallelGPT per path, from the same TinyGPT;
    reps + 1 backward passes of each (the paths taking turns to go first; the first pass warms up), each recorded on
    a Timeline: its spans, its wall time. The paths' gradients, compared bit for bit."""
    group = _named_group("tp")
    x, y = gpt_batch(config, 0, b)
    models = {path: TensorParallelGPT.from_gpt(TinyGPT(config, seed=0), group=group, async_grad_allreduce=a)
              for path, a in PATHS.items()}
    weights = _column_weights(models["synchronous"])
    out, grads = {path: [] for path in PATHS}, {}
    for rep in range(reps + 1):
        for path in list(PATHS)[:: 1 if rep % 2 else -1]:
            model = models[path]
            loss = model(x, y)
            if not PATHS[path]:
                mark_column_matmuls(loss, weights)
            with Timeline() as tl:
                t0 = time.perf_counter()
                with tl.span("backward"):
                    loss.backward()
                wall = time.perf_counter() - t0
            if rep == 0:
                grads[path] = {k: p.grad.clone() for k, p in model.named_parameters()}
            else:
                out[path].append({"wall": wall, "spans": tl.spans()})
            model.zero_grad(set_to_none=True)
    sync, asynchronous = grads["synchronous"], grads["async_grad_allreduce"]
    out["grad_diff"] = max((sync[k] - asynchronous[k]).abs().max().item() for k in sync)
    out["grads_identical"] = all(torch.equal(sync[k], asynchronous[k]) for k in sync)
    return out


def input_gradient_collectives(spans: list[Span]) -> list[tuple[Span, Span | None]]:
    """Each input-gradient collective (in a TP backward, every collective is one) and the wait for it, if the rank
    waited: the k-th wait with a tag is for the k-th collective with that tag. The collective's end is clipped to
    its wait's: its work was done when the wait returned (the completion stamp comes from a callback on gloo's
    thread, which can run late on a busy machine)."""
    collectives = [s for s in spans if s.lane not in ("compute", "wait") and _is_input_gradient(s.name)]
    waits = [s for s in spans if s.lane == "wait" and _is_input_gradient(s.name)]
    out, seen = [], defaultdict(int)
    for c in collectives:
        tagged = [w for w in waits if w.name == c.name]
        k, seen[c.name] = seen[c.name], seen[c.name] + 1
        w = tagged[k] if k < len(tagged) else None
        out.append((c._replace(end=min(c.end, w.end)) if w is not None else c, w))
    return out


def blocked_spans(spans: list[Span]) -> list[Span]:
    """When the rank was held by an input-gradient collective: inside the call that issued it (until the rank
    went on to a matmul or to the wait; gloo's call can take as long as the collective itself when the rank's
    threads outnumber its cores), and in its wait. Lane "wait", named after the collective."""
    starts = sorted(m.start for _, m in matmul_spans(spans))
    out = []
    for c, w in input_gradient_collectives(spans):
        returned = min([w.start if w is not None else c.end] + [t for t in starts if t >= c.start])
        out.append(Span("wait", c.name, c.start, max(c.start, returned)))
        if w is not None:
            out.append(w)
    return out


def matmul_spans(spans: list[Span]) -> list[tuple[str, Span]]:
    """(layer, span) for each column layer's announced backward matmul, in time order (a span the timeline cut in
    two, around a wait, is one span here)."""
    out = []
    for s in spans:
        if s.lane != "compute":
            continue
        for suffix in (" weight gradient", " input + weight gradients"):
            if s.name.endswith(suffix):
                layer = s.name[len("backward "): -len(suffix)]
                if out and out[-1][0] == layer and out[-1][1].name == s.name:
                    out[-1] = (layer, out[-1][1]._replace(end=s.end))
                else:
                    out.append((layer, s))
    return out


def overlap_order(spans: list[Span]) -> dict[str, str | None]:
    """Per column layer: the input-gradient collective that was on its way through the whole of the layer's
    backward matmul -- issued before the matmul started, waited for only after it ended -- or None."""
    pairs = input_gradient_collectives(spans)
    out = {}
    for layer, m in matmul_spans(spans):
        out[layer] = next((c.name for c, w in pairs if c.start <= m.start and (w.end if w else c.end) >= m.end),
                          None)
    return out


def overlap_stats(spans: list[Span], wall: float) -> dict:
    """One recorded backward: its wall time, the column layers' announced matmuls, the input gradients'
    collectives from issue to completion (their union), the time the rank was held by them (blocked_spans), and
    the share of their time during which it was not (hidden_fraction, the call counted as waiting)."""
    comm_spans = [c for c, _ in input_gradient_collectives(spans)] + blocked_spans(spans)
    return {"backward": wall, "matmuls": sum(m.end - m.start for _, m in matmul_spans(spans)),
            "all_reduce": lane_time(comm_spans, "all_reduce"), "blocked": lane_time(comm_spans, "wait"),
            "hidden": hidden_fraction(comm_spans)}


def overlap_results(config: GPTConfig = OVERLAP_CONFIG, b: int = OVERLAP_BATCH, reps: int = OVERLAP_REPS) -> dict:
    """Per path, rank 0's: the median of each of overlap_stats over the repetitions; the repetition of median
    backward time, to draw: its spans, its own overlap_stats ("drawn") and its overlap_order. The paths' gradients
    must be the same bits."""
    res = launch(overlap_measure, world_size=2, kwargs=dict(config=config, b=b, reps=reps), device="cpu")
    for rank, r in enumerate(res):
        if not r["grads_identical"]:
            raise AssertionError(f"rank {rank}: the synchronous and the async_grad_allreduce paths give different "
                                 f"gradients (largest difference {r['grad_diff']:.3g})")
    out = {}
    for path in PATHS:
        recorded = res[0][path]
        stats = [overlap_stats(r["spans"], r["wall"]) for r in recorded]
        median = sorted(range(len(recorded)), key=lambda k: stats[k]["backward"])[len(recorded) // 2]
        out[path] = {k: statistics.median(s[k] for s in stats) for k in stats[0]} | {
            "spans": recorded[median]["spans"], "drawn": stats[median],
            "order": overlap_order(recorded[median]["spans"]), "reps": len(recorded)}
    return out


def overlap_table(results: dict, config: GPTConfig = OVERLAP_CONFIG, b: int = OVERLAP_BATCH) -> str:
    n = b * config.block_size
    reps = next(iter(results.values()))["reps"]
    head = (f"**The input gradient's all-reduce behind the weight gradient**: t = 2 CPU ranks over gloo, TinyGPT "
            f"({config.n_layer} blocks, h = {config.n_embd}, {config.n_head} heads, vocabulary {config.vocab_size}), "
            f"b = {b}, s = {config.block_size} ({n:,} tokens), fp32; one backward on rank 0, the median of {reps} "
            f"after one to warm up. Each of the {2 * config.n_layer + 1} column layers (each block's qkv and fc, the "
            f"tied head) all-reduces an input gradient of {fmt_bytes(n * config.n_embd * 4)}. Column-layer matmuls: "
            f"the async path's weight-gradient matmuls; on the synchronous path, the autograd nodes that compute "
            f"dL/dx and dL/dW together. All-reduces: from issue to completion. Blocked: inside an all-reduce's call "
            f"or its wait. Hidden: the share of the all-reduces' time during which the rank was not blocked "
            f"(hidden_fraction). Both paths give the same gradients, bit for bit (checked).\n\n"
            "| path | backward | column-layer matmuls | input-gradient all-reduces | blocked | hidden |\n"
            "|---|---|---|---|---|---|\n")
    lines = [f"| {path} | {r['backward'] * 1e3:.1f} ms | {r['matmuls'] * 1e3:.1f} ms | "
             f"{r['all_reduce'] * 1e3:.1f} ms | {r['blocked'] * 1e3:.1f} ms | {100 * r['hidden']:.0f}% |"
             for path, r in results.items()]
    return head + "\n".join(lines) + "\n"


def _short(layer: str) -> str:
    """"blocks.1.attn.qkv" -> "qkv 1", "blocks.0.fc" -> "fc 0", "lm_head" -> "head"."""
    if layer == "lm_head":
        return "head"
    parts = layer.split(".")
    return f"{parts[-1]} {parts[1]}" if parts[0] == "blocks" else layer


@style.charts
def plot_overlap(results: dict, path: str) -> None:
    """The two paths' backward of median time, one above the other on one time axis (rank 0): a compute row (the
    column layers' matmuls labelled with their layer, the rest of backward grey, the time held by an all-reduce
    hatched) and a row for the input gradients' all-reduces, each labelled with its layer."""
    from matplotlib.patches import Patch

    other, matmul, reduce_ = style.FILLS["grey"], style.FILLS["orange"], style.FILLS["purple"]
    fig, axes = style.figure(5.0, len(PATHS), 1, sharex=True, squeeze=False)
    axes = axes[:, 0]
    longest = max(max(s.end for s in results[p]["spans"]) - min(s.start for s in results[p]["spans"]) for p in PATHS)
    for ax, name in zip(axes, PATHS):
        r = results[name]["drawn"]
        spans = results[name]["spans"]
        matmuls = matmul_spans(spans)
        origin = min(s.start for s in spans)

        def ms(s, origin=origin):
            return (s.start - origin) * 1e3, (s.end - s.start) * 1e3

        for s in spans:
            if s.lane == "compute":
                color = matmul if s.name.endswith(("weight gradient", "weight gradients")) else other
                ax.broken_barh([ms(s)], (1.4, 0.8), facecolors=color, edgecolor="none")
        for s in blocked_spans(spans):  # (over the compute row: the timeline's "backward" runs on through a call)
            ax.broken_barh([ms(s)], (1.4, 0.8), facecolors=other, edgecolor=style.MUTED, hatch="////", linewidth=0.5)
        for layer, m in matmuls:  # the layer's name above its matmul
            left, width = ms(m)
            ax.text(left + width / 2, 2.25, _short(layer), ha="center", va="bottom", fontsize=10)
        reduces = [c for c, _ in input_gradient_collectives(spans)]
        for k, s in enumerate(reduces):  # ... and below its input gradient's all-reduce
            left, width = ms(s)
            ax.broken_barh([(left, width)], (0.5, 0.8), facecolors=reduce_, edgecolor="none")
            # the k-th all-reduce is the k-th column layer's input gradient (both paths go layer by layer)
            label = _short(matmuls[k][0]) if k < len(matmuls) else ""
            ax.text(left + width / 2, 0.45, label, ha="center", va="top", fontsize=10, color=style.LINES["purple"])
        ax.set_yticks([0.9, 1.8], ["all-reduce", "compute"])
        ax.tick_params(axis="y", length=0)
        ax.set_ylim(-0.2, 2.8)
        ax.set_xlim(0, longest * 1e3 * 1.01)
        ax.set_title(f"{name}: backward {r['backward'] * 1e3:.0f} ms, {100 * r['hidden']:.0f}% of the input-gradient "
                     f"all-reduces hidden", fontsize=10, loc="left")
    axes[-1].set_xlabel("ms since backward began (rank 0 of t = 2 CPU ranks over gloo)")
    handles = [Patch(color=matmul, label="column layer's matmuls: dL/dx + dL/dW (sync), dL/dW (async)"),
               Patch(color=other, label="rest of backward"),
               Patch(color=reduce_, label="the input gradient's all-reduce"),
               Patch(facecolor=other, edgecolor=style.MUTED, hatch="////", label="in the all-reduce's call or wait")]
    fig.legend(handles=handles, loc="outside lower center", ncol=1)
    style.save(fig, path)


# -- pipeline parallelism ----------------------------------------------------------------------------------------------
def _build_pipeline(schedule: str, config: GPTConfig, batch: int, m: int, group=None, compute_time=None, v=None):
    """This rank's stage modules (a ModuleList: a parameter two of them share is listed once) and the schedule."""
    cls, default_v = SCHEDULES[schedule]
    v = default_v if v is None else v
    p, r = comm.world_size(group), comm.rank(group)
    indices = stages_of_rank(r, p, v)
    modules = nn.ModuleList(split_gpt(TinyGPT(config, seed=0), p * v, indices))
    shape = (batch // m, config.block_size, config.n_embd)
    stages = [PipelineStage(mod, s, p * v, group=group, activation_shape=shape) for mod, s in zip(modules, indices)]
    return modules, cls(stages if v > 1 else stages[0], m, loss_fn=gpt_loss, compute_time=compute_time)


def pp_measure(config: GPTConfig = PP_CONFIG, batch: int = PP_BATCH, m: int = PP_MICRO,
               compute_time: tuple[float, float] = COMPUTE_TIME) -> dict:
    """On each rank, per schedule: a timeline of one step under compute_time (after a step that connects the
    ranks), the activation bytes at their peak in a step, the bytes sent in a step."""
    x, y = gpt_batch(config, 0, batch)
    out = {}
    for name, (_, v) in SCHEDULES.items():
        modules, schedule = _build_pipeline(name, config, batch, m)
        schedule.step(x, target=y)  # the first messages between two ranks also connect them
        modules.zero_grad()
        schedule.compute_time = (compute_time[0] / v, compute_time[1] / v)
        with Timeline() as tl:
            schedule.step(x, target=y)
        modules.zero_grad()
        schedule.compute_time = None
        meter = MemoryMeter(modules)
        meter.reset_peak()
        with meter:
            schedule.step(x, target=y)
        meter.close()
        modules.zero_grad()
        with comm.counting() as counter:
            schedule.step(x, target=y)
        out[name] = {"spans": tl.spans(), "activation_peak": meter.category_peak["other"],
                     "sent": counter.bytes["send"], "stages": stages_of_rank(comm.rank(), comm.world_size(), v)}
    return out


def predicted_in_flight(schedule: str, r: int, p: int, m: int) -> int:
    """The most micro-batches (pieces of micro-batches through one of its stages, interleaved) rank r holds."""
    v = SCHEDULES[schedule][1]
    if schedule == "GPipe":
        return m
    if v == 1:
        return min(p - r, m)
    return min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)


def pp_sent_formula(config: GPTConfig, batch: int, m: int, p: int, v: int, r: int) -> int:
    """Bytes rank r sends in a step: each micro-batch's activation across each boundary after one of its stages,
    its gradient across each boundary before one; and at either end of the pipeline, the tied embedding's
    gradient to the other end."""
    stages = stages_of_rank(r, p, v)
    message = 4 * (batch // m) * config.block_size * config.n_embd
    crossings = sum((s < p * v - 1) + (s > 0) for s in stages)
    ends = (r == 0) + (r == p - 1) if p > 1 else 0
    return crossings * m * message + ends * config.vocab_size * config.n_embd * 4


def pp_results(p: int = PP_RANKS, config: GPTConfig = PP_CONFIG, batch: int = PP_BATCH, m: int = PP_MICRO,
               compute_time: tuple[float, float] = COMPUTE_TIME) -> dict:
    res = launch(pp_measure, world_size=p, kwargs=dict(config=config, batch=batch, m=m, compute_time=compute_time),
                 device="cpu")
    out = {}
    for name, (_, v) in SCHEDULES.items():
        timelines = [r[name]["spans"] for r in res]
        out[name] = {"v": v, "timelines": timelines, "bubbles": bubble_fractions(timelines),
                     "formula": bubble_formula(p, m, v),
                     "in_flight": [in_flight_peak(s) for s in timelines],
                     "in_flight_predicted": [predicted_in_flight(name, r, p, m) for r in range(p)],
                     "activation_peak": [r[name]["activation_peak"] for r in res],
                     "sent": [r[name]["sent"] for r in res],
                     "sent_formula": [pp_sent_formula(config, batch, m, p, v, r) for r in range(p)]}
    return out


def _extent(timelines) -> tuple[float, float]:
    """When the pipeline's first action began and its last ended, on any rank."""
    actions = [a for spans in timelines for a in pipeline_actions(spans)]
    return min(s for _, s, _ in actions), max(e for _, _, e in actions)


def pp_table(results: dict, p: int = PP_RANKS, m: int = PP_MICRO, config: GPTConfig = PP_CONFIG,
             batch: int = PP_BATCH, compute_time: tuple[float, float] = COMPUTE_TIME) -> str:
    head = (f"**Pipeline schedules**, p = {p} ranks, m = {m} micro-batches of {batch // m} sequences, TinyGPT of "
            f"{config.n_layer} blocks (h = {config.n_embd}); every forward of a stage made to last "
            f"{compute_time[0] * 1e3:.0f} ms and every backward {compute_time[1] * 1e3:.0f} ms (÷ v for the "
            f"interleaved schedule's v stages per rank); the bubble: each rank's idle share of the step")
    rows = []
    for name, r in results.items():
        b, v = r["bubbles"], r["v"]
        start, end = _extent(r["timelines"])
        ideal = (v * m + p - 1) * sum(compute_time) / v
        rows.append([name, v, f"{statistics.mean(b):.3f} ({min(b):.3f} – {max(b):.3f})", f"{r['formula']:.3f}",
                     f"{(end - start) * 1e3:.0f} ms", f"{ideal * 1e3:.0f} ms"])
    per_rank = {name: [[k, r["in_flight"][k], r["in_flight_predicted"][k], f"{r['activation_peak'][k]:,}",
                        f"{r['sent'][k]:,.0f}", f"{r['sent_formula'][k]:,}"] for k in range(p)]
                for name, r in results.items()}
    return pp_layout(head, rows, per_rank)


def pp_layout(head: str, rows: list[list], per_rank: dict[str, list[list]]) -> str:
    """The schedules side by side, then a tab per schedule with a row per rank (seven columns in one table
    would scroll sideways in the docs' column, md_table)."""
    schedules = md_table(["schedule", "v", "bubble: mean over ranks (min – max)", "formula (p−1)/(v·m+p−1)", "step",
                          "ideal step (v·m+p−1)(t_f+t_b)/v"], rows)
    text = ("**Per rank**, a tab per schedule: micro-batches in flight at the peak (measured on the timeline; "
            "predicted by the order: GPipe m, 1F1B p − r, interleaved 2(p−r−1) + (v−1)p + 1 pieces of 1/v "
            "stage), activation bytes at their peak (MemoryMeter, one step), bytes sent in a step (counted; "
            "formula: an activation per micro-batch across each boundary after the rank's stages, a gradient "
            "across each before, the tied embedding's gradient at either end)")
    tabs = md_tabs([(name, md_table(["rank", "in flight", "predicted", "activation peak", "bytes sent", "formula"],
                                    cells)) for name, cells in per_rank.items()])
    return "\n\n".join([head, schedules, text, tabs]) + "\n"


FORWARD_COLORS = (style.FILLS["blue"], style.LINES["blue"])       # forward through a rank's first stage, its second
BACKWARD_COLORS = (style.FILLS["orange"], style.LINES["orange"])  # the same, backward (interleaved 1F1B)


@style.charts
def plot_gantt(results: dict, path: str, p: int = PP_RANKS, m: int = PP_MICRO) -> None:
    """The schedules' timelines stacked, one panel each, on one time axis: a row per rank, a box per action,
    forwards blue and backwards orange (darker: the rank's second stage), each labelled with its micro-batch
    where the number fits in the box; empty space is the bubble."""
    from matplotlib.patches import Patch

    fig, axes = style.figure(1.0 + 1.9 * len(results), len(results), 1, sharex=True, squeeze=False)
    axes = axes[:, 0]
    longest = max(end - start for start, end in (_extent(r["timelines"]) for r in results.values()))
    labels = []  # (ax, x, y, width in ms, micro-batch): written once the layout says how wide a millisecond is
    for ax, (name, r) in zip(axes, results.items()):
        timelines = r["timelines"]
        origin, _ = _extent(timelines)
        for rank, spans in enumerate(timelines):
            y = p - 1 - rank
            for action, start, end in pipeline_actions(spans):
                chunk = action.stage // p
                color = (FORWARD_COLORS if action.kind == "F" else BACKWARD_COLORS)[chunk]
                left, width = (start - origin) * 1e3, (end - start) * 1e3
                ax.broken_barh([(left, width)], (y + 0.08, 0.84), facecolors=color, edgecolor="white", linewidth=0.6)
                labels.append((ax, left + width / 2, y + 0.5, width, str(action.microbatch)))
        ax.set_yticks([p - 1 - k + 0.5 for k in range(p)], [f"rank {k}" for k in range(p)])
        ax.tick_params(axis="y", length=0)
        ax.set_ylim(0, p)
        ax.set_xlim(0, longest * 1e3 * 1.01)
        ax.set_title(f"{name} (v = {r['v']}): bubble {statistics.mean(r['bubbles']):.3f} measured, "
                     f"{r['formula']:.3f} by the formula", fontsize=10, loc="left")
    axes[-1].set_xlabel(f"ms since the step began (p = {p}, m = {m}; in a box: its micro-batch)")
    handles = [Patch(color=FORWARD_COLORS[0], label="forward"), Patch(color=BACKWARD_COLORS[0], label="backward"),
               Patch(color=FORWARD_COLORS[1], label="forward, 2nd stage (v = 2)"),
               Patch(color=BACKWARD_COLORS[1], label="backward, 2nd stage")]
    fig.legend(handles=handles, loc="outside lower center", ncol=2)
    fig.canvas.draw()
    fig.set_layout_engine("none")  # the layout is final: the labels inside the boxes must not move it
    points_per_ms = axes[0].get_window_extent().width * 72 / fig.dpi / (longest * 1e3 * 1.01)
    for ax, x, y, width, label in labels:
        if width * points_per_ms >= 0.65 * style.MIN_FONT_PT * len(label) + 2:  # only where the number fits
            ax.text(x, y, label, ha="center", va="center", fontsize=10, color=style.INK)
    style.save(fig, path)


# -- the parallelisms side by side -------------------------------------------------------------------------------------
def stage_params(config: GPTConfig, r: int, p: int) -> int:
    """Parameters of stage r of p (one stage per rank), from the whole model's names: its blocks; the
    embeddings on the first; ln_f and the head (a copy of the tied embedding) on the last."""
    named = dict(TinyGPT(config, seed=0).named_parameters())
    per = config.n_layer // p
    mine = {f"blocks.{i}." for i in range(r * per, (r + 1) * per)}
    n = sum(q.numel() for k, q in named.items() if any(k.startswith(b) for b in mine))
    if r == 0:
        n += named["wte.weight"].numel() + named["wpe.weight"].numel()
    if r == p - 1:
        n += sum(q.numel() for k, q in named.items() if k.startswith("ln_f"))
        if p > 1 or not config.tie_weights:
            n += config.vocab_size * config.n_embd  # the head: the tied embedding's copy (or its own weight)
    return n


class _Contender:
    """One way of training the model on 4 ranks: its modules and optimizer, a step, and what it should hold."""

    def __init__(self, name: str, config: GPTConfig, batch: int, groups: dict):
        self.name, self.config, self.batch = name, config, batch
        self.unsharded, self.inner, self.schedule = [], None, None
        gpt = TinyGPT(config, seed=0)
        split, replicated = split_and_replicated(config)
        if name in ("DDP", "FSDP"):
            dp = groups["dp"]
            d = comm.world_size(dp)
            self.rows = self._slice(comm.rank(dp), d)
            if name == "DDP":
                self.model = DistributedDataParallel(gpt, process_group=dp)
                self.theory = ADAMW_BYTES * (split + replicated)
            else:
                self.model = FullyShardedDataParallel(gpt, process_group=dp, auto_wrap_policy=ModuleWrapPolicy({Block}))
                self.unsharded = [flat._full for unit in self.model.units() for flat in unit.flat_params]
                self.theory = ADAMW_BYTES * (split + replicated) / d
        elif name in ("TP + SP", "DP x TP"):
            tp = groups["tp"] if name == "TP + SP" else groups["mesh_tp"].get_group("tp")
            t = comm.world_size(tp)
            self.inner = self.model = TensorParallelGPT.from_gpt(gpt, group=tp, sequence_parallel=True)
            self.theory = ADAMW_BYTES * (split / t + replicated)
            if name == "DP x TP":
                dp = groups["mesh_tp"].get_group("dp")
                self.model = DistributedDataParallel(self.inner, process_group=dp)
                self.rows = self._slice(comm.rank(dp), 2)
            else:
                self.rows = slice(0, batch)
        else:  # the pipelines
            if name == "PP 1F1B":
                pp, self.dp, m, d = groups["pp"], None, 8, 1
            else:
                mesh = groups["mesh_pp"]
                pp, self.dp, m, d = mesh.get_group("pp"), mesh.get_group("dp"), 4, 2
            self.model, self.schedule = _build_pipeline("1F1B", config, batch // d, m, group=pp)
            self.rows = self._slice(comm.rank(self.dp), d) if self.dp is not None else slice(0, batch)
            self.theory = ADAMW_BYTES * stage_params(config, comm.rank(pp), comm.world_size(pp))
            del gpt  # (the stage modules keep the parts this rank holds)
        self.opt = OPTIMIZERS["adamw"](self.model.parameters())

    def _slice(self, replica: int, replicas: int) -> slice:
        per = self.batch // replicas
        return slice(replica * per, (replica + 1) * per)

    def step(self, i: int):
        """One training step on global batch i; returns this rank's loss (None where the rank computes none)."""
        x, y = (t[self.rows] for t in gpt_batch(self.config, i, self.batch))
        if self.schedule is not None:
            loss = self.schedule.step(x, target=y)
            if self.dp is not None:
                allreduce_gradients(self.model, group=self.dp)
        else:
            loss = self.model(x, y)
            loss.backward()
            if self.inner is not None:
                self.inner.allreduce_sequence_parallel_grads()
        self.opt.step()
        return loss


def compare_measure(config: GPTConfig = COMPARE_CONFIG, batch: int = COMPARE_BATCH, steps: int = COMPARE_STEPS,
                    contenders=CONTENDERS) -> dict:
    """On each of 4 ranks: every contender built, then stepped in turn, step by step, the first to go changing each
    step (a slow moment of the machine hits all alike). Step 0 warms up; the last is metered (the meter slows a step
    down); the others are timed, from a barrier to a barrier, and their bytes counted."""
    groups = {"dp": _named_group("dp"), "tp": _named_group("tp"), "pp": _named_group("pp"),
              "mesh_tp": init_mesh((2, 2), ("dp", "tp")), "mesh_pp": init_mesh((2, 2), ("dp", "pp"))}
    runs = {name: _Contender(name, config, batch, groups) for name in contenders}
    # AdamW's step counters: a tensor of 4 bytes per tensor it steps, beside the 16 bytes per parameter
    out = {name: {"times": [], "losses": [], "bytes": defaultdict(float), "theory": c.theory,
                  "counters": 4 * sum(len(g["params"]) for g in c.opt.param_groups)}
           for name, c in runs.items()}
    timed = range(1, steps - 1)
    names = list(runs)
    for i in range(steps):
        for name in names[i % len(names):] + names[: i % len(names)]:  # who goes first turns each step
            c, meter = runs[name], None
            if i == steps - 1:
                meter = MemoryMeter(c.model, c.opt)
                meter.watch(c.unsharded, "params")
                meter.reset_peak()
            dist.barrier()
            t0 = time.perf_counter()
            with comm.counting() as counter, (meter if meter is not None else contextlib.nullcontext()):
                loss = c.step(i)
                if meter is not None:
                    states = meter.snapshot("after the optimizer step")
                c.opt.zero_grad()
            dist.barrier()
            elapsed = time.perf_counter() - t0
            if i in timed:
                out[name]["times"].append(elapsed)
                for group, kinds in counter.by_group.items():
                    out[name]["bytes"][group] += sum(kinds.values()) / len(timed)
            if meter is not None:
                meter.close()
                out[name] |= {"peak": meter.peak, "states": states["params"] + states["grads"] + states["optim"]}
            # the global batch's loss: the mean over the ranks that computed one (each covers an equal share)
            held = torch.tensor([0.0 if loss is None else loss.item(), 0.0 if loss is None else 1.0],
                                dtype=torch.float64)
            dist.all_reduce(held)
            out[name]["losses"].append((held[0] / held[1]).item())
    for name in out:
        out[name]["bytes"] = dict(out[name]["bytes"])
    return out


def compare_results(config: GPTConfig = COMPARE_CONFIG, batch: int = COMPARE_BATCH,
                    steps: int = COMPARE_STEPS) -> dict:
    res = launch(compare_measure, world_size=4, kwargs=dict(config=config, batch=batch, steps=steps), device="cpu")
    ref_times, ref_losses = res[0]["DDP"]["times"], res[0]["DDP"]["losses"]
    out = {}
    for name in CONTENDERS:
        per_rank = [r[name] for r in res]
        ratios = [a / b for a, b in zip(per_rank[0]["times"], ref_times)]  # each over DDP's of the same step
        out[name] = {"states": max(r["states"] for r in per_rank), "theory": max(r["theory"] for r in per_rank),
                     "theory_with_counters": max(r["theory"] + r["counters"] for r in per_rank),
                     "peak": max(r["peak"] for r in per_rank),
                     "bytes": {g: max(r["bytes"].get(g, 0.0) for r in per_rank) for g in GROUPS},
                     "other_groups": sorted({g for r in per_rank for g in r["bytes"]} - set(GROUPS)),
                     "time": statistics.median(per_rank[0]["times"]),
                     "time_ratio": statistics.median(ratios),
                     "loss_diff": max(abs(a - b) for a, b in zip(per_rank[0]["losses"], ref_losses)),
                     "final_loss": per_rank[0]["losses"][-1]}
    return out


def compare_table(results: dict, config: GPTConfig = COMPARE_CONFIG, batch: int = COMPARE_BATCH,
                  steps: int = COMPARE_STEPS) -> str:
    """Memory in one table, bytes and time in another: ten columns in one would scroll sideways in the docs'
    column (md_table)."""
    psi = sum(p.numel() for p in TinyGPT(config, seed=0).parameters())
    ddp_ms = results["DDP"]["time"] * 1e3
    head = (f"**Where each wins**: GPT of {config.n_layer} blocks × {config.n_embd} ({config.n_head} heads, "
            f"vocabulary {config.vocab_size}, sequence {config.block_size}; Ψ = {psi:,}), 4 CPU ranks + gloo, "
            f"global batch {batch}, AdamW, fp32, {steps} steps; per rank, the largest over ranks; model states "
            f"after the optimizer step (theory: 16 bytes per parameter held; AdamW's step counters, 4 bytes per "
            f"tensor, aside), the peak of the last step; bytes sent "
            f"per step in each group; step time, from a barrier to a barrier: the median over steps 2 to {steps - 1} "
            f"of its ratio to DDP's in the same step (DDP's median: {ddp_ms:.0f} ms); Δloss: the largest difference "
            f"of any step's loss from DDP's (DDP's last: {results['DDP']['final_loss']:.3f})")
    return compare_layout(head, [[name, LAYOUTS[name], fmt_bytes(r["states"]), fmt_bytes(r["theory"]),
                                  fmt_bytes(r["peak"])] for name, r in results.items()],
                          [[name, *(fmt_bytes(r["bytes"][g]) if r["bytes"][g] else "–" for g in GROUPS),
                            f"{r['time_ratio']:.2f}×", f"{r['loss_diff']:.1e}"] for name, r in results.items()])


def compare_layout(head: str, memory: list[list], sent: list[list]) -> str:
    return "\n\n".join([head, md_table(["contender", "layout", "model states", "theory", "peak"], memory,
                                        caption="Memory per rank"),
                         md_table(["contender", *(f"{g} bytes" for g in GROUPS), "step time", "Δloss"], sent,
                                  caption="Bytes sent per step, step time next to DDP's, and Δloss")]) + "\n"


# -- the command -------------------------------------------------------------------------------------------------------
def _markdown_path(markdown: str | None, part: str, parts) -> str | None:
    """--markdown: a file (with one part), a directory (DIR/parallel_<part>.md) or a prefix (PREFIX_<part>.md)."""
    if not markdown:
        return None
    if os.path.isdir(markdown):
        return os.path.join(markdown, f"parallel_{part}.md")
    if markdown.endswith(".md") and len(parts) == 1:
        return markdown
    return f"{markdown.removesuffix('.md')}_{part}.md"


def _plot_path(plot: str | None, part: str, parts) -> str | None:
    """--plot, as --markdown: a file (.svg or .png, with one part that draws), a directory (DIR/tp_overlap.svg,
    DIR/pipeline_gantt.svg) or a prefix (PREFIX_<part>.svg; PREFIX.png gives PREFIX_<part>.png)."""
    if not plot:
        return None
    if os.path.isdir(plot):
        return os.path.join(plot, PLOTS[part])
    stem, ext = os.path.splitext(plot)
    if ext in (".svg", ".png") and len([p for p in parts if p in PLOTS]) == 1:
        return plot
    return f"{stem}_{part}{ext}" if ext in (".svg", ".png") else f"{plot}_{part}.svg"


def run_parallel_report(parts=PARTS, markdown: str | None = None, plot: str | None = None) -> None:
    parts = list(parts)
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}: choose from {list(PARTS)}")
    with rank_pool():  # the launches at 4 ranks share their processes
        if "tp" in parts:
            write_report(tp_table(tp_results()), _markdown_path(markdown, "tp", parts))
        if "overlap" in parts:
            results = overlap_results()
            write_report(overlap_table(results), _markdown_path(markdown, "overlap", parts))
            if plot:
                plot_overlap(results, _plot_path(plot, "overlap", parts))
                print(f"wrote {_plot_path(plot, 'overlap', parts)}")
        if "pp" in parts:
            results = pp_results()
            write_report(pp_table(results), _markdown_path(markdown, "pp", parts))
            if plot:
                plot_gantt(results, _plot_path(plot, "pp", parts))
                print(f"wrote {_plot_path(plot, 'pp', parts)}")
        if "compare" in parts:
            write_report(compare_table(compare_results()), _markdown_path(markdown, "compare", parts))
