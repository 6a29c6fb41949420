"""Cost curves: step time and peak memory per rank as the model (Ψ) and the world size (N) grow, for
minifsdp's DDP, OSS, SDP and FSDP next to torch's DDP, ZeroRedundancyOptimizer, FSDP1 and FSDP2.

    python bench/sweep.py --plot chapters/figures/cost_curves.svg --markdown chapters/generated/cost_curves.md

    [--sizes 1M 3M 10M 30M 100M 200M] [--world-sizes 1 2 4] [--strategies ddp torch_ddp ...]
    [--steps 2] [--warmup 1] [--batch 1] [--seq 64] [--memory-budget 18] [--json out.json] [--replot a.json b.json]

The models are one GPT family (minifsdp's TinyGPT, vocabulary 256, 64-token sequences) made wider and deeper
to reach Ψ ≈ 1M ... 200M (SIZES below; `--sizes 2x64` asks for 2 layers of width 64). Every contender trains
the same model from the same weights with the same AdamW, on the same data (`--batch` sequences per rank,
so the global batch grows with N), in the same ranks (CPU + gloo), alternating step by step as the other
benches do (bench/interleave.py). rank 0's median step time leaves out the warm-up steps. The peak memory is
the largest rank's peak of one more, metered step per contender, measured with minifsdp.MemoryMeter as in
bench/fsdp_vs_torch.py (the FSDPs' unsharded buffers watched as parameters): tracked tensor bytes, not RSS.

The contenders (`--strategies`), each reusing the other benches' builders:
    ddp        minifsdp DistributedDataParallel + AdamW
    oss        minifsdp OSS(AdamW) under torch's DDP (as bench/oss_vs_zero.py: next to torch's
               ZeroRedundancyOptimizer, also under torch's DDP, the sharded optimizer is the only difference)
    sdp        minifsdp ShardedDataParallel + OSS(AdamW)
    fsdp       minifsdp FullyShardedDataParallel, one unit per Block, at its defaults (as torch FSDP1's: BACKWARD_PRE)
    torch_ddp  torch DistributedDataParallel + AdamW
    zero       torch ZeroRedundancyOptimizer(AdamW) under torch's DDP
    fsdp1      torch FullyShardedDataParallel (FSDP1), one unit per Block, device_id=cpu
    fsdp2      torch fully_shard (FSDP2) on every Block and the root

Holding every contender at once in every rank stops fitting long before 200M parameters. So each (Ψ, N) runs
its contenders together when they all fit in `--memory-budget` GB (all ranks, estimated from the analytic
model, see `estimate`); else in groups, each minifsdp strategy with its torch counterpart(s); else a
group that does not fit runs its contenders one after another; a contender that does not fit even alone
is left out ("—"). The table says how each row ran. With the default 18 GB (a 24 GB machine), the sweep
stops at 200M with N = 4 for both DDPs, OSS and ZeRO-1: 4 ranks x 16Ψ is 12.9 GB of model states alone.
On 2 busy CPU cores the default sweep takes about 40 minutes; `--json` keeps every case as it ends, and
`--replot` reports (and merges) such files without running anything.

Reported (Markdown, also written to `--markdown`): the peak memory per rank and the step time of every
contender at every (Ψ, N) next to the analytic model states; the ratios minifsdp / torch per matching pair;
the log-log slope of each cost in Ψ over the largest sizes; how the peak scales with N. `--plot` draws
both costs against Ψ, log-log, one panel per N, with the analytic model states as lines.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import resource
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from fsdp_vs_torch import ADAMW, unsharded_buffers
from fsdp_vs_torch import build as build_fsdp_bench
from interleave import rank_batch, time_interleaved
from minifsdp import (DistributedDataParallel, GPTConfig, MemoryMeter, ShardedDataParallel, TinyGPT, analytic,
                      launch)
from minifsdp.reports import style
from minifsdp.reports.format import MAX_COLUMNS, md_table, md_tabs
from oss_vs_zero import sharded_optimizer

# name -> (label, ZeRO stage of its model states)
CONTENDERS = {
    "ddp": ("minifsdp DDP", 0), "oss": ("minifsdp OSS", 1), "sdp": ("minifsdp SDP", 2),
    "fsdp": ("minifsdp FSDP", 3), "torch_ddp": ("torch DDP", 0), "zero": ("torch ZeRO-1", 1),
    "fsdp1": ("torch FSDP1", 3), "fsdp2": ("torch FSDP2", 3),
}
PAIRS = [("ddp", "torch_ddp"), ("oss", "zero"), ("fsdp", "fsdp2"), ("fsdp", "fsdp1")]  # minifsdp / torch
GROUPS = [("ddp", "torch_ddp"), ("oss", "zero"), ("sdp",), ("fsdp", "fsdp1", "fsdp2")]  # when not all fit
UNDER_TORCH_DDP = ("torch_ddp", "oss", "zero")  # these keep torch DDP's gradient buckets: 4Ψ more
FSDP_BENCH_NAME = {"fsdp": "minifsdp_defaults", "fsdp1": "fsdp1", "fsdp2": "fsdp2", "torch_ddp": "ddp"}

# Ψ ≈ 12 · layers · width² (+ embeddings): 1.0M, 3.2M, 10.0M, 31.6M, 99.4M, 201.6M with 64-token sequences
SIZES = {"1M": (5, 128), "3M": (7, 192), "10M": (8, 320), "30M": (10, 512), "100M": (14, 768), "200M": (16, 1024)}
BASE_BYTES = 0.5e9  # a rank's own memory before any model: torch, gloo, Python (for the budget only)
SLACK = 1.25        # the resident set measured above the tracked estimate (freed memory malloc keeps, ...)


def config_of(size: str, seq: int) -> GPTConfig:
    """A named size of SIZES, or LAYERSxWIDTH (e.g. 2x64)."""
    if size in SIZES:
        layers, width = SIZES[size]
    elif m := re.fullmatch(r"(\d+)x(\d+)", size):
        layers, width = int(m[1]), int(m[2])
    else:
        raise ValueError(f"size {size!r} is neither one of {', '.join(SIZES)} nor LAYERSxWIDTH (e.g. 2x64)")
    return GPTConfig(vocab_size=256, block_size=seq, n_layer=layers, n_head=max(1, width // 64), n_embd=width)


def count(config: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TinyGPT(config).parameters())


def model_states(name: str, psi: int, n: int) -> float:
    """The analytic model's bytes per rank of fp32 parameters, gradients and AdamW state (16Ψ at N = 1)."""
    return analytic.model_state_bytes(psi, n, CONTENDERS[name][1])["total"]


