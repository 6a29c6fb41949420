"""Chapter 13: each strategy's step as a program, and the step time predicted from it.

The programs follow minifsdp's issue order: FSDP's from chapter 7 (the unit's forward, `pre_backward`,
`_before_concat`, `post_backward`; HSDP's all-reduce across replicas after each reduce-scatter), DDP's buckets as
backward fills them, ZeRO-1 and ZeRO-2's reduce-scatters and their all-gather after the optimizer step.
`predict` simulates them (program.py) and reports the step time, tokens/s/GPU, MFU and the communication left
exposed; `hiding_threshold`, the fewest tokens per GPU at which communication still hides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from minifsdp.measure.analytic import mixed_precision_adam, model_state_bytes
from minifsdp.measure.step_time.cluster import Cluster, Group
from minifsdp.measure.step_time.program import Collective, Compute, Simulated, Wait, simulate
from minifsdp.measure.step_time.transformer import Transformer

ADAM_BYTES_PER_PARAM = 28  # fp32 AdamW reads param, grad, two moments (16 B) and writes param and moments (12 B)


@dataclass(frozen=True)
class Run:
    """What one GPU does in a step."""
    seq_len: int = 4096
    micro_batch: float = 1          # sequences per GPU per micro-step
    grad_accum: int = 1             # micro-steps per optimizer step
    ac: str = "none"                # activation checkpointing (Transformer.recomputed_forward_flops)
    param_bytes: int = 2            # bytes per parameter as all-gathered (bf16)
    grad_bytes: int = 4             # bytes per gradient element as reduced (fp32, torch's usual reduce_dtype)
    forward_prefetch: bool = True   # on a GPU the CPU runs ahead: FSDP's implicit prefetch looks like this
    backward_prefetch: str | None = "pre"  # "pre" (BACKWARD_PRE), "post" (BACKWARD_POST) or None
    sync_each_microbatch: bool = False  # else no_sync() for all micro-steps but the last (FSDP still gathers)
    bucket_mb: float = 25.0         # DDP's gradient buckets (torch's bucket_cap_mb)
    zero_bucket: float = 5e8        # ZeRO-1/2's buckets, in elements (DeepSpeed's reduce/allgather_bucket_size)

    @property
    def tokens(self) -> float:
        """Tokens per GPU per micro-step."""
        return self.seq_len * self.micro_batch


@dataclass(frozen=True)
class Unit:
    """An FSDP unit: its parameters and its compute, split where nested units interrupt it (the root's
    forward runs the embedding, then the blocks, then the head)."""
    name: str
    params: int
    forward: tuple[float, ...]   # seconds of each forward segment (the root: before and after the blocks)
    backward: tuple[float, ...]  # ... and backward (the root: the head first, the embedding last)


def units(model: Transformer, cluster: Cluster, run: Run) -> list[Unit]:
    """The root and one unit per block, with their compute at this run's tokens (blocks as FSDP units, the
    wrap policy of chapters 6-7 and of torchtitan and llm-foundry)."""
    rate = cluster.gpu.peak_flops * cluster.gpu.efficiency
    t = run.tokens
    f = model.block_forward_flops(run.seq_len) * t / rate
    r = model.recomputed_forward_flops(run.seq_len, run.ac) * t / rate
    head = model.head_forward_flops() * t / rate
    root = Unit("(root)", model.root_params(run.seq_len), (0.0, head), (2 * head, 0.0))
    return [root] + [Unit(f"blocks.{i}", model.block_params(), (f,), (2 * f + r,)) for i in range(model.layers)]


def optimizer_seconds(local_params: float, cluster: Cluster) -> float:
    return ADAM_BYTES_PER_PARAM * local_params / cluster.gpu.hbm_bw


# --8<-- [start:fsdp_program]
def fsdp_program(unit_list: list[Unit], ag, rs, forward_prefetch: bool = True,
                 backward_prefetch="pre", reduce: bool = True,
                 hsdp_ar=None) -> list:
    """One micro-step of minifsdp's FullyShardedDataParallel (reshard after
    forward), in its issue order: `ag(unit)` and `rs(unit)` give a collective's
    seconds; `hsdp_ar(unit)`, if given, the all-reduce of the gradient shard
    across replicas that HYBRID_SHARD issues once the reduce-scatter is done.
    reduce=False: inside no_sync(), nothing is reduced (the gathers still
    happen)."""
    root, blocks = unit_list[0], unit_list[1:]
    prog, issued = [], set()

    def gather(u, phase):
        if (u.name, phase) not in issued:
            issued.add((u.name, phase))
            prog.append(Collective(f"{phase} all_gather {u.name}",
                                   "all_gather", "shard", ag(u)))

    # forward: the root gathers itself (and with forward_prefetch, blocks.0),
    # computes the embedding; each block issues its own all-gather unless a
    # prefetch did, then the next one's, then waits for its own
    gather(root, "forward")
    if forward_prefetch and blocks:
        gather(blocks[0], "forward")
    prog += [Wait(f"forward all_gather {root.name}"),
             Compute(f"forward {root.name}", root.forward[0])]
    for i, u in enumerate(blocks):
        gather(u, "forward")
        if forward_prefetch and i + 1 < len(blocks):
            gather(blocks[i + 1], "forward")
        prog += [Wait(f"forward all_gather {u.name}"),
                 Compute(f"forward {u.name}", u.forward[0])]
    # the head; the root keeps its parameters
    prog.append(Compute(f"forward {root.name}", root.forward[1]))

    # backward: the root's head first (its parameters are still there); then
    # each block, last to first
    pending = []

    def reduce_scatter(u):
        tag = f"reduce_scatter {u.name}"
        prog.append(Collective(tag, "reduce_scatter", "shard", rs(u)))
        # HYBRID_SHARD: then average the shard across the replicas
        if hsdp_ar is not None:
            prog.append(Collective(f"all_reduce {u.name}", "all_reduce",
                                   "replicate", hsdp_ar(u), after=(tag,)))
            tag = f"all_reduce {u.name}"
        pending.append(tag)

    # _before_concat: the earlier units' reductions are waited for, their
    # gradients freed
    def before_concat():
        prog.extend(Wait(t) for t in pending)
        pending.clear()

    if backward_prefetch == "pre" and blocks:
        gather(blocks[-1], "backward")
    prog.append(Compute(f"backward {root.name}", root.backward[0]))
    for i in range(len(blocks) - 1, -1, -1):
        u = blocks[i]
        # pre_backward: our own all-gather ...
        gather(u, "backward")
        if backward_prefetch == "pre" and i > 0:
            # ... then BACKWARD_PRE's prefetch
            gather(blocks[i - 1], "backward")
        prog += [Wait(f"backward all_gather {u.name}"),
                 Compute(f"backward {u.name}", u.backward[0])]
        before_concat()
        # post_backward: BACKWARD_POST's prefetch ...
        if backward_prefetch == "post" and i > 0:
            gather(blocks[i - 1], "backward")
        if reduce:
            # ... ahead of our reduce-scatter
            reduce_scatter(u)
    # the embedding's gradient
    prog.append(Compute(f"backward {root.name}", root.backward[1]))
    before_concat()
    if reduce:
        reduce_scatter(root)
    prog.extend(Wait(t) for t in pending)  # finish_backward
    return prog
# --8<-- [end:fsdp_program]


def _buckets(unit_list: list[Unit], bytes_per_param: float, cap: float):
    """Gradient buckets in the order backward fills them (the head's, the blocks' last to first, the
    embedding's): yields (unit after whose backward the bucket is complete, bucket bytes)."""
    order = [(unit_list[0].name + " head", unit_list[0].params / 2)] + \
        [(u.name, u.params) for u in reversed(unit_list[1:])] + [(unit_list[0].name, unit_list[0].params / 2)]
    filled = 0.0
    for name, params in order:
        filled += params * bytes_per_param
        while filled >= cap:
            yield name, cap
            filled -= cap
    if filled > 0:
        yield order[-1][0], filled


def data_parallel_program(strategy: str, unit_list: list[Unit], grad_collective, param_collective,
                          optimizer: float, bytes_per_param: float, cap: float, reduce: bool = True) -> list:
    """DDP, ZeRO-1 and ZeRO-2 (minifsdp's DDP, FlatOSS and FlatShardedDataParallel): forward without any
    communication; backward with the gradient buckets' all-reduces (DDP) or reduce-scatters (ZeRO-2) issued as
    each fills, or none (ZeRO-1, which reduce-scatters in step()); the optimizer; then ZeRO's all-gather of
    the updated parameters, which nothing overlaps. reduce=False: a no_sync() micro-step."""
    root, blocks = unit_list[0], unit_list[1:]
    prog = [Compute(f"forward {root.name}", root.forward[0])]
    prog += [Compute(f"forward {u.name}", u.forward[0]) for u in blocks]
    prog.append(Compute(f"forward {root.name}", root.forward[1]))
    buckets = list(_buckets(unit_list, bytes_per_param, cap)) if reduce else []
    kind = "all_reduce" if strategy == "ddp" else "reduce_scatter"
    issued = []

    def issue(after_unit):  # the buckets that this unit's gradients complete (buckets fill in order)
        while strategy != "zero1" and len(issued) < len(buckets) and buckets[len(issued)][0] == after_unit:
            k = len(issued)
            issued.append(k)
            prog.append(Collective(f"{kind} bucket {k}", kind, "world", grad_collective(kind, buckets[k][1])))

    prog.append(Compute(f"backward {root.name}", root.backward[0]))
    issue(root.name + " head")
    for u in reversed(blocks):
        prog.append(Compute(f"backward {u.name}", u.backward[0]))
        issue(u.name)
    prog.append(Compute(f"backward {root.name}", root.backward[1]))
    issue(root.name)
    if not reduce:
        return prog
    if strategy == "zero1":  # FlatOSS.step(): reduce-scatter every bucket, then step
        for k, (_, nbytes) in enumerate(buckets):
            prog.append(Collective(f"{kind} bucket {k}", kind, "world", grad_collective(kind, nbytes)))
            issued.append(k)
    prog.extend(Wait(f"{kind} bucket {k}") for k in issued)
    prog.append(Compute("optimizer", optimizer))
    if strategy in ("zero1", "zero2"):  # the owners' updated slices go back to everyone
        for k, (_, nbytes) in enumerate(buckets):
            prog.append(Collective(f"all_gather bucket {k}", "all_gather", "world", param_collective(nbytes)))
        prog.extend(Wait(f"all_gather bucket {k}") for k in range(len(buckets)))
    return prog


STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
STRATEGY_NAMES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "FSDP FULL_SHARD",
                  "hsdp": "HSDP (shard in node)"}


