"""Chapter 12's report, the parallelisms side by side (`python -m minifsdp parallel --parts compare`): one GPT,
4 ranks, a global batch of 16 sequences, AdamW, under DDP, FSDP, TP + SP, 1F1B, DDP x TP + SP and 1F1B x DDP, all
built in the same launch and stepped in turn, step by step: model-state bytes per rank (MemoryMeter's params + grads
+ optim after the optimizer step) against 16 bytes a parameter held, the peak of a step, the bytes sent per step in
each group, the step time as a ratio to DDP's in the same step (the median over the steps), and the largest
difference of any step's loss from DDP's.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from minifsdp.ddp import DistributedDataParallel
from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.distributed.mesh import init_mesh
from minifsdp.fsdp import FullyShardedDataParallel, ModuleWrapPolicy
from minifsdp.measure.meter import MemoryMeter
from minifsdp.models import Block, GPTConfig, TinyGPT, gpt_batch
from minifsdp.parallel import TensorParallelGPT
from minifsdp.parallel.compose import allreduce_gradients
from minifsdp.reports.format import fmt_bytes, md_table
from minifsdp.reports.parallel.pp import build_pipeline
from minifsdp.reports.parallel.tp import named_group, split_and_replicated
from minifsdp.train import OPTIMIZERS

# the side-by-side comparison
COMPARE_CONFIG = GPTConfig(n_layer=8, n_embd=128, n_head=8, vocab_size=256, block_size=64)
COMPARE_BATCH, COMPARE_STEPS = 16, 16  # step 0 warms up, the last is metered, the others are timed
CONTENDERS = ("DDP", "FSDP", "TP + SP", "PP 1F1B", "DP x TP", "PP x DP")
LAYOUTS = {"DDP": "d = 4", "FSDP": "d = 4, a unit per block", "TP + SP": "t = 4", "PP 1F1B": "p = 4, m = 8",
           "DP x TP": "d = 2 x t = 2 (SP)", "PP x DP": "p = 2 (m = 4) x d = 2"}
GROUPS = ("dp", "tp", "pp")
ADAMW_BYTES = 16  # fp32 AdamW: parameter 4, gradient 4, two moments 8 (SPEC, "Measurement definitions")


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
            self.model, self.schedule = build_pipeline("1F1B", config, batch // d, m, group=pp)
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
    groups = {"dp": named_group("dp"), "tp": named_group("tp"), "pp": named_group("pp"),
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

