"""The tour: every strategy built so far, trained side by side, next to torch's own DDP as the oracle.

    python -m minifsdp tour                        # 2 CPU ranks, 5 steps
    python -m minifsdp tour --world-size 4 --steps 10
    torchrun --nproc-per-node 2 -m minifsdp tour

For each strategy it prints one table: how far its parameters are from torch DDP's after the same steps
(0 means bit-identical), per-rank peak memory measured next to the analytic model, bytes communicated per
step next to the theory, and the step time. It writes a plot of memory by category per strategy.

`python -m minifsdp memory` is chapter 2's report: plain DDP at world sizes 1..4, measured vs analytic.
"""

from __future__ import annotations

import statistics

from minifsdp import analytic, comm
from minifsdp.launch import launch
from minifsdp.models import GPTConfig
from minifsdp.train import OPTIMIZERS, STRATEGIES, max_abs_diff, train

TOUR_MODEL = GPTConfig(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=64, tie_weights=True)
ORACLE = "torch_ddp"
CATEGORY_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optim": "#55a868", "other": "#c7c7c7"}
CATEGORY_LABELS = {"params": "parameters", "grads": "gradients", "optim": "optimizer state",
                   "other": "activations, temporaries, buffers"}


def _train_all(strategies, steps, optimizer, global_batch, config):
    """One rank's work: train each strategy in turn (a fresh model each time) and return every result."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(strategies) * steps, desc="tour", disable=comm.rank() != 0, leave=False)
    out = {}
    for name in strategies:
        bar.set_postfix_str(name)
        out[name] = train(strategy=name, model="gpt", optimizer=optimizer, steps=steps,
                          global_batch=global_batch, gpt_config=config, on_step=bar.update)
    bar.close()
    return out


def bytes_per_param(optimizer: str):
    return analytic.FP32_ADAM if optimizer == "adamw" else analytic.FP32_SGD_MOMENTUM


def strategy_rows(name: str, per_rank: list[dict], oracle: list[dict], optimizer: str) -> list[dict]:
    """One row per rank of the measured-vs-analytic comparison."""
    stage = STRATEGIES[name][1]
    rows = []
    for r, res in enumerate(per_rank):
        n, psi = res["world_size"], res["psi"]
        model = analytic.model_state_bytes(psi, n, stage, bytes_per_param(optimizer))
        states = res["after_step"]
        rows.append({
            "rank": r,
            "max_diff": max_abs_diff(res["params"], oracle[r]["params"]),
            # on a GPU the caching allocator's peak is the truth; on the CPU, the tracked storages
            "peak": res["allocator"].get("max_allocated", res["peak"]),
            "states": states["params"] + states["grads"] + states["optim"],
            "states_analytic": model["total"],
            "other_at_peak": res["peak_by_category"]["other"],
            "bytes_per_step": sum(res["comm_bytes"].values()) / res["steps"],
            "bytes_theory": analytic.comm_bytes_per_step(psi, n, stage),
            "step_ms": 1e3 * statistics.median(res["step_times"]),
        })
    return rows


def _fmt_bytes(b) -> str:
    if b is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def format_table(rows: list[dict], counted: bool = True) -> str:
    """A Markdown table (readable as plain text too)."""
    head = ("| rank | max abs diff vs torch DDP | peak memory | model states (measured) | model states (analytic) "
            "| activations + other at peak | bytes sent / step | theory | step time |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        sent = _fmt_bytes(r["bytes_per_step"]) if counted else "not counted"
        lines.append(f"| {r['rank']} | {r['max_diff']:.3g} | {_fmt_bytes(r['peak'])} | {_fmt_bytes(r['states'])} "
                     f"| {_fmt_bytes(r['states_analytic'])} | {_fmt_bytes(r['other_at_peak'])} | {sent} "
                     f"| {_fmt_bytes(r['bytes_theory'])} | {r['step_ms']:.1f} ms |")
    return "\n".join(lines)


def plot_memory(named_breakdowns: list[tuple[str, dict, float]], path: str, title: str) -> None:
    """Stacked bars of peak memory by category, one per label, with the analytic model states marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(named_breakdowns), 4))
    for i, (label, cats, model_states) in enumerate(named_breakdowns):
        bottom = 0.0
        for cat, color in CATEGORY_COLORS.items():
            ax.bar(i, cats[cat] / 1e6, bottom=bottom, color=color, label=CATEGORY_LABELS[cat] if i == 0 else None)
            bottom += cats[cat] / 1e6
        ax.plot([i - 0.4, i + 0.4], [model_states / 1e6] * 2, "k--", lw=1.5,
                label="analytic model states" if i == 0 else None)
    ax.set_xticks(range(len(named_breakdowns)), [b[0] for b in named_breakdowns])
    ax.set_ylabel("MB per rank (rank 0, at peak)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_tour(world_size: int = 2, steps: int = 5, device: str = "cpu", plot: str | None = "tour_memory.png",
             markdown: str | None = None, optimizer: str = "adamw", global_batch: int = 8) -> dict:
    if steps < 2:
        raise ValueError("the tour needs --steps >= 2: the last step is measured, the others are timed")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}")
    strategies = list(STRATEGIES)  # the oracle first; each chapter adds its strategy to the registry
    results = launch(_train_all, world_size, device=device,
                     kwargs=dict(strategies=strategies, steps=steps, optimizer=optimizer,
                                 global_batch=global_batch, config=TOUR_MODEL))
    if comm_rank_or_zero() != 0:
        return {}
    psi = results[0][ORACLE]["psi"]
    header = (f"minifsdp tour: tiny GPT, Ψ = {psi:,} parameters, {optimizer}, {steps} steps, "
              f"world size {world_size}, device {device}, global batch {global_batch}")
    sections, tables = [header], {}
    for name in strategies:
        rows = strategy_rows(name, [r[name] for r in results], [r[ORACLE] for r in results], optimizer)
        tables[name] = rows
        note = " (the oracle; its collectives are not seen by minifsdp's counter)" if name == ORACLE else ""
        sections.append(f"### {name}{note}\n\n{format_table(rows, counted=name != ORACLE)}")
    text = "\n\n".join(sections)
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text + "\n")
    if plot:
        bars = [(name, results[0][name]["peak_by_category"], tables[name][0]["states_analytic"])
                for name in strategies]
        plot_memory(bars, plot, f"Peak memory per rank by category, N = {world_size}")
        print(f"\nwrote {plot}")
    return tables


