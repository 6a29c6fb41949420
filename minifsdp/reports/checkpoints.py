"""Chapter 10's measurements: checkpoint size on disk and save / load time per strategy, and a picture of
which bytes each rank writes at N and reads back at M.

    python -m minifsdp checkpoints --world-sizes 1 2 3 4 --markdown chapters/generated/checkpoints.md \
        --plot chapters/figures/reshard.svg

Every strategy trains a GPT with four blocks for one AdamW step, then saves (and loads) its checkpoint
through minifsdp.checkpoint, a few times; each rank reports the bytes of its own data file and the
wall-clock time of the calls. The analytic size is the model states a checkpoint must hold: 4 bytes per
parameter plus AdamW's two moments, 12Ψ, whatever the strategy and N -- DCP writes a replicated tensor once.
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from minifsdp import checkpoint
from minifsdp.checkpoint.flat_chunks import boxes
from minifsdp.distributed.launch import launch
from minifsdp.models import GPTConfig
from minifsdp.reports import style
from minifsdp.reports.format import fmt_bytes, write_report
from minifsdp.train import STRATEGIES, batch, build_model, loss_of

CONFIG = GPTConfig(n_layer=4, n_embd=64, vocab_size=256, tie_weights=False)
STRATEGY_NAMES = ("ddp", "oss", "sdp", "oss_flat", "sdp_flat", "fsdp")
REPEATS = 5


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def measure(root: str) -> dict:
    """In every rank: per strategy, this rank's file size and the median save and load times."""
    n, r = dist.get_world_size(), dist.get_rank()
    out = {}
    for name in STRATEGY_NAMES:
        model, opt = STRATEGIES[name].build(build_model("gpt", seed=0, gpt_config=CONFIG), "adamw", False)
        loss_of("gpt", model, batch("gpt", 0, 4 * n, r, n, "cpu", CONFIG)).backward()
        opt.step()
        opt.zero_grad()
        path = Path(root) / f"{name}_n{n}"
        saves = [_timed(lambda: checkpoint.save(path, model, opt, step=1)) for _ in range(REPEATS)]
        loads = [_timed(lambda: checkpoint.load(path, model, opt)) for _ in range(REPEATS)]
        files = {f.name: f.stat().st_size for f in (path / "step_00000001").iterdir()}
        out[name] = {"mine": sum(size for f, size in files.items() if f.startswith(f"__{r}_")),
                     "total": sum(files.values()), "save": statistics.median(saves),
                     "load": statistics.median(loads)}
        dist.barrier()
    out["psi"] = sum(p.numel() for p in build_model("gpt", seed=0, gpt_config=CONFIG).parameters())
    return out


def run_checkpoint_report(world_sizes=(1, 2, 3, 4), markdown: str | None = None, plot: str | None = None) -> None:
    rows_size, rows_time = [], []
    root = tempfile.mkdtemp(prefix="minifsdp-ckpt-")
    try:
        for n in world_sizes:
            ranks = launch(measure, world_size=n, args=(root,), device="cpu")
            psi = ranks[0]["psi"]
            base = ranks[0]["ddp"]
            for name in STRATEGY_NAMES:
                mine = [ranks[r][name]["mine"] for r in range(n)]
                total = ranks[0][name]["total"]
                rows_size.append(f"| {name} | {n} | {fmt_bytes(min(mine))} – {fmt_bytes(max(mine))} | "
                                 f"{fmt_bytes(total)} | {fmt_bytes(12 * psi)} | {total / (12 * psi):.3f} |")
                rows_time.append(f"| {name} | {n} | {ranks[0][name]['save'] / base['save']:.2f} | "
                                 f"{ranks[0][name]['load'] / base['load']:.2f} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = (f"GPT {CONFIG.n_layer} blocks × {CONFIG.n_embd}, vocabulary {CONFIG.vocab_size}, untied, AdamW "
            f"(Ψ = {psi:,}); CPU + gloo, one file per rank (DCP's FileSystemWriter).\n\n"
            "**On disk**: each rank's data file (smallest – largest), the whole checkpoint (data files and "
            ".metadata), and the model states it must hold, 12Ψ\n\n"
            "| strategy | N | per rank | total | 12Ψ | total / 12Ψ |\n|---|---|---|---|---|---|\n"
            + "\n".join(rows_size) +
            f"\n\n**Time**, median of {REPEATS} saves and {REPEATS} loads, as a ratio to DDP's at the same N "
            "(wall-clock on a shared CPU: read them to within a few tenths)\n\n"
            "| strategy | N | save / DDP's | load / DDP's |\n|---|---|---|---|\n" + "\n".join(rows_time) + "\n")
    write_report(text, markdown)
    if plot:
        plot_reshard(plot)


