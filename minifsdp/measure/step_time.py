"""Chapter 13: how long a training step takes, on paper -- per strategy, per model, per cluster.

    from minifsdp.measure import step_time as st
    cluster = st.Cluster(st.H100, nodes=8)
    st.predict("fsdp", st.LLAMA2_7B, cluster, st.Run(seq_len=4096, micro_batch=2))
    # StepTime(step=..., tokens_per_s_per_gpu=..., mfu=..., exposed=...)

Three parts, each small enough to check by hand.

1. Collectives, the alpha-beta way. A collective over n ranks takes alpha per step of its algorithm plus
   the bytes one rank puts on the wire over the bandwidth. The bytes are the ring-equivalent bytes minifsdp's
   counter reports (comm.ring_bytes: 2S(n-1)/n for an all-reduce of S bytes, S(n-1)/n for an all-gather or a
   reduce-scatter), so the bandwidth is NCCL's "bus bandwidth". A ring takes 2(n-1) steps for an all-reduce
   and n-1 for the others; a (pipelined) tree all-reduce takes 2*log2(n) steps but moves 2S per rank. Where a
   group spans nodes, each step that crosses a node boundary costs the network's alpha, and the bandwidth is
   what the node's NICs give the group's ranks (see `Cluster.busbw`).
2. Compute. The FLOPs of a token (forward + backward) are 6*params + 12*layers*d_model*seq_len (the
   PaLM / Megatron convention, below), at a stated peak times an achievable fraction `GPU.efficiency`.
   Backward costs twice the forward; activation checkpointing adds (part of) a forward.
3. Overlap, from the issue order. A step is a program: compute segments, collectives issued, and waits, in
   the order minifsdp's runtime issues them (chapter 7: the FSDP unit's forward, `_pre_backward`,
   `_before_concat`, `_post_backward`). `simulate` runs it on two kinds of stream -- one compute stream, one
   FIFO channel per process group -- and the step time falls out, with the waits where they fall. Nothing
   takes max(compute, communication).

The numbers of the hardware, and where each comes from, are next to each constant. How the model compares with
published throughput is in `PUBLISHED` and `compare_published`; `python -m minifsdp step-time` writes both
tables (minifsdp/reports/step_time.py), with the calibration of alpha and beta on this machine.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

from minifsdp.distributed.comm import ring_bytes
from minifsdp.measure.analytic import mixed_precision_adam, model_state_bytes
from minifsdp.measure.timeline import Span, hidden_fraction

# ----------------------------------------------------------------------------------------------------------------
# 1. Collectives
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One kind of wire, as the alpha-beta model sees it."""
    alpha: float  # seconds per step (hop) of a ring
    busbw: float  # ring-equivalent bytes one rank moves per second (NCCL's bus bandwidth)
    tree_alpha: float | None = None  # seconds per step of a tree, if not alpha

    @property
    def tree_step(self) -> float:
        return self.alpha if self.tree_alpha is None else self.tree_alpha


# --8<-- [start:alpha_beta]
def algorithm_steps(kind: str, n: int, algorithm: str = "ring") -> int:
    """How many steps (each paying alpha once) a collective over n ranks
    takes."""
    if n <= 1:
        return 0
    # BEGIN EXERCISE 13.1: a ring's steps (an all-reduce is two rings); a tree's
    if algorithm == "ring":
        return 2 * (n - 1) if kind == "all_reduce" else n - 1
    if algorithm == "tree":
        if kind != "all_reduce":
            raise ValueError("the tree algorithm is an all-reduce's (as in "
                             "NCCL): all-gather and reduce-scatter are rings")
        # up the tree (reduce), then down it (broadcast)
        return 2 * math.ceil(math.log2(n))
    # END EXERCISE
    raise ValueError(f"algorithm must be 'ring' or 'tree', not {algorithm!r}")


def wire_bytes(kind: str, nbytes: float, n: int,
               algorithm: str = "ring") -> float:
    """Bytes one rank sends: a ring's are the counter's ring_bytes; a pipelined
    tree all-reduce sends the whole buffer up and the whole result down, 2S,
    whatever n is."""
    if n <= 1:
        return 0.0
    return ring_bytes(kind, nbytes, n) if algorithm == "ring" else 2.0 * nbytes


