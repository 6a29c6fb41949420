"""Chapter 6: an untied embedding and output head, in the root or as units of their own, measured.

The root holds its full parameters from its forward to the end of its backward, so left there the two
vocabulary-sized matrices are unsharded all through the step. As units of their own they are gathered only
while they compute. `python -m minifsdp embedding-units` (minifsdp/reports/embedding_units.py) measures it;
here the meter's "unsharded" peak must be the model's to the byte, and the bytes sent must grow by exactly
the second all-gather of each.
"""

import pytest

from minifsdp import launch
from minifsdp.reports.embedding_units import embedding_units, unsharded_model

N = 2


@pytest.fixture(scope="module")
def res():
    return launch(embedding_units, world_size=N, device="cpu")[0]


@pytest.mark.mechanism  # measured memory and all-gathers
@pytest.mark.exercise("6.1", "6.2")
def test_the_unsharded_bytes_alive_at_once_are_the_root_and_one_unit(res):
    for wrapping, m in res.items():
        want = unsharded_model(m["units"])
        assert m["forward"] == want, (
            f"{wrapping}: {m['forward']:,} B of full parameters alive at once in forward, expected {want:,} B, the "
            f"root and the largest other unit")
        assert m["backward"] == want, (
            f"{wrapping}: {m['backward']:,} B of full parameters alive at once in backward, expected {want:,} B, "
            f"the root and the largest other unit (exercise 6.2 gathers a unit when its backward is next; "
            f"exercise 6.1 reshards it once its gradient is sent)")


@pytest.mark.mechanism  # measured memory and all-gathers
@pytest.mark.exercise("6.1", "6.2")
def test_units_of_their_own_hold_less_and_send_each_one_all_gather_more(res):
    root, own = res["in the root"], res["units of their own"]
    embed, head = own["units"]["wte"], own["units"]["lm_head"]
    # left in the root, both matrices are held with the largest block; as units, only one of them at a time
    assert root["units"]["(root)"] == own["units"]["(root)"] + embed + head, (
        f"the root's buffer is {root['units']['(root)']:,} B holding both matrices, expected "
        f"{own['units']['(root)'] + embed + head:,} B, its own {own['units']['(root)']:,} B and theirs")
    block = own["units"]["blocks.0"]
    got, want = root["forward"] - own["forward"], embed + head + block - max(embed, head, block)
    assert got == want, (
        f"units of their own held {got:,} B fewer full parameters at once in forward, expected {want:,} B")
    assert own["peak"] < root["peak"], (
        f"the step's peak was {own['peak']:,} B with units of their own, not below {root['peak']:,} B with both "
        f"matrices in the root (exercises 6.1, 6.2): is a unit kept unsharded after its backward?")
    # each is all-gathered twice (forward, backward) instead of once with the root
    more = own["all_gathers"] - root["all_gathers"]
    assert more == 4, (
        f"units of their own issued {more} all-gathers more than the root, expected 4, two for each matrix "
        f"(exercise 6.2): gathered once in forward and once in backward, each")
    more = own["bytes"] - root["bytes"]
    assert more == (embed + head) * (N - 1) / N, (
        f"units of their own sent {more:,.0f} B more, expected {(embed + head) * (N - 1) / N:,.0f} B, the second "
        f"all-gather of each matrix (exercise 6.2)")
