"""The analytic model: what each strategy *should* cost per rank, as plain functions of Ψ and N.

Every measured figure in minifsdp is printed next to one of these. Definitions (SPEC, "Measurement"):

    Ψ = number of parameters.  fp32 Adam(W) model states per rank: params 4Ψ, grads 4Ψ, optimizer 8Ψ.

    stage             params      grads        optimizer       (fp32 Adam, N ranks)
    0  DDP            4Ψ          4Ψ           8Ψ              = 16Ψ
    1  ZeRO-1 (OSS)   4Ψ          4Ψ           8Ψ/N            = 8Ψ + 8Ψ/N
    2  ZeRO-2 (SDP)   4Ψ          4Ψ/N         8Ψ/N            = 4Ψ + 12Ψ/N
    3  ZeRO-3 (FSDP)  4Ψ/N        4Ψ/N         8Ψ/N            = 16Ψ/N

With mixed precision (the ZeRO paper) params and grads are 2 bytes each and the optimizer keeps K = 12
bytes per parameter (fp32 master copy, momentum, variance).
"""

from __future__ import annotations

from dataclasses import dataclass

# bytes per parameter of (params, grads, optimizer state)
FP32_ADAM = (4, 4, 8)
FP32_SGD_MOMENTUM = (4, 4, 4)


def mixed_precision_adam(k: int = 12) -> tuple[int, int, int]:
    return (2, 2, k)


# --8<-- [start:model_state_bytes]
def model_state_bytes(psi: int, world_size: int, stage: int,
                      bytes_per_param=FP32_ADAM) -> dict[str, float]:
    """Per-rank bytes of params, grads and optimizer state under ZeRO stage
    0..3 (0 = DDP)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, not {stage!r}")
    p, g, o = (b * psi for b in bytes_per_param)
    n = world_size
    # BEGIN EXERCISE 2.1: which model states does each ZeRO stage divide by N?
    sharded = {0: (), 1: ("optim",), 2: ("grads", "optim"),
               3: ("params", "grads", "optim")}[stage]
    full = {"params": p, "grads": g, "optim": o}
    out = {k: (v / n if k in sharded else float(v)) for k, v in full.items()}
    # END EXERCISE
    out["total"] = out["params"] + out["grads"] + out["optim"]
    return out
# --8<-- [end:model_state_bytes]


def comm_bytes_per_step(psi: int, world_size: int, stage: int, dtype_bytes: int = 4) -> float:
    """Bytes one rank sends per training step (ring-equivalent, see comm.py).

    DDP, ZeRO-1 and ZeRO-2 move the gradients once through an all-reduce (or its two halves):
    2Ψ(N-1)/N. ZeRO-3 all-gathers the parameters twice (forward and backward) and reduce-scatters the
    gradients once: 3Ψ(N-1)/N, the 1.5x of the ZeRO paper.
    """
    n = world_size
    passes = 3 if stage == 3 else 2
    return passes * psi * dtype_bytes * (n - 1) / n


def collective_payload_bytes(numel: int, world_size: int, dtype_bytes: int = 4) -> float:
    """Payload of one all-gather / reduce-scatter of a unit of `numel` params: each rank's shard, P*b/N."""
    return numel * dtype_bytes / world_size


@dataclass
class FSDPUnitComm:
    payload_per_collective: float  # bytes, P*b/N
    collectives_per_unit: int      # all-gather in forward, all-gather in backward, reduce-scatter in backward
    total: float                   # payload summed over every collective of every unit in one step


def fsdp_step_collectives(unit_numels: list[int], world_size: int, dtype_bytes: int = 4) -> FSDPUnitComm:
    """The collectives of one FSDP step with resharding after forward: 3 per unit, each of payload P*b/N."""
    payloads = [collective_payload_bytes(p, world_size, dtype_bytes) for p in unit_numels]
    if len(set(payloads)) != 1:
        raise ValueError("units of different sizes have different payloads; call once per unit size")
    return FSDPUnitComm(payloads[0], 3, 3 * sum(payloads))


# --8<-- [start:fsdp_buffer_bytes]
def fsdp_buffer_bytes(unit_numel: int, world_size: int,
                      dtype_bytes: int = 4) -> dict[str, float]:
    """Communication and unsharded-parameter buffers alive at FSDP's peak, for
    units of `unit_numel` params.

    Two of each: one unit is computing while the next one's all-gather is in
    flight (prefetch), and the parameters are views into the all-gather
    output, so that buffer cannot be reused early.
    """
    comm = 2 * collective_payload_bytes(unit_numel, world_size, dtype_bytes)
    unsharded = 2 * unit_numel * dtype_bytes
    return {"comm": comm, "unsharded": unsharded, "total": comm + unsharded}
