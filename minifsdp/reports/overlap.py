"""Chapter 7's measurements: timelines of one FSDP step per prefetch mode, the share of communication
hidden behind compute, and what prefetching costs in memory.

    python -m minifsdp timeline --world-size 2 --plot chapters/figures/timelines.svg --markdown chapters/generated/timelines.md
    python -m minifsdp prefetch-memory --world-sizes 2 4 --markdown chapters/generated/prefetch_memory.md

The timelines run on a throttled link (comm.throttled): on one machine the real loopback is so fast
that there would be nothing to hide. The parity of every mode is a test, on the real (unthrottled) link.
"""

from __future__ import annotations

import contextlib
import statistics
import time

from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.fsdp import BACKWARD_POST, BACKWARD_PRE, FullyShardedDataParallel, ModuleWrapPolicy
from minifsdp.measure.meter import MemoryMeter
from minifsdp.measure.timeline import (Timeline, hidden_fraction, lane_time, plot_timeline, timeline_legend,
                                      write_chrome_trace)
from minifsdp.models import Block, GPTConfig, TinyGPT
from minifsdp.reports import style
from minifsdp.reports.format import fmt_bytes, md_table, md_tabs, write_report
from minifsdp.train import OPTIMIZERS, batch, loss_of

# --8<-- [start:modes]
MODES = {  # name -> FullyShardedDataParallel's overlap arguments
    "no prefetch": dict(backward_prefetch=None, forward_prefetch=False),
    "forward_prefetch": dict(backward_prefetch=None, forward_prefetch=True),
    "BACKWARD_POST": dict(backward_prefetch=BACKWARD_POST,
                          forward_prefetch=False),
    "BACKWARD_PRE": dict(backward_prefetch=BACKWARD_PRE,
                         forward_prefetch=False),
    "forward_prefetch + BACKWARD_PRE": dict(backward_prefetch=BACKWARD_PRE,
                                            forward_prefetch=True),
}
# --8<-- [end:modes]

# Large enough that a block's compute takes a few ms on a laptop core, small enough for the test suite.
TIMELINE_MODEL = GPTConfig(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=128, tie_weights=True)


def build(config: GPTConfig, mode: str, limit_all_gathers: bool = True, seed: int = 0):
    model = FullyShardedDataParallel(TinyGPT(config, seed=seed), auto_wrap_policy=ModuleWrapPolicy({Block}),
                                     limit_all_gathers=limit_all_gathers, **MODES[mode])
    return model, OPTIMIZERS["adamw"](model.parameters())


