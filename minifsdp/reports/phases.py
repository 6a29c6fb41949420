"""Chapter 6's measurements: FSDP's units and their payloads, and memory at each phase of one step.

    python -m minifsdp units  --world-size 2 --markdown chapters/generated/fsdp_units.md
    python -m minifsdp phases --world-sizes 1 2 3 4 --plot chapters/figures/fsdp_phases.svg --plot-world-size 2 \
        --markdown chapters/generated/fsdp_phases.md
"""

from __future__ import annotations

import contextlib

from minifsdp.distributed import comm
from minifsdp.distributed.launch import launch
from minifsdp.measure import analytic
from minifsdp.measure.meter import MemoryMeter
from minifsdp.models import TinyGPT
from minifsdp.reports.format import fmt_bytes, md_table, md_tabs, plot_memory, write_report
from minifsdp.reports.tour import TOUR_MODEL
from minifsdp.train import STRATEGIES, batch, loss_of

PHASES = ("after forward", "peak in backward", "after step", "after zero_grad")


# -- units and payloads --------------------------------------------------------------------------------------
def _one_fsdp_step(steps: int = 2) -> list[dict]:
    """Train the tour's GPT under FSDP (blocks as units); per unit: its sizes and what it sent in a step."""
    wrapped, opt = STRATEGIES["fsdp"].build(TinyGPT(TOUR_MODEL), "adamw", False)
    n, r = comm.world_size(), comm.rank()
    for step in range(steps):
        with comm.counting(record=True) if step == steps - 1 else contextlib.nullcontext() as counter:
            loss_of("gpt", wrapped, batch("gpt", step, 12, r, n, "cpu", TOUR_MODEL)).backward()
            opt.step()
            opt.zero_grad()
    rows = []
    for name, unit in wrapped.named_units():
        for flat in unit.flat_params:
            events = [e for e in counter.events if e.tag.split(" ", 1)[1] == flat.name]
            rows.append({"unit": flat.name, "numel": flat.numel, "padded": flat.shard_numel * n,
                         "all_gathers": sum(e.kind == "all_gather" for e in events),
                         "reduce_scatters": sum(e.kind == "reduce_scatter" for e in events),
                         "counted": sum(e.nbytes for e in events)})
    return rows


def run_units_report(world_size: int = 2, markdown: str | None = None) -> list[dict]:
    rows = launch(_one_fsdp_step, world_size, device="cpu")[0]
    table = []
    for r in rows:
        calls = r["all_gathers"] + r["reduce_scatters"]
        computed = calls * comm.ring_bytes("all_gather", r["padded"] * 4, world_size)
        r["computed"] = computed
        payload = analytic.collective_payload_bytes(r["padded"], world_size)
        size = f"{r['numel']:,}" if r["padded"] == r["numel"] else f"{r['numel']:,} → {r['padded']:,}"
        table.append([r["unit"], size, fmt_bytes(payload), f"{r['all_gathers']} + {r['reduce_scatters']}",
                      fmt_bytes(computed), fmt_bytes(r["counted"])])
    lines = [md_table(["unit", "parameters (→ padded)", "payload per collective (P·4/N)",
                       "all-gathers + reduce-scatters / step", "bytes sent / step, computed", "counted"], table)]
    write_report(f"FSDP units of the tour GPT (blocks as units, reshard after forward), fp32, world size "
           f"{world_size}, rank 0: the root all-gathers once (it keeps its parameters from forward to "
           f"backward), every other unit twice\n\n" + "\n".join(lines), markdown)
    return rows


# -- memory at each phase of a step -------------------------------------------------------------------------
def _phases(strategies, steps: int = 3) -> dict:
    """Per strategy, the meter's categories at each phase of the last (steady-state) step."""
    n, r = comm.world_size(), comm.rank()
    out = {}
    for name in strategies:
        wrapped, opt = STRATEGIES[name].build(TinyGPT(TOUR_MODEL), "adamw", False)
        meter = MemoryMeter(wrapped, opt)
        snaps = {}
        for step in range(steps):
            last = step == steps - 1
            with meter if last else contextlib.nullcontext():
                meter.reset_peak()
                loss = loss_of("gpt", wrapped, batch("gpt", step, 12, r, n, "cpu", TOUR_MODEL))
                snaps["after forward"] = meter.live()
                meter.reset_peak()
                loss.backward()
                snaps["peak in backward"] = {**meter.peak_by_category, "total": meter.peak}
                opt.step()
                snaps["after step"] = meter.live()
                opt.zero_grad()
                snaps["after zero_grad"] = meter.live()
        meter.close()
        units = [(flat.name, flat.shard_numel * n) for _, unit in getattr(wrapped, "named_units", list)()
                 for flat in unit.flat_params]
        out[name] = {"phases": snaps, "units": units}
    return out


