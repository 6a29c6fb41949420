"""Chapter 7: what minifsdp reports of the caching allocator -- on this CPU machine, and on a GPU.

`num_alloc_retries` (an allocation found no free block; the allocator emptied its cache and tried again) exists
only in CUDA's caching allocator. On the CPU, MemoryMeter.allocator_stats() says so by returning nothing, and
`python -m minifsdp gpu-check` says there is no GPU and exits 0. On a GPU, gpu-check prints the allocator's
peak and retries per strategy and rank, from the tour's rows: that table is checked here on made-up rows. The
simulated illustration of buffers held without limit_all_gathers (DeviceLag) is chapter 13's, tested in
tests/test_ch13_simulate.py.
"""

import pytest
import torch

from minifsdp.__main__ import main
from minifsdp.measure.meter import MemoryMeter
from minifsdp.reports.gpu_check import allocator_table
from minifsdp.reports.tour import strategy_rows

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU reports")


@no_gpu
def test_on_the_cpu_there_is_no_allocator_to_report():
    assert MemoryMeter().allocator_stats() == {}


@no_gpu
def test_gpu_check_says_there_is_no_gpu(capsys):
    assert main(["gpu-check"]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


def test_the_tour_rows_carry_the_retries_and_gpu_check_shows_them():
    params = {"w": torch.zeros(2)}
    res = {"world_size": 2, "psi": 2, "params": params, "after_step": {"params": 8, "grads": 8, "optim": 16},
           "peak": 100, "peak_by_category": {"other": 50}, "comm_bytes": {"all_gather": 4.0}, "steps": 1,
           "step_times": [0.01]}
    cpu = strategy_rows("fsdp", [{**res, "allocator": {}}], [{"params": params}], "adamw")
    gpu = strategy_rows("fsdp", [{**res, "allocator": {"max_allocated": 2_000_000, "num_alloc_retries": 3}}],
                        [{"params": params}], "adamw")
    assert cpu[0]["alloc_retries"] is None and cpu[0]["peak"] == 100  # the CPU: the meter's own peak
    assert (gpu[0]["alloc_retries"], gpu[0]["peak"]) == (3, 2_000_000)
    table = allocator_table({"fsdp": gpu})
    assert "| strategy | rank | max_memory_allocated | num_alloc_retries |" in table
    assert "| fsdp | 0 | 2.00 MB | 3 |" in table