def programs(strategy: str, model: Transformer, cluster: Cluster, run: Run) -> tuple[list, list]:
    """(a no_sync micro-step, the last micro-step with the optimizer) of `strategy` on `cluster`."""
    us = units(model, cluster, run)
    n, g = cluster.world, cluster.gpus_per_node
    world = Group(n, g)
    if strategy in ("fsdp", "hsdp"):
        shard = world if strategy == "fsdp" or cluster.nodes == 1 else Group(g, g)
        replicas = Group(n // shard.size, 1) if strategy == "hsdp" and cluster.nodes > 1 else None
        ag = lambda u: cluster.collective("all_gather", u.params * run.param_bytes, shard)
        rs = lambda u: cluster.collective("reduce_scatter", u.params * run.grad_bytes, shard)
        ar = None if replicas is None else \
            (lambda u: cluster.collective("all_reduce", u.params * run.grad_bytes / shard.size, replicas))
        local = model.params(run.seq_len) / shard.size
        kw = dict(forward_prefetch=run.forward_prefetch, backward_prefetch=run.backward_prefetch, hsdp_ar=ar)
        last = fsdp_program(us, ag, rs, reduce=True, **kw) + [Compute("optimizer", optimizer_seconds(local, cluster))]
        return fsdp_program(us, ag, rs, reduce=run.sync_each_microbatch, **kw), last
    if strategy in ("ddp", "zero1", "zero2"):
        local = model.params(run.seq_len) / (1 if strategy == "ddp" else n)
        grad = lambda kind, nbytes: cluster.collective(kind, nbytes, world)
        param = lambda nbytes: cluster.collective("all_gather", nbytes * run.param_bytes / run.grad_bytes, world)
        cap = run.bucket_mb * 2**20 if strategy == "ddp" else run.zero_bucket * run.grad_bytes
        args = (strategy, us, grad, param, optimizer_seconds(local, cluster), run.grad_bytes, cap)
        return data_parallel_program(*args, reduce=run.sync_each_microbatch), data_parallel_program(*args)
    raise ValueError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")


@dataclass
class StepTime:
    strategy: str
    model: Transformer
    cluster: Cluster
    run: Run
    step: float                 # seconds per optimizer step
    compute: float              # of which compute, if nothing waited
    comm: float                 # the collectives' durations, added up
    last: Simulated             # the last micro-step, with the optimizer (spans for a timeline)

    @property
    def exposed(self) -> float:
        """Seconds of the step during which the GPU computed nothing: communication not hidden."""
        return self.step - self.compute

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.run.tokens * self.run.grad_accum / self.step

    @property
    def mfu(self) -> float:
        return self.tokens_per_s_per_gpu * self.model.model_flops_per_token(self.run.seq_len) / \
            self.cluster.gpu.peak_flops

    def model_state_bytes(self) -> float:
        """Per GPU, mixed-precision AdamW (SPEC: 2 + 2 + 12 bytes per parameter), sharded as the strategy
        shards (HSDP: within a node). Activations not included."""
        stage = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3, "hsdp": 3}[self.strategy]
        n = self.cluster.gpus_per_node if self.strategy == "hsdp" else self.cluster.world
        return model_state_bytes(self.model.params(self.run.seq_len), n, stage, mixed_precision_adam())["total"]