def resident_bytes(name: str, psi: int, n: int) -> tuple[float, float]:
    """(bytes a contender holds between its steps, what its own step adds: the gradients) per rank."""
    split = analytic.model_state_bytes(psi, n, CONTENDERS[name][1])
    return split["params"] + split["optim"] + (4 * psi if name in UNDER_TORCH_DDP else 0), split["grads"]


def estimate(group, psi: int, n: int) -> float:
    """All ranks' resident bytes for holding `group` and stepping each in turn: 8Ψ more for a model being built
    (and flattened) or AdamW's temporaries. Checked against the measured max RSS, which the sweep prints."""
    held = [resident_bytes(name, psi, n) for name in group]
    return SLACK * n * (BASE_BYTES + sum(h for h, _ in held) + max(g for _, g in held) + 8 * psi)


def plan(names, psi: int, n: int, budget: float):
    """The groups to interleave, how (a word for the table), and who does not fit at all."""
    if estimate(names, psi, n) <= budget:
        return [list(names)], "all together", []
    groups, skipped, how = [], [], "in pairs"
    for group in GROUPS:
        group = [name for name in group if name in names]
        if not group:
            continue
        if estimate(group, psi, n) <= budget:
            groups.append(group)
            continue
        how = "pairs, some alone"
        for name in group:
            (groups.append([name]) if estimate([name], psi, n) <= budget else skipped.append(name))
    return groups, how, skipped


