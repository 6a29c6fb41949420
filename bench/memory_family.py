"""ZeRO-3 peak memory per rank on a family of shapes: minifsdp's FSDP next to torch's fully_shard (FSDP2)
and FSDP1, in the same ranks, metered by the same meter.

    python bench/memory_family.py [--shapes gpt_n3 uneven_n3 ...] [--tiny] [--markdown out.md]
                                  [--diagnose [--every] [--ops 12]]

Every shape is trained for 3 steps (SGD with momentum, AdamW for one) under each design, one unit per
block (the same units for all three, each design's defaults otherwise: minifsdp FullyShardedDataParallel
with auto_wrap_policy; fully_shard on every unit, then on the model; FSDP1 with
`device_id=torch.device("cpu")`). The last step is metered with minifsdp.MemoryMeter, as
bench/fsdp_vs_torch.py does: the model's parameters (this rank's shards), gradients, optimizer state,
each design's unsharded-parameter buffers (registered with `meter.watch(..., "params")`) and every storage
an op creates inside the step, until it is freed. The optimizer state exists by then (momentum, or
AdamW's moments), so the steady state is what is measured.

The meter used here (TimelineMeter) is MemoryMeter plus a record: after every op, the live bytes by
category and the op's name (the timeline), and for each storage the op that created it and the phase it
was created in; at the peak it keeps the list of live storages. `--diagnose` prints, for each shape
where minifsdp's peak is above a torch design's (`--every`: each shape), the storages each design held at
its peak, grouped by (category, creating op, phase), and with `--ops K` the last K ops of each timeline.

Reported per shape: the peak per rank (max over ranks, and rank 0) of each design, the phase (forward /
backward / optimizer) of the largest one, and minifsdp's ratio to fully_shard's and FSDP1's (max over
ranks) with the difference in bytes. Bytes are tensor-storage bytes: no allocator overhead, and what
gloo allocates inside a collective (its reduce-scatter copies the input) is counted only from the moment
the waiting thread touches it. minifsdp's figures are the same from run to run; torch's two can come out
higher on a loaded machine (when their asynchronous all-gathers finish moves what is alive at once).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import itertools
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minifsdp import GPTConfig, MemoryMeter, ModuleWrapPolicy, TinyGPT, events, gpt_batch, launch
from minifsdp.fsdp import FullyShardedDataParallel
from minifsdp.measure.meter import CATEGORIES, _Tracker
from minifsdp.models import Block
from minifsdp.reports.format import md_folded, md_table

from fsdp_vs_torch import unsharded_buffers  # (bench/): each design's full-parameter buffers

MiB = 2 ** 20
DESIGNS = ("minifsdp", "fsdp2", "fsdp1")
LABELS = {"minifsdp": "minifsdp FSDP", "fsdp2": "torch fully_shard", "fsdp1": "torch FSDP1"}
OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
              "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)}


# -- models ------------------------------------------------------------------------------------------------
class BigStack(nn.Module):
    """One huge unit: a deep stack of wide Linears, residual around the whole stack."""

    def __init__(self, d: int, width: int, depth: int):
        super().__init__()
        dims = [d] + [width] * (depth - 1) + [d]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))

    def forward(self, x):
        h = x
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i < len(self.layers) - 1:
                h = F.gelu(h)
        return x + h


class HugeUnitGPT(TinyGPT):
    """TinyGPT with one BigStack after its (small) blocks: one unit far larger than all the others."""

    def __init__(self, config: GPTConfig, width: int, depth: int, seed: int = 0):
        super().__init__(config, seed)
        torch.manual_seed(seed + 1)  # the stack draws from torch's generator: the same weights on every rank
        self.big = BigStack(config.n_embd, width, depth)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        x = self.big(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    about: str
    world_size: int
    config: GPTConfig
    batch: int = 2             # sequences per rank
    optimizer: str = "sgd"
    huge: tuple | None = None  # (width, depth) of a BigStack unit

    def build(self) -> nn.Module:
        return HugeUnitGPT(self.config, *self.huge) if self.huge else TinyGPT(self.config)

    @property
    def unit_classes(self) -> set:
        return {Block, BigStack} if self.huge else {Block}

    def params(self) -> int:
        return sum(p.numel() for p in self.build().parameters())


def _gpt(vocab, d, layers, heads, seq=64, tie=True):
    return GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=d, tie_weights=tie)


FAMILY = {s.name: s for s in (
    Shape("gpt_n3", "GPT, 3 blocks, d 256, vocab 2,048, N = 3", 3, _gpt(2048, 256, 3, 4)),
    Shape("gpt_n3_adamw", "the same GPT with AdamW, N = 3", 3, _gpt(2048, 256, 3, 4), optimizer="adamw"),
    Shape("gpt_n2", "the same GPT, N = 2", 2, _gpt(2048, 256, 3, 4)),
    Shape("uneven_n3", "uneven: d 90, vocab 1,001, seq 37, nothing divisible by 3", 3,
          _gpt(1001, 90, 3, 3, seq=37), batch=3),
    Shape("big_vocab_root", "large-vocabulary root: vocab 16,384, d 64, untied head, N = 3", 3,
          _gpt(16384, 64, 2, 2, tie=False)),
    Shape("big_vocab_tied_n2", "large-vocabulary root: vocab 16,384, d 64, tied head, N = 2", 2,
          _gpt(16384, 64, 2, 2)),
    Shape("many_small", "many small units: 12 blocks, d 32, vocab 96, N = 3", 3, _gpt(96, 32, 12, 2, seq=32),
          batch=4),
    Shape("huge_unit", "one huge unit: a 4-Linear stack of width 1,024 beside 2 blocks of d 64, N = 3", 3,
          _gpt(256, 64, 2, 2, seq=32), huge=(1024, 4)),
)}

# A quick subset (the test's): tiny models, N = 2 and N = 3.
TINY = {s.name: s for s in (
    Shape("tiny_gpt_n3", "GPT, 2 blocks, d 64, vocab 512, N = 3", 3, _gpt(512, 64, 2, 2, seq=32)),
    Shape("tiny_uneven_n3", "uneven: d 30, vocab 301, seq 19, N = 3", 3, _gpt(301, 30, 2, 3, seq=19), batch=3),
    Shape("tiny_huge_uneven_n3", "uneven, one huge unit: d 30, vocab 301, a 5-Linear stack of width 250, N = 3", 3,
          _gpt(301, 30, 2, 3, seq=19), batch=3, huge=(250, 5)),
    Shape("tiny_big_vocab_n2", "vocab 4,096, d 32, untied head, N = 2", 2, _gpt(4096, 32, 2, 2, seq=16, tie=False)),
    Shape("tiny_gpt_n2", "GPT, 3 blocks, d 64, vocab 256, N = 2", 2, _gpt(256, 64, 3, 2, seq=32)),
)}


# -- the meter, with a timeline ----------------------------------------------------------------------------
class _OpTracker(_Tracker):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = self.meter.op = func.overloadpacket.__name__
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.meter.op = None
        self.meter._record(name)
        return out


class TimelineMeter(MemoryMeter):
    """MemoryMeter that also keeps, after every op, (phase, op, live bytes, by category); for every storage,
    the op and phase that created it; and at the peak, the list of live storages."""

    def __init__(self, model=None, optimizer=None):
        self.phase, self.op, self.timeline = "before", None, []
        self._origin: dict[int, tuple] = {}
        self._label = "model/optimizer"
        self.peak_phase, self.peak_op, self.peak_index, self.at_peak = None, None, 0, []
        super().__init__(model, optimizer)

    def watch(self, tensors, category: str, label: str = "watched") -> None:
        self._label = label
        super().watch(tensors, category)
        self._label = "model/optimizer"

    def _track(self, storage, category: str) -> None:
        key = id(storage)
        if key not in self._live:
            self._origin[key] = (self.op or self._label, self.phase)
        super()._track(storage, category)

    def _free(self, key: int) -> None:
        super()._free(key)
        self._origin.pop(key, None)

    def _update_peak(self) -> None:
        before = self.peak
        super()._update_peak()
        if self.peak > before and self._mode is not None:
            self.peak_phase, self.peak_op, self.peak_index = self.phase, self.op, len(self.timeline)
            self.at_peak = [(e[0], e[1]) + self._origin.get(k, ("?", "?"))
                            for k, e in self._live.items() if e[0]]

    def _record(self, op: str) -> None:
        cats = {c: self._by_cat[c] for c in CATEGORIES}
        self.timeline.append((self.phase, op, sum(cats.values()), cats))

    def __enter__(self):  # MemoryMeter's, with the tracker that names each op
        self._mode = _OpTracker(self)
        self._mode.__enter__()
        events.subscribe(events.STORAGE_RESIZED, self._resize)
        return self

    def at_peak_grouped(self) -> list[tuple[int, str, str, str, int]]:
        """The storages live at the peak, summed by (category, creating op, phase): (bytes, ..., count)."""
        groups = collections.defaultdict(lambda: [0, 0])
        for nbytes, cat, op, phase in self.at_peak:
            g = groups[(cat, op, phase)]
            g[0] += nbytes
            g[1] += 1
        return sorted(((b, c, o, p, n) for (c, o, p), (b, n) in groups.items()), reverse=True)


# -- the designs -------------------------------------------------------------------------------------------
def build(design: str, shape: Shape):
    """The wrapped model and its optimizer, over the same weights on every rank and in every design."""
    from torch.distributed.fsdp import fully_shard

    model = shape.build()
    if design == "minifsdp":
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy(shape.unit_classes))
    elif design == "fsdp2":
        for m in list(model.modules()):
            if type(m) in shape.unit_classes:
                fully_shard(m)
        fully_shard(model)
    elif design == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy
        with warnings.catch_warnings():  # FSDP1 is deprecated in favour of fully_shard: we know
            warnings.simplefilter("ignore", FutureWarning)
            model = TorchFSDP(model, auto_wrap_policy=TorchModuleWrapPolicy(shape.unit_classes),
                              device_id=torch.device("cpu"))
    else:
        raise ValueError(design)
    return model, OPTIMIZERS[shape.optimizer](model.parameters())


def rank_batch(shape: Shape, step: int):
    rank, n = dist.get_rank(), dist.get_world_size()
    x, y = gpt_batch(shape.config, step, shape.batch * n)
    return x[rank::n], y[rank::n]


def _phase(meter, phase: str) -> None:
    if meter is not None:
        meter.phase = phase


def measure(design: str, shape: Shape, steps: int = 3, timeline: bool = False) -> dict:
    """Train `steps` steps; meter the last one. Returns its peak, the split and the phase of the peak, and
    (timeline=True) the record of the step: the timeline, and what was live at the peak."""
    model, opt = build(design, shape)
    for step in range(steps):
        x, y = rank_batch(shape, step)
        dist.barrier()
        meter = TimelineMeter(model, opt) if step == steps - 1 else None
        if meter is not None:  # created by now (FSDP1 and fully_shard make them in the first forward)
            meter.watch(unsharded_buffers(design, model), "params", label="unsharded-parameter buffer")
        with meter if meter is not None else contextlib.nullcontext():
            _phase(meter, "forward")
            loss = model(x, y)
            _phase(meter, "backward")
            loss.backward()
            _phase(meter, "optimizer")
            opt.step()
        if meter is not None:
            meter.close()
        opt.zero_grad()
    out = {"peak": meter.peak, "split": meter.peak_by_category, "phase": meter.peak_phase}
    if timeline:
        out.update(timeline=meter.timeline, at_peak=meter.at_peak_grouped(), at_peak_raw=meter.at_peak,
                   peak_op=meter.peak_op, peak_index=meter.peak_index)
    return out


def _rank_work(names: list[str], steps: int, designs: tuple, timeline: bool) -> dict:
    shapes = {**FAMILY, **TINY}
    return {name: {d: measure(d, shapes[name], steps, timeline) for d in designs} for name in names}


def run(names=None, steps: int = 3, designs=DESIGNS, timeline: bool = False) -> dict:
    """Measure the named shapes (of FAMILY or TINY; default: the whole family), launching the ranks once per
    world size. Returns {shape: {design: [per-rank result]}}."""
    pool = {**FAMILY, **TINY}
    names = list(names or FAMILY)
    by_n = collections.defaultdict(list)
    for name in names:
        by_n[pool[name].world_size].append(name)
    out = {}
    for n, group in sorted(by_n.items()):
        per_rank = launch(_rank_work, n, args=(group, steps, tuple(designs), timeline), device="cpu")
        for name in group:
            out[name] = {d: [r[name][d] for r in per_rank] for d in designs}
    return {name: out[name] for name in names}


def summary(results: dict) -> dict:
    """Per shape and design: peak over ranks, rank 0's peak, the phase of the largest; minifsdp's ratios."""
    rows = {}
    for name, res in results.items():
        row = {d: {"max": max(r["peak"] for r in ranks), "rank0": ranks[0]["peak"],
                   "phase": ranks[max(range(len(ranks)), key=lambda i: ranks[i]["peak"])]["phase"]}
               for d, ranks in res.items()}
        ours = row.get("minifsdp")
        for ref in ("fsdp2", "fsdp1"):
            if ours and ref in row:
                row[f"ratio_{ref}"] = ours["max"] / row[ref]["max"]
        rows[name] = row
    return rows


def _phases(phases: list[str]) -> str:
    return phases[0] if len(set(phases)) == 1 else " / ".join(phases)


def markdown(results: dict) -> str:
    """One row per shape: each design's peak per rank (the largest over ranks, MiB) and minifsdp's ratio to each
    torch design; folded under it, each shape's Ψ, N and optimizer, rank 0's peaks with the phase of each
    design's largest, and minifsdp's difference in bytes (the docs' column holds six columns, md_table)."""
    pool = {**FAMILY, **TINY}
    rows = summary(results)
    designs = [d for d in DESIGNS if d in next(iter(results.values()))]
    refs = [d for d in designs if d != "minifsdp"] if "minifsdp" in designs else []
    return layout(designs, refs, {name: {
        "shape": [f"{pool[name].params():,}", str(pool[name].world_size), pool[name].optimizer],
        "max": {d: f"{row[d]['max'] / MiB:.3f}" for d in designs},
        "rank0": {d: f"{row[d]['rank0'] / MiB:.3f}" for d in designs},
        "phase": {d: row[d]["phase"] for d in designs},
        "ratio": {d: f"{row[f'ratio_{d}']:.4f}" for d in refs},
        "diff": {d: f"{row['minifsdp']['max'] - row[d]['max']:+,}" for d in refs}} for name, row in rows.items()})


def layout(designs: list[str], refs: list[str], cells: dict[str, dict]) -> str:
    """The tables of `markdown`, from its figures as printed (shape -> its cells)."""
    main = md_table(["shape", *(LABELS[d] for d in designs), *(f"minifsdp / {LABELS[d][6:]}" for d in refs)],
                    [[name, *(c["max"][d] for d in designs), *(c["ratio"][d] for d in refs)]
                     for name, c in cells.items()],
                    caption="Peak per rank, MiB (the largest rank's)")
    shapes = md_table(["shape", "Ψ", "N", "optimizer", *(f"minifsdp − {LABELS[d][6:]} (bytes)" for d in refs)],
                      [[name, *c["shape"], *(c["diff"][d] for d in refs)] for name, c in cells.items()])
    rank0 = md_table(["shape", *(f"rank 0: {LABELS[d]}" for d in designs), "phase of each peak"],
                     [[name, *(c["rank0"][d] for d in designs), _phases([c["phase"][d] for d in designs])]
                      for name, c in cells.items()])
    return "\n\n".join([main, md_folded("The shapes, the differences in bytes, rank 0's peaks (MiB) and their phases",
                                         shapes + "\n\n" + rank0)])


def diagnose(results: dict, top: int = 8, ops: int = 0, every: bool = False) -> str:
    """For each shape where minifsdp's peak is above a torch design's (every shape with `every`): what each
    design held at its peak (rank 0), grouped by (category, creating op, phase), and the last `ops` ops
    of its timeline up to the peak."""
    out = []
    for name, res in results.items():
        ours = res["minifsdp"][0]
        worse = [d for d in res if d != "minifsdp" and ours["peak"] > res[d][0]["peak"]]
        if not (worse or every) or "at_peak" not in ours:
            continue
        out.append(f"\n## {name}: rank 0, minifsdp {ours['peak'] / MiB:.3f} MiB ({ours['phase']}) vs "
                   + ", ".join(f"{LABELS[d]} {res[d][0]['peak'] / MiB:.3f} MiB ({res[d][0]['phase']})"
                               for d in res if d != "minifsdp"))
        for d in res:
            r = res[d][0]
            out.append(f"\n{LABELS[d]} at its peak ({r['peak']:,} B; split "
                       + ", ".join(f"{c} {r['split'][c]:,}" for c in CATEGORIES) + "):")
            for nbytes, cat, op, phase, count in r["at_peak"][:top]:
                out.append(f"    {nbytes:>11,} B  {cat:<6} {count:>3} x  made by {op} in {phase}")
            if ops:
                out.append(f"  timeline, the last {ops} ops up to the peak (live bytes after each op):")
                last = min(r["peak_index"], len(r["timeline"]) - 1)
                for i in range(max(0, last - ops + 1), last + 1):
                    phase, op, total, cats = r["timeline"][i]
                    out.append(f"    [{i}] {phase:<9} {op:<32} {total:>12,}  "
                               + " ".join(f"{c} {cats[c]:,}" for c in CATEGORIES))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=None, help=f"default: all of {', '.join(FAMILY)}")
    ap.add_argument("--tiny", action="store_true", help="the test's tiny subset instead")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    ap.add_argument("--diagnose", action="store_true",
                    help="for each shape where minifsdp's peak is above a torch design's: what each held at its peak")
    ap.add_argument("--every", action="store_true", help="with --diagnose: every shape")
    ap.add_argument("--ops", type=int, default=0, help="with --diagnose: the last OPS ops of each timeline")
    args = ap.parse_args()
    names = args.shapes or (list(TINY) if args.tiny else list(FAMILY))
    t0 = time.perf_counter()
    results = run(names, args.steps, timeline=args.diagnose)
    table = markdown(results)
    print(table)
    print(f"\n{args.steps} steps per design, the last metered; wall time {time.perf_counter() - t0:.0f} s")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.diagnose:
        print(diagnose(results, ops=args.ops, every=args.every))


if __name__ == "__main__":
    sys.exit(main())
