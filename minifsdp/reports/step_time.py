"""Chapter 13's step-time report: the alpha-beta model's predictions per strategy, where communication stops
hiding, HSDP across nodes; its calibration on this machine (gloo); and its errors against published runs.

    python -m minifsdp step-time --models 7b 70b --nodes 1 8 --gpus-per-node 8 \\
        --markdown chapters/generated/step_time.md --published chapters/generated/step_time_vs_published.md

The model is minifsdp/measure/step_time/. The calibration (calibration.py) runs real minifsdp collectives and one
real FSDP step on CPU ranks, so its figures move from run to run; everything else is arithmetic and does not.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from minifsdp.measure import step_time as st
from minifsdp.reports.calibration import calibrate_gloo, calibration_text, check_fsdp_step
from minifsdp.reports.format import fmt_bytes, md_folded, md_table, md_tabs, write_report


# -- the tables ----------------------------------------------------------------------------------------------------
def _s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def hardware_text(cluster: st.Cluster) -> str:
    g = cluster.gpu
    return (f"{g.note}: {g.peak_flops / 1e12:.0f} TFLOP/s bf16 dense peak, compute efficiency {g.efficiency:.3f} "
            f"(fitted to one published run: see \"Against published runs\"), NVLink bus bandwidth "
            f"{g.nvlink.busbw / 1e9:.0f} GB/s, {g.nvlink.alpha * 1e6:.1f} us per NVLink step; one NIC per GPU at "
            f"{cluster.nic.busbw / 1e9:.0f} GB/s reached, {cluster.nic.alpha * 1e6:.1f} us per network step; "
            f"HBM {g.hbm_bw / 1e12:.2f} TB/s for the optimizer step")


def strategy_table(models, nodes, cluster_of, run) -> str:
    """A tab per model and cluster size, the strategies side by side, where the time goes folded under them."""
    tabs = []
    for m in models:
        for k in nodes:
            c = cluster_of(k)
            shown, folded = [], []
            for s in st.STRATEGIES:
                if s == "hsdp" and k == 1:
                    continue  # one node: HSDP is FULL_SHARD
                p = st.predict(s, m, c, run)
                states = p.model_state_bytes()
                fits = "" if states < 80e9 else " (over 80 GB)"
                shown.append([st.STRATEGY_NAMES[s], _s(p.step), f"{p.tokens_per_s_per_gpu:,.0f}", f"{100 * p.mfu:.1f}%",
                              f"{100 * p.exposed / p.step:.1f}%", f"{fmt_bytes(states)}{fits}"])
                folded.append([st.STRATEGY_NAMES[s], _s(p.compute), _s(p.comm)])
            tabs.append((f"{m.name}, {c.world} GPUs", md_table(
                ["strategy", "step", "tokens/s/GPU", "MFU", "exposed communication", "model states per GPU"], shown)
                + "\n\n" + md_folded("Compute, and communication added up (most of it hidden under compute)",
                                      md_table(["strategy", "compute", "communication (sum)"], folded))))
    return md_tabs(tabs)


def hsdp_table(models, cluster_of, run, node_counts=(1, 2, 4, 8, 16, 32, 64, 128)) -> str:
    """FULL_SHARD over every GPU vs HSDP, under both network models (Cluster.busbw): a tab per model."""
    tabs = []
    for m in models:
        tables = []
        for spread, caption in ((True, "Rings spread over every NIC of a node (the model's network)"),
                                (False, "Each rank's bytes through its own NIC (one NIC per ring)")):
            rows = []
            for k in node_counts:
                c = replace(cluster_of(k), spread_rings=spread)
                f, h = st.predict("fsdp", m, c, run), st.predict("hsdp", m, c, run)
                rows.append([k, k * cluster_of(1).gpus_per_node,
                             f"{_s(f.step)} ({100 * f.exposed / f.step:.1f}% exposed)",
                             f"{_s(h.step)} ({100 * h.exposed / h.step:.1f}%)", f"{100 * (f.step / h.step - 1):+.1f}%"])
            tables.append(md_table(["nodes", "GPUs", "FSDP", "HSDP", "HSDP faster by"], rows, caption=caption))
        tabs.append((m.name, "\n\n".join(tables)))
    return md_tabs(tabs)


def threshold_table(models, nodes, cluster_of, run) -> str:
    strategies = ("ddp", "zero2", "fsdp", "hsdp")
    lines = ["| model | GPUs | " + " | ".join(st.STRATEGY_NAMES[s] for s in strategies) + " |",
             "|" + "---|" * (2 + len(strategies))]
    for m in models:
        for k in nodes:
            c = cluster_of(k)
            cells = []
            for s in strategies:
                t = st.hiding_threshold(s, m, c, run)
                cells.append("never" if t == float("inf") else f"{t:,.0f}")
            lines.append(f"| {m.name} | {c.world} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def crossover_text(cluster: st.Cluster) -> str:
    lines = ["| group | ranks | bus bandwidth | all-reduce size below which a tree beats a ring |", "|---|---|---|---|"]
    for name, group in (("within a node", st.Group(cluster.gpus_per_node, cluster.gpus_per_node)),
                        ("one rank per node, 8 nodes", st.Group(8, 1)),
                        ("8 nodes x 8", st.Group(64, 8)), ("128 nodes x 8", st.Group(1024, 8))):
        def tree_wins(nbytes, group=group):
            return (cluster.collective("all_reduce", nbytes, group, "tree")
                    < cluster.collective("all_reduce", nbytes, group, "ring"))

        lo, hi = 1.0, 1e13
        if not tree_wins(lo):
            where = "none: a ring is faster at every size"
        elif tree_wins(hi):
            where = "every size: a tree is faster"
        else:
            for _ in range(60):  # the size where the two algorithms' times cross
                mid = (lo * hi) ** 0.5
                lo, hi = (mid, hi) if tree_wins(mid) else (lo, mid)
            where = fmt_bytes(lo)
        lines.append(f"| {name} | {group.size} | {cluster.busbw(group) / 1e9:.0f} GB/s | {where} |")
    return "\n".join(lines)


def published_text() -> str:
    rows = st.compare_published()
    tabs = []  # a tab per source: 55 rows of eleven columns in one table would be unreadable in the docs' column
    for src in st.SOURCES:
        mine = [c for c in rows if c["row"].source is src]
        if not mine:
            continue
        shown, folded = [], []
        for c in mine:
            r = c["row"]
            label = r.label + (" (calibration)" if r.calibration else "")
            shown.append([r.table, label, f"{r.gpus} {r.gpu.name}", f"{r.tokens_per_s_per_gpu:,.0f}",
                          f"{c['predicted']:,.0f}", f"{100 * c['error']:+.1f}%"])
            folded.append([label, "-" if r.mfu is None else f"{100 * r.mfu:.1f}%", f"{100 * c['predicted_mfu']:.1f}%",
                           f"{100 * c['exposed']:.1f}%", r.lacks])
        tabs.append((src.name, md_table(["table", "configuration", "GPUs", "published tokens/s/GPU", "predicted",
                                         "error"], shown)
                     + "\n\n" + md_folded("MFU, published and predicted; exposed communication; what the model "
                                           "leaves out", md_table(["configuration", "published MFU", "predicted MFU",
                                                     "predicted exposed comm", "not in the model"], folded))))
    lines = [md_tabs(tabs)]
    predicted = [c for c in rows if not c["row"].calibration]
    summary = ["| source | rows | median error | median absolute error | largest absolute error |",
               "|---|---|---|---|---|"]
    for src in st.SOURCES:
        errs = [c["error"] for c in predicted if c["row"].source is src]
        if errs:
            summary.append(f"| {src.name} | {len(errs)} | {100 * statistics.median(errs):+.1f}% | "
                           f"{100 * statistics.median(abs(e) for e in errs):.1f}% | {100 * max(map(abs, errs)):.1f}% |")
    for label, keep in (("with activation checkpointing", lambda r: r.run.ac != "none"),
                        ("without", lambda r: r.run.ac == "none")):
        errs = [c["error"] for c in predicted if keep(c["row"])]
        summary.append(f"| all, {label} | {len(errs)} | {100 * statistics.median(errs):+.1f}% | "
                       f"{100 * statistics.median(abs(e) for e in errs):.1f}% | {100 * max(map(abs, errs)):.1f}% |")
    multi = ["| source | configuration | GPUs | published | rings over all NICs (the model), error | one NIC per ring, "
             "error |", "|" + "---|" * 6]
    flat_errors = []
    for c in rows:
        r = c["row"]
        if r.gpus <= 8:
            continue
        flat = st.predict("fsdp", r.model, replace(st.published_cluster(r), spread_rings=False), r.run)
        e = flat.tokens_per_s_per_gpu / r.tokens_per_s_per_gpu - 1
        flat_errors.append(e)
        multi.append(f"| {r.source.name} | {r.label} | {r.gpus} | {r.tokens_per_s_per_gpu:,.0f} | "
                     f"{c['predicted']:,.0f} ({100 * c['error']:+.1f}%) | {flat.tokens_per_s_per_gpu:,.0f} "
                     f"({100 * e:+.1f}%) |")
    sources = ["| source | cited as | setup, as stated | assumed here |", "|---|---|---|---|"]
    sources += [f"| {s.name} | `{s.citation}` | {s.setup} | {s.assumed} |" for s in st.SOURCES]
    return ("Published throughput of FSDP runs next to the model's prediction (FSDP FULL_SHARD, blocks as units). "
            "error = predicted / published - 1. The compute efficiency of each GPU was fitted to the row marked "
            "(calibration) and held fixed for every other row: those are predictions.\n\n"
            + "\n".join(lines) + "\n\nErrors, calibration rows left out\n\n" + "\n".join(summary)
            + "\n\nThe rows that span nodes under the two network models of `Cluster.busbw`: rings spread over "
            "every NIC of a node (the model's default), or each rank's bytes through its own NIC (median absolute "
            f"error {100 * statistics.median(abs(e) for e in flat_errors):.1f}%)\n\n" + "\n".join(multi)
            + "\n\nWhat the model leaves out, and so where to expect its errors:\n\n" + LACKS
            + "\n\nSources\n\n" + "\n".join(sources)
            + "\n\nLeft out, as their settings are not in the stored sources and the model cannot be run on them: "
            + "; ".join(st.NOT_FOUND) + ".")


LACKS = """- One compute efficiency per GPU, whatever the matrix shapes, the micro-batch and the sequence length. The
  published runs reach different fractions of peak at different sizes; the model cannot. The rows with
  activation checkpointing show it most: llm-foundry's HFU column (recomputation counted) puts most of them
  above the no-checkpointing calibration row, which the model, holding the efficiency fixed, cannot follow.