def step(model, opt, config, i, global_batch=12):
    n, r = comm.world_size(), comm.rank()
    loss = loss_of("gpt", model, batch("gpt", i, global_batch, r, n, "cpu", config))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def record_timelines(modes=tuple(MODES), config: GPTConfig = TIMELINE_MODEL, bandwidth: float = 50e6,
                     latency: float = 1e-3, warmup: int = 2, steps: int = 3, global_batch: int = 12) -> dict:
    """On each rank, per mode, on a throttled link: after `warmup` steps (the first records the unit order,
    so it cannot prefetch), `steps` recorded steps; keep the one of median step time (ranks agree on it).
    Its spans, its wall time, and the issue order of its collectives."""
    out = {}
    for mode in modes:
        model, opt = build(config, mode)
        recorded = []
        with comm.throttled(bandwidth, latency):
            for i in range(warmup):
                step(model, opt, config, i, global_batch)
            for i in range(warmup, warmup + steps):
                with Timeline() as tl:
                    t0 = time.perf_counter()
                    step(model, opt, config, i, global_batch)
                    wall = time.perf_counter() - t0
                recorded.append((wall, tl))
        walls = comm.all_gather_object([w for w, _ in recorded])  # pick the same step on every rank
        pick = sorted(range(steps), key=lambda k: max(w[k] for w in walls))[steps // 2]
        wall, tl = recorded[pick]
        out[mode] = {"spans": tl.spans(), "wall": wall,
                     "issue_order": [f"{e.kind} {e.tag.split(' ', 1)[1]}" for e in tl.counter.events]}
    return out


def run_timeline_report(world_size: int = 2, modes=tuple(MODES), bandwidth: float = 50e6, latency: float = 1e-3,
                        plot: str | None = None, markdown: str | None = None, trace: str | None = None) -> dict:
    results = launch(record_timelines, world_size, device="cpu",
                     kwargs=dict(modes=modes, bandwidth=bandwidth, latency=latency))
    summary = {}  # per mode, the numbers of the table, which the figure's titles quote as they are
    for mode in modes:
        per_rank = [r[mode] for r in results]
        spans = per_rank[0]["spans"]
        summary[mode] = {"step": f"{1e3 * statistics.median(r['wall'] for r in per_rank):.1f} ms",
                         "comm": f"{1e3 * lane_time(spans, 'all_gather', 'reduce_scatter'):.1f} ms",
                         "wait": f"{1e3 * lane_time(spans, 'wait'):.1f} ms",
                         "hidden": f"{100 * hidden_fraction(spans):.0f}%"}
    lines = ["| mode | step time | communication | blocked waiting | hidden behind compute |", "|---|---|---|---|---|"]
    lines += [f"| {mode} | {m['step']} | {m['comm']} | {m['wait']} | {m['hidden']} |" for mode, m in summary.items()]
    text = (f"One FSDP step (AdamW, blocks as units, reshard after forward) of a GPT with "
            f"{sum(p.numel() for p in TinyGPT(TIMELINE_MODEL).parameters()):,} parameters, {world_size} CPU "
            f"ranks, on a link throttled to {bandwidth / 1e6:g} MB/s and {latency * 1e3:g} ms per collective; "
            f"rank 0, the step of median time of three\n\n" + "\n".join(lines))
    write_report(text, markdown)
    if plot:
        _plot_modes(results, summary, plot)
        print(f"\nwrote {plot}")
    if trace:
        write_chrome_trace([r[modes[-1]]["spans"] for r in results], trace)
        print(f"wrote {trace} ({modes[-1]}; open it in ui.perfetto.dev)")
    return results


@style.charts
def _plot_modes(results, summary: dict, path):
    """One panel per mode, stacked, on one time axis; each title quotes the mode's row of the table."""
    modes = list(summary)
    lanes = 2 * len(results)
    fig, axes = style.figure(0.9 + len(modes) * (0.45 + 0.2 * lanes), len(modes), 1, sharex=True, squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        m = summary[mode]
        plot_timeline([r[mode]["spans"] for r in results], ax=ax, legend=False,
                      title=f"{mode}: step {m['step']}, {m['hidden']} hidden")
        ax.set_xlabel("")
    axes[-1, 0].set_xlabel("ms since the start of the step")
    fig.legend(handles=timeline_legend([r[modes[0]]["spans"] for r in results]), loc="outside lower center", ncol=4)
    style.save(fig, path)


# -- memory ----------------------------------------------------------------------------------------------------
def measure_prefetch_memory(modes=tuple(MODES), config: GPTConfig = TIMELINE_MODEL, steps: int = 3) -> dict:
    """Per mode (and with/without the rate limiter): the peak of the parameter bytes (shards + full
    buffers) during forward and during backward, and the total peak, in a steady-state step."""
    out = {}
    runs = [(mode, True) for mode in modes] + [("forward_prefetch + BACKWARD_PRE", False)]
    for mode, limit in runs:
        model, opt = build(config, mode, limit_all_gathers=limit)
        meter = MemoryMeter(model, opt)
        meter.watch([flat._full for u in model.units() for flat in u.flat_params], "params")
        n, r = comm.world_size(), comm.rank()
        for i in range(steps):
            last = i == steps - 1
            with meter if last else contextlib.nullcontext():
                meter.reset_peak()
                loss = loss_of("gpt", model, batch("gpt", i, 12, r, n, "cpu", config))
                forward = dict(meter.category_peak, total=meter.peak)
                meter.reset_peak()
                loss.backward()
                backward = dict(meter.category_peak, total=meter.peak)
                opt.step()
                opt.zero_grad()
        meter.close()
        units = {u.unit_name: sum(f.shard_numel * n for f in u.flat_params) for u in model.units()}
        out[(mode, limit)] = {"forward": forward, "backward": backward, "units": units}
    return out


def full_buffers(units: dict, n: int, alive: list[str]) -> float:
    """Analytic parameter bytes: every shard (4·padded/N) plus the full buffer (4·padded) of each unit alive."""
    return sum(4 * p / n for p in units.values()) + sum(4 * units[u] for u in alive)


def expected_full_units(mode: str, phase: str) -> int:
    """How many blocks' full parameters are alive at once at the peak of `phase`, besides the root's.

    Without prefetching one block computes at a time. A prefetch adds the next one while the current one
    computes: forward_prefetch in forward, BACKWARD_PRE in backward. BACKWARD_POST starts the next
    all-gather only once the current block's gradient is computed -- and the current block's buffer is
    freed by then (just before autograd concatenates its gradients), so one buffer at a time, as without
    prefetching (and as in PyTorch's FSDP1, which reshards before it prefetches).
    """
    kw = MODES[mode]
    if phase == "forward":
        return 2 if kw["forward_prefetch"] else 1
    return 2 if kw["backward_prefetch"] == BACKWARD_PRE else 1


def run_prefetch_memory_report(world_sizes=(2, 4), markdown: str | None = None) -> dict:
    panels, results = [], {}
    for n in world_sizes:
        res = launch(measure_prefetch_memory, n, device="cpu")[0]
        results[n] = res
        rows = []
        for (mode, limit), m in res.items():
            blocks = [u for u in m["units"] if u != "(root)"]
            cells = []
            for phase in ("forward", "backward"):
                k = expected_full_units(mode, phase)
                alive = ["(root)"] + blocks[:k]  # blocks are the same size: any k of them
                cells += [fmt_bytes(m[phase]["params"]), fmt_bytes(full_buffers(m["units"], n, alive))]
            peak = max(m["forward"]["total"], m["backward"]["total"])
            rows.append([mode if limit else f"{mode} (no limit_all_gathers)"] + cells + [fmt_bytes(peak)])
        panels.append((f"N = {n}", md_table(["mode", "parameter bytes in forward, measured", "analytic",
                                             "in backward, measured", "analytic", "peak of the step"], rows)))
    text = ("Peak bytes of parameters (shards + full buffers) per rank, rank 0, in a steady-state FSDP step of "
            "the timeline GPT; analytic: every shard plus the full buffers of the root and of the blocks "
            "alive at once (one, or two with a prefetch); limit_all_gathers=True except in the rows marked "
            "(no limit_all_gathers)\n\n" + md_tabs(panels))
    write_report(text, markdown)
    return results