def build(name: str, config: GPTConfig):
    """(wrapped model, optimizer), from the same seed in every rank: the builders of the other benches."""
    if name in FSDP_BENCH_NAME:  # minifsdp FSDP, torch FSDP1 / FSDP2 / DDP, as bench/fsdp_vs_torch.py builds them
        return build_fsdp_bench(FSDP_BENCH_NAME[name], config)
    if name in ("oss", "zero"):  # as bench/oss_vs_zero.py: the sharded optimizer under torch's DDP
        model = TorchDDP(TinyGPT(config))
        return model, sharded_optimizer("minifsdp" if name == "oss" else "torch", model.parameters())
    if name == "sdp":
        opt = sharded_optimizer("minifsdp", (net := TinyGPT(config)).parameters())
        return ShardedDataParallel(net, opt), opt
    model = DistributedDataParallel(TinyGPT(config))
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def meter_step(name: str, model, opt, x, y) -> float:
    """The tracked peak of one training step. The meter watches the parameters of the model inside a DDP
    wrapper, the state this rank's optimizer really holds (`.optim` of a sharded one), and the FSDPs'
    unsharded buffers."""
    inner = model.module if isinstance(model, (TorchDDP, DistributedDataParallel)) else model
    meter = MemoryMeter(inner, getattr(opt, "optim", opt))
    if not (name == "fsdp1" and dist.get_world_size() == 1):  # FSDP1 runs NO_SHARD on one rank: no such buffers
        meter.watch(unsharded_buffers(FSDP_BENCH_NAME.get(name, name), model), "params")
    with meter:
        model(x, y).backward()
        opt.step()
    meter.close()
    opt.zero_grad()
    return meter.peak


def run_case(groups, config: GPTConfig, steps: int, warmup: int, batch: int) -> dict:
    """One (Ψ, N) on every rank: each group trained interleaved, then metered; freed before the next."""
    times, peaks = {}, {}
    warnings.filterwarnings("ignore", message="FSDP is switching to use `NO_SHARD`")  # on one rank: we know
    for group in groups:
        runs = {name: build(name, config) for name in group}
        for name, t in time_interleaved(runs, warmup + steps, config, batch).items():
            times[name] = statistics.median(t[warmup:])
        x, y = rank_batch(config, warmup + steps, batch)
        for name, (model, opt) in runs.items():
            dist.barrier()
            peaks[name] = meter_step(name, model, opt, x, y)
        del runs, model, opt
        gc.collect()
    return {"times": times, "peaks": peaks, "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def sweep(names, sizes, world_sizes, steps=2, warmup=1, batch=1, seq=64, budget=18e9, log=sys.stderr,
          json_path=None) -> dict:
    """Every (size, N): which contenders ran and how, rank 0's median step time, the largest rank's peak.
    With `json_path`, the results so far are written there after every case."""
    names = [name for name in CONTENDERS if name in names]  # in table order
    cases = []
    res = {"names": names, "sizes": list(sizes), "world_sizes": list(world_sizes), "steps": steps,
           "warmup": warmup, "batch": batch, "seq": seq, "budget": budget, "cases": cases, "wall": 0.0}
    start = time.perf_counter()
    for size in sizes:
        config = config_of(size, seq)
        psi = count(config)
        for n in world_sizes:
            groups, how, skipped = plan(names, psi, n, budget)
            t0 = time.perf_counter()
            per_rank = launch(run_case, n, args=(groups, config, steps, warmup, batch), device="cpu",
                              timeout=900) if groups else []
            wall = time.perf_counter() - t0
            ran = [name for g in groups for name in g]
            case = {"size": size, "psi": psi, "n": n, "how": how, "skipped": skipped,
                    "shape": f"{config.n_layer} × {config.n_embd}",
                    "times": {k: per_rank[0]["times"][k] for k in ran},
                    "peaks": {k: max(r["peaks"][k] for r in per_rank) for k in ran},
                    "estimate": max((estimate(g, psi, n) for g in groups), default=0.0),
                    "rss": sum(r["maxrss"] for r in per_rank), "wall": wall}
            cases.append(case)
            print(f"[sweep] Ψ={psi / 1e6:.1f}M N={n}: {how}, {len(ran)} ran, {len(skipped)} over the budget, "
                  f"{wall:.0f} s; all ranks' max RSS {case['rss'] / 1e9:.1f} GB "
                  f"(estimated {case['estimate'] / 1e9:.1f} GB)", file=log, flush=True)
            res["wall"] = time.perf_counter() - start
            if json_path:
                with open(json_path, "w") as f:
                    json.dump(res, f, indent=1)
    return res


