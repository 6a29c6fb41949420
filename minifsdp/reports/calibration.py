"""Chapter 13: the alpha-beta model on this machine -- alpha and beta fitted to minifsdp's all-reduces on CPU ranks
(gloo), and one real FSDP step set next to the model: its collectives' times, its step time on the two-stream
simulation, its issue order against the one fsdp_program builds.

The step-time report (step_time.py) runs both unless told --no-calibrate. These are timings: their figures move from
run to run.
"""

from __future__ import annotations

import time

from minifsdp.measure import step_time as st
from minifsdp.reports.format import fmt_bytes

CALIBRATION_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


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
