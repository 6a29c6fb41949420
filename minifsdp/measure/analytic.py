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
def model_state_bytes(psi: int, world_size: int, stage: int, bytes_per_param=FP32_ADAM) -> dict[str, float]:
    """Per-rank bytes of params, grads and optimizer state under ZeRO stage 0..3 (0 = DDP)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, not {stage!r}")
    p, g, o = (b * psi for b in bytes_per_param)
    n = world_size
    # BEGIN EXERCISE 2.1: which model states does each ZeRO stage divide by N?
    sharded = {0: (), 1: ("optim",), 2: ("grads", "optim"), 3: ("params", "grads", "optim")}[stage]
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
def fsdp_buffer_bytes(unit_numel: int, world_size: int, dtype_bytes: int = 4) -> dict[str, float]:
    """Communication and unsharded-parameter buffers alive at FSDP's peak, for units of `unit_numel` params.

    Two of each: one unit is computing while the next one's all-gather is in flight (prefetch), and the
    parameters are views into the all-gather output, so that buffer cannot be reused early.
    """
    comm = 2 * collective_payload_bytes(unit_numel, world_size, dtype_bytes)
    unsharded = 2 * unit_numel * dtype_bytes
    return {"comm": comm, "unsharded": unsharded, "total": comm + unsharded}
# --8<-- [end:fsdp_buffer_bytes]


def sgd_momentum_state_bytes(psi: int) -> int:
    return 4 * psi


def adam_state_bytes(psi: int, num_tensors: int) -> int:
    """torch's Adam/AdamW: exp_avg and exp_avg_sq (4Ψ each) plus a 4-byte `step` per parameter tensor."""
    return 8 * psi + 4 * num_tensors
