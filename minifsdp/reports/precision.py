"""Chapter 8's measurements: memory and bytes per rank across precisions and offload, and loss curves.

    python -m minifsdp precision --world-size 2 --markdown chapters/generated/precision.md \
        --plot chapters/figures/precision_loss.svg

Every row trains a GPT with four blocks for a few AdamW steps under one strategy and one policy, and
reports rank 0's meter (model states after the step, the parameter bytes' peak, the step's peak) and byte
counter (network bytes per step, host <-> device copies per step), next to the analytic model.
"""

from __future__ import annotations

import torch

from minifsdp.distributed.launch import launch
from minifsdp.measure import analytic
from minifsdp.mixed_precision import CPUOffload, MixedPrecision
from minifsdp.models import GPTConfig, TinyGPT
from minifsdp.reports import style
from minifsdp.reports.format import fmt_bytes, md_table, write_report
from minifsdp.train import STRATEGIES, train

CONFIG = GPTConfig(n_layer=4)
STEPS = 3
BF16 = MixedPrecision(param_dtype=torch.bfloat16)
POLICIES = {  # label -> (mixed_precision, cpu_offload)
    "fp32": (None, None),
    "bf16": (BF16, None),
    "bf16, reduce fp32": (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), None),
    "bf16 + CPU offload": (BF16, CPUOffload(offload_params=True)),
}
ROWS = [(s, p) for s in ("ddp", "oss", "sdp", "fsdp") for p in POLICIES if s == "fsdp" or "offload" not in p]


def _states(m: dict) -> int:
    return m["params"] + m["grads"] + m["optim"]


def measure() -> dict:
    out = {}
    for strategy, label in ROWS:
        mp, offload = POLICIES[label]
        r = train(strategy, optimizer="adamw", steps=STEPS, gpt_config=CONFIG, mixed_precision=mp,
                  cpu_offload=offload)
        out[(strategy, label)] = {k: r[k] for k in ("after_step", "peak", "comm_bytes", "comm_copies")}
        out[(strategy, label)]["params_peak"] = r["category_peak"]["params"]
    return out


def model_states(psi: int, n: int, stage: int) -> tuple[float, float]:
    """(this design, the ZeRO paper's mixed-precision formula) for AdamW, bytes per rank.

    This design (PyTorch's, for FSDP) keeps the fp32 parameters as the master copy and casts them to compute;
    gradients are fp32 once reduced: params 4, grads 4, optimizer 8 -- sharded as in chapter 2.
    The ZeRO paper keeps fp16 parameters and gradients (2 + 2) and puts the fp32 master copy in the
    optimizer state (K = 12), so stages 1 and 2 shard the master copy too."""
    return (analytic.model_state_bytes(psi, n, stage)["total"],
            analytic.model_state_bytes(psi, n, stage, analytic.mixed_precision_adam())["total"])


def loss_curves(steps: int = 300, world_size: int = 2) -> dict:
    """The loss of FSDP training of the default GPT (GPTConfig()), in fp32, bf16, and fp16 with a loss scaler."""
    fp16 = MixedPrecision(param_dtype=torch.float16)
    runs = {"fp32": dict(), "bf16": dict(mixed_precision=BF16),
            "fp16 + ShardedGradScaler": dict(mixed_precision=fp16, scaler=dict(init_scale=2.0 ** 15))}
    return {label: launch(train, world_size, kwargs=dict(strategy="fsdp", optimizer="adamw", steps=steps, measure=False,
                                                 **kw), device="cpu")[0]["losses"]
            for label, kw in runs.items()}


@style.charts
def plot_losses(curves: dict, path: str, world_size: int = 2) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, ax = style.figure(3.6)
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (rank 0)")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))  # plain numbers, even on less than a decade
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="major")
    ax.set_title(f"FSDP on {world_size} CPU ranks, default GPT, AdamW")
    ax.legend()
    style.save(fig, path)


def run_precision_report(world_size: int = 2, markdown: str | None = None, plot: str | None = None,
                         curve_steps: int = 300) -> dict:
    res = launch(measure, world_size, device="cpu")[0]
    n = world_size
    psi = sum(p.numel() for p in TinyGPT(CONFIG).parameters())
    states, flows = [], []
    for (strategy, label), m in res.items():
        ours, zero = model_states(psi, n, STRATEGIES[strategy].stage)
        copies = m["comm_copies"]
        moved = (f"{fmt_bytes(copies.get('host_to_device', 0) / STEPS)} in, "
                 f"{fmt_bytes(copies.get('device_to_host', 0) / STEPS)} out") if copies else "-"
        states.append([strategy, label, fmt_bytes(_states(m["after_step"])), fmt_bytes(ours), fmt_bytes(zero)])
        flows.append([strategy, label, fmt_bytes(m["params_peak"]), fmt_bytes(m["peak"]),
                      fmt_bytes(sum(m["comm_bytes"].values()) / STEPS), moved])
    lines = [f"Rank 0 of {n}, the 4-block GPT (Ψ = {psi:,}), AdamW, {STEPS} steps, CPU\n",
             md_table(["strategy", "precision", "model states after the step", "model: this design",
                       "model: ZeRO paper, (2+2+K)Ψ"], states, "Model states, measured and analytic"), "",
             md_table(["strategy", "precision", "parameter bytes, peak", "peak of the step", "network bytes per step",
                       "host ↔ device per step"], flows, "What shrinks: peaks and bytes moved")]
    curves = loss_curves(curve_steps, n)
    lines += ["", f"**Loss after {curve_steps} steps** (FSDP, {n} ranks, the default GPT; mean of the last 20 steps)\n",
              "| precision | loss |", "|---|---|"]
    for label, losses in curves.items():
        tail = losses[-20:]
        lines.append(f"| {label} | {sum(tail) / len(tail):.4f} |")
    text = "\n".join(lines)
    write_report(text, markdown)
    if plot:
        plot_losses(curves, plot, n)
    return {"rows": res, "curves": curves}
