"""Chapter 12's measurements: tensor parallelism (and sequence parallelism), the column layers' input-gradient
all-reduce behind their weight-gradient matmul, the pipeline schedules, and the parallelisms side by side on 4 ranks.

    python -m minifsdp parallel --parts tp --markdown chapters/generated/parallel_tp.md
    python -m minifsdp parallel --parts overlap --markdown chapters/generated/parallel_overlap.md --plot chapters/figures/tp_overlap.svg
    python -m minifsdp parallel --parts pp --markdown chapters/generated/parallel_pp.md --plot chapters/figures/pipeline_gantt.svg
    python -m minifsdp parallel --parts compare --markdown chapters/generated/parallel_compare.md

(`--markdown DIR` writes each part's table to DIR/parallel_<part>.md, `--markdown PREFIX` to PREFIX_<part>.md;
`--plot` likewise for the two parts that draw: DIR/tp_overlap.svg and DIR/pipeline_gantt.svg, or PREFIX_<part>.svg.)

    tp.py       tensor and sequence parallelism at t = 1, 2, 4: parameter bytes, bytes per step, activations saved
    overlap.py  the column layers' input-gradient all-reduce behind their weight-gradient matmul, on a timeline
    pp.py       the pipeline schedules: bubbles, micro-batches in flight, activations, bytes sent; a Gantt chart
    compare.py  DDP, FSDP, TP + SP, 1F1B, DP x TP and PP x DP on 4 ranks, side by side
"""

from __future__ import annotations

import os

from minifsdp.distributed.launch import rank_pool
from minifsdp.reports.format import write_report
from minifsdp.reports.parallel.compare import compare_results, compare_table
from minifsdp.reports.parallel.overlap import overlap_results, overlap_table, plot_overlap
from minifsdp.reports.parallel.pp import plot_gantt, pp_results, pp_table
from minifsdp.reports.parallel.tp import tp_results, tp_table

PARTS = ("tp", "overlap", "pp", "compare")
PLOTS = {"overlap": "tp_overlap.svg", "pp": "pipeline_gantt.svg"}  # the parts that draw, and their default file


def _markdown_path(markdown: str | None, part: str, parts) -> str | None:
    """--markdown: a file (with one part), a directory (DIR/parallel_<part>.md) or a prefix (PREFIX_<part>.md)."""
    if not markdown:
        return None
    if os.path.isdir(markdown):
        return os.path.join(markdown, f"parallel_{part}.md")
    if markdown.endswith(".md") and len(parts) == 1:
        return markdown
    return f"{markdown.removesuffix('.md')}_{part}.md"


def _plot_path(plot: str | None, part: str, parts) -> str | None:
    """--plot, as --markdown: a file (.svg or .png, with one part that draws), a directory (DIR/tp_overlap.svg,
    DIR/pipeline_gantt.svg) or a prefix (PREFIX_<part>.svg; PREFIX.png gives PREFIX_<part>.png)."""
    if not plot:
        return None
    if os.path.isdir(plot):
        return os.path.join(plot, PLOTS[part])
    stem, ext = os.path.splitext(plot)
    if ext in (".svg", ".png") and len([p for p in parts if p in PLOTS]) == 1:
        return plot
    return f"{stem}_{part}{ext}" if ext in (".svg", ".png") else f"{plot}_{part}.svg"


def run_parallel_report(parts=PARTS, markdown: str | None = None, plot: str | None = None) -> None:
    parts = list(parts)
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}: choose from {list(PARTS)}")
    with rank_pool():  # the launches at 4 ranks share their processes
        if "tp" in parts:
            write_report(tp_table(tp_results()), _markdown_path(markdown, "tp", parts))
        if "overlap" in parts:
            results = overlap_results()
            write_report(overlap_table(results), _markdown_path(markdown, "overlap", parts))
            if plot:
                plot_overlap(results, _plot_path(plot, "overlap", parts))
                print(f"wrote {_plot_path(plot, 'overlap', parts)}")
        if "pp" in parts:
            results = pp_results()
            write_report(pp_table(results), _markdown_path(markdown, "pp", parts))
            if plot:
                plot_gantt(results, _plot_path(plot, "pp", parts))
                print(f"wrote {_plot_path(plot, 'pp', parts)}")
        if "compare" in parts:
            write_report(compare_table(compare_results()), _markdown_path(markdown, "compare", parts))
