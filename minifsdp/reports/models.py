"""The models of the docs, by name: each GPT configuration a page trains or measures, and its Ψ.

    python -m minifsdp.reports.models --markdown chapters/generated/models.md

Every configuration is read from where the code that uses it defines it (the reports' own constants), and
Ψ is counted on the built model, a tied weight once, as the meter and the analytic model count it. The
home page shows the table in its "Models used" box, and each chapter calls its model by the name here.
"""

from __future__ import annotations

import argparse

from minifsdp.models import GPTConfig, TinyGPT
from minifsdp.reports import checkpoints, fsdp2, full_precision, options, overlap, parallel, precision, state_dict_memory, tour
from minifsdp.reports.format import md_table, write_report

# bench/fsdp_vs_torch.py builds its GPT from its command line; these are its defaults (--layers 8 --embd 448
# --heads 8), the run chapters 7 and 11 show.
BENCH_MODEL = GPTConfig(vocab_size=256, block_size=128, n_layer=8, n_head=8, n_embd=448)

# name -> (the configuration, where the code defines it, where the docs use it)
MODELS: dict[str, tuple[GPTConfig, str, str]] = {
    "default GPT": (GPTConfig(), "`GPTConfig()`'s defaults, minifsdp/models.py",
                    "the tests of chapters 1 to 11 (chapter 10's with one block); chapter 8 (loss "
                    "curves, fp32 modules)"),
    "tour GPT": (tour.TOUR_MODEL, "`TOUR_MODEL`, tour.py",
                 "the tour; chapters 2 to 4 (memory), 3 (partition), 6 (units, phases)"),
    "states-heavy GPT": (tour.STATES_HEAVY_MODEL, "`STATES_HEAVY_MODEL`, tour.py",
                         "chapter 4 (where the peak falls)"),
    "timeline GPT": (overlap.TIMELINE_MODEL, "`TIMELINE_MODEL`, overlap.py",
                     "chapter 7 (timelines, prefetch memory)"),
    "4-block GPT": (precision.CONFIG, "`CONFIG`, precision.py and options.py",
                    "chapter 8 (precision table), chapter 9 (training options)"),
    "bench GPT": (BENCH_MODEL, "the defaults of bench/fsdp_vs_torch.py", "chapters 7 and 11 (against torch's FSDP)"),
    "state-dict GPT": (state_dict_memory.MODEL, "`MODEL`, state_dict_memory.py",
                       "chapter 10 (state dict memory)"),
    "checkpoint GPT": (checkpoints.CONFIG, "`CONFIG`, checkpoints.py", "chapter 10 (save at N, load at M)"),
    "FSDP2 GPT": (fsdp2.CONFIG, "`CONFIG`, fsdp2.py", "chapter 11 (fully_shard, HSDP)"),
    "TP GPT": (parallel.TP_CONFIG, "`TP_CONFIG`, parallel.py", "chapter 12 (tensor parallel)"),
    "TP-overlap GPT": (parallel.OVERLAP_CONFIG, "`OVERLAP_CONFIG`, parallel.py",
                       "chapter 12 (overlapped all-reduces)"),
    "pipeline GPT": (parallel.PP_CONFIG, "`PP_CONFIG`, parallel.py", "chapter 12 (pipelines)"),
    "comparison GPT": (parallel.COMPARE_CONFIG, "`COMPARE_CONFIG`, parallel.py",
                       "chapter 12 (the parallelisms compared)"),
}
assert options.CONFIG == precision.CONFIG, "chapters 8 and 9 share the 4-block GPT"
assert full_precision.CONFIG == GPTConfig(), "chapter 8's fp32 modules train the default GPT"


def psi(config: GPTConfig) -> int:
    """The parameters of the built model; a tied embedding and output projection count once."""
    return sum(p.numel() for p in TinyGPT(config).parameters())


def shape(c: GPTConfig) -> str:
    """Blocks × width, heads; vocabulary, context; whether the output projection is the embedding."""
    return (f"{c.n_layer} × {c.n_embd}, {c.n_head} heads; vocab {c.vocab_size}, context {c.block_size}"
            f"{'; tied' if c.tie_weights else ''}")


def run_models_report(markdown: str | None = None) -> dict[str, int]:
    counts = {name: psi(config) for name, (config, _, _) in MODELS.items()}
    rows = [[f"**{name}**", f"{counts[name]:,}", shape(config), defined, used]
            for name, (config, defined, used) in MODELS.items()]
    write_report(md_table(["name", "Ψ", "blocks × width", "defined by", "used in"], rows),
                 markdown)
    return counts


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", default=None, help="also write the table as Markdown to this file")
    run_models_report(ap.parse_args().markdown)