# -- the picture: which parts of which parameter each rank writes at N and reads back at M ---------------------
def reshard_boxes(shapes, n: int) -> list[list[tuple[int, tuple, tuple]]]:
    """For tensors laid end to end in one flat buffer padded to N equal shards (chapter 5's FlatParameter,
    unaligned here so the picture stays small): per tensor, (rank, offsets, sizes) of every box."""
    offsets = [sum(math.prod(s) for s in shapes[:i]) for i in range(len(shapes))]
    shard = -(-sum(math.prod(s) for s in shapes) // n)
    out = []
    for shape, offset in zip(shapes, offsets):
        numel = math.prod(shape)
        out.append([(q, o, s) for q in range(n)
                    for o, s in boxes(shape, max(0, q * shard - offset), min(numel, (q + 1) * shard - offset))])
    return out


@style.charts
def plot_reshard(path: str, shapes=((6, 10), (10,), (4, 10)), saved_at: int = 2, loaded_at: int = 3) -> None:
    from matplotlib.patches import Rectangle

    colours = [style.FILLS[c] for c in ("blue", "orange", "green", "purple", "red", "teal", "yellow", "grey")]
    rows = [s[0] if len(s) == 2 else 1 for s in shapes]
    fig, axes = style.figure(0.95 + 0.33 * sum(rows) + 0.3 * len(shapes), len(shapes), 2,
                             gridspec_kw={"height_ratios": rows}, squeeze=False)
    saved = reshard_boxes(shapes, saved_at)
    for col, (n, verb) in enumerate(((saved_at, "written"), (loaded_at, "read"))):
        for t, (shape, found) in enumerate(zip(shapes, reshard_boxes(shapes, n))):
            ax = axes[t][col]
            height, width = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])

            def rect(o, s):  # (x, y, w, h) of a box, row 0 at the top
                y, x = (o[0], o[1]) if len(shape) == 2 else (0, o[0])
                h, w = (s[0], s[1]) if len(shape) == 2 else (1, s[0])
                return x, height - y - h, w, h

            for q, o, s in found:
                x, y, w, h = rect(o, s)
                ax.add_patch(Rectangle((x, y), w, h, facecolor=colours[q % len(colours)], edgecolor=style.INK,
                                       linewidth=1.2))
                ax.text(x + w / 2, y + h / 2, f"rank {q}", ha="center", va="center", fontsize=10, color=style.INK,
                        zorder=5, bbox=dict(facecolor=colours[q % len(colours)], edgecolor="none", pad=1))
            if col == 1:  # the chunks on disk, dashed: a read that crosses one of these lines is two reads
                for _, o, s in saved[t]:
                    x, y, w, h = rect(o, s)
                    ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor=style.INK, linestyle=(0, (4, 2)),
                                           linewidth=2.5))
            ax.set_xlim(0, width)
            ax.set_ylim(0, height)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_aspect("equal")
            for side in ax.spines.values():
                side.set_visible(False)
            ax.set_title(f"tensor {t} {tuple(shape)}: {verb} at N = {n}", fontsize=10)
    fig.suptitle(f"Three tensors in one flat buffer. Left: saved by {saved_at} ranks, each box a chunk on disk.\n"
                 f"Right: loaded by {loaded_at}, each box what one rank reads; dashed: the chunks on disk.",
                 fontsize=10)
    style.save(fig, path)
    print(f"wrote {path}")
