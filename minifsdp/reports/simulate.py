"""Chapter 13's simulator, as the command prints it: one run's memory per phase, its checks against the analytic
model and its bytes per collective; a sweep over models, N and strategies as tables and a figure; and the seeds'
worked examples (worked_examples.py).

    python -m minifsdp simulate --model 7b --world-size 1024 --strategy fsdp --precision bf16
    python -m minifsdp simulate --model 7b 70b --world-sizes 8 16 32 64 128 256 512 1024 \\
        --strategy ddp oss sdp fsdp fully_shard --plot chapters/figures/scaling_memory.svg \\
        --markdown chapters/generated/scaling_memory.md
    python -m minifsdp simulate --example all --markdown chapters/generated/worked_examples.md

The simulator itself is minifsdp/measure/simulate.py.
"""

from __future__ import annotations

import collections
import math

from minifsdp.measure import analytic
from minifsdp.measure.simulate import STAGES, STATE_BYTES, STRATEGY_NAMES, Spec, comm_totals, simulate
from minifsdp.reports import style
from minifsdp.reports.format import MAX_COLUMNS, fmt_size, md_folded, md_table, md_tabs, write_report
from minifsdp.reports.worked_examples import EXAMPLES, worked_examples_report

COLUMNS = (("params", "parameters"), ("unsharded", "unsharded units"), ("grads", "gradients"),
           ("optim", "optimizer state"), ("other", "activations + other"), ("total", "total"))


def describe(spec: dict, psi: int) -> str:
    c = Spec(**spec).config()
    layers = f", {spec['layers']} layers" if spec["layers"] is not None else ""
    return (f"{spec['model']}{layers} (Ψ = {psi:,}), {STRATEGY_NAMES[spec['strategy']]}, {spec['precision']}, "
            f"N = {spec['world_size']:,}, micro-batch {spec['micro_batch']} × {spec['seq_len']:,} tokens"
            f"{', activation checkpointing per layer' if spec['checkpoint_activations'] else ''}"
            f" ({c.n_layers} decoder layers of dim {c.dim})")


