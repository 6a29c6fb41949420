"""ZeRO-3's peak memory per rank is at most torch's fully_shard's, on tiny shapes of bench/memory_family.py.

Each shape is trained 3 steps (SGD with momentum) under minifsdp's FullyShardedDataParallel and torch's
fully_shard, one unit per block, in the same ranks; the last step is metered by the same MemoryMeter
(tensor storages, each design's unsharded-parameter buffers watched), so the figures are deterministic
on the CPU. The shapes are the family's in miniature: a large-vocabulary root (untied head) at N = 2,
where the root's concatenated gradients used to sit beside its full parameters; one huge unit beside
small ones at N = 3, with no size divisible by 3 (the padding); and a small GPT at N = 3.

The peak per rank is the largest over the ranks (what a rank must have room for); rank 0's is checked
too. FSDP1 is not asserted: minifsdp aligns every parameter to 64 bytes (chapter 5) and FSDP1 does not,
so where the peak is the loss's backward (the same tensors in both) minifsdp may hold a few hundred bytes
more; bench/memory_family.py reports it.
"""

import sys
from pathlib import Path

import pytest

from minifsdp import launch

BENCH = Path(__file__).resolve().parents[1] / "bench"
SHAPES = {2: ["tiny_big_vocab_n2"], 3: ["tiny_huge_uneven_n3", "tiny_gpt_n3"]}


def measure(names):
    """In each rank: the bench's measurement of minifsdp and fully_shard on these shapes."""
    sys.path.insert(0, str(BENCH))
    import memory_family

    return memory_family._rank_work(names, 3, ("minifsdp", "fsdp2"), False)


@pytest.fixture(scope="module")
def peaks():
    out = {}
    for n, names in SHAPES.items():
        per_rank = launch(measure, n, args=(names,), device="cpu")
        for name in names:
            out[name] = {d: [r[name][d]["peak"] for r in per_rank] for d in ("minifsdp", "fsdp2")}
    return out


@pytest.mark.parametrize("name", [name for names in SHAPES.values() for name in names])
def test_zero3_peak_at_most_fully_shard(peaks, name):
    ours, torch_fsdp2 = peaks[name]["minifsdp"], peaks[name]["fsdp2"]
    assert max(ours) <= max(torch_fsdp2), (name, ours, torch_fsdp2)
    assert ours[0] <= torch_fsdp2[0], (name, ours, torch_fsdp2)