# --8<-- [end:fsdp_buffer_bytes]


# --8<-- [start:fsdp_gradient_bytes]
def fsdp_gradient_bytes(padded_numel: int, world_size: int,
                        dtype_bytes: int = 4,
                        backend_buffer: bool = True) -> dict[str, float]:
    """Gradient bytes of one unit alive at once, around its backward and its
    reduce-scatter.

    concat:         autograd's backward of the split that cut the views is a
                    concatenation: the per-parameter gradients (and zeros for
                    the gaps), one flat size, are copied into a new flat
                    gradient, another -- both alive while it runs.
    reduce_scatter: the flat gradient (the output is this rank's chunk of it: in
                    place), plus a buffer of the input's size if the backend
                    allocates one (gloo does; NCCL works in the buffers it is
                    given).
    handover:       the flat gradient and the shard copied out of it (1/N),
                    until the flat one is released.
    kept:           the shard, in .grad until the optimizer step.
    """
    flat = padded_numel * dtype_bytes
    return {"concat": 2 * flat,
            "reduce_scatter": (2 if backend_buffer else 1) * flat,
            "handover": flat + flat / world_size, "kept": flat / world_size}
# --8<-- [end:fsdp_gradient_bytes]


def sgd_momentum_state_bytes(psi: int) -> int:
    return 4 * psi


def adam_state_bytes(psi: int, num_tensors: int) -> int:
    """torch's Adam/AdamW: exp_avg and exp_avg_sq (4Ψ each) plus a 4-byte `step` per parameter tensor."""
    return 8 * psi + 4 * num_tensors