def merge(parts: list[dict]) -> dict:
    """Results of several runs (the same settings, other sizes or world sizes) as one."""
    res = dict(parts[0], cases=[c for part in parts for c in part["cases"]], wall=sum(p["wall"] for p in parts),
               runs=len(parts))
    res["cases"].sort(key=lambda c: (c["psi"], c["n"]))
    res["world_sizes"] = sorted({c["n"] for c in res["cases"]})
    res["sizes"] = list(dict.fromkeys(c["size"] for c in res["cases"]))
    return res


# -- what the numbers say --------------------------------------------------------------------------------------
def curve(res: dict, name: str, n: int, key: str) -> list[tuple[int, float]]:
    """(Ψ, cost) of one contender at one N, over the sizes it ran at."""
    return [(c["psi"], c[key][name]) for c in res["cases"] if c["n"] == n and name in c[key]]


def slope(points, largest: int = 3) -> float | None:
    """The log-log slope (least squares) over the `largest` greatest x: cost ∝ x^slope there."""
    points = sorted(points)[-largest:]
    if len(points) < 2:
        return None
    xs, ys = [math.log(p) for p, _ in points], [math.log(v) for _, v in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def ratios(res: dict) -> list[dict]:
    """minifsdp / torch per pair and case, where both ran."""
    out = []
    for c in res["cases"]:
        row = {"psi": c["psi"], "n": c["n"]}
        for a, b in PAIRS:
            if a in c["times"] and b in c["times"]:
                row[(a, b)] = (c["times"][a] / c["times"][b], c["peaks"][a] / c["peaks"][b])
        out.append(row)
    return out


def n_scaling(res: dict, name: str):
    """At the largest Ψ where `name` ran at every N: (Ψ, {N: peak(N) / peak(smallest N)}, fitted exponent b)."""
    ns = sorted(res["world_sizes"])
    ran = {}  # Ψ -> {N: peak}
    for c in res["cases"]:
        if name in c["peaks"]:
            ran.setdefault(c["psi"], {})[c["n"]] = c["peaks"][name]
    full = [psi for psi, peaks in ran.items() if set(peaks) >= set(ns)]
    if len(ns) < 2 or not full:
        return None
    psi = max(full)
    peaks = ran[psi]
    return psi, {n: peaks[n] / peaks[ns[0]] for n in ns}, slope(list(peaks.items()), largest=len(ns))


def mb(b: float) -> str:
    return f"{b / 1e6:,.0f}" if b >= 10e6 else f"{b / 1e6:.1f}"


def ms(s: float) -> str:
    return f"{1e3 * s:,.0f}" if s >= 0.1 else f"{1e3 * s:.1f}"


def psi_text(psi: int) -> str:
    return f"{psi / 1e6:.1f}M" if psi >= 1e6 else f"{psi / 1e3:.0f}k"


def markdown(res: dict) -> str:
    names, lines = res["names"], []
    labels = [CONTENDERS[n][0] for n in names]
    add = lines.append
    add(f"TinyGPT family (vocabulary 256, {res['seq']}-token sequences, {res['batch']} per rank), AdamW, CPU + gloo; "
        f"step time: rank 0's median of {res['steps']} steps after {res['warmup']} warm-up; peak: the largest "
        f"rank's tracked peak (MemoryMeter) of one more step. Contenders run in the same ranks, interleaved "
        f"step by step, as many at a time as {res['budget'] / 1e9:.0f} GB allow (all ranks, estimated); "
        f"— : over that budget even alone. Ψ (layers × width): " + ", ".join(dict.fromkeys(
            f"{psi_text(c['psi'])} ({c['shape']})" for c in res["cases"])) + ".\n")
    # A tab per N, a column per Ψ and a row per contender, each minifsdp strategy beside its torch counterpart:
    # eight contenders as columns would scroll sideways in the docs' column (format.MAX_COLUMNS).
    order = sorted(names, key=lambda n: CONTENDERS[n][1])
    stages = sorted({CONTENDERS[n][1] for n in names})
    tabs = []
    for n in sorted(res["world_sizes"], key=lambda n: (n == 1, n)):  # N = 1, where nothing is sharded, last
        at = [c for c in res["cases"] if c["n"] == n]
        body = []
        for title, key, fmt in (("Peak memory per rank, MB", "peaks", mb), ("Median step time, ms", "times", ms)):
            for chunk in range(0, len(at), MAX_COLUMNS - 1):
                cases = at[chunk:chunk + MAX_COLUMNS - 1]
                rows = [["run", *(c["how"] for c in cases)]] if key == "peaks" else []
                rows += [[CONTENDERS[name][0], *(fmt(c[key][name]) if name in c[key] else "—" for c in cases)]
                         for name in order]
                if key == "peaks":
                    rows += [[f"model states, {STAGE_NAMES[s]} (analytic)",
                              *(mb(analytic.model_state_bytes(c["psi"], c["n"], s)["total"]) for c in cases)]
                             for s in stages]
                body.append(md_table(["Ψ", *(psi_text(c["psi"]) for c in cases)], rows, caption=title))
        tabs.append((f"N = {n}", "\n\n".join(body)))
    add(md_tabs(tabs) + "\n")
    rows = ratios(res)
    pairs = [(a, b) for a, b in PAIRS if a in names and b in names]
    if pairs:
        add("**minifsdp / torch** (step time, peak memory)\n")
        add("| Ψ | N | " + " | ".join(f"{CONTENDERS[a][0]} / {CONTENDERS[b][0]}" for a, b in pairs) + " |")
        add("|---|---|" + "---|" * len(pairs))
        for r in rows:
            add(f"| {psi_text(r['psi'])} | {r['n']} | " + " | ".join(
                f"{r[p][0]:.2f}, {r[p][1]:.2f}" if p in r else "—" for p in pairs) + " |")
        summary = []
        for p in pairs:
            got = [r[p] for r in rows if p in r]
            if got:
                t, m = [g[0] for g in got], [g[1] for g in got]
                summary.append(f"{statistics.median(t):.2f} ({min(t):.2f}–{max(t):.2f}), "
                               f"{statistics.median(m):.2f} ({min(m):.2f}–{max(m):.2f})")
            else:
                summary.append("—")
        add("| median (range) | | " + " | ".join(summary) + " |")
        add("")
    ns = res["world_sizes"]
    add("**Log-log slopes in Ψ** over the three largest Ψ each ran at: peak ∝ Ψ^a, step time ∝ Ψ^k\n")
    for letter, key in (("a", "peaks"), ("k", "times")):
        add(md_table(["", *(f"{letter} at N={n}" for n in ns)],
                     [[CONTENDERS[name][0], *("—" if s is None else f"{s:.2f}"
                                              for s in (slope(curve(res, name, n, key)) for n in ns))]
                      for name in order]) + "\n")
    if len(ns) > 1:
        add(f"**Peak per rank as N grows**, at the largest Ψ each ran at with every N: peak(N) / peak(N={ns[0]}), "
            f"measured (model states), and the fitted peak ∝ N^b\n")
        add("| | Ψ | " + " | ".join(f"N={n}" for n in ns[1:]) + " | b |")
        add("|---|---|" + "---|" * len(ns))
        for name, label in zip(names, labels):
            got = n_scaling(res, name)
            if got is None:
                continue
            psi, rel, b = got
            model = {n: model_states(name, psi, n) / model_states(name, psi, ns[0]) for n in ns}
            add(f"| {label} | {psi_text(psi)} | " + " | ".join(f"{rel[n]:.2f} ({model[n]:.2f})" for n in ns[1:])
                + f" | {b:.2f} |")
        add("")
    return "\n".join(lines)


STYLE = {  # family colour by stage; minifsdp filled and solid, torch hollow and dashed
    "ddp": ("blue", "o", "-"), "torch_ddp": ("blue", "o", "--"), "oss": ("orange", "s", "-"),
    "zero": ("orange", "s", "--"), "sdp": ("green", "D", "-"), "fsdp": ("red", "^", "-"),
    "fsdp1": ("red", "v", "--"), "fsdp2": ("red", "^", "--"),
}
STAGE_NAMES = {0: "DDP 16Ψ", 1: "OSS 8Ψ+8Ψ/N", 2: "SDP 4Ψ+12Ψ/N", 3: "FSDP 16Ψ/N"}


@style.charts
def plot(res: dict, path: str) -> None:
    """Peak memory (top row) and step time (bottom row) against Ψ, log-log, a column per N, in the charts'
    style (minifsdp/reports/style.py); the analytic model states dotted, in the colour of their stage."""
    import numpy as np
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ns, names = res["world_sizes"], res["names"]
    psis = sorted({c["psi"] for c in res["cases"]})
    fig, axes = style.figure(6.6, 2, len(ns), squeeze=False, sharex=True, sharey="row")
    grid = np.geomspace(psis[0] / 1.3, psis[-1] * 1.3, 50)
    for j, n in enumerate(ns):
        mem, tim = axes[0][j], axes[1][j]
        for stage in sorted({CONTENDERS[name][1] for name in names}):
            colour = style.LINES[STYLE[next(k for k in names if CONTENDERS[k][1] == stage)][0]]
            mem.plot(grid, [analytic.model_state_bytes(p, n, stage)["total"] / 1e6 for p in grid], color=colour,
                     lw=1.6, ls=":", label=f"model states, {STAGE_NAMES[stage]}")
        for name in names:
            hue, marker, ls = STYLE[name]
            colour = style.LINES[hue]
            for ax, key, scale in ((mem, "peaks", 1e-6), (tim, "times", 1e3)):
                pts = sorted(curve(res, name, n, key))
                if pts:
                    ax.plot([p for p, _ in pts], [v * scale for _, v in pts], color=colour, marker=marker, ls=ls,
                            ms=5, lw=1.4, mfc=colour if ls == "-" else "none", mew=1.3, label=CONTENDERS[name][0])
        mem.set_title(f"N = {n}")
        for ax in (mem, tim):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.xaxis.set_major_locator(LogLocator(base=10))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e6:g}M"))
            ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))  # labels even on less than a decade
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.grid(True, which="major")
            ax.grid(True, which="minor", alpha=0.12)
        tim.set_xlabel("Ψ (parameters)")
        if j == 0:
            mem.set_ylabel("peak MB per rank (tracked)")
            tim.set_ylabel("step time, ms (rank 0)")
    legend = {}  # every line once, whichever panel has it
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(legend.values(), legend.keys(), loc="outside lower center", ncol=3, columnspacing=1.0,
               handlelength=2.2)
    fig.suptitle("Cost per rank as Ψ and N grow (CPU + gloo); dotted: the analytic model states")
    style.save(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), help=f"of {', '.join(SIZES)}, or LAYERSxWIDTH")
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--strategies", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    ap.add_argument("--steps", type=int, default=2, help="timed steps, after the warm-up ones")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--memory-budget", type=float, default=18, help="GB, all ranks together (estimated)")
    ap.add_argument("--markdown", help="write the tables here too")
    ap.add_argument("--plot", help="draw the curves into this image")
    ap.add_argument("--json", help="keep the raw results here (rewritten after every case)")
    ap.add_argument("--replot", nargs="+", help="report the results of earlier --json runs (merged), running nothing")
    args = ap.parse_args()
    if args.replot:
        parts = []
        for path in args.replot:
            with open(path) as f:
                parts.append(json.load(f))
        res = merge(parts)
    else:
        res = sweep(args.strategies, args.sizes, args.world_sizes, args.steps, args.warmup, args.batch, args.seq,
                    args.memory_budget * 1e9, json_path=args.json)
    runs = res.get("runs", 1)
    text = markdown(res) + f"\nwall time of the sweep: {res['wall'] / 60:.0f} min" + \
        (f" ({runs} runs, merged)\n" if runs > 1 else "\n")
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.plot:
        plot(res, args.plot)


if __name__ == "__main__":
    main()
