"""The tour: every strategy built so far, trained side by side, next to torch's own DDP as the oracle.

    python -m minifsdp tour                        # 2 CPU ranks, 5 steps
    python -m minifsdp tour --world-size 4 --steps 10
    torchrun --nproc-per-node 2 -m minifsdp tour

For each strategy it prints one table: how far its parameters are from torch DDP's after the same steps
(0 means bit-identical), per-rank peak memory measured next to the analytic model, bytes communicated per
step next to the theory, and the step time. It writes a plot of each strategy's model states per rank
(parameters, gradients, optimizer state, as measured after the optimizer step), the analytic model states
and the step's peak beside them; `--plot-world-size 4` measures the plot at 4 ranks, whatever the tour's
own world size. A terminal gets plain tables; `--markdown PATH` writes the same data as the site shows it,
the per-rank tables folded.

`python -m minifsdp memory` is chapter 2's report: plain DDP at world sizes 1..4, measured vs analytic.
"""

from __future__ import annotations

import statistics

from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.measure import analytic
from minifsdp.models import GPTConfig
from minifsdp.reports.format import (MARKDOWN, TERMINAL, Renderer, fmt_bytes, md_table, md_tabs, plot_memory,
                                     write_report)
from minifsdp.train import OPTIMIZERS, STRATEGIES, max_abs_diff, train

TOUR_MODEL = GPTConfig(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=64, tie_weights=True)
# A GPT whose model states outweigh its activations (a wide vocabulary, an untied head, short sequences,
# two per rank): where sharding the gradients shows in the peak (chapter 4).
STATES_HEAVY_MODEL = GPTConfig(vocab_size=1024, block_size=32, n_layer=2, n_head=4, n_embd=128, tie_weights=False)
MODELS = {"tour": (TOUR_MODEL, lambda n: 12), "states-heavy": (STATES_HEAVY_MODEL, lambda n: 2 * n)}
ORACLE = "torch_ddp"


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
    strategy = STRATEGIES[name]
    rows = []
    for r, res in enumerate(per_rank):
        n, psi = res["world_size"], res["psi"]
        model = analytic.model_state_bytes(psi, n, strategy.stage, bytes_per_param(optimizer))
        states = res["after_step"]
        rows.append({
            "rank": r,
            "max_diff": max_abs_diff(res["params"], oracle[r]["params"]),
            # on a GPU the caching allocator's peak is the truth; on the CPU, the tracked storages
            "peak": res["allocator"].get("max_allocated", res["peak"]),
            "alloc_retries": res["allocator"].get("num_alloc_retries"),  # CUDA only (None on the CPU)
            "states": states["params"] + states["grads"] + states["optim"],
            "states_analytic": model["total"],
            "other_at_peak": res["peak_by_category"]["other"],
            "bytes_per_step": sum(res["comm_bytes"].values()) / res["steps"],
            "bytes_theory": strategy.comm_passes * psi * 4 * (n - 1) / n,
            "step_ms": 1e3 * statistics.median(res["step_times"]),
        })
    return rows


def counted(name: str) -> bool:
    """torch's own strategies talk to torch.distributed directly: minifsdp's counter never sees their bytes."""
    return not name.startswith("torch")