- Attention is timed as the 12 L d s FLOPs of the MFU convention, at the same efficiency as the matrices.
  FlashAttention with a causal mask computes half of them, at its own efficiency: long sequences show it.
- On a GPU the CPU runs ahead (implicit prefetch); the model issues the next unit's all-gather explicitly
  instead, and knows no CPU overhead, no rate-limiter stall, no straggler, no congestion in the network.
- torch.compile and Float8 change the compute itself: rows that use them are left out, not modelled.
- Where a source does not state its network, the one assumed is named in the table of sources."""


def run_step_time_report(models=("7b", "70b"), nodes=(1, 8), gpus_per_node: int = 8, gpu: str = "h100",
                         seq_len: int = 4096, micro_batch: float = 2, markdown: str | None = None,
                         published: str | None = None, calibrate: bool = True) -> dict:
    ms = [st.MODELS[m] for m in models]
    g = st.GPUS[gpu]
    nic = st.IB_400G if g is st.H100 else st.IB_200G
    cluster_of = lambda k: st.Cluster(g, nodes=k, gpus_per_node=gpus_per_node, nic=nic)
    run = st.Run(seq_len=seq_len, micro_batch=micro_batch)
    c1 = cluster_of(1)
    parts = [f"Step-time model (minifsdp/measure/step_time/). {hardware_text(c1)}. Run: sequences of "
             f"{seq_len} tokens, {micro_batch:g} per GPU per step ({run.tokens:,.0f} tokens), bf16 parameters "
             f"gathered, fp32 gradients reduced, FSDP with forward prefetch and BACKWARD_PRE, no activation "
             f"checkpointing, AdamW.",
             "\n**Per strategy**\n", strategy_table(ms, nodes, cluster_of, run),
             "\n**HSDP across nodes**: shard within each node (NVLink), all-reduce each gradient shard across the "
             "nodes (one NIC per rank), vs FULL_SHARD over every GPU; under the model's network (rings spread "
             "over every NIC of a node) and under the pessimistic one (each rank's bytes through its own NIC). "
             "With rings spread over the NICs, FULL_SHARD moves as many bytes between nodes as HSDP's "
             "all-reduces, and HSDP pays for two things FULL_SHARD does not: an optimizer step over 1/8 of the "
             "model instead of 1/N, and the replicas' all-reduce of the last units, which ends the backward.\n",
             hsdp_table(ms, cluster_of, run),
             "\n**Where communication stops hiding**: the fewest tokens per GPU per step at which at most 5% of "
             "the step is exposed communication (sequence length as above; fewer tokens, more exposed)\n",
             threshold_table(ms, nodes, cluster_of, run),
             "\n**Ring or tree**: where the alpha-beta model switches an all-reduce from ring to tree\n",
             crossover_text(c1)]
    out = {}
    if calibrate:
        cal = calibrate_gloo()
        step = check_fsdp_step(cal["alpha"], cal["beta"], other_fit=cal["fsdp_fit"])
        out.update(calibration=cal, step=step)
        parts += ["\n**Calibration on this machine**\n", calibration_text(cal, step)]
    write_report("\n".join(parts), markdown)
    if published:
        write_report(published_text(), published)
    return out