def alpha_beta(kind: str, nbytes: float, n: int, link: Link,
               algorithm: str = "ring") -> float:
    """Seconds for a collective over `nbytes` (the full, unsharded size) on n
    ranks of one kind of link: alpha * steps + bytes on the wire / bandwidth."""
    if algorithm == "auto":
        if kind == "all_reduce":
            return min(alpha_beta(kind, nbytes, n, link, a)
                       for a in ("ring", "tree"))
        return alpha_beta(kind, nbytes, n, link, "ring")
    step = link.alpha if algorithm == "ring" else link.tree_step
    return (step * algorithm_steps(kind, n, algorithm)
            + wire_bytes(kind, nbytes, n, algorithm) / link.busbw)


def ring_tree_crossover(n: int, link: Link) -> float:
    """The all-reduce size (bytes) below which a tree beats a ring on n ranks
    of `link`, with L = log2(n):
    2(n-1)a + 2S(n-1)/(nB) = 2L t + 2S/B  gives  S = n B ((n-1)a - L t)
    (a, t: a ring's and a tree's step)."""
    L = math.ceil(math.log2(n))
    return max(0.0,
               n * link.busbw * ((n - 1) * link.alpha - L * link.tree_step))
# --8<-- [end:alpha_beta]


# Per-hop latencies from NCCL's own alpha-beta tuning model (NVIDIA/nccl, src/graph/tuning.cc, commit 01afd20:
# hwLat, Simple protocol -- the protocol of the megabyte payloads here): a ring's step costs 3.4 us over NVLink
# and 9.6 us over the network; a tree's, 28 and 50 us ("the latency [of] a 256kB chunk").
NCCL_ALPHA_NVLINK, NCCL_TREE_ALPHA_NVLINK = 3.4e-6, 28e-6
NCCL_ALPHA_NET, NCCL_TREE_ALPHA_NET = 9.6e-6, 50e-6


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense bf16 FLOP/s (the vendor's datasheet)
    hbm_bw: float      # bytes/s of device memory (the optimizer step reads and writes it)
    nvlink: Link       # within a node
    efficiency: float  # the fraction of peak a transformer's compute reaches: calibrated, see PUBLISHED
    note: str = ""


# A100 SXM: 312 TFLOP/s bf16 dense, 2.04 TB/s HBM2e (80 GB), NVLink 3 at 300 GB/s per direction. NCCL's tuning
# model caps an A100's bus bandwidth at 235 GB/s ("if (compCap80) busBw = std::min(busBw, 235.0f)", the
# file above): the bus bandwidth used here.
# H100 SXM: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 4 at 450 GB/s per direction. No H100 cap in that
# file; we take the same fraction of the link NCCL reaches on an A100 (235/300, about 0.78): 0.78 x 450 = 351 GB/s. (Published
# all-reduce figures of 460-480 GB/s on 8 H100s exceed the 450 GB/s link, so they come from reductions in the
# NVSwitch, NVLS, which rings of all-gathers and reduce-scatters do not get.)
# `efficiency` is fitted to one published run per GPU (the rows marked "calibration" in PUBLISHED) and then
# held fixed for every other prediction; `calibrate_efficiency` recomputes it.
A100 = GPU("A100", 312e12, 2.04e12, Link(NCCL_ALPHA_NVLINK, 235e9, NCCL_TREE_ALPHA_NVLINK), efficiency=0.6564,
           note="A100 SXM 80 GB")
H100 = GPU("H100", 989e12, 3.35e12, Link(NCCL_ALPHA_NVLINK, 0.78 * 450e9, NCCL_TREE_ALPHA_NVLINK),
           efficiency=0.4833,
           note="H100 SXM 80 GB")
GPUS = {"h100": H100, "a100": A100}


def nic(gbit_per_s: float, efficiency: float = 0.9) -> Link:
    """One network port per GPU at `gbit_per_s` line rate, of which `efficiency` is reached (an assumption:
    RDMA reaches ~90% of the line rate for large messages)."""
    return Link(NCCL_ALPHA_NET, efficiency * gbit_per_s * 1e9 / 8, NCCL_TREE_ALPHA_NET)


IB_400G = nic(400)  # H100 clusters: one 400 Gb/s port (NDR InfiniBand or RoCE) per GPU
IB_200G = nic(200)  # A100 clusters: one 200 Gb/s port (HDR) per GPU, 1,600 Gb/s per node


@dataclass(frozen=True)
class Group:
    """A process group laid out on the cluster: `size` ranks, `per_node` of them on each node it spans."""
    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.size / self.per_node))


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    nodes: int = 1
    gpus_per_node: int = 8
    nic: Link = IB_400G  # per GPU
    nics_per_node: int = 8
    spread_rings: bool = True  # False: a ring across nodes gets one NIC's bandwidth (the pessimistic model)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    # --8<-- [start:hierarchy]
    def busbw(self, group: Group) -> float:
        """The bus bandwidth a group's ranks get. Within a node: NVLink's. Across
        nodes, a ring enters and leaves each node once per channel, and NCCL runs
        one channel per NIC: with p of the group's ranks on a node, each owning a
        NIC, the node's p NICs carry the group's traffic side by side, so a rank
        moves min(NVLink, p * NIC). One rank per node (HSDP's replicas): one NIC's
        bandwidth. With spread_rings=False, every group that spans nodes gets one
        NIC's bandwidth: as if each rank sent all its bytes through its own NIC."""
        if group.nodes == 1:
            return self.gpu.nvlink.busbw
        rails = min(group.per_node, self.nics_per_node) if self.spread_rings else 1
        return min(self.gpu.nvlink.busbw, rails * self.nic.busbw)

    def collective(self, kind: str, nbytes: float, group: Group,
                   algorithm: str = "auto") -> float:
        """alpha-beta on this cluster: the steps that cross nodes pay the network's
        alpha, the others NVLink's (NCCL's tuning model does the same); the bytes go
        at `busbw(group)`."""
        n = group.size
        if n <= 1 or nbytes <= 0:
            return 0.0
        if algorithm == "auto":
            algos = ("ring", "tree") if kind == "all_reduce" else ("ring",)
            return min(self.collective(kind, nbytes, group, a) for a in algos)
        a_in, a_net, k = self.gpu.nvlink.alpha, self.nic.alpha, group.nodes
        if algorithm == "ring":
            steps = algorithm_steps(kind, n, "ring")
            inter = (2 * (k - 1) if kind == "all_reduce" else k - 1)
            latency = (steps - inter) * a_in + inter * a_net
        else:  # a tree within each node and one across the nodes, up and down
            algorithm_steps(kind, n, "tree")  # (checks the kind)
            depth_in_node = math.ceil(math.log2(max(1, min(n, group.per_node))))
            latency = 2 * (depth_in_node * self.gpu.nvlink.tree_step
                           + math.ceil(math.log2(k)) * self.nic.tree_step)
        return latency + wire_bytes(kind, nbytes, n, algorithm) / self.busbw(group)
    # --8<-- [end:hierarchy]