def format_tour(tables: dict[str, list[dict]], render: Renderer = MARKDOWN) -> str:
    """The tour, for the site (MARKDOWN) or a terminal (TERMINAL): one row per strategy with what the home
    page compares (rank 0; the difference from torch's DDP is the largest over the ranks), then every column
    for every rank, folded on the site."""
    summary = []
    for name, rows in tables.items():
        r0 = rows[0]
        summary.append([f"{name} (the oracle)" if name == ORACLE else name,
                        f"{max(r['max_diff'] for r in rows):.3g}", fmt_bytes(r0["states"]),
                        fmt_bytes(r0["states_analytic"]),
                        fmt_bytes(r0["bytes_per_step"]) if counted(name) else "not counted",
                        fmt_bytes(r0["bytes_theory"])])
    theirs = [name for name in tables if not counted(name)]
    note = (f"{' and '.join(theirs)} {'is' if len(theirs) == 1 else 'are'} PyTorch's own: "
            f"{'its' if len(theirs) == 1 else 'their'} collectives do not pass through minifsdp's counter."
            if theirs else "")
    memory, traffic = [], []
    for name, rows in tables.items():
        for r in rows:
            memory.append([name, r["rank"], fmt_bytes(r["peak"]), fmt_bytes(r["states"]),
                           fmt_bytes(r["states_analytic"]), fmt_bytes(r["other_at_peak"])])
            traffic.append([name, r["rank"], f"{r['max_diff']:.3g}",
                            fmt_bytes(r["bytes_per_step"]) if counted(name) else "not counted",
                            fmt_bytes(r["bytes_theory"]), f"{r['step_ms']:.1f} ms"])
    every_rank = "\n\n".join([
        render.table(["strategy", "rank", "peak memory", "model states (measured)", "model states (analytic)",
                      "activations + other at peak"], memory, "Memory"),
        render.table(["strategy", "rank", "max abs diff vs torch DDP", "bytes sent / step", "theory", "step time"],
                     traffic, "Parity, traffic and time")])
    return "\n\n".join(part for part in [
        render.table(["strategy", "max abs diff vs torch DDP", "model states (measured)", "model states (analytic)",
                      "bytes sent / step", "theory"], summary), note,
        render.folded("All columns, every rank: peak memory, activations, step time", every_rank)] if part)


def run_tour(world_size: int = 2, steps: int = 5, device: str = "cpu", plot: str | None = "tour_memory.svg",
             markdown: str | None = None, optimizer: str = "adamw", global_batch: int = 8,
             strategies=None, plot_world_size: int | None = None) -> dict:
    """plot_world_size: the world size the plot shows (default: the tour's own). Another one trains every
    strategy again at that size, for the plot only: two steps, the second measured."""
    if plot_world_size not in (None, world_size) and under_torchrun():
        raise ValueError("under torchrun the plot is measured at the tour's own world size: "
                         "leave out --plot-world-size")
    if steps < 2:
        raise ValueError("the tour needs --steps >= 2: the last step is measured, the others are timed")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}")
    unknown = sorted(set(strategies or ()) - set(STRATEGIES))
    if unknown:
        raise ValueError(f"unknown strategies {unknown}: choose from {', '.join(STRATEGIES)}")
    # the oracle first, always (every row is compared with it); each chapter adds its strategy to the registry
    strategies = [ORACLE] + [name for name in (strategies or STRATEGIES) if name != ORACLE]
    results = launch(_train_all, world_size, device=device,
                     kwargs=dict(strategies=strategies, steps=steps, optimizer=optimizer,
                                 global_batch=global_batch, config=TOUR_MODEL))
    if comm_rank_or_zero() != 0:
        return {}
    psi = results[0][ORACLE]["psi"]
    header = (f"minifsdp tour: the tour GPT, Ψ = {psi:,} parameters, {optimizer}, {steps} steps, "
              f"world size {world_size}, device {device}, global batch {global_batch}")
    tables = {name: strategy_rows(name, [r[name] for r in results], [r[ORACLE] for r in results], optimizer)
              for name in strategies}
    write_report(f"{header}\n\n{format_tour(tables)}", markdown,
                 printed=f"{header}\n\n{format_tour(tables, TERMINAL)}")
    if plot:
        at, measured = world_size, results
        if plot_world_size not in (None, world_size):
            at, measured = plot_world_size, launch(
                _train_all, plot_world_size, device=device,
                kwargs=dict(strategies=strategies, steps=2, optimizer=optimizer, global_batch=global_batch,
                            config=TOUR_MODEL))
        plot_tour({name: ([r[name] for r in measured], [r[ORACLE] for r in measured]) for name in strategies},
                  optimizer, plot, at)
        print(f"\nwrote {plot}")
    return tables


