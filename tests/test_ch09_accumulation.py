"""Chapter 9: gradient accumulation under FULL_SHARD, SHARD_GRAD_OP and NO_SHARD, per micro-batch, measured.

`python -m minifsdp accumulation` (minifsdp/reports/accumulation.py) runs one optimizer step of three
micro-batches per strategy, reducing every micro-batch or inside no_sync() until the last. Here every byte
count is held to its model, in units of one collective over the whole model, 4Ψ(N−1)/N (every tensor of this
GPT is a multiple of 64 elements, so the units need no padding at N = 2), and the memory alive between two
micro-batches to its model states. Torch's FSDP1 keeps SHARD_GRAD_OP's full parameters through no_sync():
measured beside ours, which gathers them again in every micro-batch.
"""

import pytest

from minifsdp import launch
from minifsdp.models import TinyGPT
from minifsdp.reports.accumulation import CONFIG, accumulation_by_strategy

N = 2
PSI = sum(p.numel() for p in TinyGPT(CONFIG).parameters())
ONE = 4 * PSI * (N - 1) / N  # one all-gather, or one reduce-scatter, of every unit
ROOT = 4 * 4160 * (N - 1) / N  # the root's all-gather: it is gathered once, blocks twice (FULL_SHARD)
STEP_COUNTERS = 4 * 5  # AdamW's step, one fp32 per flat parameter


@pytest.fixture(scope="module")
def res():
    return launch(accumulation_by_strategy, world_size=N, device="cpu")[0]


def test_bytes_per_micro_batch(res):
    every, quiet = res["FULL_SHARD", False]["sent"], res["FULL_SHARD", True]["sent"]
    assert every == [3 * ONE - ROOT] * 3
    assert quiet == [2 * ONE - ROOT] * 2 + [3 * ONE - ROOT]  # no_sync() saves only the reduce-scatters
    assert res["SHARD_GRAD_OP", False]["sent"] == [2 * ONE] * 3
    assert res["SHARD_GRAD_OP", True]["sent"] == [ONE, ONE, 2 * ONE]  # it still all-gathers, once per unit
    assert res["NO_SHARD", False]["sent"] == [2 * ONE] * 3  # an all-reduce: twice a reduce-scatter's bytes
    assert res["NO_SHARD", True]["sent"] == [0, 0, 2 * ONE]


def held_after_a_collective(held: int, model: int) -> bool:
    """gloo reduces a copy of its input (chapter 5 measures it), and about one time in four that copy is still
    alive for a moment after the wait: at most one unit's flat gradient more than the model, a block's."""
    return model <= held <= model + 4 * 12_608


def test_memory_between_micro_batches(res):
    sharded = 16 * PSI / N + STEP_COUNTERS  # parameters, gradients and AdamW's state, as shards
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        assert all(held_after_a_collective(h, sharded) for h in res[strategy, False]["held"])
        # no_sync(): every unit's full gradient in place of its shard (no collective: to the byte), until the
        # last micro-batch reduces
        quiet = res[strategy, True]["held"]
        assert quiet[:2] == [sharded - 4 * PSI / N + 4 * PSI] * 2
        assert held_after_a_collective(quiet[2], sharded)
    full = 16 * PSI + STEP_COUNTERS  # NO_SHARD: DDP's model states
    assert res["NO_SHARD", True]["held"][:2] == [full] * 2
    assert held_after_a_collective(res["NO_SHARD", True]["held"][2], full)
    assert res["FULL_SHARD", True]["peak"] < res["SHARD_GRAD_OP", True]["peak"] < res["NO_SHARD", True]["peak"]


def test_torch_fsdp1_keeps_shard_grad_op_parameters_through_no_sync(res):
    theirs, ours = res["torch FSDP1 SHARD_GRAD_OP", True], res["SHARD_GRAD_OP", True]
    assert theirs["sent"] == [5, 0, 0]  # all-gathers: every unit once, then never again until the step
    assert [t - o for t, o in zip(theirs["held"][:2], ours["held"][:2])] == [4 * PSI, 4 * PSI]