# ----------------------------------------------------------------------------------------------------------------
# 2. Compute
# ----------------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------------
# 3. Programs and the two-stream simulation
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Compute:
    name: str
    seconds: float


@dataclass(frozen=True)
class Collective:
    """Issued at this point of the program; it starts once its channel has carried everything issued on it
    before (one FIFO per process group, as NCCL runs a group's collectives on one stream), the compute issued
    before it is done, and the collectives in `after` are complete."""
    tag: str
    kind: str
    channel: str
    seconds: float
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class Wait:
    """The compute stream stops until the collective `tag` is complete."""
    tag: str


@dataclass
class Simulated:
    step: float               # seconds from the first op to the end of the last one, compute or collective
    compute: float            # the compute segments, added up
    comm: float               # the collectives' durations, added up
    waiting: float            # the time the compute stream sat blocked
    spans: list[Span] = field(default_factory=list)

    @property
    def hidden(self) -> float:
        return hidden_fraction(self.spans)


# --8<-- [start:simulate]
def simulate(program) -> Simulated:
    """Run a program on one compute stream and one FIFO channel per process
    group."""
    now = 0.0                    # the compute stream's clock
    free = defaultdict(float)    # channel -> when all it was given is carried
    done: dict[str, float] = {}  # collective tag -> when it completes
    spans, compute, comm, waiting = [], 0.0, 0.0, 0.0
    for op in program:
        if isinstance(op, Compute):
            spans.append(Span("compute", op.name, now, now + op.seconds))
            now += op.seconds
            compute += op.seconds
            continue
        if not isinstance(op, (Collective, Wait)):
            raise TypeError(f"not a program step: {op!r}")
        # BEGIN EXERCISE 13.2: when a collective runs (FIFO); what a wait costs
        if isinstance(op, Collective):
            start = max([now, free[op.channel]] + [done[t] for t in op.after])
            done[op.tag] = free[op.channel] = start + op.seconds
            spans.append(Span(op.kind, op.tag, start, start + op.seconds))
            comm += op.seconds
        elif done[op.tag] > now:
            # a Wait on a collective still running: the compute stream sits
            # until it ends
            spans.append(Span("wait", op.tag, now, done[op.tag]))
            waiting += done[op.tag] - now
            now = done[op.tag]
        # END EXERCISE
    end = max([now] + list(done.values()))
    return Simulated(end, compute, comm, waiting,
                     sorted(spans, key=lambda s: s.start))