# ---------------------------------------------------------------------------------------------------------
# The memory calculator (chapter 13): a whole model's per-rank memory and traffic from its shape.
# chapters/js/memory_calculator.js is these functions again, line for line, for the page in the browser;
# tests/test_ch13_calculator.py checks the two agree.
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape: Llama-like (gated=True) or GPT-like (gated=False, ffn=4h)."""
    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn: int          # the MLP's inner width
    kv_heads: int     # heads of K and V (fewer than `heads` with grouped-query attention)
    gated: bool       # SwiGLU: three MLP matrices (gate, up, down); GELU: two
    tied: bool        # the output head shares the embedding's matrix


PRESETS = {  # Llama 3.2 1B and Llama 2 7B / 13B / 70B
    "1B": ModelShape(layers=16, hidden=2048, heads=32, vocab=128256, ffn=8192, kv_heads=8, gated=True, tied=True),
    "7B": ModelShape(layers=32, hidden=4096, heads=32, vocab=32000, ffn=11008, kv_heads=32, gated=True, tied=False),
    "13B": ModelShape(layers=40, hidden=5120, heads=40, vocab=32000, ffn=13824, kv_heads=40, gated=True, tied=False),
    "70B": ModelShape(layers=80, hidden=8192, heads=64, vocab=32000, ffn=28672, kv_heads=8, gated=True, tied=False),
}


def gpt_shape(layers: int, hidden: int, heads: int, vocab: int) -> ModelShape:
    return ModelShape(layers, hidden, heads, vocab, ffn=4 * hidden, kv_heads=heads, gated=False, tied=True)


# --8<-- [start:param_count]
def layer_params(shape: ModelShape) -> int:
    """One block's weight matrices: Q and O (h x h each), K and V
    (h x h_kv each), the MLP (2 or 3 of h x f).

    A GPT block (f = 4h, h_kv = h, two MLP matrices) has 2h² + 2h² + 8h² = 12h².
    Norms and biases are left out: O(h) per block, under 0.1% of a block of
    these widths.
    """
    h, f = shape.hidden, shape.ffn
    h_kv = h * shape.kv_heads // shape.heads
    return 2 * h * h + 2 * h * h_kv + (3 if shape.gated else 2) * h * f


def param_count(shape: ModelShape) -> int:
    """Ψ = L·(block) + V·h for the embedding, + V·h again for an untied output
    head. GPT: 12·L·h² + V·h."""
    return (shape.layers * layer_params(shape)
            + (1 if shape.tied else 2) * shape.vocab * shape.hidden)
# --8<-- [end:param_count]


# --8<-- [start:activation_bytes]
def activation_bytes(shape: ModelShape, seq: int, micro_batch: int,
                     checkpointing: str = "none",
                     dtype_bytes: int = 2) -> float:
    """What forward keeps for backward, per rank: Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv:2205.05198), without tensor or sequence parallelism.

    One GPT block in 16 bits keeps s·b·h·(34 + 5·a·s/h) bytes: 34·s·b·h of
    inputs to its matmuls, norms and GELU (and dropout masks), and 5·a·s²·b of
    attention scores and softmax, s x s for each of a heads.
      none       every block keeps all of it;
      selective  the attention core is recomputed (as FlashAttention does):
                 34·s·b·h per block;
      full       every block keeps only its input, 2·s·b·h, and one block at a
                 time recomputes its own.
    fp32 doubles the 16-bit figures (the 1-byte dropout masks too: slightly
    over). The fp32 logits the loss keeps, 4·s·b·V, come on top. An estimate:
    the layout of a gated MLP, GQA, and the temporaries differ.
    """
    s, b, h, a = seq, micro_batch, shape.hidden, shape.heads
    scale = dtype_bytes / 2
    block = s * b * h * (34 + 5 * a * s / h) * scale
    if checkpointing == "none":
        blocks = shape.layers * block
    elif checkpointing == "selective":
        blocks = shape.layers * s * b * h * 34 * scale
    elif checkpointing == "full":
        blocks = shape.layers * s * b * h * 2 * scale + block
    else:
        raise ValueError(f"checkpointing must be 'none', 'selective' or "
                         f"'full', not {checkpointing!r}")
    return blocks + 4 * s * b * shape.vocab
# --8<-- [end:activation_bytes]


STRATEGIES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "hsdp": 3}  # the ZeRO stage of each


# --8<-- [start:estimate]
def estimate(shape: ModelShape | None = None, psi: int | None = None,
             seq: int = 2048, micro_batch: int = 1, world_size: int = 8,
             strategy: str = "fsdp", shard_size: int | None = None,
             precision: str = "bf16", checkpointing: str = "none",
             prefetch: bool = True) -> dict[str, float]:
    """Per-rank bytes of one training step with Adam(W), by category, and the
    bytes one rank sends per step.

    Ψ is `psi` if given, else param_count(shape); without a shape there are no
    activations or units.
    precision "fp32": 4 + 4 + 8 bytes per parameter; "bf16": the ZeRO paper's
    2 + 2 + K, K = 12 (an fp32 master copy, momentum and variance), with bf16
    activations, gathers and reductions.
    strategy "hsdp" shards over groups of `shard_size` ranks and replicates
    across the N / shard_size groups.
    units: the full bf16/fp32 parameters of the FSDP units being computed, one
    unit per block, two with prefetch (the next unit's all-gather in flight),
    none when the shard group is a single rank.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, "
                         f"not {strategy!r}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(
            f"precision must be 'fp32' or 'bf16', not {precision!r}")
    n, stage = world_size, STRATEGIES[strategy]
    # the ranks the model states are sharded over
    group = (shard_size or n) if strategy == "hsdp" else n
    if n % group:
        raise ValueError(
            f"the shard group ({group}) must divide the world size ({n})")
    psi = psi if psi is not None else param_count(shape)
    per_param = FP32_ADAM if precision == "fp32" else mixed_precision_adam(12)
    # what is computed with, gathered and reduced: 4 or 2 bytes
    dtype = per_param[0]
    out = model_state_bytes(psi, group, stage, per_param)
    unit_alive = stage == 3 and group > 1 and shape is not None
    out["units"] = (float((2 if prefetch else 1) * layer_params(shape) * dtype)
                    if unit_alive else 0.0)
    out["activations"] = (activation_bytes(shape, seq, micro_batch,
                                           checkpointing, dtype)
                          if shape else 0.0)
    out["total"] += out["units"] + out["activations"]
    out["psi"] = psi
    # HSDP: FSDP inside the group, then each shard all-reduced across groups
    if strategy == "hsdp":
        out["sent_within"] = comm_bytes_per_step(psi, group, 3, dtype)
        out["sent_across"] = comm_bytes_per_step(psi / group, n // group, 0,
                                                 dtype)
    else:
        out["sent_within"], out["sent_across"] = (
            comm_bytes_per_step(psi, n, stage, dtype), 0.0)
    out["sent"] = out["sent_within"] + out["sent_across"]
    return out
# --8<-- [end:estimate]