def plot_tour(per_strategy: dict[str, tuple[list[dict], list[dict]]], optimizer: str, path: str,
              world_size: int) -> None:
    """The tour's figure: each strategy's model states on rank 0 after the optimizer step (parameters,
    gradients, optimizer state: what the ZeRO stages shard), the analytic model states dashed, and the
    step's peak (activations and temporaries included) as a dot. per_strategy: name -> (each rank's result
    of train(), the oracle's)."""
    bars, peaks = [], []
    for name, (per_rank, oracle) in per_strategy.items():
        row = strategy_rows(name, per_rank, oracle, optimizer)[0]
        stage = STRATEGIES[name].stage
        bars.append((f"{name} (ZeRO-{stage})" if stage else name, per_rank[0]["after_step"], row["states_analytic"]))
        peaks.append(row["peak"])
    plot_memory(bars, path, f"Model states per rank after the optimizer step, N = {world_size}", peaks=peaks,
                xlabel="MB per rank (rank 0)", categories=("params", "grads", "optim"))


def comm_rank_or_zero() -> int:
    """Under torchrun every rank runs the tour; only rank 0 reports."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def under_torchrun() -> bool:
    """Whether this process is one of torchrun's ranks (its environment names the rank and the world)."""
    import os

    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def run_memory_report(strategies=("ddp",), world_sizes=(1, 2, 3, 4), steps: int = 6, optimizer: str = "adamw",
                      plot: str | None = None, markdown: str | None = None, device: str = "cpu",
                      bars: str = "after_step", model: str = "tour") -> list[dict]:
    """Chapters 2-4: per-rank memory and traffic of each strategy as N grows, measured vs analytic (rank 0).

    bars:  what the plot stacks -- "peak" (memory by category at the peak) or "after_step" (the model
           states after the optimizer step, with the peak as a dot).
    model: "tour" (the tour GPT, global batch 12) or "states-heavy" (STATES_HEAVY_MODEL, two sequences per rank).
    """
    config, global_batch = MODELS[model]
    rows = []
    for n in world_sizes:
        per_rank = launch(_train_all, n, device=device,
                          kwargs=dict(strategies=list(strategies), steps=steps, optimizer=optimizer,
                                      global_batch=global_batch(n), config=config))
        baseline = statistics.median(per_rank[0][strategies[0]]["step_times"])
        for name in strategies:
            res = per_rank[0][name]
            row = strategy_rows(name, [res], [res], optimizer)[0]  # rank 0; no oracle needed here
            rows.append({**row, "strategy": name, "world_size": n, "measured": res["after_step"],
                         "peak_by_category": res["peak_by_category"], "psi": res["psi"],
                         "time_vs_first": statistics.median(res["step_times"]) / baseline})
    tables = format_memory_report(rows, list(strategies))
    batch = "global batch 12" if model == "tour" else "2 sequences per rank"
    text = (f"{'tour GPT' if model == 'tour' else 'states-heavy GPT'} (Ψ = {rows[0]['psi']:,}), {optimizer}, "
            f"{batch}, per rank (rank 0), CPU\n\n" + tables)
    write_report(text, markdown)
    if plot:
        # one strategy: a bar per world size; several: a panel per world size, a bar per strategy
        one = len(strategies) == 1
        label = (lambda r: f"N = {r['world_size']}") if one else (lambda r: r["strategy"])
        panels = None if one else [f"N = {r['world_size']}" for r in rows]
        if bars == "peak":
            plot_memory([(label(r), r["peak_by_category"], r["states_analytic"]) for r in rows], plot,
                        f"{', '.join(strategies)}: peak memory per rank by category", panels=panels)
        else:
            plot_memory([(label(r), r["measured"], r["states_analytic"]) for r in rows], plot,
                        f"{', '.join(strategies)}: memory per rank after the optimizer step",
                        peaks=[r["peak"] for r in rows], xlabel="MB per rank (rank 0)", panels=panels)
        print(f"\nwrote {plot}")
    return rows