def fsdp_param_bytes(units: list[tuple[str, int]], n: int, alive: list[str]) -> float:
    """The analytic FSDP parameter bytes: every shard, plus the full buffer of each unit alive now."""
    return sum(4 * padded / n for _, padded in units) + sum(4 * padded for name, padded in units if name in alive)


PHASE_COLUMNS = {"params": "parameters", "grads": "gradients", "optim": "optimizer state",
                 "analytic": "model states, analytic", "other": "activations + other", "total": "total"}


def phase_table(phase: str, rows: list[dict]) -> str:
    """One phase's table, a row per strategy. Seven columns would not fit the docs' column, and at each phase
    some are empty: a column under 1 kB on every row (the gradients after forward, the activations after the
    step) or with no analytic figure (the peak) is left out, and the caption says what it held."""
    keep, notes = [], []
    for col, label in PHASE_COLUMNS.items():
        values = [r[col] for r in rows if r[col] is not None]
        if not values:
            notes.append(f"{label}: no closed form")
        elif max(values) < 1e3:
            notes.append(f"{label}: {fmt_bytes(max(values))}{' at most' if max(values) else ''}")
        else:
            keep.append(col)
    caption = phase[0].upper() + phase[1:] + (f" ({'; '.join(notes)})" if notes else "")
    return md_table(["strategy"] + [PHASE_COLUMNS[c] for c in keep],
                    [[r["strategy"]] + ["—" if r[c] is None else fmt_bytes(r[c]) for c in keep] for r in rows],
                    caption)


def run_phases_report(world_sizes=(1, 2, 3, 4),
                      strategies=("ddp", "oss", "sdp", "fsdp", "fsdp_nraf", "torch_fsdp2"),
                      plot: str | None = None, markdown: str | None = None,
                      plot_world_size: int | None = None) -> dict:
    """Per-phase memory at each world size (table); the plot shows one of them, `plot_world_size` (default:
    the last), a panel per phase, a bar per strategy. The tabs open on that world size; N = 1, where
    nothing is sharded and every strategy holds the same, comes last."""
    shown = world_sizes[-1] if plot_world_size is None else plot_world_size
    if plot and shown not in world_sizes:
        raise ValueError(f"--plot-world-size {shown} is not one of --world-sizes {list(world_sizes)}")
    psi = sum(p.numel() for p in TinyGPT(TOUR_MODEL).parameters())
    panels, results, shown_bars = [], {}, []
    for n in world_sizes:
        results[n] = launch(_phases, n, device="cpu", args=(list(strategies),))[0]
        cells = {phase: [] for phase in PHASES}
        for name in strategies:
            stage = STRATEGIES[name].stage
            model = analytic.model_state_bytes(psi, n, stage)
            for phase in PHASES:
                m = results[n][name]["phases"][phase]
                grads = 0.0 if phase in ("after forward", "after zero_grad") else model["grads"]
                states = model["params"] + grads + model["optim"]
                if phase == "peak in backward" or (stage == 3 and phase == "after forward"
                                                   and name not in ("fsdp", "fsdp_nraf")):
                    states = None  # no closed form here (torch's FSDP2: its units are its own business)
                elif stage == 3 and phase == "after forward":  # + the units still unsharded: root, or all
                    units = results[n][name]["units"]
                    alive = [u for u, _ in units] if name == "fsdp_nraf" else ["(root)"]
                    states += fsdp_param_bytes(units, n, alive) - model["params"]
                cells[phase].append({"strategy": name, **{c: m[c] for c in PHASE_COLUMNS if c in m},
                                     "analytic": states})
                if n == shown:
                    shown_bars.append((name, m, states, phase))
        panels.append((f"N = {n}", "\n\n".join(phase_table(phase, cells[phase]) for phase in PHASES)))
    write_report(f"Memory per rank (rank 0) at each phase of one step: tour GPT (Ψ = {psi:,}), AdamW, CPU; "
                 f"analytic model states per the ZeRO stage (for FSDP: 16Ψ/N over the padded units, plus the full "
                 f"buffer of every unit still unsharded). A tab per world size, a table per phase.\n\n"
                 + md_tabs(sorted(panels, key=lambda tab: (tab[0] != f"N = {shown}", tab[0] == "N = 1"))),
                 markdown)
    if plot:
        shown_bars.sort(key=lambda b: PHASES.index(b[3]))  # a panel per phase, a bar per strategy
        plot_memory([b[:3] for b in shown_bars], plot, f"Memory per rank at each phase of the third step, N = {shown}",
                    xlabel="MB per rank (rank 0)", panels=[b[3] for b in shown_bars])
        print(f"\nwrote {plot}")
    return results