# --8<-- [end:simulate]


# -- the programs, one per strategy ------------------------------------------------------------------------------
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
        # _pre_backward: our own all-gather ...
        gather(u, "backward")
        if backward_prefetch == "pre" and i > 0:
            # ... then BACKWARD_PRE's prefetch
            gather(blocks[i - 1], "backward")
        prog += [Wait(f"backward all_gather {u.name}"),
                 Compute(f"backward {u.name}", u.backward[0])]
        before_concat()
        # _post_backward: BACKWARD_POST's prefetch ...
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
    prog.extend(Wait(t) for t in pending)  # _finish_backward
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


# ----------------------------------------------------------------------------------------------------------------
# 4. A recorded minifsdp step as a program (chapter 7's recorder, fed in)
# ----------------------------------------------------------------------------------------------------------------


def issue_sequence(program) -> list[str]:
    """A program's order as tokens -- each collective ("all_gather blocks.1") and each block's compute
    ("compute backward blocks.1") -- to compare with a recorded step's (`recorded_sequence`). The root's
    compute is left out: in a real step it is cut into many slivers around the blocks."""
    out = []
    for op in program:
        if isinstance(op, Collective) and op.channel != "replicate":
            out.append(f"{op.kind} {op.tag.rsplit(' ', 1)[1]}")
        elif isinstance(op, Compute) and "(root)" not in op.name and op.name != "optimizer":
            out.append(f"compute {op.name}")
    return out


def recorded_sequence(events, segments) -> list[str]:
    """The same tokens from a recording: `events` [(issued, kind, tag)] from a comm counter with record=True,
    `segments` [(start, name)] from a Timeline's compute segments."""
    marks = [(t, f"{kind} {tag.rsplit(' ', 1)[1]}") for t, kind, tag in events]
    marks += [(t, f"compute {name}") for t, name in segments if "(root)" not in name]
    out = []
    for _, token in sorted(marks):
        if not (out and out[-1] == token and token.startswith("compute")):
            out.append(token)
    return out