def phase_table(result: dict) -> str:
    """Rank 0's memory per phase, by category: at the moment of each phase's peak, and after the step."""
    lines = ["| phase | " + " | ".join(label for _, label in COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    for phase in ("after wrapping", "peak of forward", "peak of backward", "peak of optimizer step",
                  "after optimizer step"):
        m = result["phases"][phase]
        lines.append(f"| {phase} | " + " | ".join(fmt_size(m[c]) for c, _ in COLUMNS) + " |")
    return "\n".join(lines)


def checks(result: dict) -> list[tuple[str, float, float, str]]:
    """(quantity, measured, analytic, why they may differ) for what the analytic model covers."""
    a, phases, most = result["analytic"], result["phases"], result["most"]
    after = phases["after optimizer step"]
    strategy = result["spec"]["strategy"]
    padding = {"fsdp": "each unit padded to a multiple of N, each parameter aligned to 64 bytes",
               "fully_shard": "each parameter's rows padded to a multiple of N"}.get(strategy, "nothing")
    shares = {"oss": "; rank 0's share of whole tensors is not Ψ/N (OSS's greedy partition)",
              "sdp": "; rank 0's share of whole tensors is not Ψ/N (OSS's greedy partition)"}.get(strategy, "")
    rows = [("parameters after wrapping", phases["after wrapping"]["params"], a["model states"]["params"], padding),
            ("model states after the step (parameters + gradients + optimizer)",
             after["params"] + after["grads"] + after["optim"], a["model states"]["total"],
             f"{padding if padding != 'nothing' else 'no padding'}; AdamW's 4-byte step per tensor{shares}")]
    if "unsharded" in a:
        in_backward = "the root + the layer computing + the next one's all-gather (BACKWARD_PRE)" \
            if strategy == "fsdp" else \
            "the root + the layer computing (the next one's all-gather lands in a flat buffer, \"other\", " \
            "until its copy-out)"
        rows += [("unsharded units, most at once in forward", most["forward"]["unsharded"],
                  a["unsharded"]["forward"], "the root unit, kept from forward to backward, + the layer computing"),
                 ("unsharded units, most at once in backward", most["backward"]["unsharded"],
                  a["unsharded"]["backward"], in_backward)]
    return rows


def checks_table(result: dict) -> str:
    lines = ["| quantity | measured | analytic | measured / analytic | what the analytic figure counts, or leaves "
             "out |", "|---|---|---|---|---|"]
    for what, measured, model, why in checks(result):
        lines.append(f"| {what} | {fmt_size(measured)} | {fmt_size(model)} | {measured / model:.4f} | {why} |")
    return "\n".join(lines)


def comm_table(result: dict) -> str:
    a = result["analytic"]
    measured = comm_totals(result)
    calls = collections.Counter()
    for phase in result["comm"].values():
        calls.update(phase["calls"])
    lines = ["| collective | calls | bytes sent by rank 0 (counted) | analytic |", "|---|---|---|---|"]
    for kind in sorted(set(measured) | set(a["comm"])):
        lines.append(f"| {kind} | {calls.get(kind, 0):,} | {fmt_size(measured.get(kind, 0))} "
                     f"| {fmt_size(a['comm'].get(kind))} |")
    lines.append(f"| total | {sum(calls.values()):,} | {fmt_size(sum(measured.values()))} "
                 f"| {fmt_size(sum(a['comm'].values()))} (ZeRO paper: {fmt_size(a['comm total, ZeRO paper'])}) |")
    return "\n".join(lines)


def report(result: dict) -> str:
    spec = result["spec"]
    steps = "the second of two steps" if spec["warmup"] else "one step"
    return (f"**Rank 0 of {result['world_size']:,}: {describe(spec, result['psi'])}**\n\n"
            f"Meta tensors under a fake process group; memory by MemoryMeter, bytes by comm.counting(); "
            f"{steps}; simulated in {result['seconds']:.1f} s.\n\n"
            f"{phase_table(result)}\n\n{checks_table(result)}\n\n{comm_table(result)}\n")


# -- sweeps and the figure -----------------------------------------------------------------------------------------
def sweep(models, world_sizes, strategies, precision: str = "fp32", **fields) -> list[dict]:
    results = []
    for model in models:
        for n in world_sizes:
            for strategy in strategies:
                r = simulate(Spec(model=model, world_size=n, strategy=strategy, precision=precision, **fields))
                print(f"  {model} N={n:>5} {strategy:<12} {r['seconds']:6.1f} s", flush=True)
                results.append(r)
    return results


SWEEP_FIELDS = ("states", "analytic", "ratio", "peak", "sent", "sent_analytic")


def sweep_cells(results: list[dict]) -> dict[tuple[str, int, str], dict[str, str]]:
    """(model, N, strategy) -> the sweep's figures as printed: model states after the step, measured and analytic,
    their ratio, the peak of the step, the bytes sent per step, counted and the ZeRO paper's."""
    cells = {}
    for r in results:
        s, after = r["spec"], r["phases"]["after optimizer step"]
        measured = after["params"] + after["grads"] + after["optim"]
        model = r["analytic"]["model states"]["total"]
        peak = max(r["phases"][p]["total"] for p in ("peak of forward", "peak of backward", "peak of optimizer step"))
        cells[(s["model"], s["world_size"], s["strategy"])] = dict(zip(SWEEP_FIELDS, (
            fmt_size(measured), fmt_size(model), f"{measured / model:.4f}", fmt_size(peak),
            fmt_size(sum(comm_totals(r).values())), fmt_size(r["analytic"]["comm total, ZeRO paper"]))))
    return cells


def sweep_layout(cells: dict[tuple[str, int, str], dict[str, str]]) -> str:
    """A tab per model; in it a table per quantity, a row per N and the strategies side by side (split into
    tables of MAX_COLUMNS where there are more), the analytic figures folded under them."""
    def tables(model, fields):
        ns = sorted({n for m, n, _ in cells if m == model})
        strategies = list(dict.fromkeys(s for m, _, s in cells if m == model))
        out = []
        for field, caption in fields:
            for i in range(0, len(strategies), MAX_COLUMNS - 1):
                chunk = strategies[i:i + MAX_COLUMNS - 1]
                out.append(md_table(["N", *chunk], [[f"{n:,}", *(cells[(model, n, s)][field] if (model, n, s) in cells
                                                              else "-" for s in chunk)] for n in ns], caption=caption))
        return "\n\n".join(out)

    shown = (("states", "Model states after the step, measured"), ("peak", "Peak of the step"),
             ("sent", "Bytes sent per step"))
    folded = (("analytic", "Model states, analytic"), ("ratio", "Model states, measured / analytic"),
              ("sent_analytic", "Bytes sent per step, analytic (ZeRO paper)"))
    models = list(dict.fromkeys(m for m, _, _ in cells))
    return md_tabs([(model, tables(model, shown) + "\n\n" + md_folded("The analytic figures, and measured / analytic",
                                                                     tables(model, folded)))
                    for model in models])


def sweep_table(results: list[dict]) -> str:
    return sweep_layout(sweep_cells(results))


MARKERS = {"ddp": "o", "oss": "s", "sdp": "^", "fsdp": "D", "fully_shard": "v"}


def _colours() -> dict:
    return {"ddp": style.LINES["blue"], "oss": style.LINES["orange"], "sdp": style.LINES["green"],
            "fsdp": style.LINES["red"], "fully_shard": style.LINES["purple"]}


def plot_scaling(results: list[dict], path: str) -> None:
    """Memory per rank against N, log-log, one panel per model, one above the other: each strategy's analytic
    model states as a line, rank 0's measured model states (after the step) as filled markers on it, and the
    measured peak of the step (activations included) as hollow markers. In the charts' style (reports/style.py)."""
    style.charts(_plot_scaling)(results, path)


def _plot_scaling(results: list[dict], path: str) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    colours = _colours()
    models = list(dict.fromkeys(r["spec"]["model"] for r in results))
    fig, axes = style.figure(1.5 + 2.9 * len(models), len(models), 1, sharex=True, squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        mine = [r for r in results if r["spec"]["model"] == model]
        psi = mine[0]["psi"]
        for strategy in dict.fromkeys(r["spec"]["strategy"] for r in mine):
            rs = sorted((r for r in mine if r["spec"]["strategy"] == strategy), key=lambda r: r["world_size"])
            ns = [r["world_size"] for r in rs]
            grid = [2 ** (k / 8) for k in range(int(8 * math.log2(min(ns))), int(8 * math.log2(max(ns))) + 1)]
            per_param = STATE_BYTES[rs[0]["spec"]["precision"]]
            curve = [analytic.model_state_bytes(psi, x, STAGES[strategy], per_param)["total"] for x in grid]
            color, marker = colours[strategy], MARKERS[strategy]
            ax.plot(grid, [c / 1e9 for c in curve], "-", color=color, lw=1.5)
            states = [sum(r["phases"]["after optimizer step"][c] for c in ("params", "grads", "optim")) for r in rs]
            peaks = [max(r["phases"][p]["total"] for p in ("peak of forward", "peak of backward",
                                                            "peak of optimizer step")) for r in rs]
            ax.plot(ns, [s / 1e9 for s in states], marker, color=color, ms=6, ls="none", label=strategy)
            ax.plot(ns, [p / 1e9 for p in peaks], marker, color=color, ms=7, ls="none", mfc="none", mew=1.3)
        ns_all = sorted({r["world_size"] for r in mine})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(ns_all))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_locator(LogLocator(base=10))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("GB per rank (rank 0)")
        ax.set_title(f"{model} (Ψ = {psi / 1e9:.2f} B)", loc="left", fontsize=10)
        ax.grid(True, which="major")
    axes[-1, 0].set_xlabel("ranks N")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    handles += [Line2D([], [], color=style.MUTED, lw=1.5), Line2D([], [], marker="o", color=style.MUTED, ls="none"),
                Line2D([], [], marker="o", color=style.MUTED, ls="none", mfc="none")]
    labels += ["analytic model states", "measured model states", "measured peak of the step"]
    fig.legend(handles, labels, loc="outside lower center", ncol=3)
    spec = results[0]["spec"]
    fig.suptitle(f"Rank 0 of N, {spec['precision']} AdamW, {spec['micro_batch']} × {spec['seq_len']:,} tokens: "
                 f"model states and the peak of a step")
    style.save(fig, path)


def run_simulate(models=("7b",), world_sizes=(8,), strategies=("fsdp",), precision: str = "fp32", seq_len: int = 4096,
                 micro_batch: int = 1, checkpoint_activations: bool = False, layers: int | None = None,
                 markdown: str | None = None, plot: str | None = None, examples=()) -> list[dict] | str:
    """The command line's entry: worked examples, one detailed report, or a sweep (table and figure)."""
    if examples:
        names = EXAMPLES if "all" in examples else examples
        for name in names:
            if name not in EXAMPLES:
                raise ValueError(f"unknown example {name!r}: choose from {', '.join(EXAMPLES)} or all")
        text = worked_examples_report(names)
        write_report(text, markdown)
        return text
    fields = dict(precision=precision, seq_len=seq_len, micro_batch=micro_batch,
                  checkpoint_activations=checkpoint_activations, layers=layers)
    for model in models:  # every argument checked before the first (long) run
        for strategy in strategies:
            Spec(model=model, strategy=strategy, world_size=world_sizes[0], **fields).check()
    if len(models) * len(world_sizes) * len(strategies) == 1 and not plot:
        result = simulate(Spec(model=models[0], world_size=world_sizes[0], strategy=strategies[0], **fields))
        write_report(report(result), markdown)
        return [result]
    results = sweep(models, world_sizes, strategies, **fields)
    text = (f"**Rank 0's memory and bytes against N: {', '.join(models)}, {precision}, micro-batch {micro_batch} × "
            f"{seq_len:,} tokens{', activation checkpointing' if checkpoint_activations else ''}**\n\n"
            f"Meta tensors under a fake process group, the second of two steps. Model states: parameters + "
            f"gradients + optimizer state after the optimizer step (analytic: analytic.model_state_bytes); the "
            f"peak includes activations and ZeRO-3's unsharded units; bytes: comm.counting() (analytic: "
            f"analytic.comm_bytes_per_step, the ZeRO paper's 2Ψ or 3Ψ; minifsdp's OSS runs under DDP and "
            f"broadcasts the parameters too: 3Ψ).\n\n{sweep_table(results)}\n")
    write_report(text, markdown)
    if plot:
        plot_scaling(results, plot)
        print(f"\nwrote {plot}")
    return results