def comm_rank_or_zero() -> int:
    """Under torchrun every rank runs the tour; only rank 0 reports."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def run_memory_report(world_sizes=(1, 2, 3, 4), steps: int = 3, optimizer: str = "adamw",
                      plot: str | None = None, markdown: str | None = None, device: str = "cpu") -> list[dict]:
    """Chapter 2: DDP's per-rank memory and traffic as N grows, measured next to the analytic model."""
    rows = []
    for n in world_sizes:
        res = launch(train, n, device=device, kwargs=dict(strategy="ddp", model="gpt", optimizer=optimizer,
                                                          steps=steps, global_batch=12, gpt_config=TOUR_MODEL))[0]
        model = analytic.model_state_bytes(res["psi"], n, 0, bytes_per_param(optimizer))
        rows.append({"world_size": n, "psi": res["psi"], "measured": res["after_step"],
                     # on a GPU the caching allocator's peak is the truth; on the CPU, the tracked storages
            "peak": res["allocator"].get("max_allocated", res["peak"]), "peak_by_category": res["peak_by_category"], "analytic": model,
                     "bytes_per_step": sum(res["comm_bytes"].values()) / steps,
                     "bytes_theory": analytic.comm_bytes_per_step(res["psi"], n, 0)})
    lines = ["| N | params | grads | optimizer state | model states analytic (16Ψ) | activations + other at peak "
             "| peak | bytes sent / step | 2Ψ(N−1)/N × 4 B |", "|" + "---|" * 9]
    for r in rows:
        m = r["measured"]
        lines.append(f"| {r['world_size']} | {_fmt_bytes(m['params'])} | {_fmt_bytes(m['grads'])} "
                     f"| {_fmt_bytes(m['optim'])} | {_fmt_bytes(r['analytic']['total'])} "
                     f"| {_fmt_bytes(r['peak_by_category']['other'])} | {_fmt_bytes(r['peak'])} "
                     f"| {_fmt_bytes(r['bytes_per_step'])} | {_fmt_bytes(r['bytes_theory'])} |")
    text = (f"DDP, tiny GPT (Ψ = {rows[0]['psi']:,}), {optimizer}, global batch 12, per rank (rank 0)\n\n"
            + "\n".join(lines))
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text + "\n")
    if plot:
        plot_memory([(f"N={r['world_size']}", r["peak_by_category"], r["analytic"]["total"]) for r in rows],
                    plot, "DDP: peak memory per rank by category")
        print(f"\nwrote {plot}")
    return rows