def program_from_recording(events, waits, end: float, seconds) -> list:
    """A recorded step (host times from its start) as a program: the host computes between the moments it
    issued a collective or blocked, and blocks where it blocked. `events`: [(issued, kind, tag, nbytes)];
    `waits`: [(start, end, tag)]; `seconds(kind, nbytes)` gives each collective its duration (measured, or
    predicted by alpha-beta)."""
    marks = [(t, 0, (kind, tag, nbytes)) for t, kind, tag, nbytes in events] + [(s, 1, (e, tag)) for s, e, tag in waits]
    prog, cursor, latest = [], 0.0, {}
    for k, (t, what, data) in enumerate(sorted(marks, key=lambda m: (m[0], m[1]))):
        if t > cursor:
            prog.append(Compute("host", t - cursor))
            cursor = t
        if what == 0:
            kind, tag, nbytes = data
            latest[tag] = f"{tag} #{k}"
            prog.append(Collective(latest[tag], kind, "world", seconds(kind, nbytes)))
        else:
            wait_end, tag = data
            if tag in latest:
                prog.append(Wait(latest[tag]))
            cursor = max(cursor, wait_end)
    if end > cursor:
        prog.append(Compute("host", end - cursor))
    return prog


# ----------------------------------------------------------------------------------------------------------------
# 5. Published throughput, and how far the model is from it
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    name: str
    repo: str
    path: str
    commit: str
    setup: str    # the setup, as the source states it
    assumed: str  # what the source does not state, and what we assumed instead

    @property
    def citation(self) -> str:
        return f"{self.repo}, {self.path} @ {self.commit[:9]}"


TORCHTITAN_A100 = Source(
    "torchtitan (A100)", "pytorch/torchtitan", "docs/performance.md", "157a12c562288b3bccb077003a97f18a4ca657aa",
    "64 A100 80 GB, FSDP2 (fully_shard per block), 1D; bf16 compute, fp32 gradient reduction; no torch.compile, "
    "no Float8. Sequence length 8192 (Llama 3) and 4096 (Llama 2), from the train configs at that commit. MFU "
    "counted as 6 x all parameters + 12 L h q t (torchtitan/utils.py at that commit): our convention",
    "The network is not stated: 8 x 200 Gb/s per node assumed. 'selective layer' taken as every 2nd block "
    "checkpointed; 'selective op' as the op policy of that commit (every 2nd matmul recomputed)")
TORCHTITAN_H100 = Source(
    "torchtitan (H100)", "pytorch/torchtitan", "docs/performance.md", "d4c86e3758a84cf23e2e879ab3c995cba9d5e410",
    "Grand Teton hosts: 8 H100 (96 GB HBM2e, 500 W power limit) with NVLink, 400 Gb/s RDMA per GPU. FSDP2, "
    "local batch 2 x 8192 tokens, selective AC. Tables 1 (8 GPUs) and 3 (128 GPUs), the rows without "
    "torch.compile and Float8. No MFU in the table (the text gives 33-39% for these runs)",
    "Selective AC taken as the op policy (the train config's default). These H100s run at 500 W with HBM2e: "
    "slower than the H100 SXM whose efficiency we calibrated, which the source itself notes")
LLM_FOUNDRY = "mosaicml/llm-foundry", "scripts/train/benchmarking/README.md", "495218376830947dce625efabc4d86be7c47cc45"
LLM_FOUNDRY_H100 = Source(
    "llm-foundry (H100)", *LLM_FOUNDRY,
    "MPT models under Composer's FSDP1 (FULL_SHARD, one unit per block, limit_all_gathers), amp_bf16 with "
    "mixed precision DEFAULT (fp32 gradient reduction), FlashAttention; tables 'H100 80GB BF16' and "
    "'H100 80GB BF16 (Large Scale, >= 128 GPUs)'. MFU counted as 6 x all parameters + 12 L d s: our convention",
    "The network is not stated: 8 x 400 Gb/s per node assumed. Backward prefetch: Composer's default "
    "(BACKWARD_POST); no_sync on every micro-batch but the last (Composer's default sync strategy)")
LLM_FOUNDRY_A100 = Source(
    "llm-foundry (A100)", *LLM_FOUNDRY,
    "The table 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)': as for H100, mixed precision DEFAULT, "
    "or PURE (bf16 gradient reduction) for the 70b rows",
    "8 x 200 Gb/s per node (the stated 1,600 Gb/s); the rest as for H100")
SOURCES = (TORCHTITAN_A100, TORCHTITAN_H100, LLM_FOUNDRY_H100, LLM_FOUNDRY_A100)