def format_memory_report(rows: list[dict], strategies: list[str]) -> str:
    """Two tables, each within format.MAX_COLUMNS: the model states after the step (measured next to the
    analytic model), then the step's peak and the bytes sent (next to the theory). One strategy: a row per
    world size. Several: a tab per world size, a row per strategy."""
    state_head = ["params", "grads", "optimizer state", "model states (measured)", "model states (analytic)"]
    peak_head = ["activations + other at peak", "peak", "bytes sent / step", "theory"]
    captions = ("Model states after the optimizer step", "Peak of the step, and bytes sent")

    def states(r):
        m = r["measured"]
        return [fmt_bytes(m["params"]), fmt_bytes(m["grads"]), fmt_bytes(m["optim"]), fmt_bytes(r["states"]),
                fmt_bytes(r["states_analytic"])]

    def peak(r):
        return [fmt_bytes(r["other_at_peak"]), fmt_bytes(r["peak"]), fmt_bytes(r["bytes_per_step"]),
                fmt_bytes(r["bytes_theory"])]

    if len(strategies) == 1:  # the step time against itself would be 1.00 on every row
        return "\n\n".join([md_table(["N"] + state_head, [[r["world_size"]] + states(r) for r in rows], captions[0]),
                            md_table(["N"] + peak_head, [[r["world_size"]] + peak(r) for r in rows], captions[1])])
    panels = []
    # the tabs open on the first N > 1: at N = 1 nothing is sharded and every strategy holds the same (last)
    for n in sorted(dict.fromkeys(r["world_size"] for r in rows), key=lambda n: (n == 1, n)):
        at_n = [r for r in rows if r["world_size"] == n]
        panels.append((f"N = {n}", "\n\n".join([
            md_table(["strategy"] + state_head, [[r["strategy"]] + states(r) for r in at_n], captions[0]),
            md_table(["strategy"] + peak_head + [f"step time vs {strategies[0]}"],
                     [[r["strategy"]] + peak(r) + [f"{r['time_vs_first']:.2f}"] for r in at_n], captions[1])])))
    return md_tabs(panels)


def run_partition_report(world_sizes=(2, 3, 4, 5, 6, 7, 8), markdown: str | None = None) -> list[dict]:
    """Chapter 3: how evenly each way of splitting the tour GPT's parameters loads the ranks.

    Imbalance = the largest rank's share over the mean share; every rank must be provisioned for the
    largest, so 1.25 means 25% more memory than a perfect split. No process group is needed: a partition
    is plain arithmetic on parameter sizes.
    """
    import torch

    from minifsdp.models import TinyGPT
    from minifsdp.zero.oss import imbalance, partition_by_order, partition_parameters

    def report(name, model):
        groups = [{"params": list(model.parameters())}]
        psi = sum(p.numel() for p in groups[0]["params"])
        out = []
        for n in world_sizes:
            greedy = [[p for g in rank for p in g["params"]] for rank in partition_parameters(groups, n)]
            flat = n * -(-psi // n) / psi  # a flat buffer cut into N equal slices: only the padding
            out.append({"model": name, "world_size": n, "greedy": imbalance(greedy),
                        "by_order": imbalance(partition_by_order(groups, n)), "flat": flat})
        return out

    huge = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 10))
    rows = report(f"tour GPT (Ψ = {sum(p.numel() for p in TinyGPT(TOUR_MODEL).parameters()):,})",
                  TinyGPT(TOUR_MODEL)) + report("one 1000x1000 layer + a small one", huge)
    lines = ["| model | N | greedy by size (OSS) | consecutive by order | flat slices |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['world_size']} | {r['greedy']:.3f} | {r['by_order']:.3f} | {r['flat']:.4f} |"
              for r in rows]
    text = "Largest rank's share of the parameters (and so of the optimizer state) over the mean share\n\n" + \
        "\n".join(lines)
    write_report(text, markdown)
    return rows
