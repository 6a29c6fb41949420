"""`python -m minifsdp gpu-check`: what a machine with GPUs can show that a laptop cannot.

On CUDA + NCCL, one GPU per rank (up to 4), it trains every strategy of the tour next to torch's DDP:
parity (max |difference| from torch's DDP), peak memory from the caching allocator
(`max_memory_allocated`, the truth on a GPU) next to the analytic model states, and the bytes each rank
sent, counted -- and writes the tables with the device's name, for the chapters.

    python -m minifsdp gpu-check --markdown chapters/generated/gpu_check.md

On a machine without a GPU it says so and exits 0: the CPU runs are the test suite's.
"""

from __future__ import annotations

import torch

from minifsdp.reports.format import write_report
from minifsdp.reports.tour import run_tour


def run_gpu_check(markdown: str | None = None, steps: int = 5, max_world_size: int = 4) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        print("minifsdp gpu-check: this machine has no CUDA GPU, so there is nothing to check here "
              "(on the CPU, the test suite and the tour run every strategy on gloo)")
        return 0
    world_size = min(gpus, max_world_size)
    name = torch.cuda.get_device_name(0)
    print(f"minifsdp gpu-check: {world_size} x {name}, torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL")
    run_tour(world_size=world_size, steps=steps, device="cuda", plot=None, markdown=markdown)
    if markdown:  # the tables name the device they were measured on
        with open(markdown) as f:
            tables = f.read()
        write_report(f"Measured on {world_size} x {name} (torch {torch.__version__}, CUDA {torch.version.cuda}, "
                     f"NCCL) by `python -m minifsdp gpu-check`\n\n{tables}", markdown)
    return 0