@dataclass(frozen=True)
class Published:
    source: Source
    table: str                   # where in the source
    label: str                   # the row, as the source names its configuration
    model: Transformer
    gpu: GPU
    gpus: int
    nic: Link
    run: Run
    tokens_per_s_per_gpu: float  # as published
    mfu: float | None            # as published (a fraction); None where the source gives none
    calibration: bool = False    # the row the GPU's efficiency was fitted to
    lacks: str = ""              # what the published run has that the model does not


_TT_RUN = dict(param_bytes=2, grad_bytes=4, forward_prefetch=True, backward_prefetch="pre")
_MPT_RUN = dict(param_bytes=2, forward_prefetch=True, backward_prefetch="post", sync_each_microbatch=False)
_FLASH = "FlashAttention with a causal mask computes half the attention FLOPs counted"


def _tt(table, label, model, seq, gpus, mb, ac, tps, mfu, gpu=A100, nic_=IB_200G, source=TORCHTITAN_A100):
    return Published(source, table, label, model, gpu, gpus, nic_,
                     Run(seq_len=seq, micro_batch=mb, ac=ac, **_TT_RUN), tps, mfu,
                     lacks="FlashAttention (SDPA) with a causal mask computes half the attention FLOPs counted")


def _mpt(table, model, seq, gpus, mb, ga, ac, tps, mfu, gpu=H100, nic_=IB_400G, grad_bytes=4, calibration=False):
    source = LLM_FOUNDRY_H100 if gpu is H100 else LLM_FOUNDRY_A100
    label = (f"{model.name.split()[1].lower()}, seq {seq}, {gpus} GPUs, micro-batch {mb} x {ga} accumulated, "
             f"{'full AC' if ac == 'full' else 'no AC'}")
    return Published(source, table, label, model, gpu, gpus, nic_,
                     Run(seq_len=seq, micro_batch=mb, grad_accum=ga, ac=ac, grad_bytes=grad_bytes, **_MPT_RUN),
                     tps, mfu / 100, calibration=calibration, lacks=_FLASH)


_H100_BIG = "H100 80GB BF16 (Large Scale, >= 128 GPUs)"
_H100_TAB = "H100 80GB BF16"
_A100_TAB = "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"
_A100, _F = dict(gpu=A100, nic_=IB_200G), "full"

