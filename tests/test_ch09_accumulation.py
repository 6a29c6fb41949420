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


def _sent(strategy, quiet, res) -> str:
    return (f"{strategy} {'inside no_sync() until the last micro-batch' if quiet else 'reducing every micro-batch'} "
            f"sent {', '.join(f'{b:,.0f}' for b in res[strategy, quiet]['sent'])} B in its three micro-batches")


def test_bytes_per_micro_batch(res):
    """Bytes each micro-batch sends, in units of ONE, a collective over the whole model (4Ψ(N−1)/N)."""
    expected = {("FULL_SHARD", False): [3 * ONE - ROOT] * 3,
                # no_sync() saves only the reduce-scatters
                ("FULL_SHARD", True): [2 * ONE - ROOT] * 2 + [3 * ONE - ROOT],
                ("SHARD_GRAD_OP", False): [2 * ONE] * 3,
                ("SHARD_GRAD_OP", True): [ONE, ONE, 2 * ONE],  # it still all-gathers, once per unit
                ("NO_SHARD", False): [2 * ONE] * 3,  # an all-reduce: twice a reduce-scatter's bytes
                ("NO_SHARD", True): [0, 0, 2 * ONE]}
    for (strategy, quiet), want in expected.items():
        assert res[strategy, quiet]["sent"] == want, (
            f"{_sent(strategy, quiet, res)}, expected {', '.join(f'{b:,.0f}' for b in want)} B "
            f"(exercise 9.1): inside no_sync() a micro-batch all-gathers as ever and reduces nothing; the last "
            f"one reduces every unit once")


def held_after_a_collective(held: int, model: int) -> bool:
    """gloo reduces a copy of its input (chapter 5 measures it), and about one time in four that copy is still
    alive for a moment after the wait: at most one unit's flat gradient more than the model, a block's."""
    return model <= held <= model + 4 * 12_608


def test_memory_between_micro_batches(res):
    sharded = 16 * PSI / N + STEP_COUNTERS  # parameters, gradients and AdamW's state, as shards
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        every = res[strategy, False]["held"]
        assert all(held_after_a_collective(h, sharded) for h in every), (
            f"{strategy} reducing every micro-batch held {', '.join(f'{h:,}' for h in every)} B between "
            f"micro-batches, expected the sharded model states, {sharded:,.0f} B, each time")
        # no_sync(): every unit's full gradient in place of its shard (no collective: to the byte), until the
        # last micro-batch reduces
        quiet, want = res[strategy, True]["held"], sharded - 4 * PSI / N + 4 * PSI
        assert quiet[:2] == [want] * 2, (
            f"{strategy} inside no_sync() held {quiet[0]:,} B and {quiet[1]:,} B after its first two micro-batches, "
            f"expected {want:,.0f} B: the sharded model states with every unit's full gradient, 4Ψ = {4 * PSI:,} B, "
            f"in place of its shard (exercise 9.1): is the full gradient kept once, and added to in place?")
        assert held_after_a_collective(quiet[2], sharded), (
            f"{strategy}: after the last micro-batch, outside no_sync(), {quiet[2]:,} B held, expected the sharded "
            f"model states, {sharded:,.0f} B (exercise 9.1): is the kept full gradient let go once it is reduced?")
    full = 16 * PSI + STEP_COUNTERS  # NO_SHARD: DDP's model states
    held = res["NO_SHARD", True]["held"]
    assert held[:2] == [full] * 2 and held_after_a_collective(held[2], full), (
        f"NO_SHARD with no_sync() held {', '.join(f'{h:,}' for h in held)} B after its micro-batches, expected "
        f"DDP's model states, {full:,} B, each time (exercise 9.1)")
    peaks = [res[s, True]["peak"] for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")]
    assert peaks[0] < peaks[1] < peaks[2], (
        f"peaks with no_sync(): FULL_SHARD {peaks[0]:,} B, SHARD_GRAD_OP {peaks[1]:,} B, NO_SHARD {peaks[2]:,} B, "
        f"expected to grow in that order")


def test_torch_fsdp1_keeps_shard_grad_op_parameters_through_no_sync(res):
    theirs, ours = res["torch FSDP1 SHARD_GRAD_OP", True], res["SHARD_GRAD_OP", True]
    assert theirs["sent"] == [5, 0, 0], (  # all-gathers: every unit once, then never again until the step
        f"torch's FSDP1 SHARD_GRAD_OP issued {theirs['sent']} all-gathers in its three micro-batches under "
        f"no_sync(), expected [5, 0, 0]: every unit once, then none")
    more = [t - o for t, o in zip(theirs["held"][:2], ours["held"][:2])]
    assert more == [4 * PSI, 4 * PSI], (
        f"torch's FSDP1 SHARD_GRAD_OP held {', '.join(f'{m:,}' for m in more)} B more than minifsdp's between "
        f"micro-batches, expected the full parameters, 4Ψ = {4 * PSI:,} B, each time")
