"""`python -m minifsdp gpu-check`: what a machine with GPUs can show that a laptop cannot.

On CUDA + NCCL, one GPU per rank (up to 4), it trains every strategy of the tour next to torch's DDP:
parity (max |difference| from torch's DDP), peak memory from the caching allocator
(`max_memory_allocated`, the truth on a GPU) next to the analytic model states, and the bytes each rank
sent, counted -- and writes the tables with the device's name, for the chapters. Then the caching
allocator's own books per strategy and rank: its peak and `num_alloc_retries`, the times it ran out,
emptied its cache and tried again (chapter 7; on the CPU there is no such allocator, and nothing to show).

    python -m minifsdp gpu-check --markdown chapters/generated/gpu_check.md

On a machine without a GPU it says so and exits 0: the CPU runs are the test suite's.
"""

from __future__ import annotations

import torch

from minifsdp.reports.format import fmt_bytes, md_table, write_report
from minifsdp.reports.tour import run_tour


def allocator_table(tables: dict[str, list[dict]]) -> str:
    """The caching allocator's peak and retries, per strategy and rank, from the tour's rows."""
    rows = [[name, r["rank"], fmt_bytes(r["peak"]), r["alloc_retries"]] for name, ranks in tables.items()
            for r in ranks]
    return md_table(["strategy", "rank", "max_memory_allocated", "num_alloc_retries"], rows,
                    "The caching allocator, per rank")


def run_gpu_check(markdown: str | None = None, steps: int = 5, max_world_size: int = 4) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        print("minifsdp gpu-check: this machine has no CUDA GPU, so there is nothing to check here "
              "(on the CPU, the test suite and the tour run every strategy on gloo)")
        return 0
    world_size = min(gpus, max_world_size)
    name = torch.cuda.get_device_name(0)
    print(f"minifsdp gpu-check: {world_size} x {name}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL")
    rows = run_tour(world_size=world_size, steps=steps, device="cuda", plot=None, markdown=markdown)
    allocator = allocator_table(rows)
    print(f"\n{allocator}")
    if markdown:  # the tables name the device they were measured on
        with open(markdown) as f:
            tables = f.read()
        write_report(f"Measured on {world_size} x {name} (torch {torch.__version__}, CUDA {torch.version.cuda}, "
                     f"NCCL) by `python -m minifsdp gpu-check`\n\n{tables}\n\n{allocator}", markdown)
    return 0