# The rows: every bf16 row of torchtitan's tables at the two commits that uses neither torch.compile nor Float8;
# every bf16 row of llm-foundry's H100 and A100-80GB tables for the 7b-70b models at sequence lengths up to 8192.
# (The A100-40GB table repeats the A100 with smaller micro-batches and is left out.) Numbers copied from the
# sources; `calibration=True` marks the one row per GPU the efficiency was fitted to.
PUBLISHED = [
    _tt("Llama 3, 64 A100", "Llama 3 8B, batch 1, selective layer AC", LLAMA3_8B, 8192, 64, 1, "every_2nd",
        2904, 0.568),
    _tt("Llama 3, 64 A100", "Llama 3 8B, batch 1, selective op AC", LLAMA3_8B, 8192, 64, 1, "selective_op",
        2973, 0.582),
    _tt("Llama 3, 64 A100", "Llama 3 70B, batch 1, full AC", LLAMA3_70B, 8192, 64, 1, "full", 331, 0.517),
    _tt("Llama 2, 64 A100", "Llama 2 13B, batch 2, no AC", LLAMA2_13B, 4096, 64, 2, "none", 2162, 0.611),
    _tt("Llama 2, 64 A100", "Llama 2 13B, batch 2, selective layer AC", LLAMA2_13B, 4096, 64, 2, "every_2nd",
        1914, 0.541),
    _tt("Llama 2, 64 A100", "Llama 2 13B, batch 2, selective op AC", LLAMA2_13B, 4096, 64, 2, "selective_op",
        1904, 0.538),
    _tt("Llama 2, 64 A100", "Llama 2 70B, batch 1, selective op AC", LLAMA2_70B, 4096, 64, 1, "selective_op",
        355, 0.508),
    _tt("Llama 2, 64 A100", "Llama 2 70B, batch 2, full AC", LLAMA2_70B, 4096, 64, 2, "full", 353, 0.505),
    _tt("Table 1", "Llama 3.1 8B, 8 GPUs, FSDP", LLAMA3_8B, 8192, 8, 2, "selective_op", 5762, None,
        gpu=H100, nic_=IB_400G, source=TORCHTITAN_H100),
    _tt("Table 3", "Llama 3.1 8B, 128 GPUs, FSDP", LLAMA3_8B, 8192, 128, 2, "selective_op", 5605, None,
        gpu=H100, nic_=IB_400G, source=TORCHTITAN_H100),
    _mpt(_H100_BIG, MPT_70B, 2048, 512, 8, 1, _F, 1007, 41.25),
    _mpt(_H100_BIG, MPT_70B, 2048, 256, 8, 1, _F, 1035, 42.42),
    _mpt(_H100_BIG, MPT_70B, 2048, 128, 8, 1, _F, 1058, 43.36),
    _mpt(_H100_BIG, MPT_30B, 2048, 512, 8, 1, _F, 2115, 40.27),
    _mpt(_H100_BIG, MPT_30B, 2048, 256, 8, 1, _F, 2148, 40.89),
    _mpt(_H100_BIG, MPT_30B, 2048, 128, 8, 1, _F, 2199, 41.85),
    _mpt(_H100_BIG, MPT_13B, 2048, 512, 16, 1, _F, 4952, 41.12),
    _mpt(_H100_BIG, MPT_13B, 2048, 256, 16, 1, _F, 4989, 41.42),
    _mpt(_H100_BIG, MPT_13B, 2048, 128, 16, 1, _F, 5080, 42.18),
    _mpt(_H100_BIG, MPT_7B, 2048, 512, 6, 1, "none", 9670, 42.2),
    _mpt(_H100_BIG, MPT_7B, 2048, 256, 6, 1, "none", 10119, 44.15),
    _mpt(_H100_BIG, MPT_7B, 2048, 128, 6, 1, "none", 10475, 45.71),
    _mpt(_H100_TAB, MPT_70B, 2048, 64, 8, 4, _F, 1039, 42.57),
    _mpt(_H100_TAB, MPT_70B, 2048, 32, 2, 16, _F, 882, 36.15),
    _mpt(_H100_TAB, MPT_30B, 8192, 8, 1, 21, _F, 1384, 29.92),
    _mpt(_H100_TAB, MPT_30B, 4096, 8, 1, 21, _F, 1802, 35.86),
    _mpt(_H100_TAB, MPT_30B, 2048, 32, 14, 3, _F, 2308, 43.92),
    _mpt(_H100_TAB, MPT_30B, 2048, 16, 10, 3, _F, 2263, 43.07),
    _mpt(_H100_TAB, MPT_30B, 2048, 8, 3, 21, _F, 2002, 38.11),
    _mpt(_H100_TAB, MPT_30B, 1024, 8, 6, 21, _F, 2084, 38.76),
    _mpt(_H100_TAB, MPT_13B, 4096, 8, 10, 3, _F, 4717, 41.6),
    _mpt(_H100_TAB, MPT_13B, 2048, 64, 2, 1, "none", 4800, 39.86),
    _mpt(_H100_TAB, MPT_13B, 2048, 32, 2, 1, "none", 4811, 39.95),
    _mpt(_H100_TAB, MPT_13B, 2048, 16, 2, 1, "none", 4767, 39.58),
    _mpt(_H100_TAB, MPT_13B, 2048, 8, 2, 1, "none", 4792, 39.79),
    _mpt(_H100_TAB, MPT_13B, 1024, 8, 40, 3, _F, 5502, 44.27),
    _mpt(_H100_TAB, MPT_7B, 8192, 8, 8, 2, _F, 6935, 37.14),
    _mpt(_H100_TAB, MPT_7B, 4096, 8, 16, 2, _F, 8611, 40.42),
    _mpt(_H100_TAB, MPT_7B, 2048, 8, 6, 1, "none", 10643, 46.44, calibration=True),
    _mpt(_H100_TAB, MPT_7B, 1024, 8, 64, 2, _F, 10203, 42.83),
    _mpt(_A100_TAB, MPT_70B, 2048, 64, 8, 4, _F, 410, 53.33, grad_bytes=2, **_A100),
    _mpt(_A100_TAB, MPT_70B, 2048, 32, 2, 16, _F, 373, 48.56, grad_bytes=2, **_A100),
    _mpt(_A100_TAB, MPT_30B, 8192, 8, 1, 21, _F, 574, 39.38, **_A100),
    _mpt(_A100_TAB, MPT_30B, 4096, 8, 1, 21, _F, 814, 51.37, **_A100),
    _mpt(_A100_TAB, MPT_30B, 2048, 8, 3, 21, _F, 916, 55.3, **_A100),
    _mpt(_A100_TAB, MPT_30B, 1024, 8, 6, 21, _F, 946, 55.82, **_A100),
    _mpt(_A100_TAB, MPT_30B, 512, 8, 12, 21, _F, 967, 56.4, **_A100),
    _mpt(_A100_TAB, MPT_13B, 8192, 8, 5, 3, _F, 1795, 56.07, **_A100),
    _mpt(_A100_TAB, MPT_13B, 4096, 8, 10, 3, _F, 2060, 57.62, **_A100),
    _mpt(_A100_TAB, MPT_13B, 2048, 8, 2, 3, "none", 2262, 59.57, **_A100),
    _mpt(_A100_TAB, MPT_13B, 1024, 8, 40, 3, _F, 2330, 59.48, **_A100),
    _mpt(_A100_TAB, MPT_7B, 8192, 8, 8, 2, _F, 3206, 54.47, **_A100),
    _mpt(_A100_TAB, MPT_7B, 4096, 8, 16, 2, _F, 3684, 54.84, **_A100),
    _mpt(_A100_TAB, MPT_7B, 2048, 8, 6, 2, "none", 4641, 64.23, calibration=True, **_A100),
    _mpt(_A100_TAB, MPT_7B, 1024, 8, 64, 2, _F, 4357, 58.01, **_A100),
]
# Searched for and not found in the stored corpora this module was written from, so left out rather than quoted
# from memory: the FSDP paper's (Zhao et al., VLDB 2023) scaling figures, the ZeRO paper's (Rajbhandari et al.,
# SC 2020) throughput tables, and Megatron-LM's MFU tables (whose runs use tensor and pipeline parallelism).
NOT_FOUND = ("the FSDP paper (Zhao et al., VLDB 2023), its scaling figures",
             "the ZeRO paper (Rajbhandari et al., SC 2020), its throughput tables",
             "Megatron-LM's MFU tables (runs with tensor and pipeline parallelism, which this model lacks)")