def predict(strategy: str, model: Transformer, cluster: Cluster, run: Run = Run()) -> StepTime:
    """The step time of `strategy` for `model` on `cluster`, from the simulation of its programs."""
    sync, last = programs(strategy, model, cluster, run)
    a, b = simulate(sync), simulate(last)
    k = run.grad_accum
    return StepTime(strategy, model, cluster, run, step=(k - 1) * a.step + b.step,
                    compute=(k - 1) * a.compute + b.compute, comm=(k - 1) * a.comm + b.comm, last=b)


def hiding_threshold(strategy: str, model: Transformer, cluster: Cluster, run: Run = Run(),
                     tolerance: float = 0.05) -> float:
    """The fewest tokens per GPU per step (varying the micro-batch, at run.seq_len) at which no more than
    `tolerance` of the step is exposed communication: below it, communication no longer hides behind compute.
    Infinity if even a million tokens are not enough."""
    def exposed(tokens):
        p = predict(strategy, model, cluster, replace(run, micro_batch=tokens / run.seq_len, grad_accum=1))
        return p.exposed / p.step

    lo, hi = 16.0, 2.0**20
    if exposed(hi) > tolerance:
        return math.inf
    if exposed(lo) <= tolerance:
        return lo
    for _ in range(16):  # bisection in log space: to within 0.1%
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if exposed(mid) > tolerance else (lo, mid)
    return hi
