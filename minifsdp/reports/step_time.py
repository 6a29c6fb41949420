"""Chapter 13's step-time report: the alpha-beta model's predictions per strategy, where communication stops
hiding, HSDP across nodes; its calibration on this machine (gloo); and its errors against published runs.

    python -m minifsdp step-time --models 7b 70b --nodes 1 8 --gpus-per-node 8 \\
        --markdown chapters/generated/step_time.md --published chapters/generated/step_time_vs_published.md

The model is minifsdp/measure/step_time.py. The calibration runs real minifsdp collectives and one real
FSDP step on CPU ranks, so its figures move from run to run; everything else is arithmetic and does not.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from minifsdp.measure import step_time as st
from minifsdp.reports.format import fmt_bytes, md_folded, md_table, md_tabs, write_report

CALIBRATION_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


# -- calibration on this machine ---------------------------------------------------------------------------------
def _time_collectives(sizes, repeats: int) -> list[tuple[str, int, list[float]]]:
    """On every rank: each collective at each size, blocking, `repeats` times after a warm-up, each call
    started together (a barrier first). Returns (kind, full bytes, [seconds]) per case."""
    import torch

    from minifsdp.distributed import comm

    n = comm.world_size()
    out = []
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        for nbytes in sizes:
            numel = nbytes // 4 // n * n
            full, part = torch.ones(numel), torch.ones(numel // n)
            call, args = {"all_reduce": (comm.all_reduce, (full,)), "all_gather": (comm.all_gather, (full, part)),
                          "reduce_scatter": (comm.reduce_scatter, (part, full))}[kind]
            times = []
            for r in range(repeats + 1):
                comm.barrier()
                t0 = time.perf_counter()
                call(*args)
                if r:
                    times.append(time.perf_counter() - t0)
            out.append((kind, numel * 4, times))
    return out


def fit_alpha_beta(points) -> tuple[float, float]:
    """alpha, beta from [(steps, wire bytes, seconds)]: least squares on the relative error of
    alpha * steps + bytes / beta, so the small sizes count as much as the large ones."""
    rows = [(s / t, b / t) for s, b, t in points]
    a11 = sum(x * x for x, _ in rows)
    a12 = sum(x * y for x, y in rows)
    a22 = sum(y * y for _, y in rows)
    r1, r2 = sum(x for x, _ in rows), sum(y for _, y in rows)
    det = a11 * a22 - a12 * a12
    alpha, inv_beta = (r1 * a22 - r2 * a12) / det, (a11 * r2 - a12 * r1) / det
    return alpha, 1.0 / inv_beta


def calibrate_gloo(world_size: int = 2, sizes=CALIBRATION_SIZES, repeats: int = 11) -> dict:
    """Time minifsdp's all-reduces on `world_size` CPU ranks (gloo), fit alpha and beta to them, and predict
    the all-gathers and reduce-scatters of the same sizes with that fit (which never saw them). Each figure is
    the fastest of `repeats` calls (each call's time is its slower rank's)."""
    from minifsdp.distributed.launch import launch

    results = launch(_time_collectives, world_size, device="cpu", args=(sizes, repeats))
    cases = []
    for k, (kind, nbytes, _) in enumerate(results[0]):
        per_repeat = zip(*(r[k][2] for r in results))   # a collective ends when its slowest rank is done
        # the fastest of the repeats: whatever else runs on the machine only ever adds time
        cases.append((kind, nbytes, min(max(ts) for ts in per_repeat)))
    fit = [(st.algorithm_steps(kind, world_size), st.wire_bytes(kind, nbytes, world_size), t)
           for kind, nbytes, t in cases if kind == "all_reduce"]
    alpha, beta = fit_alpha_beta(fit)
    link = st.Link(alpha, beta)
    rows = [dict(kind=kind, nbytes=nbytes, measured=t, predicted=st.alpha_beta(kind, nbytes, world_size, link),
                 fitted=kind == "all_reduce") for kind, nbytes, t in cases]
    # for comparison only: the same fit to the all-gathers and reduce-scatters, the collectives FSDP makes
    other = fit_alpha_beta([(st.algorithm_steps(kind, world_size), st.wire_bytes(kind, nbytes, world_size), t)
                            for kind, nbytes, t in cases if kind != "all_reduce"])
    return dict(world_size=world_size, alpha=alpha, beta=beta, rows=rows, fsdp_fit=other)


def _record_fsdp_steps(steps: int = 3, repeats: int = 5) -> dict:
    """On every rank: chapter 7's timeline GPT under FSDP (both prefetches), two warm-up steps (the first
    records the unit order), then `steps` recorded steps: collectives, waits, compute segments, wall time.
    Then the collectives of the first recorded step once more, alone: blocking, in the same order and sizes,
    nothing computing beside them, `repeats` times (the fastest of each is kept)."""
    import torch

    from minifsdp.distributed import comm
    from minifsdp.measure.timeline import Timeline
    from minifsdp.reports.overlap import TIMELINE_MODEL, build, step

    model, opt = build(TIMELINE_MODEL, "forward_prefetch + BACKWARD_PRE")
    for i in range(2):
        step(model, opt, TIMELINE_MODEL, i)
    recorded = []
    for i in range(2, 2 + steps):
        with Timeline() as tl:
            t0 = time.perf_counter()
            step(model, opt, TIMELINE_MODEL, i)
            wall = time.perf_counter() - t0
        recorded.append(dict(
            wall=wall,
            events=[(e.issued - t0, e.kind, e.tag, e.nbytes, e.done - e.issued) for e in tl.counter.events],
            waits=[(w.start - t0, w.end - t0, w.tag) for w in tl.counter.waits],
            segments=[(s - t0, name) for name, s, _ in tl._segments]))
    n = comm.world_size()
    alone = []
    for _, kind, _, sent, _ in recorded[0]["events"]:
        full_numel = round(sent * n / (n - 1) / 4)       # sent = ring_bytes of the full fp32 buffer
        full, part = torch.ones(full_numel), torch.ones(full_numel // n)
        call = comm.all_gather if kind == "all_gather" else comm.reduce_scatter
        args = (full, part) if kind == "all_gather" else (part, full)
        times = []
        for _ in range(repeats):
            comm.barrier()
            t0 = time.perf_counter()
            call(*args)
            times.append(time.perf_counter() - t0)
        alone.append(min(times))
    return dict(recorded=recorded, alone=alone)


def check_fsdp_step(alpha: float, beta: float, world_size: int = 2, steps: int = 3, other_fit=None) -> dict:
    """A real FSDP step on CPU ranks against the model. Its communication: the alpha-beta prediction of its
    collectives vs their durations measured alone (replayed blocking, in order), and vs their durations inside
    the step (from issue to completion, beside compute on the same cores). Its step time: measured vs the
    two-stream simulation of its own recorded program (compute as measured, collectives as predicted). And its
    issue order vs the one fsdp_program builds. Rank 0; of the recorded steps, the one of median wall time."""
    from minifsdp.distributed.launch import launch
    from minifsdp.reports.overlap import TIMELINE_MODEL

    res = launch(_record_fsdp_steps, world_size, device="cpu", kwargs=dict(steps=steps))
    rec = res[0]["recorded"]
    alone = [max(ts) for ts in zip(*(r["alone"] for r in res))]  # done when the slower rank is
    r = sorted(rec, key=lambda x: x["wall"])[len(rec) // 2]
    link = st.Link(alpha, beta)
    # the counter's nbytes are already the bytes one rank sends (ring_bytes): predict from them directly
    predict = lambda kind, sent: link.alpha * st.algorithm_steps(kind, world_size) + sent / link.busbw
    events = [(t, kind, tag, sent) for t, kind, tag, sent, _ in r["events"]]
    sim_pred = st.simulate(st.program_from_recording(events, r["waits"], r["wall"], predict))
    sim_meas = st.simulate(st.program_from_recording(events, r["waits"], r["wall"],
                                                     _measured_durations(r["events"])))
    recorded = st.recorded_sequence([(t, kind, tag) for t, kind, tag, *_ in r["events"]], r["segments"])
    built = st.issue_sequence(st.fsdp_program(_dummy_units(TIMELINE_MODEL.n_layer), lambda u: 1.0, lambda u: 1.0))
    return dict(world_size=world_size, collectives=len(r["events"]), sent=sum(e[3] for e in r["events"]),
                comm_predicted=sum(predict(kind, sent) for _, kind, _, sent in events),
                comm_alone=sum(alone), comm_in_step=sum(d for *_, d in r["events"]),
                wall=r["wall"], step_predicted=sim_pred.step, step_replayed=sim_meas.step,
                order_matches=recorded == built,
                comm_predicted_other=None if other_fit is None else sum(
                    other_fit[0] * st.algorithm_steps(kind, world_size) + sent / other_fit[1]
                    for _, kind, _, sent in events))


def _measured_durations(events):
    """seconds(kind, nbytes) for program_from_recording that hands out the recorded durations in order."""
    queue = [d for *_, d in sorted(events)]

    def seconds(kind, sent):
        return queue.pop(0)
    return seconds


def _dummy_units(blocks: int) -> list[st.Unit]:
    return [st.Unit("(root)", 1, (1.0, 1.0), (1.0, 1.0))] + [st.Unit(f"blocks.{i}", 1, (1.0,), (1.0,))
                                                            for i in range(blocks)]


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


def calibration_text(cal: dict, step: dict) -> str:
    lines = [f"alpha = {cal['alpha'] * 1e6:.1f} us per step, beta = {cal['beta'] / 1e9:.2f} GB/s per rank "
             f"(gloo, {cal['world_size']} CPU ranks on this machine; fitted to the all-reduces only). These are "
             f"timings on a shared two-core machine: they move from run to run.", "",
             "| collective | size | measured (fastest of 11) | alpha-beta | error |", "|---|---|---|---|---|"]
    for r in cal["rows"]:
        err = r["predicted"] / r["measured"] - 1
        lines.append(f"| {r['kind'].replace('_', '-')}{'' if r['fitted'] else ' (not fitted)'} | "
                     f"{fmt_bytes(r['nbytes'])} | {r['measured'] * 1e3:.3f} ms | {r['predicted'] * 1e3:.3f} ms | "
                     f"{100 * err:+.0f}% |")
    lines += ["", f"One real FSDP step (chapter 7's timeline GPT, both prefetches, {step['world_size']} CPU ranks, "
              f"rank 0, the step of median wall time of three): {step['collectives']} collectives, "
              f"{fmt_bytes(step['sent'])} sent by the rank.", "",
              "| | measured | predicted | error |", "|---|---|---|---|",
              f"| communication: the step's collectives replayed alone, in order, durations added up | "
              f"{step['comm_alone'] * 1e3:.1f} ms | {step['comm_predicted'] * 1e3:.1f} ms | "
              f"{100 * (step['comm_predicted'] / step['comm_alone'] - 1):+.0f}% |",
              f"| ... predicted instead with alpha = {cal['fsdp_fit'][0] * 1e6:.0f} us, beta = "
              f"{cal['fsdp_fit'][1] / 1e9:.2f} GB/s, fitted to the all-gathers and reduce-scatters of the table "
              f"above (in-sample for these kinds, for comparison) | {step['comm_alone'] * 1e3:.1f} ms | "
              f"{step['comm_predicted_other'] * 1e3:.1f} ms | "
              f"{100 * (step['comm_predicted_other'] / step['comm_alone'] - 1):+.0f}% |",
              f"| communication: the same collectives inside the step, issue to completion, added up | "
              f"{step['comm_in_step'] * 1e3:.1f} ms | {step['comm_predicted'] * 1e3:.1f} ms | "
              f"{100 * (step['comm_predicted'] / step['comm_in_step'] - 1):+.0f}% |",
              f"| step: its recorded program, collectives as predicted, on the two-stream simulation | "
              f"{step['wall'] * 1e3:.1f} ms | {step['step_predicted'] * 1e3:.1f} ms | "
              f"{100 * (step['step_predicted'] / step['wall'] - 1):+.0f}% |",
              f"| step: the same program with each collective's measured duration | {step['wall'] * 1e3:.1f} ms | "
              f"{step['step_replayed'] * 1e3:.1f} ms | {100 * (step['step_replayed'] / step['wall'] - 1):+.0f}% |",
              "", "The recorded step's issue order " + ("equals" if step["order_matches"] else "DIFFERS from") +
              " the one `fsdp_program` builds from the runtime's rules."]
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
            + "\n\nLooked for and not found in the stored sources, so left out rather than quoted from memory: "
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
    parts = [f"Step-time model (minifsdp/measure/step_time.py). {hardware_text(c1)}. Run: sequences of "
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