def published_cluster(row: Published, gpu: GPU | None = None) -> Cluster:
    return Cluster(gpu or row.gpu, nodes=max(1, row.gpus // 8), gpus_per_node=min(8, row.gpus), nic=row.nic)


def predict_published(row: Published, gpu: GPU | None = None) -> StepTime:
    return predict("fsdp", row.model, published_cluster(row, gpu), row.run)


def calibrate_efficiency(row: Published) -> float:
    """The compute efficiency at which the model predicts `row`'s published tokens/s exactly."""
    lo, hi = 0.05, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        tps = predict_published(row, replace(row.gpu, efficiency=mid)).tokens_per_s_per_gpu
        lo, hi = (mid, hi) if tps < row.tokens_per_s_per_gpu else (lo, mid)
    return (lo + hi) / 2


def compare_published(rows=None) -> list[dict]:
    """Each published row next to the model's prediction, with the relative error of the prediction."""
    out = []
    for row in PUBLISHED if rows is None else rows:
        p = predict_published(row)
        out.append(dict(row=row, predicted=p.tokens_per_s_per_gpu, predicted_mfu=p.mfu,
                        error=p.tokens_per_s_per_gpu / row.tokens_per_s_per_gpu - 1,
                        exposed=p.exposed / p.step))
    return out
